"""Continuous batching: who runs this step and with how many query tokens.

Running requests go first (FCFS), then waiting ones, within a token budget per step. Prompts longer than
what is left of the budget are split into chunks (chunked prefill) and mixed with decodes. A decoding
request with drafts is scheduled with 1 + k query tokens (its pending token and the k drafts); the policy
(spec_decode/adaptive.py) decides how many drafts the step proposes. When KV blocks run out, the newest running
request is preempted: its blocks are freed and it is recomputed later.
"""
import time
from collections import deque

from mtpserve.engine.kv_cache import BlockManager
from mtpserve.request import Request, RequestStatus
from mtpserve.spec_decode.adaptive import FixedK
from mtpserve.step import ScheduledRequest, StepPlan


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_slots: int, min_last_chunk: int = 1, policy: FixedK = FixedK(0)):
        self.block_manager = block_manager
        self.policy = policy                             # how many drafts a step proposes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_slots = num_lookahead_slots   # KV slots the MTP draft passes write ahead
        self.min_last_chunk = min_last_chunk             # a chunked prompt's last chunk holds at least this many
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}   # finished, KV kept for a decode server to pull (disagg/)
        self.num_preemptions = 0             # cumulative

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def release(self, request_id: str) -> bool:
        """Frees a held request's KV blocks (pulled, or never pulled in time)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.block_manager.free(req)
        return req is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        return self.policy.plan(self.schedule_requests())

    def schedule_requests(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled = []
        prefilling = {r.parent_id for r in self.running if self.block_manager.enable_caching
                      and r.params.n > 1 and r.num_computed_tokens < len(r.prompt_token_ids)}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            item = self._plan(req, budget)
            if item is None:
                break
            while not self.block_manager.allocate(req, self._slots_needed(item)):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            scheduled.append(item)
            budget -= item.num_query_tokens
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.parent_id in prefilling:   # (n > 1, prefix caching: a sibling computes the prompt first)
                break
            if req.num_computed_tokens == 0:
                hit = self.block_manager.take_cached_prefix(req)
                if req.num_preemptions == 0:   # (a resume also hits its own output's blocks)
                    req.num_cached_tokens = hit
            item = self._plan(req, budget)
            if item is None or not self.block_manager.allocate(req, self._slots_needed(item)):
                self.block_manager.free(req)   # (the cached blocks it took go back; it starts over next time)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or time.monotonic()
            self.running.append(req)
            scheduled.append(item)
            budget -= item.num_query_tokens
            if self.block_manager.enable_caching and req.params.n > 1:
                prefilling.add(req.parent_id)
        return scheduled

    def _plan(self, req: Request, budget: int) -> ScheduledRequest | None:
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = min(remaining, budget)
        if num_new < remaining and remaining - num_new < self.min_last_chunk:
            num_new = remaining - self.min_last_chunk   # (Proposer.min_last_chunk: MTP own layers)
            if num_new <= 0:
                return None
        drafts = req.draft_token_ids if num_new == remaining else []
        if num_new + len(drafts) > budget:
            drafts = []   # the budget is nearly spent: verify nothing this step, draft again after
        return ScheduledRequest(req, req.num_computed_tokens, num_new, list(drafts))

    def _slots_needed(self, item: ScheduledRequest) -> int:
        lookahead = self.num_lookahead_slots if item.samples else 0
        return item.start + item.num_query_tokens + lookahead

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids, req.draft_probs = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def computed(self, req: Request) -> None:
        """After a step advanced req: its newly computed full blocks go into the prefix cache."""
        self.block_manager.cache_blocks(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        if req.hold_kv and reason not in ("abort", "error"):
            self.held[req.request_id] = req
        else:
            self.block_manager.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
