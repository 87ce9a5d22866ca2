"""The shipped default model is an ordinary HF DeepSeek-V3 checkpoint: our loader and transformers give the
same logits, its tokenizer loads with AutoTokenizer, and speculation on it is lossless and really accepts."""
import torch
import torch.nn.functional as F

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
    plain = LLM(enforce_eager=True).generate(prompts, params, use_tqdm=False)
    llm = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}, enforce_eager=True)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    assert llm.get_metrics()["acceptance_rate"] > 0.4


def test_default_model_in_bf16_keeps_every_bit_with_mtp_beside_new_prompts():
    """bf16 (the checkpoint's dtype), eager, two requests at a time: a new prompt arrives beside the other request's
    decode rows (a mixed step, run as two forwards) and MTP's verify steps see a plain step's bits, so tokens and
    logprobs equal those without MTP to the bit. (Before, oneDNN's GEMM over a prompt's rows and the decode rows
    changed the decode rows' bits: 87 of 384 logprobs differed.)"""
    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(root):",
               "with open(path) as f:\n"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 40, 20, 30)]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    outs = []
    for s in (None, spec):
        llm = LLM(dtype="bfloat16", speculative_config=s, enforce_eager=True, max_num_seqs=2)
        outs.append([(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in e.items()] for e in o.outputs[0].logprobs])
                     for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[1] == outs[0]


def test_default_model_uses_group_limited_routing():
    """DeepSeek-V3's routing: experts in groups, a token's experts from the best topk_group groups only. The limit
    must bind on real text (for some token, the unrestricted top experts are not the ones picked)."""
    from mtpserve.model.moe import Gate
    from mtpserve.train.tokenizer import load_tokenizer
    path = default_model_path()
    model = load_model(path, torch.float32)
    cfg = model.config
    assert cfg.topk_method == "noaux_tc" and 1 < cfg.n_group and 1 <= cfg.topk_group < cfg.n_group
    per_group = cfg.n_routed_experts // cfg.n_group
    picks, unrestricted = [], []

    def record(gate, inputs, output):
        picks.append(output[1])
        x = inputs[0]
        choice = F.linear(x.float(), gate.weight.float()).sigmoid() + gate.e_score_correction_bias.float()
        unrestricted.append(choice.topk(cfg.num_experts_per_tok, dim=-1).indices)

    gates = [m for m in model.modules() if isinstance(m, Gate)]
    assert gates
    for g in gates:
        g.register_forward_hook(record)
    ids = torch.tensor([load_tokenizer(path).encode(EXAMPLE_CODE).ids])
    with torch.no_grad():
        model.forward_dense(ids)
    groups_used = torch.cat([(p // per_group).sort(-1).values for p in picks])
    spans = [len(set(row.tolist())) for row in groups_used]
    assert max(spans) <= cfg.topk_group
    changed = sum(int((p.sort(-1).values != u.sort(-1).values).any(-1).sum()) for p, u in zip(picks, unrestricted))
    assert changed > 0   # the group limit changed some token's experts: it is really in effect


def test_default_tokenizer_round_trips_python():
    """Any Python source (this repository's, which the tokenizer never saw) and odd strings decode back exactly."""
    import pathlib
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_path())
    root = pathlib.Path(__file__).resolve().parents[1]
    texts = [p.read_text() for p in sorted((root / "mtpserve").rglob("*.py"))[:40]]
    texts += [EXAMPLE_CODE, "", "\t\r\n  \x0b\x0c", "s = 'naïve café 日本語 🙂'\n", "x = b'\\x00\\xff'  # \u200b\n"]
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text


EXAMPLE_CODE = '''import json
from dataclasses import dataclass


@dataclass
class Config:
    name: str
    size: int = 8

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls(**json.load(f))


def main(argv=None):
    cfg = Config.load(argv[0] if argv else "config.json")
    for i in range(cfg.size):
        print(f"{cfg.name}-{i}")
'''


def test_auto_dtype_follows_a_bf16_checkpoint_where_our_kernels_run(tmp_path):
    """vLLM's "auto": the checkpoint's bf16 (the shipped model's), not float32, on a CPU where our bf16 kernels keep
    MTP lossless to the bit; float32 checkpoints stay float32 on the CPU; CUDA takes bf16."""
    from mtpserve.config import EngineConfig
    from mtpserve.engine.setup import engine_setup, resolve_device_dtype
    from mtpserve.model import cpu_kernels
    from tiny_models import random_checkpoint
    shipped = engine_setup(EngineConfig(model=None, device="cpu", enforce_eager=True)).dtype
    assert shipped == (torch.bfloat16 if cpu_kernels.load() else torch.float32)
    fp32 = random_checkpoint(tmp_path / "fp32")
    assert engine_setup(EngineConfig(model=fp32, device="cpu", enforce_eager=True)).dtype == torch.float32
    assert resolve_device_dtype("cuda", "auto", "float32")[1] == torch.bfloat16
    assert resolve_device_dtype("cpu", "float32", "bfloat16")[1] == torch.float32
