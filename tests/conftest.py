"""Shared helpers for the model tests: tiny DeepSeek-V3 configs, random HF-format checkpoints written by
Hugging Face transformers (the independent reference), and loading them back into transformers.

Random weights are scaled so that every part of the network matters (norm weights 1 +- 0.1, linear weights
~ N(0, 1/fan_in), a non-zero expert-score correction bias): with transformers' default init (std 0.02) most
of a tiny model's output comes from the embedding and the final norm, and a wrong attention would hardly
show.
"""
import json
import math
import os

import pytest
import torch

# Tiny models: one thread is much faster than two fighting over a shared 2-core machine.
torch.set_num_threads(1)
from safetensors import safe_open
from safetensors.torch import save_file

# YaRN as in DeepSeek-V3's config.json, shrunk. mscale != mscale_all_dim, so both the cos/sin factor
# (mscale(f, mscale) / mscale(f, mscale_all_dim)) and the softmax scale (mscale(f, mscale_all_dim)^2) differ
# from 1 and a mix-up of the two shows. max_position_embeddings = factor * original keeps transformers quiet.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

# A DeepSeek-V3-style config.json, tiny. Hidden 64, 3 layers, 8 routed experts in 4 groups (2 per group, so
# the "top-2 sum" group score is defined), 2 groups kept, 3 experts per token (<= the 4 experts of the kept
# groups, so dropped groups are never needed).
BASE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def make_config(**overrides) -> dict:
    # deep copies: transformers' config standardization edits rope dicts in place
    cfg = json.loads(json.dumps(BASE))
    cfg.update(json.loads(json.dumps(overrides)))
    return cfg


# The configurations the parity tests run (each option both ways somewhere):
#   q_lora_rank set / None, dense-only / MoE, norm_topk_prob True / False, YaRN on / off (and once
#   attention_bias, which DeepSeek's checkpoints do not use but their config format allows).
# Dense-only = first_k_dense_replace == num_hidden_layers (the MTP layer, index L, is still MoE: both
# transformers and DeepSeek make MTP layers MoE).
CONFIGS = {
    "dense_qlora_yarn": dict(first_k_dense_replace=3, rope_scaling=YARN),
    "dense_noqlora": dict(first_k_dense_replace=3, q_lora_rank=None),
    "moe_noqlora_yarn_norm": dict(q_lora_rank=None, rope_scaling=YARN, norm_topk_prob=True),
    "moe_qlora_nonorm": dict(norm_topk_prob=False, routed_scaling_factor=1.5, attention_bias=True),
}


