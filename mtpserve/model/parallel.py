"""Tensor parallelism: which slice of each weight a rank holds, and the two collectives the model needs.

Megatron's split, as vLLM applies it to MLA: a projection that fans out (q / q_b, kv_b, gate and up) is split
by output rows (column-parallel: by head for attention, by intermediate dimension for MLPs and experts), the
projection that fans back in (o_proj, down) by input columns (row-parallel), so each rank's output is a partial
sum and one all-reduce per block completes it. The compressed latent (kv_a and its norm) is small and replicated,
so every rank caches the whole latent KV. Embedding and output heads are split by vocabulary rows (padded to a
multiple of the ranks); the router is replicated, so every rank picks the same experts.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

COLUMN = {"q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj"}   # split by output rows
ROW = {"o_proj", "down_proj"}                                           # split by input columns
VOCAB = {"embed_tokens", "lm_head", "head"}                             # split by vocabulary rows


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None   # torch.distributed ProcessGroup (None with one rank)

    def divide(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"tensor_parallel_size = {self.size}: must divide {what} = {n}")
        return n // self.size

    def vocab_rows(self, vocab: int) -> int:
        """Rows of an embedding / head per rank: the vocabulary padded to a multiple of the ranks."""
        return -(-vocab // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as fc   # traceable into graphs
        return fc.wait_tensor(fc.all_reduce(x, "sum", self.group))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank 0's columns first."""
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as fc
        gathered = fc.wait_tensor(fc.all_gather_single(x.contiguous(), 0, self.group))   # [size * M, n]
        return gathered.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


def shard_kind(name: str) -> str | None:
    """"column" | "row" | "vocab" | None (replicated) for a parameter name (ours or the checkpoint's)."""
    parts = name.split(".")
    if parts[-1] != "weight" or len(parts) < 2:
        return None
    module = parts[-2]
    if module in COLUMN:
        return "column"
    if module in ROW:
        return "row"
    if module in VOCAB:
        return "vocab"
    return None


def shard_slices(kind: str | None, shape: tuple, tp: TensorParallel) -> tuple[slice, ...] | None:
    """Which part of a full checkpoint tensor of `shape` this rank holds (None: all of it)."""
    if kind is None or tp.size == 1:
        return None
    if kind == "column":
        n = tp.divide(shape[0], "the output rows of a column-parallel weight")
        return (slice(tp.rank * n, (tp.rank + 1) * n),)
    if kind == "row":
        n = tp.divide(shape[1], "the input columns of a row-parallel weight")
        return (slice(None), slice(tp.rank * n, (tp.rank + 1) * n))
    rows = tp.vocab_rows(shape[0])
    return (slice(min(tp.rank * rows, shape[0]), min((tp.rank + 1) * rows, shape[0])),)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks: each looks up the ids in its range, zeros the rest,
    and the all-reduce sums the one non-zero row per token."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.rows = tp.vocab_rows(vocab)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.randn(self.rows, hidden))   # (nn.Embedding's init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


@dataclass
class ExpertParallel:
    """Routed experts partitioned over `size` ranks, rank r owning a contiguous range of them.

    dispatch=False (tensor parallelism): every rank has every token, runs its own experts on them, and the
    block's all-reduce sums the partial outputs. dispatch=True (data-parallel attention): each rank has its
    own tokens; every MoE layer all-gathers the ranks' tokens with their routing, runs its experts on all of
    them and reduce-scatters the outputs back (each rank receives the sum over all experts for its own
    tokens). Every rank sends the same number of rows, `tokens_per_rank`, which the runner agrees on before
    each eager forward (a graph's rows are already the same on every rank)."""
    rank: int = 0
    size: int = 1
    group: object = None
    dispatch: bool = False
    tokens_per_rank: int = 0

    def experts(self, num_experts: int) -> range:
        if num_experts % self.size:
            raise ValueError(f"expert parallel size {self.size} (data_parallel_size x tensor_parallel_size): must "
                             f"divide n_routed_experts = {num_experts}")
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def gather_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, d] on each rank -> [size * n, d], rank 0's rows first."""
        import torch.distributed._functional_collectives as fc
        return fc.wait_tensor(fc.all_gather_single(rows.contiguous(), 0, self.group))

    def sum_back(self, rows: torch.Tensor) -> torch.Tensor:
        """[size * n, d] partial sums on each rank -> [n, d]: this rank's rows summed over the ranks."""
        import torch.distributed._functional_collectives as fc
        return fc.wait_tensor(fc.reduce_scatter_single(rows.contiguous(), "sum", 0, self.group))


def parallel_layout(tp_size: int, dp_size: int, expert_parallel: bool, rank: int = 0,
                    group=None) -> tuple[TensorParallel, ExpertParallel | None]:
    """Rank `rank`'s tensor- and expert-parallel layout. Data-parallel ranks replicate attention (no TP inside
    them); expert parallelism spans every rank and dispatches tokens when the ranks hold different ones (DP)."""
    if dp_size > 1 and tp_size > 1:
        raise ValueError(f"data_parallel_size = {dp_size} with tensor_parallel_size = {tp_size}: tensor parallelism "
                         "inside data-parallel ranks is not supported; use tensor_parallel_size = 1")
    tp = TensorParallel(rank, tp_size, group) if tp_size > 1 else TensorParallel()
    world = tp_size * dp_size
    ep = ExpertParallel(rank, world, group, dispatch=dp_size > 1) if expert_parallel and world > 1 else None
    return tp, ep
