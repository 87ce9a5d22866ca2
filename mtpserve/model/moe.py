"""DeepSeek mixture of experts: group-limited top-k routing and shared experts."""
import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.config import ModelConfig
from mtpserve.model import cpu_kernels
from mtpserve.model.attention import SMALL_BMM_ROWS, few_rows_in_cpu_graph
from mtpserve.model.fp8 import Fp8Weight
from mtpserve.model.int8 import Int8Weight
from mtpserve.model.layers import FEW_ROWS, MLP, by_columns, linear, silu_and_mul
from mtpserve.model.ops import opaque_op
from mtpserve.model.parallel import ExpertParallel, TensorParallel

# Up to this many (token, expert) choices, every expert chosen runs on all the tokens: fewer ops than grouping
# tokens by expert, and on small batches the per-op cost and the weight reads, not the FLOPs, dominate.
FEW_CHOICES = 8


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest of each row [N, E] -> [N, k], largest first."""
    if few_rows_in_cpu_graph(scores, len(scores)) and scores.shape[-1] <= SMALL_BMM_ROWS:   # (no ATen topk call)
        # each index's rank: the scores above it (ties: lower indices first). [0.1 0.7 0.3] -> ranks [2 0 1]; top 2:
        # the index of rank 0, then of rank 1 -> [1 2]
        index = torch.arange(scores.shape[-1], device=scores.device)
        mine, other = scores.unsqueeze(-1), scores.unsqueeze(-2)
        rank = ((other > mine) | ((other == mine) & (index < index.unsqueeze(-1)))).sum(-1)
        return (rank.unsqueeze(-2) == torch.arange(k, device=scores.device).unsqueeze(-1)).int().argmax(-1)
    return scores.topk(k, dim=-1).indices


def router_logits(x32: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """x [N, hidden] @ w [E, hidden].T in fp32, a row's logits independent of the other rows on the CPU: a fused sum
    in a graph of a few rows, else our kernel (MKL's bits for a row change with the number of rows)."""
    if few_rows_in_cpu_graph(x32, len(x32)):
        return (x32.unsqueeze(1) * w32).sum(-1)
    if cpu_kernels.usable(x32, w32, dtype=torch.float32):
        return cpu_kernels.fp32_linear(x32, w32)
    return F.linear(x32, w32)


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
        logits = router_logits(x.float(), self.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
        if cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)
            if cfg.topk_method == "noaux_tc":   # a group's score: its top-2 experts (all of it when it has 2)
                group_scores = grouped.sum(-1) if grouped.shape[-1] == 2 else grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            keep = _top(group_scores, cfg.topk_group)
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).flatten(1)
        ids = _top(choice, cfg.num_experts_per_tok)
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
    """Under tensor parallelism (TP-MoE) every rank holds every expert's slice of the intermediate dimension
    and routes identically (the router is replicated): its output is a partial sum, completed by the caller.
    Under expert parallelism (`ep`, model/parallel.py) a rank holds whole experts, a range of them; the
    experts are keyed by their global id, as in the checkpoint."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel(), ep: ExpertParallel = ExpertParallel()):
        super().__init__()
        self.ep = ep
        self.gate = Gate(cfg)
        inter = tp.divide(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.local_experts = ep.experts(cfg.n_routed_experts)
        routed_inter = cfg.moe_intermediate_size if ep.size > 1 else inter
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, routed_inter) for e in self.local_experts})
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, inter * cfg.n_shared_experts)
        self.w13: torch.Tensor | Fp8Weight | None = None   # stacked expert weights, set by fuse()
        self.w2: torch.Tensor | Fp8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if self.ep.dispatch:
            return out + self._dispatched(x, weights, ids)
        if self.ep.size > 1:
            ids = self._local_ids(ids)
        return out + self._routed(x, weights, ids)

    def _local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices; another rank's expert (or -1, padding) -> len(local)."""
        n = len(self.local_experts)
        local = ids - self.local_experts.start
        return torch.where((local >= 0) & (local < n), local, n)

    def _dispatched(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention: every rank's tokens and routing are gathered (one all-gather: the rows
        travel in float32 with their weights and ids, all exact), this rank's experts run on the choices that
        are theirs, and one reduce-scatter hands each rank the sum over all experts for its own tokens.
        Padding rows (up to tokens_per_rank) choose expert -1: nobody's."""
        n, k = ids.shape
        pad = 0 if torch.compiler.is_compiling() else max(0, self.ep.tokens_per_rank - n)
        packed = torch.cat([F.pad(x.float(), (0, 0, 0, pad)), F.pad(weights.float(), (0, 0, 0, pad)),
                            F.pad(ids.float(), (0, 0, 0, pad), value=-1.0)], dim=-1)
        rows = self.ep.gather_tokens(packed)
        h = x.shape[1]
        routed = self._routed(rows[:, :h].to(x.dtype), rows[:, h:h + k].to(weights.dtype),
                              self._local_ids(rows[:, h + k:].long()))
        return self.ep.sum_back(routed)[:n]

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output; ids index this rank's experts (len(local) marks another rank's)."""
        if self.w13 is None:   # unfused (training): the per-expert modules
            experts = list(self.experts.values())
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
            return _hit_experts(x, weights, ids, w13, torch.stack([e.down_proj.weight for e in experts], 1))
        fp8 = isinstance(self.w13, Fp8Weight)
        int8 = isinstance(self.w13, Int8Weight)
        partitioned = self.ep.size > 1   # some choices are not this rank's: only the paths that skip them
        if torch.compiler.is_compiling():
            if cpu_kernels.experts_usable(x, weights, self.w13, self.w2):   # bf16, int8, fp32: our kernel
                return cpu_kernels.routed_experts(x, weights, ids, self.w13, self.w2, FEW_ROWS)
            if int8:   # (PyTorch's int8 kernel; chosen pairs read the few experts hit like the others)
                if ids.numel() <= FEW_CHOICES and not partitioned:
                    return _chosen_pairs(x, weights, ids, self.w13, self.w2)
                return routed_experts_int8(x, weights, ids, self.w13.data, self.w13.scale, self.w2.data,
                                           self.w2.scale)
            if x.is_cuda:   # a CUDA graph cannot loop over the experts hit on the host: all experts, two GEMMs
                w13, w2 = (self.w13.dequantize(x.dtype), self.w2.dequantize(x.dtype)) if fp8 else (self.w13, self.w2)
                return _all_experts(x, weights, ids, w13, w2)
            if ids.numel() <= FEW_CHOICES and not partitioned:
                return _chosen_pairs(x, weights, ids, self.w13, self.w2)
            if fp8:   # the experts hit, each dequantized as it runs
                return routed_experts_fp8(x, weights, ids, self.w13.data, self.w13.scale, self.w2.data,
                                          self.w2.scale, self.w13.block, self.w2.block)
            return routed_experts(x, weights, ids, self.w13, self.w2)
        return _hit_experts(x, weights, ids, self.w13, self.w2)

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference only: the experts' weights become views of two tensors, w13 [E, 2I, H] (gate and up of
        an expert as one GEMM) and w2 [H, E, I]; the state dict keeps its names. On CUDA w2 lies as [H, E, I]
        (all down projections side by side: one GEMM over all experts' outputs); elsewhere it is stored
        expert-major [E, H, I] and viewed as [H, E, I], so that one expert's w2[:, e] is contiguous (the CPU
        kernels read one expert at a time). FP8 and int8 experts are stacked with their scales."""
        def stack(attr):
            down = [getattr(e.down_proj, attr) for e in experts]
            return (torch.stack([torch.cat([getattr(e.gate_proj, attr), getattr(e.up_proj, attr)]) for e in experts]),
                    torch.stack(down, dim=1) if side_by_side else torch.stack(down).movedim(0, 1))

        experts = list(self.experts.values())
        int8 = getattr(experts[0].gate_proj, "int8_scale", None) is not None
        side_by_side = experts[0].gate_proj.weight.is_cuda and not int8
        w13, w2 = stack("weight")
        w13, w2 = by_columns(w13), by_columns(w2.movedim(1, 0)).movedim(0, 1)   # (w2[:, e] by columns too)
        inter = w2.shape[-1]
        for i, e in enumerate(experts):
            e.gate_proj.weight = nn.Parameter(w13[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(w13[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(w2[:, i], requires_grad=False)
        self.w13, self.w2 = w13, w2
        if int8:
            s13, s2 = stack("int8_scale")
            for i, e in enumerate(experts):
                e.gate_proj.int8_scale, e.up_proj.int8_scale = s13[i, :inter], s13[i, inter:]
                e.down_proj.int8_scale = s2[:, i]
            self.w13, self.w2 = Int8Weight(w13, s13), Int8Weight(w2, s2)
        block = getattr(experts[0].gate_proj, "weight_block", None)
        if block is not None:
            s13, s2 = stack("weight_scale")
            for i, e in enumerate(experts):
                e.gate_proj.weight_scale, e.up_proj.weight_scale = s13[i, :inter], s13[i, inter:]
                e.down_proj.weight_scale = s2[:, i]
            self.w13, self.w2 = Fp8Weight(w13, s13, block), Fp8Weight(w2, s2, block)


def _hit_experts(x, weights, ids, w13, w2) -> torch.Tensor:
    """Runs each expert that some token chose on those tokens only, weighted by its routing weight.
    w13: [E, 2I, H]; w2: [H, E, I]. An id of E is a choice of an expert held elsewhere (expert parallelism):
    skipped. Every path sums a token's weighted expert outputs in fp32 in expert id order, rounded once (_sum):
    a token's bits do not depend on the path or the other tokens."""
    if cpu_kernels.experts_usable(x, weights, w13, w2):   # on the CPU: _grouped's bits in one op
        return cpu_kernels.routed_experts(x, weights, ids, w13, w2, FEW_ROWS)
    num_experts = len(w13)
    if ids.numel() <= FEW_CHOICES:
        # A few tokens (decode; verify at small batch): each expert chosen by any of them runs once on all of
        # them (a GEMM of a few columns costs about what one column does), weighted by a routing weight that
        # is zero for the tokens that did not choose it.
        routing = torch.zeros(ids.shape[0], num_experts + 1, dtype=x.dtype, device=x.device).scatter(1, ids, weights)
        return _sum(x, [linear(silu_and_mul(linear(x, w13[e])), w2[:, e]) * routing[:, e:e + 1]
                        for e in sorted(set(ids.flatten().tolist())) if e < num_experts])
    return _grouped(x, weights, ids, w13, w2)


def _grouped(x, weights, ids, w13, w2) -> torch.Tensor:
    """Many tokens: each expert on the tokens that chose it, gathered once in expert order (so each expert's
    rows are a slice), then put back in a grid of each token's choices in id order: [t0: e1 e5] [t1: e2 e5]
    -> rows e1:t0, e2:t1, e5:t0, e5:t1 -> grid [[e1 e5] [e2 e5]]."""
    num_experts = len(w13)
    ids, by_id = ids.sort(-1)
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)   # (an expert's rows in token order, as our kernel gathers them)
    chosen_x = x[order // ids.shape[1]]
    outputs, start = [], 0
    for expert, count in enumerate(torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()):
        if count:
            rows = chosen_x[start:start + count]
            outputs.append(linear(silu_and_mul(linear(rows, w13[expert])), w2[:, expert]))
            start += count
    if not outputs:
        return torch.zeros_like(x)
    grid = x.new_zeros(ids.numel(), x.shape[1])
    grid[order[:start]] = torch.cat(outputs) * weights.gather(1, by_id).flatten()[order[:start]].unsqueeze(-1)
    return _sum(x, list(grid.view(*ids.shape, -1).unbind(1)))


def _sum(x: torch.Tensor, terms: list[torch.Tensor]) -> torch.Tensor:
    """A token's weighted expert outputs (in expert id order) summed in fp32, rounded once to x's dtype."""
    if not terms:
        return torch.zeros_like(x)
    total = terms[0].float()
    for term in terms[1:]:
        total = total + term.float()
    return total.to(x.dtype)


def _chosen_pairs(x, weights, ids, w13, w2) -> torch.Tensor:
    """A CPU graph's few tokens: every (token, expert) choice as its own GEMM pair, the expert picked by a
    scalar read inside the graph (needs dynamo's capture_scalar_outputs). No host loop, no per-op dispatch;
    an expert two tokens chose is read twice."""
    ids, by_id = ids.sort(-1)
    weights, rows = weights.gather(1, by_id), []
    for t in range(x.shape[0]):
        terms = []
        for j in range(ids.shape[1]):
            expert = ids[t, j].item()
            torch._check(expert >= 0)
            torch._check(expert < len(w13))
            y = linear(silu_and_mul(linear(x[t:t + 1], w13.select(0, expert))), w2.select(1, expert))
            terms.append(y * weights[t:t + 1, j:j + 1])
        rows.append(_sum(x[t:t + 1], terms))
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def _like_x(x, *args):
    return torch.empty_like(x)


@opaque_op("routed_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2) -> Tensor", _like_x)
def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """The hit-experts loop as one opaque op, so CPU graphs (inductor) run only the experts chosen."""
    return _hit_experts(x, weights, ids, w13, w2)


@opaque_op("routed_experts_fp8(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor s13, Tensor w2, Tensor s2, "
           "int block13, int block2) -> Tensor", _like_x)
def routed_experts_fp8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                       w2: torch.Tensor, s2: torch.Tensor, block13: int, block2: int) -> torch.Tensor:
    """The same with FP8 experts (w13/w2, their scales and column blocks), each expert dequantized as it runs."""
    return _hit_experts(x, weights, ids, Fp8Weight(w13, s13, block13), Fp8Weight(w2, s2, block2))


@opaque_op("routed_experts_int8(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor s13, Tensor w2, "
           "Tensor s2) -> Tensor", _like_x)
def routed_experts_int8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                        s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The same with int8 experts (model/int8.py)."""
    return _hit_experts(x, weights, ids, Int8Weight(w13, s13), Int8Weight(w2, s2))


def _all_experts(x, weights, ids, w13, w2) -> torch.Tensor:
    """Every expert on every token as two GEMMs (no data-dependent shapes), weighted by the routing weights,
    zero for the experts a token did not choose. E/k times the expert FLOPs, one pass over all expert weights."""
    num_experts, inter = w13.shape[0], w2.shape[-1]
    dense = torch.zeros(x.shape[0], num_experts + 1, dtype=x.dtype, device=x.device).scatter(1, ids, weights)
    dense = dense[:, :num_experts]   # (column E: choices of experts held elsewhere)
    hidden = silu_and_mul(F.linear(x, w13.view(-1, w13.shape[-1])).view(x.shape[0], num_experts, 2 * inter))
    return F.linear((hidden * dense.unsqueeze(-1)).view(x.shape[0], -1), w2.view(w2.shape[0], -1))
