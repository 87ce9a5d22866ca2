"""DeepSeek mixture of experts: group-limited top-k routing and shared experts."""
import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.config import ModelConfig
from mtpserve.model.layers import MLP


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (weights [N, k], expert ids [N, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
        if cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            keep = group_scores.topk(cfg.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.scoring_func == "sigmoid":   # V3: normalize (optionally), then always scale
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * cfg.routed_scaling_factor
        elif cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:   # V2 softmax scoring
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            weights = weights * cfg.routed_scaling_factor
        return weights.to(x.dtype), ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if torch.compiler.is_compiling():
            return out + self._all_experts(x, weights, ids)
        flat_ids = ids.flatten()
        order = flat_ids.argsort()
        token_of = order // ids.shape[1]
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                chosen = order[start:start + count]
                rows = token_of[start:start + count]
                y = expert(x[rows]) * weights.flatten()[chosen].unsqueeze(-1)
                out = out.index_add(0, rows, y)
                start += count
        return out

    def _all_experts(self, x, weights, ids):
        """Graph-mode form with no data-dependent shapes: every expert runs on every token and is weighted
        by its (mostly zero) routing weight. E/k times the expert FLOPs: meant for small expert counts."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype, device=x.device).scatter(1, ids, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * dense[:, e:e + 1]
        return out
