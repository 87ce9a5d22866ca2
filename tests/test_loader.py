"""Loading checkpoints: sharded indexes, block-FP8 weights, dtypes, clear errors, shared MTP embed/head,
and the config checks."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conftest import CONFIGS, make_config, max_diff, read_safetensors, rerandomize, write_single
from mtpserve.config import ModelConfig
from mtpserve.model.checkpoint import write_random_checkpoint
from mtpserve.model.loader import load_model, quantize_fp8_blockwise

E4M3_MAX = 448.0


IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def logits_of(model, ids=IDS):
    """Main logits and depth-1 MTP logits of `ids`."""
    with torch.no_grad():
        h = model.forward_dense(ids)
        g = model.mtp_forward_dense(0, ids[:, 1:], h[:, :-1])
        return model.compute_logits(h), model.mtp_logits(0, g)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random MoE + q_lora + YaRN checkpoint with one MTP layer."""
    cfg = make_config(**dict(CONFIGS["moe_noqlora_yarn_norm"], q_lora_rank=32))
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("base")), seed=8, **cfg)
    rerandomize(path, seed=8)
    return path, cfg


@pytest.fixture(scope="module")
def ckpt_logits(ckpt):
    """logits_of the fp32 model loaded from `ckpt`."""
    return logits_of(load_model(ckpt[0], dtype=torch.float32))


def copy_ckpt(src, dst, tensors=None, config=None):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config if config is not None else cfg, f)
    write_single(dst, read_safetensors(src) if tensors is None else tensors)
    return dst


def test_sharded_index_loads_identically(ckpt, tmp_path):
    """Same parameters, bit for bit, from a 3-shard index as from the single file."""
    path, _ = ckpt
    tensors = read_safetensors(path)
    shard_dir = copy_ckpt(path, str(tmp_path / "sharded"))
    os.remove(os.path.join(shard_dir, "model.safetensors"))
    keys = sorted(tensors)
    weight_map = {}
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {k: tensors[k] for k in keys[i::3]}
        save_file(part, os.path.join(shard_dir, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    a, b = load_model(path), load_model(shard_dir)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def dequant(w_fp8, scale_inv, block):
    """DeepSeek's convention: weight = fp8 value * weight_scale_inv of its (block[0] x block[1]) tile."""
    s = scale_inv.float().repeat_interleave(block[0], 0)[: w_fp8.shape[0]]
    return w_fp8.float() * s.repeat_interleave(block[1], 1)[:, : w_fp8.shape[1]]


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((24, 64), (16, 16)), ((256, 128), (128, 128))])
def test_fp8_blockwise_round_trip(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, 0] = 3.0   # one large value: its tile gets a coarse scale, the others must not
    q, scale_inv = quantize_fp8_blockwise(w, block=block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    assert q.float().abs().max() <= E4M3_MAX
    back = dequant(q, scale_inv, block)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal numbers; subnormal spacing 2^-9 (x scale)
    tile_scale = dequant(torch.ones(shape, dtype=torch.float8_e4m3fn), scale_inv, block)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + tile_scale * 2 ** -9 + 1e-12).all()
    assert max_diff(back, w) < 0.1


FP8_SKIP = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight", "norm")


def test_fp8_checkpoint_loads_dequantized(ckpt, tmp_path):
    """Every linear weight stored as e4m3 + weight_scale_inv (as DeepSeek-V3 ships), tile 16x16 so tiny
    matrices have several (and partial) tiles; loads as the dequantized weights."""
    path, _ = ckpt
    block = (16, 16)
    tensors = read_safetensors(path)
    fp8, ref = {}, {}
    for k, t in tensors.items():
        if t.dim() == 2 and not any(s in k for s in FP8_SKIP):
            q, s = quantize_fp8_blockwise(t, block=block)
            fp8[k], fp8[k.removesuffix("weight") + "weight_scale_inv"] = q, s
            ref[k] = dequant(q, s, block)
        else:
            fp8[k] = ref[k] = t
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 20
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    fp8_dir = copy_ckpt(path, str(tmp_path / "fp8"), tensors=fp8, config=config)
    ref_dir = copy_ckpt(path, str(tmp_path / "ref"), tensors=ref)
    a, b = load_model(fp8_dir), load_model(ref_dir)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)   # so the logits are identical too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(ckpt, ckpt_logits, tmp_path, dtype):
    path, cfg = ckpt
    low = load_model(path, dtype=dtype)
    for name, p in low.named_parameters():
        if ".mlp.gate." not in name:   # the router may stay float32 (routing is sensitive)
            assert p.dtype == dtype, name
    ref, _ = ckpt_logits
    got, mtp = logits_of(low)
    assert torch.isfinite(got).all() and torch.isfinite(mtp).all()
    # Loose: a low-precision run of the same model, not a different one (routing may flip on near ties).
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree > 0.8, agree
    # A checkpoint stored in this dtype loads into float32 as exactly those values.
    low_tensors = {k: v.to(dtype) for k, v in read_safetensors(path).items()}
    low_dir = copy_ckpt(path, str(tmp_path / "low"), tensors=low_tensors)
    m = load_model(low_dir, dtype=torch.float32)
    w = read_safetensors(low_dir)["model.layers.0.self_attn.kv_b_proj.weight"]
    assert m.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert torch.equal(m.model.layers[0].self_attn.kv_b_proj.weight, w.float())


