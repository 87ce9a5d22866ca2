"""The executor seam: the engine asks an executor to run a step; this one runs it in this process."""
from mtpserve.executor.compile_process import CompileProcess
from mtpserve.executor.worker import RankSetup, build_rank


class UniProcExecutor:
    def __init__(self, setup: RankSetup):
        rank = build_rank(setup, 0)
        self.runner, self.num_blocks, self.rank_stats = rank.runner, rank.num_blocks, rank.rank_stats
        if self.runner.graphs is not None and self.runner.graphs.background:
            self.runner.graphs.compile_elsewhere = CompileProcess(setup)

    def execute(self, scheduled):
        return self.runner.execute(scheduled)

    def pass_counts(self) -> list[dict]:
        return [dict(self.runner.pass_counts)]

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.runner.graphs is not None:
            self.runner.graphs.stop()   # (compile_in_background: after the graph it is building)
