"""One engine step on the model: the target forward, sampling or verification, then MTP drafting."""
from collections import Counter
from dataclasses import dataclass

import torch

from mtpserve.config import SpeculativeConfig
from mtpserve.runner.batch import Row, build_batch
from mtpserve.runner.dp_sync import DataParallelSync
from mtpserve.runner.graphs import GraphRunner
from mtpserve.sampling import logprobs, processors
from mtpserve.sampling.sampler import TARGET_NOISE, draw, request_probs, sample
from mtpserve.spec_decode import fused
from mtpserve.spec_decode.proposer import make_proposer, proposer_class
from mtpserve.spec_decode.verifier import Verifier


@dataclass
class StepResult:
    new_token_ids: list[int]                 # accepted drafts, then one token from the target model
    num_drafts: int = 0                      # drafts verified this step
    num_accepted: int = 0
    next_drafts: list[int] | None = None
    next_draft_probs: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None  # the sampled position's hidden state (requests that hold their KV)
    logprobs: list | None = None             # per new token [(token, logprob, rank), top...] (sampling/logprobs.py)
    prompt_logprobs: list | None = None      # the same for prompt tokens prompt_logprobs_start.. of this chunk
    prompt_logprobs_start: int = 0


def num_drafter_caches(cfg, spec: SpeculativeConfig | None) -> int:
    cls = proposer_class(spec)
    return 0 if cls is None else cls.num_kv_caches(cfg, spec)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, spec: SpeculativeConfig | None,
                 device, kv_dtype: torch.dtype, seed: int = 0, graph_batch_sizes: list[int] | None = None,
                 max_span: int = 0, dp: DataParallelSync | None = None):
        """max_span: the most KV positions a request can reach (max_model_len plus a step's overshoot).
        dp: data-parallel ranks with expert parallelism; every forward is agreed with them (runner/dp_sync.py)."""
        cfg = model.config
        self.model, self.spec, self.device, self.block_size = model, spec, device, block_size
        # One more block than the manager hands out: slot -1 (padding) lands in its last row.
        self.kv_caches = [torch.zeros(num_blocks + 1, block_size, cfg.kv_cache_dim, dtype=kv_dtype, device=device)
                          for _ in range(cfg.num_hidden_layers + num_drafter_caches(cfg, spec))]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.main_caches = self.kv_caches[:cfg.num_hidden_layers]
        self.mtp_caches = self.kv_caches[cfg.num_hidden_layers:]
        self.graphs = None
        if graph_batch_sizes:
            self.graphs = GraphRunner(model, self.main_caches, self.mtp_caches, graph_batch_sizes, block_size,
                                      max_span, device, spec)
        self.dp = dp
        self.pass_counts = Counter()   # forwards run: "main", "mtp" and (DP) their dummies
        self._planned_passes = self._passes_run = self._step_passes = 0
        # one verify path for every drafter: only the proposer differs
        self.proposer = make_proposer(spec, model, self.forward, self.generator, device, self.graphs is not None)
        self.verifier = Verifier(spec, model, self.generator, device) if spec is not None else None
        # MTP decode steps (k drafts verified, k drafted) run as one function (spec_decode/fused.py), in one
        # process: compiled in graph mode, for each k a step can verify and draft; eagerly otherwise
        fuses = (dp is None and self.proposer is not None and self.proposer.fuses_with_verification
                 and spec.fused_graph_step and spec.synthetic_acceptance is None and spec.scorer == "mqa")
        self.builds_fused_step = fuses and self.graphs is not None
        self.fused_steps = self.graphs if self.builds_fused_step else None
        if fuses and self.graphs is None:
            self.fused_steps = GraphRunner(model, self.main_caches, self.mtp_caches, [], block_size, max_span, device,
                                           spec, compiled=False)

    def forward(self, what: str, rows: list[Row], prev_hidden: torch.Tensor | None = None,
                output_index: list[int] | None = None) -> torch.Tensor:
        """Runs the main model ("main") or MTP layer j ("mtp{j}") on rows: a graph when the rows are uniform
        and fit one, else eagerly. Returns hidden states of every token, or of `output_index` (MTP only)."""
        self.pass_counts["main" if what == "main" else "mtp"] += 1
        if self.dp is not None:
            return self._forward_in_step(what, rows, prev_hidden, output_index)
        if self.graphs is not None and self.graphs.fits(what, rows, output_index):
            return self.graphs.run(what, rows, prev_hidden, output_index)
        return self._eager(what, rows, prev_hidden, output_index)

    def _eager(self, what, rows, prev_hidden, output_index):
        input_ids, positions, meta = build_batch(rows, self.block_size, self.device)
        if what == "main":
            return self.model(input_ids, positions, meta, self.main_caches)
        layer = int(what.removeprefix("mtp"))
        index = None if output_index is None else torch.tensor(output_index, dtype=torch.long, device=self.device)
        return self.model.mtp_forward(layer, input_ids, positions, prev_hidden, meta, self.mtp_caches[layer], index)

    def warm_up_graphs(self) -> float:
        """Compiles/captures every graph now (start-up); returns the seconds it took."""
        if self.graphs is None:
            return 0.0
        verified = self.spec.verified_draft_counts if self.spec is not None else [0]
        shapes = [("main", 1 + v) for v in verified] + (self.proposer.graph_shapes() if self.proposer else [])
        if self.builds_fused_step:
            for k in verified:   # (adaptive k: 0 too, plain decoding with the MTP layers' KV passes)
                shapes += [("fused", 1 + k), ("fused_sampled", 1 + k)]
        self.graphs.warm_up(list(dict.fromkeys(shapes)))
        return self.graphs.compile_seconds

    def _fused_step(self, what: str, scheduled) -> list[StepResult]:
        k = len(scheduled[0].draft_token_ids)
        rows = [Row(s.req.all_token_ids[s.start:s.start + 1] + s.draft_token_ids, s.start, s.req.block_ids)
                for s in scheduled]
        self.pass_counts["main"] += 1
        self.pass_counts["mtp"] += self.proposer.num_passes(scheduled)
        self.pass_counts[what] += 1
        sampling = None
        if what == "fused_sampled":
            sampling = fused.sampling_inputs(self.spec, [s.req for s in scheduled],
                                             [s.draft_token_ids for s in scheduled], self.model.config.vocab_size,
                                             self.generator, self.device)
        outs, probs = self.fused_steps.run_fused(what, rows, sampling)
        results = []
        for i, out in enumerate(outs):
            accepted = out[1 + k]
            results.append(StepResult(out[:accepted + 1], num_drafts=k, num_accepted=accepted,
                                      next_drafts=out[k + 2:] or None,
                                      next_draft_probs=None if probs is None or not k else probs[i]))
        return results

    def _forward_in_step(self, what, rows, prev_hidden, output_index):
        """Data parallel: the forward every rank runs alike (runner/dp_sync.py); no rows: a dummy one."""
        if output_index is not None and not output_index:   # a KV-only pass would skip the experts' collectives
            output_index = None
        fits = self.graphs is not None and bool(rows) and self.graphs.fits(what, rows, output_index)
        plan = self.dp.agree(len(output_index) if output_index is not None else sum(len(r.token_ids) for r in rows),
                             self.graphs.padded_size(len(rows)) if fits else 0,
                             len(rows[0].token_ids) if fits else 0, bool(rows) and not fits,
                             self._planned_passes if what == "main" else 0)
        if what == "main":
            self._step_passes = plan.mtp_passes
        else:
            self._passes_run += 1
        if not rows:
            self.pass_counts["dummy_" + ("main" if what == "main" else "mtp")] += 1
            rows, prev_hidden, output_index = self._dummy_batch(what, plan)
        self.model.ep.tokens_per_rank = plan.tokens_per_rank
        if plan.graph is not None:
            return self.graphs.run(what, rows, prev_hidden, output_index, batch=plan.graph[0])
        return self._eager(what, rows, prev_hidden, output_index)

    def _dummy_batch(self, what, plan):
        """One row of padding tokens (slot -1: no KV written), shaped like the graph the others run."""
        q = plan.graph[1] if plan.graph is not None else 1
        prev_hidden = None if what == "main" else torch.zeros(q, self.model.config.hidden_size,
                                                              dtype=self.kv_caches[0].dtype, device=self.device)
        indexed = plan.graph is not None and self.graphs.indexed(what, q)
        return [Row([0] * q, 0, [0], 0)], prev_hidden, [0] if indexed else None

    def _mtp_passes(self, scheduled) -> int:
        """Drafter passes this step runs here (Proposer.num_passes)."""
        return self.proposer.num_passes(scheduled) if scheduled and self.proposer else 0

    def _finish_dp_step(self) -> None:
        """Data parallel: the MTP passes the busiest rank runs and this one did not, as dummies."""
        num_layers = self.model.num_mtp_layers
        for j in range(self._passes_run, self._step_passes):
            self.forward(f"mtp{j if j < num_layers else 0}", [])

    @torch.inference_mode()
    def execute(self, scheduled: list) -> list[StepResult]:   # ScheduledRequests (engine/scheduler.py)
        if self.dp is not None:
            self._planned_passes, self._passes_run = self._mtp_passes(scheduled), 0
            if not scheduled:   # nothing here: the same forwards as the others, on padding
                self.forward("main", [])
                self._finish_dp_step()
                return []
        fused_what = fused.fused_graph(self, scheduled)
        if fused_what is not None:
            return self._fused_step(fused_what, scheduled)
        rows, offsets = [], [0]   # offsets[i]: where request i's tokens start in the flat batch
        pad_to = self._graph_query_len(scheduled)
        for s in scheduled:
            tokens = s.req.all_token_ids[s.start:s.start + s.num_new_tokens] + s.draft_token_ids
            if self.spec is not None and self.spec.scorer == "batch_expansion" and s.draft_token_ids:
                rows += [Row([t], s.start + j, s.req.block_ids) for j, t in enumerate(tokens)]
            elif len(tokens) < pad_to:   # padding tokens: computed, never kept, never read
                rows.append(Row(tokens + tokens[-1:] * (pad_to - len(tokens)), s.start, s.req.block_ids, len(tokens)))
            else:
                rows.append(Row(tokens, s.start, s.req.block_ids))
            offsets.append(offsets[-1] + max(len(tokens), pad_to))
        hidden = self.forward("main", rows)
        results = [StepResult([]) for _ in scheduled]
        self._sample([i for i, s in enumerate(scheduled) if s.samples and not s.draft_token_ids],
                     scheduled, hidden, offsets, results)
        verifying = [i for i, s in enumerate(scheduled) if s.samples and s.draft_token_ids]
        if verifying:
            self.verifier(verifying, scheduled, hidden, offsets, results)
        if any(s.req.params.logprobs is not None or s.req.params.prompt_logprobs is not None for s in scheduled):
            logprobs.attach(self.model, scheduled, hidden, offsets, results)
        if self.proposer is not None:
            self.proposer.propose(scheduled, hidden, offsets, results)
        if self.dp is not None:
            self._finish_dp_step()
        return results

    def _graph_query_len(self, scheduled) -> int:
        """Drafters other than MTP leave a request without drafts when they find none; in graph mode a decode
        batch mixing such requests with ones verifying k drafts is padded to 1+k tokens each, so that it runs
        as a graph. (MTP drafts for every request.) 0: no padding."""
        if self.graphs is None or self.proposer is None or self.proposer.always_drafts or self.spec.scorer != "mqa":
            return 0
        counts = {len(s.draft_token_ids) for s in scheduled}
        if (len(counts) == 1 or self.graphs.padded_size(len(scheduled)) is None
                or not all(s.samples and s.num_new_tokens == 1 for s in scheduled)):
            return 0
        return 1 + max(counts)

    def _sample(self, idx, scheduled, hidden, offsets, results):
        if not idx:
            return
        reqs = [scheduled[i].req for i in idx]
        last_hidden = hidden[[offsets[i] + scheduled[i].num_query_tokens - 1 for i in idx]]
        logits = processors.process(self.model.compute_logits(last_hidden),
                                    [h for r in reqs for h in processors.histories(r, [[]])])
        if all(r.params.greedy for r in reqs):   # no distribution needed: the argmax is the sample
            tokens = logits.argmax(-1)
        else:
            probs = request_probs(logits, reqs, None, self.device)
            noise = draw([r.seed for r in reqs], [r.num_tokens for r in reqs], 1, probs.shape[-1], "exponential",
                         TARGET_NOISE, self.generator, self.device, [r.params.greedy for r in reqs])
            tokens = sample(probs, noise[:, 0])
        for j, (i, token) in enumerate(zip(idx, tokens.tolist())):
            results[i].new_token_ids = [token]
            if scheduled[i].req.hold_kv:   # a prefill server may ship it (disagg scheme 2)
                results[i].last_hidden = last_hidden[j].clone()

