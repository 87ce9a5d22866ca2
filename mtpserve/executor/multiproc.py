"""Ranks in worker processes: the front (this process) is rank 0 and runs its own shard; it spawns this
node's other ranks (torch.multiprocessing, spawn) unless torchrun started them, and before each step
broadcasts the batch to every rank (executor/step_sync.py), then runs the step with them. Tensor-parallel
ranks all run the same batch; data-parallel ranks each run their own part and send their results back.

A failed rank fails the engine, never hangs it: a worker that raises reports why and exits, a worker that dies
closes its sockets, and either way the front's next collective raises. The executor then names the rank and
the reason, stops the other workers, and refuses further steps (WorkerFailedError).
"""
import atexit
import logging
import queue

import torch.distributed as dist
import torch.multiprocessing as mp

from mtpserve.distributed.launch import end_processes, free_port, leave
from mtpserve.executor.step_sync import PASS_COUNTS, StepSender, gather_to_front, send_step
from mtpserve.executor.worker import RankSetup, build_rank, worker_process

logger = logging.getLogger("mtpserve")


class WorkerFailedError(RuntimeError):
    """A rank failed; the engine cannot run further steps."""


class MultiProcExecutor:
    def __init__(self, setup: RankSetup):
        launch = setup.launch
        if launch.master_port is None:
            launch.master_port = free_port()
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        self.failure: str | None = None
        self.closed = False
        self.control = None
        self.data_parallel_size = setup.config.data_parallel_size
        self.world_size = launch.world_size
        self.sender = StepSender()
        self.senders = [StepSender() for _ in range(self.data_parallel_size)]   # (data parallel: one per rank)
        self.workers = []
        if not launch.external:
            for rank in launch.local_ranks()[1:]:
                p = ctx.Process(target=worker_process, args=(setup, rank, self.errors), name=f"mtpserve-rank{rank}")
                p.start()
                self.workers.append((rank, p))
        atexit.register(self.shutdown)
        joins = not dist.is_initialized()   # (else joining refuses: another engine of this process runs)
        try:
            built = build_rank(setup, 0)
        except Exception as e:
            self._fail(e)
            if joins:
                leave()   # the group this start-up joined: the next engine of this process can start
            raise WorkerFailedError(f"start-up failed: {self.failure}") from e
        self.runner, self.num_blocks, self.control, self.rank_stats = (built.runner, built.num_blocks, built.control,
                                                                        built.rank_stats)
        logger.info("%d ranks (tensor parallel %d, data parallel %d; %d worker processes started here)",
                    launch.world_size, setup.config.tensor_parallel_size, self.data_parallel_size, len(self.workers))

    def execute(self, scheduled):
        self.check_health()
        try:
            if self.data_parallel_size == 1:
                send_step(self.control, self.sender.message(scheduled))
                return self.runner.execute(scheduled)
            return self._execute_data_parallel(scheduled)
        except Exception as e:
            self._fail(e)
            raise WorkerFailedError(f"parallel step failed: {self.failure}") from e

    def _execute_data_parallel(self, scheduled):
        """Each rank its own requests (an idle rank a dummy step); the results come back in `scheduled`'s order."""
        parts = [[] for _ in self.senders]
        for s in scheduled:
            parts[s.req.dp_rank].append(s)
        send_step(self.control, [sender.message(part) for sender, part in zip(self.senders, parts)])
        every = gather_to_front(self.control, len(self.senders), self.runner.execute(parts[0]))
        returned = [iter(results) for results in every]
        return [next(returned[s.req.dp_rank]) for s in scheduled]

    def pass_counts(self) -> list[dict]:
        """Every rank's forward counts (ModelRunner.pass_counts), rank 0 first."""
        self.check_health()
        send_step(self.control, PASS_COUNTS)
        return gather_to_front(self.control, self.world_size, dict(self.runner.pass_counts))

    def check_health(self) -> None:
        """Raises WorkerFailedError if a rank has failed (also noticed while idle: a worker that exited)."""
        if self.failure is None:
            dead = [(rank, p) for rank, p in self.workers if p.exitcode is not None]
            if dead and not self.closed:
                self._fail(None)
        if self.failure is not None:
            raise WorkerFailedError(self.failure)

    def _fail(self, error: Exception | None) -> None:
        """Records why the ranks fell out of step (a worker's own report first) and stops the workers."""
        reports = []
        try:
            while True:
                reports.append(self.errors.get(timeout=0.1 if reports else 2.0))
        except (queue.Empty, OSError, ValueError):
            pass
        if reports:
            self.failure = "; ".join(f"worker rank {rank} failed: {why}" for rank, why in reports)
        else:
            dead = [f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    for rank, p in self.workers if p.exitcode is not None]
            self.failure = "; ".join(dead) or f"{type(error).__name__}: {error}"
        logger.error("parallel engine failed: %s", self.failure)
        self._stop_workers(graceful=False)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        graceful = self.failure is None and self.control is not None
        if graceful:
            try:
                send_step(self.control, None)
            except Exception:
                graceful = False
        self._stop_workers(graceful)
        leave()

    def _stop_workers(self, graceful: bool) -> None:
        end_processes([p for _, p in self.workers], timeout=10 if graceful else 0.5)
