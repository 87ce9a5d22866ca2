"""A data-parallel rank's runner (attention data parallel, experts parallel): every rank runs the same forwards.

Each forward is agreed with the other ranks first (runner/dp_sync.py: rows the experts see, graph or eager, and
before the target forward how many MTP passes follow); a rank with nothing to run makes the same forwards on one
padding row that writes no KV (execute_dummy, vLLM's execute_dummy_batch). Rank 0 with 2 requests, rank 1 idle:
    rank 0: main [a, b]   mtp0 [a, b]   mtp0 [a, b]
    rank 1: main [pad]    mtp0 [pad]    mtp0 [pad]        (same graph batch size when rank 0 runs one)
The fused decode step is not used: its MTP passes would not be agreed one by one.
"""
import torch

from mtpserve.runner.dp_sync import DataParallelSync
from mtpserve.runner.model_runner import ModelRunner
from mtpserve.step import MAIN, Row, StepResult, mtp_layer


class DataParallelRunner(ModelRunner):
    fuses_steps = splits_mixed_steps = False   # (every rank runs the same passes a step)

    def __init__(self, *args, dp: DataParallelSync, **kwargs):
        self.dp = dp
        self._planned_passes = self._passes_run = self._step_passes = 0
        super().__init__(*args, **kwargs)

    @torch.inference_mode()
    def execute(self, scheduled: list) -> list[StepResult]:
        if not scheduled:
            return self.execute_dummy()
        self._start_step(self.proposer.num_passes(scheduled) if self.proposer else 0)
        results = super().execute(scheduled)
        self._finish_step()
        return results

    def execute_dummy(self) -> list[StepResult]:
        """Nothing to run here: the same forwards as the others, on padding."""
        self._start_step(0)
        self.forward(MAIN, [])
        self._finish_step()
        return []

    def _start_step(self, mtp_passes: int) -> None:
        self._planned_passes, self._passes_run = mtp_passes, 0

    def _finish_step(self) -> None:
        """The MTP passes the busiest rank runs and this one did not, as dummies."""
        num_layers = self.model.num_mtp_layers
        for j in range(self._passes_run, self._step_passes):
            self.forward(mtp_layer(j if j < num_layers else 0), [])

    def forward(self, which, rows, prev_hidden=None, output_index=None) -> torch.Tensor:
        self.pass_counts[which.kind] += 1
        if output_index is not None and not output_index:   # a KV-only pass would skip the experts' collectives
            output_index = None
        fits = self.graphs is not None and bool(rows) and self.graphs.fits(which, rows, output_index)
        plan = self.dp.agree(len(output_index) if output_index is not None else sum(len(r.token_ids) for r in rows),
                             self.graphs.padded_size(len(rows)) if fits else 0,
                             len(rows[0].token_ids) if fits else 0, bool(rows) and not fits,
                             self._planned_passes if which == MAIN else 0)
        if which == MAIN:
            self._step_passes = plan.mtp_passes
        else:
            self._passes_run += 1
        if not rows:
            self.pass_counts["dummy_" + which.kind] += 1
            rows, prev_hidden, output_index = self._dummy_batch(which, plan)
        self.model.ep.tokens_per_rank = plan.tokens_per_rank
        if plan.graph is not None:
            return self.graphs.run(which, rows, prev_hidden, output_index, batch=plan.graph[0])
        return self._eager(which, rows, prev_hidden, output_index)

    def _dummy_batch(self, which, plan):
        """One row of padding tokens (slot -1: no KV written), shaped like the graph the others run."""
        q = plan.graph[1] if plan.graph is not None else 1
        prev_hidden = None if which == MAIN else torch.zeros(q, self.model.config.hidden_size,
                                                              dtype=self.kv_caches[0].dtype, device=self.device)
        indexed = plan.graph is not None and self.graphs.indexed(which, q)
        return [Row([0] * q, 0, [0], 0)], prev_hidden, [0] if indexed else None
