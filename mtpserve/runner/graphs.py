"""Graph mode: uniform decode/verify steps run as compiled graphs of fixed shapes.

A step is uniform when every row has the same number of query tokens (1 without speculation, 1+k with it). Its batch is
padded to the next of `graph_batch_sizes`; padding rows have KV length 0 and slot -1, so they never read or write real
KV, and their outputs are dropped. Up to FEW_ROWS rows each size is a graph of its own (the few-row paths for linears
and experts unroll over the rows: layers.py, moe.py); on the CPU one graph with a dynamic batch serves every batch above
it, unpadded ("many"): sizes 1, 2, 4, 8, 16, 32 -> graphs b1, b2, b4, b8 and one for 9-32 rows; 3 rows run as 4, 20 as
20. The block table is cut to the blocks that cover the longest row (the KV bucket; a power of two on CUDA), a dimension
the graphs treat as dynamic: one compiled graph serves every KV length, and attention reads only the bucket, not all of
max_model_len. Inputs are copied into static buffers (graph_inputs.py). On CUDA the compiled step is captured as CUDA
graphs (inductor's cudagraph trees; one per KV bucket, recorded at warm-up; the KV caches it writes are marked static
inputs); on the CPU it is an inductor-compiled kernel, called through the code dynamo made without dynamo's per-call
hook, or for a fixed batch straight into the compiled C++ (direct_call.py). Anything else (prompt chunks, run apart
from decode rows: ModelRunner.execute; batches above the largest size) runs eagerly in the same loop.

compile_in_background (one CPU process): nothing is compiled at start-up; the first step that fits a shape
queues its graph and runs eagerly until a compiler thread has built it, in compile_order (cold, in a compiler
process: executor/compile_process.py). Without it, MTP builds the fused step's graphs at start-up and, in one CPU
process, the passes apart that way (ModelRunner.warm_up_graphs).
"""
import contextlib
import itertools
import logging
import queue
import sys
import threading
import time
import types

import torch
import torch._dynamo

from mtpserve.model import cpu_kernels
from mtpserve.model.attention import AttentionMetadata
from mtpserve.model.layers import FEW_ROWS
from mtpserve.model.ops import register_graph_lowerings
from mtpserve.runner.background import MANY, compile_order
from mtpserve.runner.direct_call import direct_caller
from mtpserve.runner.graph_inputs import StaticInputs, sampling_buffers
from mtpserve.step import Pass, Row, fused_kv_reach

logger = logging.getLogger("mtpserve")
COMPILING_SWITCH_INTERVAL = 2e-4   # seconds a thread holds the GIL while a graph compiles in the background


