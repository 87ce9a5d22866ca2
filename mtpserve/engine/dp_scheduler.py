"""Data-parallel engine cores: one scheduler and one KV block pool per data-parallel rank.

Each rank runs its own requests against its own KV cache (attention is data-parallel); the front places a new
request on the rank with the least load (waiting + running requests), or where the caller asks. One engine
step schedules every scheduler, and the executor hands each rank its part (idle ranks run dummy forwards).
"""
from mtpserve.engine.kv_cache import BlockManager
from mtpserve.engine.scheduler import Scheduler
from mtpserve.request import Request
from mtpserve.spec_decode.adaptive import FixedK
from mtpserve.step import StepPlan


class DataParallelScheduler:
    def __init__(self, schedulers: list[Scheduler], policy: FixedK):
        self.schedulers, self.policy = schedulers, policy   # (one k for every rank's requests)

    @property
    def block_manager(self) -> BlockManager:   # (every scheduler has as many blocks)
        return self.schedulers[0].block_manager

    @property
    def waiting(self) -> list[Request]:
        return [r for scheduler in self.schedulers for r in scheduler.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for scheduler in self.schedulers for r in scheduler.running]

    def loads(self) -> list[int]:
        return [len(scheduler.waiting) + len(scheduler.running) for scheduler in self.schedulers]

    def add(self, req: Request, rank: int | None = None) -> None:
        """Placed on the rank whose prefix cache holds the longest run of its blocks, among the ranks with room
        for it (fewer requests than max_num_seqs), the least loaded of those; else the least loaded."""
        if rank is None:
            loads = self.loads()
            hits = [len(scheduler.block_manager.cached_run(req)) if load < scheduler.max_num_seqs else -1
                    for scheduler, load in zip(self.schedulers, loads)]
            rank = max(range(len(self.schedulers)), key=lambda i: (hits[i], -loads[i]))
        req.dp_rank = rank
        self.schedulers[rank].add(req)

    def has_unfinished(self) -> bool:
        return any(scheduler.has_unfinished() for scheduler in self.schedulers)

    def schedule(self) -> StepPlan:
        return self.policy.plan([s for scheduler in self.schedulers for s in scheduler.schedule_requests()])

    def computed(self, req: Request) -> None:
        self.schedulers[req.dp_rank].computed(req)

    def finish(self, req: Request, reason: str) -> None:
        self.schedulers[req.dp_rank].finish(req, reason)
