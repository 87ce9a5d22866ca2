"""Overlap (EngineConfig.overlap), a wrapper around the engine's step: step N runs on a model thread while the
engine finishes step N-1's outputs (detokenisation, stop strings) and the caller handles them. Scheduling still
waits for step N-1's tokens (they are step N's inputs):

    call 1: schedule 1, launch 1                          -> []
    call 2: wait 1, commit 1's tokens, schedule 2, launch 2, finish 1's outputs -> outputs of 1
"""
import copy
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from mtpserve.step import ScheduledRequest, StepPlan


@dataclass
class Flight:
    """A step handed to the model thread: the scheduler's plan, its results to come."""
    plan: StepPlan
    results: Future


class Overlap:
    def __init__(self, engine):
        self.engine = engine
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="mtpserve-model")
        self.in_flight: Flight | None = None

    def step(self) -> list:
        engine, started = self.engine, time.perf_counter()
        done, self.in_flight = self.in_flight, None
        if done is not None:
            results = done.results.result()
            # (finished while the step ran, by an abort or a stop string in the step before: results dropped)
            live = [(s, r) for s, r in zip(done.plan.scheduled, results) if not s.req.is_finished]
            committed = engine.commit_tokens(live)
        plan = engine.scheduler.schedule()
        if plan.scheduled:   # the step reads copies: the engine changes the requests while it runs
            self.in_flight = Flight(plan, self.thread.submit(engine.execute, snapshot(plan.scheduled)))
        if done is None:
            return []
        outputs = engine.finish_outputs(*committed)
        engine.policy.observe(done.plan, results, time.perf_counter() - started)
        return outputs

    def shutdown(self) -> None:
        self.thread.shutdown(wait=True)


def snapshot(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The scheduled requests as a step reads them, copied (the lists the engine changes in place included)."""
    copies = []
    for s in scheduled:
        req = copy.copy(s.req)
        req.output_token_ids, req.block_ids = list(req.output_token_ids), list(req.block_ids)
        copies.append(dataclasses.replace(s, req=req, draft_token_ids=list(s.draft_token_ids)))
    return copies