class GraphRunner:
    def __init__(self, model, main_caches, mtp_caches, batch_sizes: list[int], block_size: int,
                 max_span: int, device, spec=None, background: bool = False):
        """spec: the speculative config (how the sampled fused step drafts and verifies). background: graphs are
        built by a compiler thread when first needed."""
        self.model, self.main_caches, self.mtp_caches, self.spec = model, main_caches, mtp_caches, spec
        self.batch_sizes = sorted(batch_sizes)
        self.block_size, self.device = block_size, device
        self.max_blocks = -(-max_span // block_size)
        self.graphs: dict[tuple, tuple] = {}    # (Pass, batch or MANY, query_len) -> (compiled fn, static buffers)
        self.compile_seconds, self.background = 0.0, background
        self.later: set[tuple[Pass, int]] = set()   # (pass, query length): graphs built when first needed
        self._queued: set[tuple] = set()
        self._queue_order = itertools.count()
        self._compiled, self._unloaded = set(), set()   # built by the compiler process; ... not loaded (ready)
        self.reached_sizes: set = set()   # batch sizes (or MANY) steps outside the start-up timing asked for
        self._lock = threading.Lock()
        self._to_compile: queue.PriorityQueue = queue.PriorityQueue()   # (compile_order(key), n, key); None: stop
        self._compiler: threading.Thread | None = None
        self.held = False
        self.compile_elsewhere = None   # background: where graphs compile cold first (executor/compile_process.py)
        self.cuda_graphs = torch.device(device).type == "cuda"
        lowerings_key = register_graph_lowerings()
        if self.cuda_graphs:   # a CUDA graph writes an input only at a fixed address (else inductor skips it)
            for cache in main_caches + mtp_caches:
                torch._dynamo.mark_static_address(cache)
        self._compile = lambda fn: torch.compile(fn, dynamic=False, fullgraph=True, options={   # (a dict each:
            "guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "size_asserts": False,   # compile pops)
            "triton.cudagraphs": self.cuda_graphs,   # ("reduce-overhead": torch.compile takes a mode or options)
            "post_grad_custom_post_pass": lowerings_key,
            "emulate_precision_casts": True,   # (bf16 rounded as eagerly: a row's bits whatever a graph's shape fused)
            # CPU, one process: the graph's calls made from C++ (history.md); a rank's graphs hold collectives,
            # whose process-group argument inductor's C++ wrapper cannot pass
            "cpp_wrapper": not self.cuda_graphs and not torch.distributed.is_initialized(),
            **cpu_kernels.inductor_config()})   # (our ops called from C++ without the dispatcher)

    def padded_size(self, num_rows: int) -> int | None:
        """The rows a step of num_rows runs as (None: more than the largest graph takes)."""
        size = next((b for b in self.batch_sizes if b >= num_rows), None)
        return max(num_rows, FEW_ROWS + 1) if size is not None and self._many(size) else size

    def key(self, which: Pass, size: int, q: int) -> tuple:
        return which, MANY if self._many(size) else size, q

    def _many(self, size: int) -> bool:
        """A batch of `size` rows runs the CPU graph of any batch above FEW_ROWS rows."""
        return size > FEW_ROWS and not self.cuda_graphs

    def indexed(self, which: Pass, q: int) -> bool:
        """An MTP pass over 1+k tokens per row wants one output per row (at the accepted index): its graph
        writes KV for every token but runs the layer for that token alone. Own layers chained (one MTP cache
        per layer) output every token: the next layer reads them all (spec_decode/mtp.py)."""
        return which.kind == "mtp" and q > 1 and len(self.mtp_caches) == 1

    def fits(self, which: Pass, rows: list[Row], output_index: list[int] | None = None) -> bool:
        """Rows fit a built graph: same query length everywhere, a batch size that pads to one, a shape start-up
        builds (a prefill batch of equal-length chunks is not: it runs eagerly; nothing is compiled for it)."""
        q, size = len(rows[0].token_ids), self.padded_size(len(rows))
        return (size is not None and all(len(r.token_ids) == q for r in rows)
                and all(len(r.block_ids) <= self.max_blocks for r in rows)
                and self.indexed(which, q) == (output_index is not None) and self.ready(self.key(which, size, q)))

    def ready(self, key: tuple) -> bool:
        """The graph `key` is built; queues it for the compiler thread if it is one of the `later` ones. The
        first step outside the start-up timing at a batch size queues the loading of that size's compiled graphs."""
        if key in self.graphs:
            return True
        if not self.held and key[1] not in self.reached_sizes:
            with self._lock:
                self.reached_sizes.add(key[1])
                reached = {k for k in self._unloaded if k[1] == key[1]}
                self._unloaded -= reached
            for k in reached:
                self._queue(k)
        if (key[0], key[2]) in self.later and key not in self._queued:
            self._queued.add(key)
            self._queue(key)
        return False

    def _queue(self, key: tuple) -> None:
        self._to_compile.put((compile_order(key), next(self._queue_order), key))
        self._start_compiler()

    @contextlib.contextmanager
    def compiler_held(self):
        """Graphs queued meanwhile (adaptive k timing its start-up steps) wait: the compiler thread starts after."""
        self.held = True
        try:
            yield
        finally:
            self.held = False
            self._start_compiler()

    def _start_compiler(self) -> None:
        if not self.held and self._compiler is None and not self._to_compile.empty():
            self._compiler = threading.Thread(target=self._compile_queued, name="mtpserve-compile", daemon=True)
            self._compiler.start()

    def _compile_queued(self) -> None:
        while (key := self._to_compile.get()[-1]) is not None:
            start, switch = time.perf_counter(), sys.getswitchinterval()
            try:
                if self.compile_elsewhere is not None and key not in self._compiled:   # (cold, in its own process)
                    if not self.compile_elsewhere(key):   # (stopped: shutting down)
                        continue
                    self._compiled.add(key)
                with self._lock:   # (loading one takes seconds of the GIL: only sizes steps reached)
                    if self.compile_elsewhere is not None and key[1] not in self.reached_sizes:
                        self._unloaded.add(key)
                        continue
                # The model thread takes the GIL back after every op: with Python's 5 ms turns, a step of
                # hundreds of ops waits seconds on a compiling thread (stalls of ~20 s per step: docs/history.md).
                sys.setswitchinterval(COMPILING_SWITCH_INTERVAL)
                self.graphs[key] = self._build(*key)
                logger.info("graph %s built in the background in %.1fs (%d built)", key,
                            time.perf_counter() - start, len(self.graphs))
            except Exception:   # (that shape keeps running eagerly)
                logger.exception("graph %s: compiling failed; its steps run eagerly", key)
            finally:
                sys.setswitchinterval(switch)
                self._to_compile.task_done()
                if self.compile_elsewhere is not None and self._to_compile.empty():
                    self.compile_elsewhere.stop()   # (until a graph is next queued)
        self._to_compile.task_done()   # (the None that stopped it)

    def compiling(self) -> bool:   # some queued graph is not built yet
        return self._to_compile.unfinished_tasks > 0

    def drain(self) -> None:   # waits until the compiler thread has built every graph queued so far
        self._to_compile.join()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the compiler thread after the graph it builds, waiting `timeout` s at most (a daemon thread)."""
        if self._compiler is not None:
            while not self._to_compile.empty():
                self._to_compile.get_nowait()
                self._to_compile.task_done()
            self._to_compile.put(((), 0, None))
            if self.compile_elsewhere is not None:
                self.compile_elsewhere.close(timeout)
            self._compiler.join(timeout)

    def run(self, which: Pass, rows: list[Row], prev_hidden: torch.Tensor | None = None,
            output_index: list[int] | None = None, batch: int | None = None) -> torch.Tensor:
        """which: the main model or an MTP layer. Returns hidden states for the real rows' tokens in order, or for
        `output_index` (one flat token index per row; indexed graphs only). batch: a larger graph than the
        rows need (data parallel: every rank runs the largest any needs)."""
        n, q = len(rows), len(rows[0].token_ids)
        batch = batch or self.padded_size(n)
        fn, buf = self._graph(self.key(which, batch, q))
        inputs = buf.load(rows, q, self.kv_bucket(max(r.start for r in rows) + q), self.block_size, batch)
        if buf.prev_hidden is not None:
            buf.prev_hidden[:n * q].copy_(prev_hidden)
        if buf.output_index is not None:   # padding rows read their own first token
            buf.output_index[:batch].copy_(torch.tensor(output_index + [i * q for i in range(n, batch)]))
        out = fn(*inputs)
        out = out[:n] if output_index is not None else out[:n * q]
        # a CUDA graph's output memory is overwritten by its next replay; inductor's CPU outputs are fresh
        return out.clone() if self.cuda_graphs else out

    def fused_ready(self, which: Pass, num_rows: int, k: int) -> bool:
        """The fused step's graph (FUSED or FUSED_SAMPLED, spec_decode/fused.py) is built for this batch size."""
        size = self.padded_size(num_rows)
        return size is not None and self.ready(self.key(which, size, 1 + k))

    def run_fused(self, which: Pass, rows: list[Row], sampling: list[torch.Tensor] | None = None):
        """The fused step on decode rows of 1+k tokens -> (per row the emitted 1+k tokens, the accepted count
        and k next drafts (one host sync); the drafts' distributions [rows, k, V] or None; the main model's
        hidden states [rows * (1+k), H]). sampling: the sampled step's further inputs (fused.sampling_inputs,
        the leading ones of the buffers), one row per request."""
        n, q = len(rows), len(rows[0].token_ids)
        size = self.padded_size(n)
        fn, buf = self._graph(self.key(which, size, q))
        for target, value in zip(buf.sampling, sampling or []):   # (padding rows keep theirs: outputs dropped)
            target[:n].copy_(value)
        bucket = self.kv_bucket(fused_kv_reach(max(r.start for r in rows), q - 1))
        ids, probs, hidden = fn(*buf.load(rows, q, bucket, self.block_size, size))
        hidden = hidden[:n * q].clone() if self.cuda_graphs else hidden[:n * q]   # (as run's output)
        return ids[:n].tolist(), None if probs is None else probs[:n].clone(), hidden

    def kv_bucket(self, kv_len: int) -> int:
        """Blocks in the table a graph sees (at least 2: dynamo specializes sizes 0 and 1): on CUDA the next
        power of two covering kv_len tokens (each bucket is a captured graph); on the CPU exactly the blocks
        covering them (one dynamic kernel serves every width, and attention reads no padding blocks)."""
        blocks = -(-kv_len // self.block_size)
        if self.cuda_graphs:
            blocks = 1 << (blocks - 1).bit_length()
        return min(max(2, blocks), self.max_blocks)

    def warm_up_buckets(self) -> list[int]:
        """The buckets run at build time: every one on CUDA (each is captured); on the CPU the narrowest and
        the whole table (the dynamic kernel serves the widths between)."""
        buckets = {self.kv_bucket(n * self.block_size) for n in range(1, self.max_blocks + 1)}
        return sorted(buckets if self.cuda_graphs else {min(buckets), max(buckets)})

    def _graph(self, key: tuple):
        if key not in self.graphs:
            self.graphs[key] = self._build(*key)
        return self.graphs[key]

    def _build(self, which: Pass, rows: int | str, q: int):
        """The graph of `which` over `rows` rows (MANY: above FEW_ROWS) of q tokens."""
        dev, cfg = self.device, self.model.config
        batch = self.batch_sizes[-1] if rows == MANY else rows
        buf = StaticInputs.allocate(batch, q, self.max_blocks, dev)
        if which.kind == "mtp":
            buf.prev_hidden = torch.zeros(batch * q, cfg.hidden_size, dtype=next(self.model.parameters()).dtype,
                                          device=dev)
            buf.output_index = torch.arange(batch, device=dev) * q if self.indexed(which, q) else None
        if which.kind == "fused":
            from mtpserve.spec_decode.fused import fused_step
            step = fused_step(self.model, self.main_caches, self.mtp_caches, self.block_size, self.spec, which, q)
            buf.sampling = sampling_buffers(batch, q - 1, cfg.vocab_size, dev) if which.sampled else []
        else:
            step = self._pass_step(which, q)
        # a code object per graph: dynamo caches per code object, so no guards need to tell the graphs apart
        code = step.__code__.replace(co_name=f"graph_{which}_b{rows}_q{q}")
        fn = self._compile(types.FunctionType(code, step.__globals__, None, step.__defaults__, step.__closure__))
        start = time.perf_counter()
        buckets = self.warm_up_buckets()   # compiled now, run with padding rows only (no real KV; captured on CUDA)
        # (scalar outputs: a MoE reads its expert ids in the graph; prepare_freezing: CPU graphs hold the weights)
        with torch.inference_mode(), torch._dynamo.config.patch(capture_scalar_outputs=True,
                                                                prepare_freezing=not self.cuda_graphs):
            for bucket in buckets:   # (the many-row graph: compiled at its most rows, then run at its fewest)
                fn(*buf.compiling_args(bucket, batch, fewest_rows=FEW_ROWS + 1 if rows == MANY else None))
                fn(*buf.compiling_args(bucket, FEW_ROWS + 1 if rows == MANY else batch))
        # CPU: dynamo's code of `step` as a plain function (no hook, no guards), a fixed batch's into its C++ directly
        made = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
        if not self.cuda_graphs and len(made) == 1:
            fn = types.FunctionType(made[0].code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)
            fn = rows != MANY and direct_caller(fn, buf.args(buckets[0], batch), buf.args(buckets[-1], batch)) or fn
        self.compile_seconds += time.perf_counter() - start
        return fn, buf

    def _pass_step(self, which: Pass, q: int):
        """One model pass: the main model or an MTP layer over rows of q tokens."""
        device, model, main_caches, mtp_caches, block_size = (self.device, self.model, self.main_caches,
                                                              self.mtp_caches, self.block_size)
        layer = None if which.kind == "main" else which.layer

        def step(input_ids, positions, seq_lens, slot_mapping, block_tables, prev_hidden, output_index):
            meta = AttentionMetadata(torch.arange(seq_lens.shape[0] + 1, device=device) * q, seq_lens, slot_mapping,
                                     block_tables, q, block_tables.shape[1] * block_size)
            if layer is None:
                return model(input_ids, positions, meta, main_caches)
            return model.mtp_forward(layer, input_ids, positions, prev_hidden, meta, mtp_caches[layer], output_index)
        return step

    def warm_up(self, shapes: list[tuple[Pass, int]], later: list[tuple[Pass, int]] = ()) -> None:
        """Builds the graph of every (pass, query length) in `shapes` for every batch size, those in `later` as
        steps first need them (background mode: all of them)."""
        self.later = set(shapes) if self.background else set(later)
        for key in dict.fromkeys(self.key(which, b, q) for b in self.batch_sizes for which, q in shapes
                                 if (which, q) not in self.later):
            self._graph(key)
