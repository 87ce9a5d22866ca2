"""Data-parallel engine cores: one scheduler and one KV block pool per data-parallel rank.

Each rank runs its own requests against its own KV cache (attention is data-parallel); the front places a new
request on the rank with the least load (waiting + running requests), or where the caller asks. One engine
step schedules every core, and the executor hands each rank its part (idle ranks run dummy forwards).
"""
from mtpserve.engine.kv_cache import BlockManager
from mtpserve.engine.request import Request
from mtpserve.engine.scheduler import ScheduledRequest, Scheduler


class DataParallelScheduler:
    def __init__(self, cores: list[Scheduler]):
        self.cores = cores

    @property
    def block_manager(self) -> BlockManager:   # (every core has as many blocks)
        return self.cores[0].block_manager

    @property
    def waiting(self) -> list[Request]:
        return [r for core in self.cores for r in core.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for core in self.cores for r in core.running]

    def loads(self) -> list[int]:
        return [len(core.waiting) + len(core.running) for core in self.cores]

    def add(self, req: Request, rank: int | None = None) -> None:
        if rank is None:
            loads = self.loads()
            rank = loads.index(min(loads))
        req.dp_rank = rank
        self.cores[rank].add(req)

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    def schedule(self) -> list[ScheduledRequest]:
        return [s for core in self.cores for s in core.schedule()]

    def finish(self, req: Request, reason: str) -> None:
        self.cores[req.dp_rank].finish(req, reason)