def random_tensor(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """A random value for the checkpoint tensor `name` (HF naming), scaled so activations stay O(1)."""
    shape = tuple(shape)
    if name.endswith("norm.weight"):             # every RMSNorm: input/post_attention/q_a/kv_a/final/e/h/shared_head
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        # Non-negative on purpose: scores_for_choice = sigmoid + bias > 0, so masking dropped groups with
        # -inf (transformers 5.24, DeepSeek's inference code, mtpserve) or 0.0 (DeepSeek's HF remote code)
        # selects the same experts. Large enough (up to 0.5) to change which experts are picked.
        return 0.5 * torch.rand(shape, generator=gen)
    if "embed_tokens" in name:
        return torch.randn(shape, generator=gen)
    if len(shape) == 1:
        return 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def layer_shapes(cfg: dict, layer_idx: int) -> dict:
    """Shapes of one decoder layer's tensors under HF checkpoint names (per-expert keys), relative names."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    a = "self_attn."
    if cfg.get("q_lora_rank") is None:
        out[a + "q_proj.weight"] = (heads * qk, h)
    else:
        r = cfg["q_lora_rank"]
        out[a + "q_a_proj.weight"] = (r, h)
        out[a + "q_a_layernorm.weight"] = (r,)
        out[a + "q_b_proj.weight"] = (heads * qk, r)
    out[a + "kv_a_proj_with_mqa.weight"] = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h)
    out[a + "kv_a_layernorm.weight"] = (cfg["kv_lora_rank"],)
    out[a + "kv_b_proj.weight"] = (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
    out[a + "o_proj.weight"] = (h, heads * cfg["v_head_dim"])
    if cfg.get("attention_bias"):
        out[a + "kv_a_proj_with_mqa.bias"] = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],)
        out[a + "o_proj.bias"] = (h,)
        if cfg.get("q_lora_rank") is not None:
            out[a + "q_a_proj.bias"] = (cfg["q_lora_rank"],)
    moe = (cfg.get("n_routed_experts") and layer_idx >= cfg["first_k_dense_replace"]
           and layer_idx % cfg.get("moe_layer_freq", 1) == 0)
    if moe:
        i = cfg["moe_intermediate_size"]
        out["mlp.gate.weight"] = (cfg["n_routed_experts"], h)
        if cfg.get("topk_method", "noaux_tc") == "noaux_tc" and cfg["model_type"] == "deepseek_v3":
            out["mlp.gate.e_score_correction_bias"] = (cfg["n_routed_experts"],)
        for e in range(cfg["n_routed_experts"]):
            out[f"mlp.experts.{e}.gate_proj.weight"] = (i, h)
            out[f"mlp.experts.{e}.up_proj.weight"] = (i, h)
            out[f"mlp.experts.{e}.down_proj.weight"] = (h, i)
        if cfg.get("n_shared_experts"):
            s = i * cfg["n_shared_experts"]
            out["mlp.shared_experts.gate_proj.weight"] = (s, h)
            out["mlp.shared_experts.up_proj.weight"] = (s, h)
            out["mlp.shared_experts.down_proj.weight"] = (h, s)
    else:
        i = cfg["intermediate_size"]
        out.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
    return out


def mtp_tensors(cfg: dict, main: dict, gen: torch.Generator, with_embed_and_head: bool = True) -> dict:
    """Random MTP-module tensors at model.layers.{L+i}.* as DeepSeek-V3 checkpoints lay them out; the
    module's embed_tokens / shared_head.head are copies of the main model's (as in DeepSeek-V3)."""
    out = {}
    h, num_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    for d in range(cfg.get("num_nextn_predict_layers", 0)):
        idx = num_layers + d
        p = f"model.layers.{idx}."
        shapes = dict(layer_shapes(cfg, idx))
        shapes.update({"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                       "shared_head.norm.weight": (h,)})
        for k, shape in shapes.items():
            out[p + k] = random_tensor(p + k, shape, gen)
        if with_embed_and_head:
            out[p + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
            out[p + "shared_head.head.weight"] = main["lm_head.weight"].clone()
    return out


def read_safetensors(path: str) -> dict:
    """All tensors of a checkpoint dir (single file or sharded), by name."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                for k in st.keys():
                    out[k] = st.get_tensor(k)
    return out


def write_single(path: str, tensors: dict) -> None:
    """Replace the checkpoint's weights by one model.safetensors holding `tensors`."""
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(path, f))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def hf_config(cfg: dict):
    from transformers import DeepseekV3Config
    return DeepseekV3Config.from_dict({k: v for k, v in cfg.items() if k != "architectures"})


def save_with_transformers(path: str, cfg: dict, seed: int = 0) -> str:
    """A random checkpoint written by transformers' save_pretrained (its own key names and config.json,
    which spells rope as `rope_parameters`), plus MTP layers appended at model.layers.{L+i}.*"""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(random_tensor(name, t.shape, gen))
    model.save_pretrained(path)
    tensors = read_safetensors(path)
    tensors.update(mtp_tensors(cfg, tensors, gen))
    write_single(path, tensors)
    return path


def rerandomize(path: str, seed: int = 0) -> None:
    """Give every tensor of a checkpoint a new random value by `random_tensor`'s scales (names, shapes and
    dtypes unchanged); MTP embed_tokens / shared_head.head stay copies of the main ones."""
    tensors = read_safetensors(path)
    gen = torch.Generator().manual_seed(seed)
    for k in sorted(tensors):
        tensors[k] = random_tensor(k, tensors[k].shape, gen).to(tensors[k].dtype)
    for k in tensors:
        if k.endswith(".embed_tokens.weight") and k != "model.embed_tokens.weight":
            tensors[k] = tensors["model.embed_tokens.weight"].clone()
        if k.endswith("shared_head.head.weight"):
            tensors[k] = tensors["lm_head.weight"].clone()
    write_single(path, tensors)


@pytest.fixture
def load_hf(monkeypatch):
    """load_hf(path) -> (transformers main model, MtpModel or None), fp32, eager attention, eval mode.

    transformers ignores MTP keys by the class attribute `_keys_to_ignore_on_load_unexpected`, hard-coded to
    DeepSeek-V3's layer 61, and MtpModel.from_pretrained finds the MTP weights through it: point it at the
    tiny model's layers L..L+D-1."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

    def load(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        num_layers = cfg["num_hidden_layers"]
        num_mtp = cfg.get("num_nextn_predict_layers", 0)
        patterns = [rf"model\.layers\.{num_layers + d}\..*" for d in range(max(num_mtp, 1))]
        monkeypatch.setattr(DeepseekV3PreTrainedModel, "_keys_to_ignore_on_load_unexpected", patterns)
        monkeypatch.setattr(DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", patterns, raising=False)
        main = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        mtp = None
        if num_mtp:
            from transformers.modeling_layers import MtpModel
            mtp = MtpModel.from_pretrained(main).eval()
        return main, mtp

    return load


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
