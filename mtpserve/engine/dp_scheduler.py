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
        """Placed on the rank whose prefix cache holds the longest run of its blocks, among the ranks with room
        for it (fewer requests than max_num_seqs), the least loaded of those; else the least loaded."""
        if rank is None:
            loads = self.loads()
            hits = [len(core.block_manager.cached_run(req)) if load < core.max_num_seqs else -1
                    for core, load in zip(self.cores, loads)]
            rank = max(range(len(self.cores)), key=lambda i: (hits[i], -loads[i]))
        req.dp_rank = rank
        self.cores[rank].add(req)

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    def schedule(self) -> list[ScheduledRequest]:
        return [s for core in self.cores for s in core.schedule()]

    def computed(self, req: Request) -> None:
        self.cores[req.dp_rank].computed(req)

    def finish(self, req: Request, reason: str) -> None:
        self.cores[req.dp_rank].finish(req, reason)
