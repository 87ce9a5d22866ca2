"""What the front sends every worker each step, and the copy of the running requests a worker keeps.

Every rank runs the same `ModelRunner.execute` on the same batch, so every rank samples, verifies and drafts
the same tokens: logits are gathered whole on each rank and the random draws come from generators seeded
alike (the engine's, drawn in the same order, and each seeded request's, keyed on its seed and position). A worker therefore needs only
what its runner reads: each scheduled request's position, drafts, block table, the tokens it has not seen yet
(new prompts; tokens the front appended), and, once, its sampling parameters. Draft distributions are never
sent: each rank computed the same ones itself.

Under data parallelism each rank runs its own requests: the front sends every rank the message for its
part of the step (one list, a message per rank), and gathers each rank's results back (their draft
distributions stay with the rank that drew them).
"""
import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from mtpserve.request import Request, request_seed
from mtpserve.sampling.grammar import GrammarState
from mtpserve.step import ScheduledRequest


@dataclass
class ScheduledItem:
    request_id: str
    start: int
    num_new_tokens: int
    draft_token_ids: list[int]
    block_ids: list[int]
    new_token_ids: list[int]            # tokens of the request the worker has not seen yet
    first_seen: tuple | None = None     # (params, index, prompt length) the first time the request is sent
    num_next_drafts: int = 0


@dataclass
class StepMessage:
    items: list[ScheduledItem]
    forget: list[str]                   # finished or aborted requests: drop their copies


class StepSender:
    """Front side: builds each step's message, sending every token once."""

    def __init__(self):
        self.sent: dict[str, Request] = {}
        self.num_sent: dict[str, int] = {}

    def message(self, scheduled: list[ScheduledRequest]) -> StepMessage:
        forget = [rid for rid, req in self.sent.items() if req.is_finished]
        for rid in forget:
            del self.sent[rid], self.num_sent[rid]
        items = []
        for s in scheduled:
            req, rid = s.req, s.req.request_id
            if self.sent.get(rid) is not req:   # new (or a new request reusing a finished one's id)
                forget += [rid] if rid in self.sent else []
                self.sent[rid], self.num_sent[rid] = req, 0
            first = (req.params, req.index, len(req.prompt_token_ids)) if self.num_sent[rid] == 0 else None
            tokens = req.all_token_ids
            items.append(ScheduledItem(rid, s.start, s.num_new_tokens, list(s.draft_token_ids), list(req.block_ids),
                                       tokens[self.num_sent[rid]:], first, s.num_next_drafts))
            self.num_sent[rid] = len(tokens)
        return StepMessage(items, forget)


class RequestMirror:
    """Worker side: the running requests as far as the runner needs them."""

    def __init__(self, device, grammars=None):
        """grammars(): this rank's structured-outputs compiler (sampling/grammar.py), made on first use."""
        self.device, self.grammars, self.compiler = device, grammars, None
        self.requests: dict[str, Request] = {}

    def apply(self, msg: StepMessage) -> list[ScheduledRequest]:
        for rid in msg.forget:
            self.requests.pop(rid, None)
        scheduled = []
        for item in msg.items:
            tokens = item.new_token_ids
            if item.first_seen is not None:   # (its first message carries the whole prompt)
                params, index, num_prompt = item.first_seen
                req = Request(item.request_id, None, tokens[:num_prompt], params, 0, request_seed(params, index), index)
                if params.structured_outputs is not None:   # (each rank its own matcher, on the same tokens)
                    self.compiler = self.compiler or self.grammars()
                    req.grammar = GrammarState(self.compiler.compile(params.structured_outputs))
                self.requests[item.request_id] = req
                tokens = tokens[num_prompt:]
            req = self.requests[item.request_id]
            req.output_token_ids += tokens
            req.block_ids = item.block_ids
            scheduled.append(ScheduledRequest(req, item.start, item.num_new_tokens, item.draft_token_ids,
                                              item.num_next_drafts))
        return scheduled

    @staticmethod
    def record(scheduled: list[ScheduledRequest], results) -> None:
        """What the front's engine keeps from a step that the runner reads next time: the draft distributions."""
        for s, r in zip(scheduled, results):
            if s.samples:
                s.req.draft_probs = r.next_draft_probs


PASS_COUNTS = "pass_counts"   # a message asking every rank for its runner's forward counts


def send_step(control, message) -> None:
    """Front: hands the step (a StepMessage; under data parallelism a list, one per rank; None: stop; or
    PASS_COUNTS) to every worker."""
    dist.broadcast_object_list([message], src=0, group=control)


def receive_step(control):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def gather_to_front(control, world_size: int, mine) -> list | None:
    """Every rank's `mine` on the front (rank 0), rank 0's first; None elsewhere."""
    every = [None] * world_size if dist.get_rank(control) == 0 else None
    dist.gather_object(mine, every, dst=0, group=control)
    return every


def without_draft_probs(results) -> list:
    """Results as the front needs them from another data-parallel rank (the rank keeps its distributions)."""
    return [dataclasses.replace(r, next_draft_probs=None) for r in results]
