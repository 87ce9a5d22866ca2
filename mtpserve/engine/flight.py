"""A step in flight (overlap: on the model thread) and the copies of the requests it reads."""
import copy
import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

from mtpserve.step import ScheduledRequest, StepPlan


@dataclass
class Flight:
    """A step handed to the model: the scheduler's plan, its results to come."""
    plan: StepPlan
    results: Future


def snapshot(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The scheduled requests as a step reads them, copied (the lists the engine changes in place included)."""
    copies = []
    for s in scheduled:
        req = copy.copy(s.req)
        req.output_token_ids, req.block_ids = list(req.output_token_ids), list(req.block_ids)
        copies.append(dataclasses.replace(s, req=req, draft_token_ids=list(s.draft_token_ids)))
    return copies
