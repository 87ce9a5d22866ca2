"""FP8 weights in memory: the engine on an FP8 checkpoint kept in FP8 must produce exactly what it produces on
the dequantized checkpoint (the reference), eagerly, in graph mode and per tensor-parallel rank; online FP8 of
an unquantized checkpoint likewise against the checkpoint of its dequantized values."""
import json
import os

import pytest
import torch

from conftest import read_safetensors, write_single
from mtpserve import LLM, SamplingParams
from mtpserve.model.fp8 import Fp8Weight, keeps_fp8, quantize_rows, weight_of
from mtpserve.model.loader import dequantize_fp8_blockwise, load_model, quantize_fp8_blockwise
from mtpserve.model.parallel import TensorParallel, shard_kind, shard_slices
from tiny_models import trained_checkpoint

BLOCK = (16, 16)


def write_checkpoint(src, dst, tensors, quantization_config=None):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_single(dst, tensors)
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(FP8 checkpoint as DeepSeek ships one, the same weights dequantized, the original fp32 one)."""
    root = tmp_path_factory.mktemp("fp8")
    original = trained_checkpoint(root / "fp32", num_mtp_layers=1)
    tensors = read_safetensors(original)
    fp8, dequantized = {}, {}
    for key, t in tensors.items():
        if keeps_fp8(key):
            q, scale = quantize_fp8_blockwise(t, BLOCK)
            fp8[key], fp8[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantized[key] = dequantize_fp8_blockwise(q, scale, BLOCK)
        else:
            fp8[key] = dequantized[key] = t
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    return (write_checkpoint(original, str(root / "fp8"), fp8, qc),
            write_checkpoint(original, str(root / "deq"), dequantized), original)


PROMPTS = [[5, 7, 9, 11, 13], [20, 21, 22], [3, 6, 9, 12, 15, 18]]
SPEC = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}


def generate(path, spec=SPEC, **kw):
    llm = LLM(model=path, dtype="float32", speculative_config=spec, **(dict(enforce_eager=True) | kw))
    params = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=0.9, seed=3, max_tokens=30),
              SamplingParams(temperature=0.0, max_tokens=30)]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_fp8_in_memory_generates_exactly_like_the_dequantized_model(checkpoints):
    fp8, dequantized, _ = checkpoints
    expected, _ = generate(dequantized)
    got, llm = generate(fp8)   # FP8 by default: the checkpoint says so
    assert got == expected
    moe = llm.engine.model.model.layers[1].mlp
    attn = llm.engine.model.model.layers[0].self_attn
    assert isinstance(moe.w13, Fp8Weight) and moe.w13.data.dtype == torch.float8_e4m3fn
    assert isinstance(weight_of(attn.o_proj), Fp8Weight)
    assert generate(fp8, quantization="none")[0] == expected


def test_fp8_weights_take_a_byte_per_value_plus_a_scale_per_block(checkpoints):
    fp8, dequantized, _ = checkpoints
    kept = load_model(fp8, quantization="fp8")
    full = dict(load_model(dequantized).named_parameters())
    quantized = [(n, p) for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 10
    values = sum(p.numel() * p.element_size() for _, p in quantized)
    scales = sum(kept.get_submodule(n.rsplit(".", 1)[0]).weight_scale.numel() * 4 for n, _ in quantized)
    assert values * 4 == sum(full[n].numel() * full[n].element_size() for n, _ in quantized)   # vs fp32
    assert scales <= values * 4 / BLOCK[1] * 1.2   # one fp32 scale per row and block (1/32 at DeepSeek's 128)


def test_fp8_graph_mode_matches_eager(checkpoints):
    """FP8 linear layers inside a compiled graph, without speculation: the MTP layer's FP8 linears are the same
    modules, run eagerly by the tests above, and its graphs would cost a minute and a half more to build here."""
    fp8, _, _ = checkpoints
    eager, _ = generate(fp8, spec=None)
    graph, _ = generate(fp8, spec=None, enforce_eager=False, graph_batch_sizes=[4])
    assert graph == eager


@pytest.mark.parametrize("stored", ["fp8", "fp32"])
def test_fp8_tensor_parallel_shards_dequantize_to_the_slices(checkpoints, stored):
    """Each rank's FP8 shard (rows or columns of tiles) dequantizes to its slice of the one-process FP8 model, and
    stays FP8: as stored, and quantized online (128-column blocks: rank 1's down projections start at column 48)."""
    path = checkpoints[0] if stored == "fp8" else checkpoints[2]
    one = load_model(path, quantization="fp8")
    whole = {name: weight_of(one.get_submodule(name.rsplit(".", 1)[0])).dequantize(torch.float32)
             if w.dtype == torch.float8_e4m3fn else w for name, w in one.named_parameters()}
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        shard = load_model(path, tp=tp, quantization="fp8")
        checked = 0
        for name, p in shard.named_parameters():
            module = shard.get_submodule(name.rsplit(".", 1)[0])
            got = weight_of(module).dequantize(torch.float32) if p.dtype == torch.float8_e4m3fn else p
            index = shard_slices(shard_kind(name), tuple(whole[name].shape), tp)
            expected = whole[name] if index is None else whole[name][index]
            assert torch.equal(got[:expected.shape[0]], expected), name
            assert (p.dtype == torch.float8_e4m3fn) == keeps_fp8(name), name
            checked += p.dtype == torch.float8_e4m3fn
        assert checked > 10


def test_online_fp8_of_an_unquantized_checkpoint(checkpoints, tmp_path):
    _, _, original = checkpoints
    tensors = read_safetensors(original)
    rounded = {k: quantize_rows(t).dequantize(torch.float32) if keeps_fp8(k) else t for k, t in tensors.items()}
    for k, t in tensors.items():   # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 (+ subnormals)
        assert ((rounded[k] - t).abs() <= t.abs() * 2 ** -4 + 1e-3 * t.abs().max()).all(), k
    reference = write_checkpoint(original, str(tmp_path / "rounded"), rounded)
    assert generate(original, quantization="fp8")[0] == generate(reference)[0]
