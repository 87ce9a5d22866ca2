"""Writing checkpoints in the HF DeepSeek-V3 format (random tiny ones for tests and benchmarks too)."""
import dataclasses
import json
import os

import torch
from safetensors.torch import save_file

from mtpserve.config import ModelConfig


def hf_name(name: str, num_hidden_layers: int) -> str:
    """Our parameter name -> checkpoint key (MTP module i lives at model.layers.{L + i})."""
    if name.startswith("mtp_layers."):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{num_hidden_layers + int(i)}.{rest}"
    return name


def tiny_config(**overrides) -> dict:
    """A small but complete HF config.json dict (MoE, q_lora, one MTP layer) with `overrides` applied."""
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        first_k_dense_replace=1, moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False,
        num_nextn_predict_layers=1, attention_bias=False, bos_token_id=0, eos_token_id=1,
        rope_interleave=True, torch_dtype="float32", initializer_range=0.02,
    )
    cfg.update(overrides)
    return cfg


def config_to_hf_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None or k == "q_lora_rank"}
    d.pop("quantization_config", None)
    d.update(architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=cfg.num_attention_heads,
             rope_interleave=True, torch_dtype=str(dtype).removeprefix("torch."))
    return d


def save_checkpoint(model, path: str, dtype: torch.dtype = torch.bfloat16, hf_config: dict | None = None) -> str:
    """Writes config.json + model.safetensors with HF key names. MTP layers get their own copies of the
    shared embedding and head (as DeepSeek's released checkpoints have)."""
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensors[hf_name(name, cfg.num_hidden_layers)] = t.detach().to("cpu", dtype).contiguous().clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = hf_config if hf_config is not None else config_to_hf_dict(cfg, dtype)
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def write_random_checkpoint(path: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> str:
    """A random checkpoint of `tiny_config(**overrides)` (pass larger sizes for benchmark models)."""
    from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM
    hf = tiny_config(**overrides)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(hf))
    model.init_weights(seed)
    return save_checkpoint(model, path, dtype=dtype, hf_config=hf)
