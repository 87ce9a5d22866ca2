"""Weight-only int8 (model/int8.py): the kernel against a dequantized reference in fp32 math, the whole model
against the same model with the dequantized weights, and MTP lossless with respect to the int8 model (greedy
output identical with and without speculation, eager and graph mode)."""
import pytest
import torch

from mtpserve import LLM, SamplingParams
from mtpserve.model.int8 import Int8Weight, int8_linear, quantize_rows
from mtpserve.model.loader import load_model
from tiny_models import pattern_batch, trained_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("int8") / "m", num_mtp_layers=1)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_linear_matches_the_dequantized_weight_in_fp32(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen)
    q = quantize_rows(w, torch.bfloat16)
    assert q.data.dtype == torch.int8 and q.data.abs().max() == 127 and q.scale.shape == (96,)
    assert (q.dequantize(torch.float32) - w).abs().max() <= q.scale.float().max() / 2 + 1e-6   # round to nearest
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    want = x.float() @ q.dequantize(torch.float32).t()
    got = int8_linear(x, q).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())   # bf16 output


def test_int8_model_matches_the_model_with_dequantized_weights(ckpt):
    """Every linear and expert weight int8 (the loader quantizes as it loads); the reference loads the same
    checkpoint in fp32 with each of those weights replaced by its int8 value times its scale."""
    from mtpserve.model.attention import dense_metadata
    int8 = load_model(ckpt, torch.bfloat16, quantization="int8").eval().fuse_for_inference()
    ref = load_model(ckpt, torch.float32).eval()
    quantized = 0
    with torch.no_grad():
        for name, module in ref.named_modules():
            target = int8.get_submodule(name)
            if getattr(target, "int8_scale", None) is not None:
                module.weight.copy_(Int8Weight(target.weight, target.int8_scale).dequantize(torch.float32))
                quantized += 1
    assert quantized >= 10   # attention, MLP, experts and the MTP layer's projection
    ref.fuse_for_inference()
    ids = pattern_batch(torch.Generator().manual_seed(0), 1, 24)[0]
    meta, positions = dense_metadata(1, len(ids), "cpu")
    with torch.no_grad():
        want = ref.compute_logits(ref(ids, positions, meta, None)).float()
        meta, positions = dense_metadata(1, len(ids), "cpu")
        got = int8.compute_logits(int8(ids, positions, meta, None)).float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.02 * scale   # bf16 activations against fp32 math (~0.4% here)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_mtp_is_lossless_on_the_int8_model(ckpt, graphs):
    prompts = pattern_batch(torch.Generator().manual_seed(3), 3, 10).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    mode = dict(enforce_eager=not graphs, graph_batch_sizes=[4])
    want = [o.outputs[0].token_ids for o in LLM(ckpt, quantization="int8", enforce_eager=True).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    specs = [{"num_speculative_tokens": 2, "adaptive": False}] + ([] if graphs else [{"num_speculative_tokens": 2}])
    for spec in specs:
        llm = LLM(ckpt, quantization="int8", speculative_config=spec, **mode)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                            use_tqdm=False)]
        assert got == want
        assert llm.get_metrics()["num_accepted_tokens"] > 0
        assert llm.engine.dtype == torch.bfloat16


def test_int8_refuses_float32_activations(ckpt):
    with pytest.raises(ValueError, match="quantization = 'int8': dtype must be bfloat16 or float16"):
        LLM(ckpt, quantization="int8", dtype="float32", enforce_eager=True)
