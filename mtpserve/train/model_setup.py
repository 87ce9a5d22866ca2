"""Model construction, initialisation, optimiser, MoE balancing and export for train.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from mtpserve.config import ModelConfig
from mtpserve.model.checkpoint import save_checkpoint, tiny_config
from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from mtpserve.model.moe import Gate
from mtpserve.train import tokenizer as tok_mod


def hf_config_from_args(args, tok) -> dict:
    moe = args.experts > 0
    return tiny_config(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora_rank or None, kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        n_routed_experts=args.experts if moe else None, n_shared_experts=1 if moe else None,
        num_experts_per_tok=args.experts_per_tok if moe else None, n_group=args.n_group,
        topk_group=args.topk_group,
        routed_scaling_factor=1.0, first_k_dense_replace=args.first_dense if moe else args.layers,
        max_position_embeddings=args.max_position_embeddings,
        num_nextn_predict_layers=args.mtp_depth, **tok_mod.special_ids(tok))


@torch.no_grad()
def init_for_training(model: DeepseekV3ForCausalLM, seed: int, std: float = 0.02) -> None:
    """GPT-2 style: N(0, std) weights, residual output projections scaled by 1/sqrt(2 * #blocks),
    norms at 1, router biases at 0."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = model.config.num_hidden_layers + model.num_mtp_layers
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("e_score_correction_bias") else 1.0)
        else:
            s = std / math.sqrt(2 * n_blocks) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.copy_(s * torch.randn(p.shape, generator=gen))


def build_model(args, tok) -> DeepseekV3ForCausalLM:
    if args.init:
        from mtpserve.model.loader import load_model
        base = load_model(args.init, dtype=torch.float32)
        if base.config.vocab_size != tok.get_vocab_size():
            raise SystemExit(f"--init {args.init}: vocab_size {base.config.vocab_size} does not match "
                             f"the tokenizer's {tok.get_vocab_size()}")
        cfg_dict = json.loads((Path(args.init) / "config.json").read_text())
        if (args.n_group, args.topk_group) != (1, 1):   # switch routing on a trained model
            cfg_dict.update(n_group=args.n_group, topk_group=args.topk_group)
            base.config.n_group, base.config.topk_group = args.n_group, args.topk_group
        if args.grow_layers:
            if base.num_mtp_layers != args.mtp_depth:
                raise SystemExit("--grow-layers keeps the checkpoint's MTP modules: pass its --mtp-depth")
            from mtpserve.train.grow import grow
            model, cfg_dict = grow(base, cfg_dict, args.grow_layers, args.grow_first_dense)
            model.hf_config = cfg_dict
            return model
        if base.num_mtp_layers == args.mtp_depth:
            base.hf_config = cfg_dict
            return base
        cfg_dict["num_nextn_predict_layers"] = args.mtp_depth
        model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg_dict))
        init_for_training(model, args.seed)
        state = {k: v for k, v in base.state_dict().items() if k in model.state_dict()}
        model.load_state_dict(state, strict=False)   # MTP modules beyond the checkpoint's stay fresh
        model.hf_config = cfg_dict
        return model
    hf = hf_config_from_args(args, tok)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(hf))
    init_for_training(model, args.seed)
    model.hf_config = hf
    return model


def trainable_params(model: DeepseekV3ForCausalLM, freeze_main: bool) -> list[nn.Parameter]:
    """All parameters; with freeze_main only the MTP modules' own ones (embedding and head are shared
    with the main model and stay frozen too)."""
    main_ids = {id(p) for n, p in model.named_parameters() if not n.startswith("mtp_layers.")}
    out = []
    for n, p in model.named_parameters():
        train = (not freeze_main) or id(p) not in main_ids
        if n.endswith("e_score_correction_bias"):
            train = False   # updated by ExpertBalancer, not by gradients
        p.requires_grad_(train)
        if train:
            out.append(p)
    return out


def make_optimizer(params: list[nn.Parameter], args) -> torch.optim.Optimizer:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing: after each step, every router's
    e_score_correction_bias moves by gamma towards equal expert load (sign of the load error).
    Routers of a frozen main model are left alone."""

    def __init__(self, model: DeepseekV3ForCausalLM, gamma: float):
        self.gamma = gamma
        self.gates = [m for m in model.modules() if isinstance(m, Gate) and hasattr(m, "e_score_correction_bias")
                      and m.weight.requires_grad]
        self.counts = {}
        for g in self.gates:
            g.register_forward_hook(self._hook)

    def _hook(self, gate, inputs, output):
        if gate.training and torch.is_grad_enabled():
            ids = output[1].flatten()
            c = torch.bincount(ids, minlength=gate.e_score_correction_bias.numel())
            self.counts[id(gate)] = self.counts.get(id(gate), 0) + c

    def reset(self) -> None:
        self.counts = {}

    @torch.no_grad()
    def update(self) -> None:
        if not self.gamma:
            return
        for g in self.gates:
            c = self.counts.get(id(g))
            if c is not None:
                load = c.float()
                g.e_score_correction_bias.add_(self.gamma * torch.sign(load.mean() - load))


def param_counts(model: DeepseekV3ForCausalLM) -> dict:
    seen, main, mtp = set(), 0, 0
    for n, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if n.startswith("mtp_layers."):
            mtp += p.numel()
        else:
            main += p.numel()
    return {"total_params": main + mtp, "main_params": main, "mtp_params": mtp}


def save(model: DeepseekV3ForCausalLM, tok, out, model_max_length: int) -> None:
    out = Path(out)
    hf = getattr(model, "hf_config", None)
    save_checkpoint(model, str(out), dtype=torch.bfloat16, hf_config=hf)
    tok_mod.save_tokenizer(tok, out, model_max_length)
