"""Loading HF DeepSeek-V2/V3 safetensors checkpoints (single file or sharded; bf16/fp16/fp32 or block FP8).

The model is built on the meta device and each parameter is filled from its checkpoint tensor one at a
time, so peak memory stays near the model's own size.
"""
import json
import os
import re

import torch
from safetensors import safe_open

from mtpserve.config import ModelConfig
from mtpserve.model.checkpoint import hf_name
from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_SHARED_IN_MTP = ("embed_tokens.weight", "shared_head.head.weight")


def our_name(key: str, num_hidden_layers: int) -> str:
    """Checkpoint key -> our parameter name (inverse of checkpoint.hf_name)."""
    m = _LAYER_KEY.match(key)
    if m and int(m.group(1)) >= num_hidden_layers:
        return f"mtp_layers.{int(m.group(1)) - num_hidden_layers}.{m.group(2)}"
    return key


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"model: no model.safetensors or model.safetensors.index.json in {path!r}")


def quantize_fp8_blockwise(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 weight, weight_scale_inv [ceil(out/b0), ceil(in/b1)]) as DeepSeek ships them."""
    b0, b1 = block
    out_dim, in_dim = w.shape
    padded = torch.zeros(-(-out_dim // b0) * b0, -(-in_dim // b1) * b1, dtype=torch.float32)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8_blockwise(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    out_dim, in_dim = w.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out_dim].repeat_interleave(block[1], 1)[:, :in_dim]
    return w.float() * scale


def _read_checkpoint(path: str, cfg: ModelConfig):
    """Yields (our name, tensor) for every weight, FP8 weights dequantized to float32."""
    block = tuple((cfg.quantization_config or {}).get("weight_block_size", (128, 128)))
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for key in sorted(keys):
                if key.endswith("weight_scale_inv") or key.endswith("rotary_emb.inv_freq"):
                    continue
                t = f.get_tensor(key)
                if t.dtype == torch.float8_e4m3fn:
                    scale_key = key.removesuffix("weight") + "weight_scale_inv"
                    if scale_key not in keys:
                        raise ValueError(f"checkpoint: FP8 tensor {key} has no {scale_key}")
                    t = dequantize_fp8_blockwise(t, f.get_tensor(scale_key), block)
                yield our_name(key, cfg.num_hidden_layers), key, t


def load_model(path: str, dtype: torch.dtype = torch.float32, device="cpu",
               cfg: ModelConfig | None = None) -> DeepseekV3ForCausalLM:
    cfg = cfg or ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    model.to_empty(device=device)
    params = dict(model.named_parameters(remove_duplicate=False))
    shared_in_mtp = {n for n in params if n.startswith("mtp_layers.") and n.endswith(_SHARED_IN_MTP)}
    optional = set(shared_in_mtp) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    loaded, unexpected, bad_shape, mtp_copies = set(), [], [], {}
    with torch.no_grad():
        for name, key, t in _read_checkpoint(path, cfg):
            if name in shared_in_mtp:
                mtp_copies[name] = t   # decided below, once the main model's copy is loaded
                continue
            if name not in params:
                unexpected.append(key)
            elif tuple(t.shape) != tuple(params[name].shape):
                bad_shape.append(f"{key}: checkpoint {tuple(t.shape)}, model {tuple(params[name].shape)}")
                loaded.add(name)   # reported once, as wrongly shaped
            else:
                params[name].copy_(t)
                loaded.add(name)
        missing = sorted(hf_name(n, cfg.num_hidden_layers) for n in set(params) - loaded - optional)
        if missing or unexpected or bad_shape:
            lines = [f"missing: {missing}"] * bool(missing) + [f"unexpected: {sorted(unexpected)}"] * bool(unexpected)
            raise ValueError(f"checkpoint {path!r} does not match the config:\n  "
                             + "\n  ".join(lines + [f"wrong shape: {bad_shape}"] * bool(bad_shape)))
        for name, t in mtp_copies.items():
            _use_mtp_copy(model, name, t)
    model.rotary.reset_tables()
    return cast_model(model, dtype)


def cast_model(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    """Casts weights to `dtype`; the MoE router and the rope tables stay float32 (routing is sensitive)."""
    for name, p in model.named_parameters():
        if ".mlp.gate." not in name:
            p.data = p.data.to(dtype)
    return model


def _use_mtp_copy(model: DeepseekV3ForCausalLM, name: str, t: torch.Tensor) -> None:
    """An MTP layer's own embed/head: kept shared when equal to the main model's, else its own module."""
    depth = int(name.split(".")[1])
    layer = model.mtp_layers[depth]
    if name.endswith("embed_tokens.weight"):
        current = layer.embed_tokens
        if current.weight.shape != t.shape:
            raise ValueError(f"checkpoint: {name} has shape {tuple(t.shape)}, expected {tuple(current.weight.shape)}")
        if not torch.equal(current.weight, t.to(current.weight.dtype)):
            layer.embed_tokens = torch.nn.Embedding.from_pretrained(t.to(current.weight.device), freeze=False)
    else:
        current = layer.shared_head.head
        if current.weight.shape != t.shape:
            raise ValueError(f"checkpoint: {name} has shape {tuple(t.shape)}, expected {tuple(current.weight.shape)}")
        if not torch.equal(current.weight, t.to(current.weight.dtype)):
            head = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device=current.weight.device)
            head.weight.data.copy_(t)
            layer.shared_head.head = head
