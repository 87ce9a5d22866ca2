"""Depth up-scaling: grow a trained model to more main layers without changing what it computes.

Each new layer is a copy of the nearest earlier layer of its kind (dense MLP or MoE) with its residual
output projections (attention `o_proj`, every `down_proj`) set to zero, so at step 0 the new layer adds
nothing to the residual stream and the grown model's logits equal the original's. Training then moves
the new layers away from identity. Old layers keep their order and are spread evenly over the slots of
their kind; dense layers stay first (DeepSeek-V3's `first_k_dense_replace`).
"""
from __future__ import annotations

import torch

from mtpserve.config import ModelConfig
from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM


def slot_sources(n_old: int, n_new: int) -> list[int]:
    """For each of n_new slots, the old layer (0..n_old-1) it starts from; old layer j sits at slot
    j * n_new // n_old and the slots after it copy it."""
    if n_new < n_old:
        raise ValueError(f"cannot shrink {n_old} layers to {n_new}")
    if n_old == 0:
        if n_new:
            raise ValueError("no layer of this kind to copy from")
        return []
    home = [j * n_new // n_old for j in range(n_old)]
    return [max(j for j in range(n_old) if home[j] <= s) for s in range(n_new)]


def layer_plan(old_layers: int, old_dense: int, new_layers: int, new_dense: int) -> list[tuple[int, bool]]:
    """(source layer, is_copy) for every new main layer."""
    dense = slot_sources(old_dense, new_dense)
    moe = [old_dense + j for j in slot_sources(old_layers - old_dense, new_layers - new_dense)]
    plan, seen = [], set()
    for src in dense + moe:
        plan.append((src, src in seen))
        seen.add(src)
    return plan


@torch.no_grad()
def grow(base: DeepseekV3ForCausalLM, hf_config: dict, new_layers: int, new_dense: int
         ) -> tuple[DeepseekV3ForCausalLM, dict]:
    cfg = dict(hf_config, num_hidden_layers=new_layers, first_k_dense_replace=new_dense)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg))
    old_dense = min(hf_config.get("first_k_dense_replace", 0), hf_config["num_hidden_layers"])
    plan = layer_plan(hf_config["num_hidden_layers"], old_dense, new_layers, new_dense)
    old_state = base.state_dict()
    new_state = {}
    for name in model.state_dict():
        src = name
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            old_idx, is_copy = plan[int(idx)]
            src = f"model.layers.{old_idx}.{rest}"
            if is_copy and rest.endswith(("o_proj.weight", "down_proj.weight")):
                new_state[name] = torch.zeros_like(old_state[src])
                continue
        new_state[name] = old_state[src].clone()
    model.load_state_dict(new_state, strict=True)
    return model, cfg
