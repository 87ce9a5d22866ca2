"""The shipped default model is an ordinary HF DeepSeek-V3 checkpoint: our loader and transformers give the
same logits, its tokenizer loads with AutoTokenizer, and speculation on it is lossless and really accepts."""
import torch

from mtpserve import LLM, SamplingParams, default_model_path
from mtpserve.model.loader import load_model


def test_default_model_matches_transformers():
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("import os\n\ndef walk(root):\n    for name in os.listdir(root):")])
    ours = load_model(path, torch.float32)
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        a = ours.compute_logits(ours.forward_dense(ids))
        b = hf(ids).logits
    assert (a - b).abs().max() < 1e-4
    assert ours.num_mtp_layers == ours.config.num_nextn_predict_layers >= 2


def test_default_model_speculation_lossless_and_accepting():
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM().generate(prompts, params, use_tqdm=False)
    llm = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert llm.get_metrics()["acceptance_rate"] > 0.4