def test_mismatched_checkpoint_one_error_naming_all(ckpt, tmp_path):
    path, _ = ckpt
    tensors = read_safetensors(path)
    missing = "model.layers.1.self_attn.o_proj.weight"
    unexpected = "model.layers.0.self_attn.extra_proj.weight"
    wrong = "model.layers.2.mlp.experts.3.down_proj.weight"
    del tensors[missing]
    tensors[unexpected] = torch.zeros(4, 4)
    tensors[wrong] = torch.zeros(tensors[wrong].shape[0], tensors[wrong].shape[1] + 1)
    bad = copy_ckpt(path, str(tmp_path / "bad"), tensors=tensors)
    with pytest.raises(ValueError) as err:
        load_model(bad)
    for key in (missing, unexpected, wrong):
        assert key in str(err.value)


def test_missing_mtp_tensor_named_by_its_checkpoint_key(ckpt, tmp_path):
    path, cfg = ckpt
    tensors = read_safetensors(path)
    key = f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"
    del tensors[key]
    with pytest.raises(ValueError) as err:
        load_model(copy_ckpt(path, str(tmp_path / "bad"), tensors=tensors))
    assert key in str(err.value)


def test_mtp_without_own_embed_and_head_uses_main(ckpt, tmp_path):
    """The slim checkpoint loads as the full one, bit for bit (so it computes the same logits: comparing logits of
    two loads bit for bit flaked once in CI at the 1e-4 level, GEMM rounding)."""
    path, cfg = ckpt
    num_layers = cfg["num_hidden_layers"]
    tensors = read_safetensors(path)
    p = f"model.layers.{num_layers}."
    assert torch.equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    del tensors[p + "embed_tokens.weight"], tensors[p + "shared_head.head.weight"]
    slim = load_model(copy_ckpt(path, str(tmp_path / "slim"), tensors=tensors))
    assert slim.mtp_layers[0].embed_tokens.weight is slim.model.embed_tokens.weight
    assert slim.mtp_layers[0].shared_head.head.weight is slim.lm_head.weight
    full, mine = load_model(path).state_dict(), slim.state_dict()
    assert full.keys() == mine.keys()
    assert all(torch.equal(full[k], mine[k]) for k in full)


def test_mtp_own_head_and_embed_are_used_when_different(ckpt, tmp_path):
    path, cfg = ckpt
    num_layers = cfg["num_hidden_layers"]
    tensors = read_safetensors(path)
    p = f"model.layers.{num_layers}."
    gen = torch.Generator().manual_seed(1)
    tensors[p + "embed_tokens.weight"] = torch.randn(tensors[p + "embed_tokens.weight"].shape, generator=gen)
    tensors[p + "shared_head.head.weight"] = torch.randn(tensors[p + "shared_head.head.weight"].shape, generator=gen)
    model = load_model(copy_ckpt(path, str(tmp_path / "own"), tensors=tensors))
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    layer = model.mtp_layers[0]
    assert torch.equal(layer.embed_tokens.weight, tensors[p + "embed_tokens.weight"])
    assert torch.equal(layer.shared_head.head.weight, tensors[p + "shared_head.head.weight"])
    with torch.no_grad():
        h = model.forward_dense(IDS)
        g = model.mtp_forward_dense(0, IDS[:, 1:], h[:, :-1])
        normed = layer.shared_head.norm(g)
        assert max_diff(model.mtp_logits(0, g), normed @ tensors[p + "shared_head.head.weight"].T) < 1e-4


# ------------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("field,value", [
    ("scoring_func", "foo"),
    ("topk_method", "foo"),
    ("hidden_act", "gelu"),
    ("model_type", "llama"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("quantization_config", {"quant_method": "awq"}),
    # noaux_tc scores a group by the sum of its top-2 experts: a group needs >= 2
    ("n_group", 8),
])
def test_config_refuses_unsupported_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(make_config(**{field: value}))


def test_config_reads_transformers_rope_parameters(tmp_path):
    """transformers >= 5 writes rope as `rope_parameters` (rope_theta inside) in config.json."""
    from conftest import YARN, hf_config
    for rope, theta in ((YARN, 5000.0), (None, 20000.0)):
        hf_config(make_config(rope_scaling=rope, rope_theta=theta)).save_pretrained(str(tmp_path))
        with open(tmp_path / "config.json") as f:
            d = json.load(f)
        assert "rope_parameters" in d and "rope_scaling" not in d
        cfg = ModelConfig.from_dict(d)
        assert cfg.rope_theta == theta
        if rope is None:
            assert cfg.rope_scaling is None
        else:
            for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim"):
                assert cfg.rope_scaling[k] == YARN[k]


def test_deepseek_v2_config_accepted():
    # DeepSeek-V2-Lite's config.json fields (shrunk): softmax routing, no groups, no MTP, no q_lora.
    v2 = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
        "n_shared_experts": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "hidden_act": "silu",
        "max_position_embeddings": 256, "rope_theta": 10000, "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    }
    cfg = ModelConfig.from_dict(v2)
    assert cfg.model_type == "deepseek_v2" and cfg.scoring_func == "softmax" and cfg.num_nextn_predict_layers == 0
    # A V2 config without V3's routing fields gets V2's meaning.
    bare = {k: v for k, v in v2.items() if k not in ("scoring_func", "topk_method", "n_group", "topk_group")}
    cfg = ModelConfig.from_dict(bare)
    assert cfg.scoring_func == "softmax" and cfg.topk_method == "greedy"
