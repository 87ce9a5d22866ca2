"""A step's data, flowing one way: the scheduler's plan (StepPlan, a ScheduledRequest each), the rows the model
runs (Row), what the runner returns for each request (StepResult), which the engine commits.

Request "a" at 5, pending t5, drafts [d6, d7]:
    ScheduledRequest(a, start=5, num_new_tokens=1, draft_token_ids=[d6, d7], num_next_drafts=2)
    Row([t5, d6, d7], start=5, block_ids)            (positions 5, 6, 7)
    StepResult([d6, e7], num_drafts=2, num_accepted=1, next_drafts=[d8, d9])
"""
from dataclasses import dataclass, field

import torch

from mtpserve.request import Request


@dataclass
class ScheduledRequest:
    req: Request
    start: int                   # position of the first query token (= tokens already in the KV cache)
    num_new_tokens: int          # known tokens computed this step (a prompt chunk, or the pending token)
    draft_token_ids: list[int]   # drafts verified after them (only when the request samples this step)
    num_next_drafts: int = 0     # drafts to propose for its next step (the scheduler's policy sets it)

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens == self.req.num_tokens

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)

    def decodes(self, k: int) -> bool:
        """A decode step verifying k drafts: the pending token, then k drafts ([t5, d6, d7] for k = 2)."""
        return self.samples and self.num_new_tokens == 1 and len(self.draft_token_ids) == k


@dataclass
class StepPlan:
    """The scheduler's plan: the requests, the drafts every one proposes (spec_decode/adaptive.py decides), and
    the batch size when the step is steady (each decodes(k) and drafts k: adaptive k times it), else None."""
    scheduled: list[ScheduledRequest]
    num_next_drafts: int
    steady_batch: int | None = None


@dataclass(frozen=True, repr=False)
class Pass:
    """A forward the runner runs as one function (a graph in graph mode): the main model, MTP layer `layer`, or
    the fused decode step (verify 1+k tokens, accept, draft k; `sampled` when a row samples or penalizes)."""
    kind: str               # "main", "mtp" or "fused"
    layer: int = 0          # (mtp) which of the checkpoint's MTP layers
    sampled: bool = False   # (fused)

    def __str__(self) -> str:   # (graph names, logs, pass counts): main, mtp0, fused, fused_sampled
        if self.kind == "mtp":
            return f"mtp{self.layer}"
        return "fused_sampled" if self.sampled else self.kind

    __repr__ = __str__


MAIN, FUSED, FUSED_SAMPLED = Pass("main"), Pass("fused"), Pass("fused", sampled=True)


def mtp_layer(j: int) -> Pass:
    return Pass("mtp", j)


@dataclass
class Row:
    """Consecutive query tokens of one request, starting at `start`; `block_ids` is its block table.
    num_kept: only the first num_kept tokens' KV is kept (the rest pad the row to a graph's shape: slot -1)."""
    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_kept: int | None = None

    def slots(self, block_size: int) -> list[int]:
        """Cache slot (block * block_size + offset) of each of the row's tokens; -1 for padding tokens."""
        kept = len(self.token_ids) if self.num_kept is None else self.num_kept
        return [self.block_ids[p // block_size] * block_size + p % block_size
                for p in range(self.start, self.start + kept)] + [-1] * (len(self.token_ids) - kept)


def flat_rows(rows: list[Row], q: int, bucket: int, block_size: int) -> tuple[list, ...]:
    """Rows of q tokens as flat lists: token ids, positions, slots [n * q]; KV lengths [n]; block table cut or
    padded to `bucket` blocks [n * bucket]. Rows [t5 d6 d7] at 5 and [u9 e10 e11] at 9, block size 4, bucket 3:
    ids [t5 d6 d7 u9 e10 e11], positions [5 6 7 9 10 11], KV lengths [8 12], tables [a0 a1 0 b0 b1 b2]."""
    # Index arithmetic in Python lists, one copy per tensor: per-op costs dominate a small decode step.
    ids, positions, slots, seq_lens, tables = [], [], [], [], []
    for r in rows:
        ids += r.token_ids
        positions += range(r.start, r.start + q)
        slots += r.slots(block_size)
        seq_lens.append(r.start + q)
        blocks = r.block_ids[:bucket]
        tables += blocks + [0] * (bucket - len(blocks))
    return ids, positions, slots, seq_lens, tables


def fused_kv_reach(start: int, k: int) -> int:
    """The KV length a fused step of k drafts from `start` needs its block table to cover: [t5 d6 d7] at 5 (k = 2)
    verifies 5..7 and drafts at positions up to 9, so 10."""
    return start + 2 * k + 1


@dataclass
class StepResult:
    """What a step did for one request (the runner's output; the engine commits it)."""
    new_token_ids: list[int]                 # accepted drafts, then one token from the target model
    num_drafts: int = 0                      # drafts verified this step
    num_accepted: int = 0
    next_drafts: list[int] | None = None
    next_draft_probs: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None  # the sampled position's hidden state (requests that hold their KV)
    logprobs: list = field(default_factory=list)   # per new token [(token, logprob, rank), top...] (when asked)
    prompt_logprobs: list | None = None      # the same for prompt tokens prompt_logprobs_start.. of this chunk
    prompt_logprobs_start: int = 0
