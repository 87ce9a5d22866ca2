"""Data-parallel attention with expert parallelism: every rank makes the same collectives, every step.

Each MoE layer all-gathers the ranks' tokens and reduce-scatters the experts' outputs (model/moe.py), so
every rank must run the same forwards in the same order, each with the same number of rows: the target
model, then as many MTP passes as the busiest rank runs (k when anyone drafts, 1 when only prompt chunks
ran), whatever its own requests are doing. Before each forward the ranks agree, in one small all-reduce, on
what it looks like: how many rows every rank sends to the experts, whether it runs as a graph (only when every
rank's batch fits the same graph; then all pad to the largest graph size) and, before the target forward,
how many MTP passes follow. A rank with nothing to run makes a dummy forward: one padding row that writes no
KV (slot -1), or a graph of padding rows. (vLLM's dummy runs, SGLang's IDLE batches.)
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

_NONE = 1 << 30   # "no graph query length" in a MAX-reduction of negated lengths


@dataclass
class ForwardPlan:
    tokens_per_rank: int              # rows every rank sends to the experts (the most any rank has)
    graph: tuple[int, int] | None     # (batch size, query length) of the graph every rank runs; None: eager
    mtp_passes: int                   # MTP passes every rank runs after this (target) forward


class DataParallelSync:
    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def agree(self, moe_tokens: int, graph_batch: int, graph_query_len: int, eager: bool,
              mtp_passes: int) -> ForwardPlan:
        """This rank's forward: the rows its experts see, the graph its batch fits (0, 0: none; an idle rank
        fits any), whether it must run eagerly, and the MTP passes it needs. Returns what every rank runs."""
        mine = torch.tensor([moe_tokens, graph_batch, graph_query_len, -graph_query_len if graph_query_len else -_NONE,
                             int(eager), mtp_passes])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        tokens, batch, q_max, neg_q_min, any_eager, passes = mine.tolist()
        same_shape = batch > 0 and q_max == -neg_q_min
        graph = (batch, q_max) if same_shape and not any_eager else None
        return ForwardPlan(max(1, tokens), graph, passes)
