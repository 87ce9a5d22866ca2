"""The engine loop: schedule -> execute -> update."""
import contextlib
import copy
import logging
import time

from mtpserve.config import EngineConfig, eos_token_ids
from mtpserve.engine import stats, validation
from mtpserve.engine.dp_scheduler import DataParallelScheduler
from mtpserve.engine.overlap import Overlap
from mtpserve.engine.kv_cache import BlockManager
from mtpserve.engine.outputs import (detokenize_until_stop_string, logprob_dicts, request_output,
                                     take_prompt_logprobs, take_tokens)
from mtpserve.engine.scheduler import Scheduler
from mtpserve.engine.setup import engine_config, engine_setup, is_front
from mtpserve.executor.multiproc import MultiProcExecutor
from mtpserve.executor.uniproc import UniProcExecutor
from mtpserve.model.loader import load_tokenizer
from mtpserve.request import Request, RequestOutput, request_seed
from mtpserve.sampling_params import SamplingParams
from mtpserve.spec_decode import adaptive, calibration
from mtpserve.spec_decode.metrics import SpecDecodeMetrics

logger = logging.getLogger("mtpserve")


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.config = cfg
        setup = engine_setup(cfg)
        if not is_front(setup.launch):
            raise ValueError(f"node_rank = {setup.launch.node_rank}: only the first node (rank 0) runs the engine; "
                             "other nodes run their ranks with run_non_front_ranks (the command line does this)")
        self.model_config, self.max_model_len = setup.model_config, setup.max_model_len
        self.max_step_overshoot = setup.max_step_overshoot
        self.num_lookahead_slots = setup.num_lookahead_slots
        self.tokenizer = None if cfg.skip_tokenizer_init else load_tokenizer(setup.path)
        executor_class = UniProcExecutor if setup.launch.world_size == 1 else MultiProcExecutor
        self.executor = executor_class(setup)
        self.runner = self.executor.runner          # this process's rank (rank 0)
        self.model = self.runner.model
        self.device, self.dtype = self.runner.device, setup.dtype
        min_last_chunk = self.runner.proposer.min_last_chunk() if self.runner.proposer else 1
        self.policy = adaptive.make_policy(cfg.speculative)   # how many drafts each step proposes
        # (a block's MTP KV depends on as many tokens after it as MTP layers are chained: kv_cache.py)
        self.schedulers = [Scheduler(BlockManager(self.executor.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                                  len(self.runner.mtp_caches)),
                                     cfg.max_num_seqs, cfg.max_num_batched_tokens, self.num_lookahead_slots,
                                     min_last_chunk, self.policy)
                           for _ in range(cfg.data_parallel_size)]   # one per data-parallel rank
        self.scheduler = (self.schedulers[0] if len(self.schedulers) == 1
                          else DataParallelScheduler(self.schedulers, self.policy))
        self.block_manager = self.scheduler.block_manager   # (rank 0's under data parallelism)
        self.use_graphs = self.runner.graphs is not None
        self.graph_warmup_seconds = self.runner.graphs.compile_seconds if self.use_graphs else 0.0
        if self.use_graphs and self.runner.graphs.background:
            logger.info("graph mode: each graph is compiled in the background when a step first needs it")
        elif self.use_graphs:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            logger.info("graph mode: %d graphs (batch sizes %s%s) built in %.1fs; compile cache %s",
                        len(self.runner.graphs.graphs), cfg.graph_batch_sizes,
                        ", every k up to num_speculative_tokens: speculative_config \"adaptive\": false builds one"
                        if cfg.speculative and cfg.speculative.adaptive else "", self.graph_warmup_seconds, cache_dir())
        self.spec_metrics = SpecDecodeMetrics(self.policy.max_k)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.grammars = None   # structured outputs: the grammar compiler, made on first use (validation.py)
        self.children: dict[str, list[Request]] = {}
        self.overlap = Overlap(self) if cfg.overlap else None   # (engine/overlap.py)
        self.graphs_timed: int | None = None   # graphs built when adaptive k last timed its steps (None: never)

    def calibrate(self) -> None:
        """Start-up, adaptive speculation length: times decode steps of every k (spec_decode/calibration.py);
        until then the policy drafts the maximum k. Graphs compiled in the background: the steps it times run
        eagerly and queue their graphs; `idle` times them again once those are built."""
        if self.policy.adapts:
            kept = self.counters()
            # (its steps timed without a compiler thread beside them)
            with self.runner.graphs.compiler_held() if self.use_graphs else contextlib.nullcontext():
                calibration.calibrate(self, self.policy)
            self.restore_counters(kept)   # (its steps count nowhere: a server's counters only grow)
            self.graphs_timed = len(self.runner.graphs.graphs) if self.use_graphs else 0

    def idle(self) -> None:
        """While no request runs (the server's loop, LLM.generate): a calibrated adaptive k times its steps again
        once the compiler thread has built every graph queued, if it built some since the last timing:
            start-up: eager steps timed, 6 graphs queued ... built ... idle: the same steps timed as graphs."""
        graphs = self.runner.graphs
        if (self.graphs_timed is not None and self.use_graphs and graphs.background and not graphs.compiling()
                and len(graphs.graphs) > self.graphs_timed and not self.has_unfinished_requests()):
            self.calibrate()

    def wait_for_graphs(self) -> None:
        """Returns once the compiler thread has built every graph queued so far, then `idle` (benchmarks: nothing
        timed runs eagerly or beside a compiler process on the other core)."""
        if self.use_graphs:
            self.runner.graphs.drain()
        self.idle()

    def counters(self) -> tuple:
        """The cumulative counters (spec decoding; per scheduler preemptions, prefix-cache queries and hits)."""
        return copy.deepcopy(self.spec_metrics), [(s.num_preemptions, s.block_manager.num_queries,
                                                   s.block_manager.num_hits) for s in self.schedulers]

    def restore_counters(self, kept: tuple) -> None:
        self.spec_metrics = copy.deepcopy(kept[0])
        for s, (preemptions, queries, hits) in zip(self.schedulers, kept[1]):
            s.num_preemptions, s.block_manager.num_queries, s.block_manager.num_hits = preemptions, queries, hits

    def reset_stats(self) -> None:
        """Sets the counters (see counters) back to zero."""
        self.restore_counters((SpecDecodeMetrics(self.spec_metrics.num_speculative_tokens),
                               [(0, 0, 0)] * len(self.schedulers)))

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (on every data-parallel rank)."""
        for scheduler in self.schedulers:
            scheduler.block_manager.reset()

    @property
    def max_num_seqs(self) -> int:
        """Requests the engine runs at once (all data-parallel ranks together)."""
        return self.config.max_num_seqs * len(self.schedulers)

    @classmethod
    def from_kwargs(cls, *args, **kwargs) -> "LLMEngine":
        return cls(engine_config(*args, **kwargs))

    def shutdown(self) -> None:
        """Stops the model thread (overlap) and worker processes (tensor parallelism); the engine cannot run
        after this."""
        if self.overlap is not None:
            self.overlap.shutdown()
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raises (WorkerFailedError) if a rank has failed."""
        self.executor.check_health()

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, data_parallel_rank: int | None = None, hold_kv: bool = False) -> None:
        """data_parallel_rank: the rank to run it on (default: the least loaded). hold_kv: keep the request's
        KV blocks when it finishes, until release_kv (a prefill server's requests, pulled by a decode server)."""
        if request_id in self.children:
            raise ValueError(f"request_id {request_id!r} is already in use")
        dp = self.config.data_parallel_size
        token_ids, max_tokens = validation.check_request(self, prompt, prompt_token_ids, params, data_parallel_rank)
        params = validation.prepare_params(self, params)
        children = []
        num_run = max(params.n, params.best_of or 1)   # best_of > n: the n best are returned (engine/outputs.py)
        for i in range(num_run):
            child_id = request_id if num_run == 1 else f"{request_id}#{i}"
            req = Request(child_id, prompt, list(token_ids), params, max_tokens, request_seed(params, i), i, request_id)
            req.hold_kv, req.grammar = hold_kv, validation.grammar_state(self, params)
            children.append(req)
            self.requests[child_id] = req
            if dp > 1:
                self.scheduler.add(req, data_parallel_rank)
            else:
                self.scheduler.add(req)
        self.children[request_id] = children

    def abort_request(self, request_id: str) -> None:
        for req in self.children.get(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
        self._forget(request_id)

    def release_kv(self, request_id: str) -> bool:
        """Frees the KV blocks a finished hold_kv request kept."""
        return self.scheduler.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.overlap is not None and self.overlap.in_flight is not None)

    # ---- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, commit; returns the outputs of the requests the step advanced. (Overlap returns
        the step before's outputs, finished while this one runs: engine/overlap.py.)"""
        if self.overlap is not None:
            return self.overlap.step()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        results = self.execute(plan.scheduled)
        outputs = self.finish_outputs(*self.commit_tokens(list(zip(plan.scheduled, results))))
        self.policy.observe(plan, results, time.perf_counter() - started)   # (the forward and the engine's work)
        return outputs

    def commit_tokens(self, step: list[tuple]) -> tuple:
        """Applies a step's results, (ScheduledRequest, StepResult or the exception it failed with) per request,
        as far as the next schedule needs them (tokens, drafts, stops on token ids and lengths). Returns the
        parents it advanced and, per request that sampled, how many tokens it got."""
        now = time.monotonic()
        progressed, appended = [], []
        for s, r in step:
            req = s.req
            if isinstance(r, Exception) or req.is_finished:   # (a sibling failed this step)
                self._fail(req, r, now)
            else:
                take_prompt_logprobs(req, r, self.tokenizer)
                if s.samples:
                    appended.append((req, self._commit(req, r, now)))
                else:
                    req.num_computed_tokens += s.num_new_tokens
            if not req.is_finished:
                self.scheduler.computed(req)
            if req.parent_id not in progressed:
                progressed.append(req.parent_id)
        return progressed, appended

    def _commit(self, req: Request, r, now: float) -> int:
        """Takes a step's tokens and drafts for req; returns how many tokens it appended."""
        req.num_computed_tokens = req.num_tokens + len(r.new_token_ids) - 1
        if r.num_drafts:
            self.spec_metrics.record(r.num_drafts, r.num_accepted)
        num_appended, reason = take_tokens(req, r.new_token_ids, self.eos_token_ids)
        req.logprobs += logprob_dicts(r.logprobs[:num_appended], self.tokenizer)   # ([] unless asked)
        if reason is not None:
            self.scheduler.finish(req, reason)
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.last_token_time = now
        req.draft_token_ids = r.next_drafts or []
        req.draft_probs = r.next_draft_probs
        req.last_hidden = r.last_hidden       # (prefill side, its first token: what scheme 2 hands over)
        if req.is_finished:
            req.metrics.finished_time = now
        return num_appended

    def finish_outputs(self, progressed: list[str], appended: list[tuple[Request, int]]) -> list[RequestOutput]:
        now = time.monotonic()
        for req, num_new in appended:
            if req.error is not None:   # (failed with a sibling)
                continue
            try:
                keep = detokenize_until_stop_string(self.tokenizer, req, num_new)
            except Exception as e:   # (detokenisation, stop strings): this request's fault, not the others'
                self._fail(req, e, now)
                continue
            if keep is not None:   # the tokens after the stop string go
                del req.output_token_ids[keep:], req.logprobs[keep:]
                req.finish_reason = "stop"   # (over "length")
                if not req.is_finished:
                    self.scheduler.finish(req, "stop")
                req.metrics.finished_time = now
        if self.spec_metrics.maybe_log():
            self.policy.log(len(appended))
        outputs = [self._output(pid) for pid in progressed]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def execute(self, scheduled) -> list:
        """The step's results; if the step raises, the batch is split in halves and each half re-run, down to
        the requests it raises on, whose entries are the exception: one request's fault (an input that passed
        validation but breaks sampling, say) fails that request only. Re-running is safe because a step's
        effects on the requests are applied only from its results; KV slots it wrote are written again, and
        seeded draws are keyed on positions. Across processes a half-done step would leave the ranks' collectives
        out of step, so there the step fails as a whole."""
        try:
            return self.executor.execute(scheduled)
        except Exception as e:
            if not isinstance(self.executor, UniProcExecutor):
                raise
            if len(scheduled) == 1:
                logger.error("request %s failed in a step: %s: %s", scheduled[0].req.request_id, type(e).__name__, e)
                return [e]
            mid = len(scheduled) // 2
            return self.execute(scheduled[:mid]) + self.execute(scheduled[mid:])

    def _fail(self, req: Request, error: Exception | None, now: float) -> None:
        """Ends a request the engine failed, and its siblings (the n completions of one prompt)."""
        for sibling in self.children.get(req.parent_id, [req]):
            if not sibling.is_finished:
                sibling.error = (f"{type(error).__name__}: {error}" if error is not None
                                 else "a sibling completion failed")
                self.scheduler.finish(sibling, "error")
                sibling.metrics.finished_time = now
        req.error = req.error or "a sibling completion failed"

    def _output(self, parent_id: str) -> RequestOutput:
        return request_output(parent_id, self.children[parent_id])

    def _forget(self, parent_id: str) -> None:
        for req in self.children.pop(parent_id, []):
            self.requests.pop(req.request_id, None)

    # ---- introspection (engine/stats.py) -------------------------------------------------------------
    def get_metrics(self) -> dict:
        return stats.metrics(self)

    def get_stats(self) -> dict:
        return stats.load(self)
