"""AsyncEngine: the LLMEngine behind an asyncio server.

The engine is not thread-safe, so one background thread owns it: every engine call (add_request,
abort_request, step, get_stats, get_metrics) happens on that thread. Coroutines talk to it through a
command queue; the thread hands a step's outputs to the requests' asyncio.Queues with one call_soon_threadsafe.

    stream = await async_engine.add_request(rid, prompt, prompt_token_ids, params)  # ValueError on bad input
    async for out in stream: ...                  # cumulative RequestOutputs; the last has finished=True
    async for out in async_engine.generate(...)   # both in one; aborts the request if the consumer stops

A consumer that stops early (client disconnect) aborts its request, which frees its KV blocks. An
engine fails one request (engine.py isolates a step that raised because of it), that request's stream gets an
EngineError; the others carry on. An exception from engine.step() itself fails the requests that were in the
engine (each gets an EngineError) and the loop carries on with new requests, unless a rank of a tensor-parallel
engine failed (checked after each failed step and every second while idle): then the loop stops, new requests get
EngineDeadError (503) and `on_fatal` is called (the server shuts down).
"""
import asyncio
import logging
import threading
import time
from collections import deque

from mtpserve.engine.streams import (ADDED, EngineDeadError, EngineError, QueueFullError,  # noqa: F401 (re-exported)
                                     RequestStream, deliver)

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine, max_queue_len: int | None = None, on_outputs=None, on_abort=None, on_fatal=None):
        """on_outputs(outputs, now) / on_abort(request_id): called on the engine thread after each step /
        abort (metrics); on_fatal(): once, when the engine can run no more steps."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_queue_len = max_queue_len
        self.max_num_seqs = getattr(engine, "max_num_seqs", 0)
        self.on_outputs, self.on_abort, self.on_fatal = on_outputs, on_abort, on_fatal
        self._commands: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}   # engine thread only
        self._pending_adds = 0                          # under _wake
        self._stop = False
        self.stats = dict(engine.get_stats())           # snapshots, refreshed by the engine thread
        self.spec_metrics = dict(engine.get_metrics())
        self.num_step_errors = 0
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine", daemon=True)
        self._thread.start()

    # ---- any thread / coroutine ----

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def num_waiting(self) -> int:
        with self._wake:
            return self.stats.get("num_waiting", 0) + self._pending_adds

    def _num_queued(self) -> int:
        """Requests that will wait for a slot: those in the engine or being handed to it, beyond what it runs
        at once. (Under the lock.)"""
        in_engine = self.stats.get("num_running", 0) + self.stats.get("num_waiting", 0) + self._pending_adds
        return max(in_engine - self.max_num_seqs, 0)

    def _send(self, command: tuple) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call_soon(self, fn) -> None:
        """Runs fn(engine) on the engine thread, between steps (any thread may ask)."""
        self._send(("call", fn))

    async def add_request(self, request_id: str, prompt, prompt_token_ids, params, add=None) -> RequestStream:
        """add(engine, request_id, prompt, prompt_token_ids, params): how the engine takes the request
        (default engine.add_request; a decode server imports a hand-off instead)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        stream = RequestStream(request_id, asyncio.get_running_loop(), self)
        with self._wake:
            if self._stop:   # re-checked under the lock: shutdown may have drained the commands meanwhile
                raise EngineDeadError("the engine loop is not running")
            if self.max_queue_len is not None and self._num_queued() >= self.max_queue_len:
                raise QueueFullError(f"{self.max_queue_len} requests are already waiting (--max-queue-len)")
            self._pending_adds += 1
            self._commands.append(("add", request_id, prompt, prompt_token_ids, params, add, stream))
            self._wake.notify()
        try:
            first = await stream.queue.get()
        except BaseException:   # cancelled while being added
            stream.abort()
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        return stream

    async def generate(self, prompt, prompt_token_ids, params, request_id: str):
        """Cumulative RequestOutputs of one request; stopping early aborts it."""
        stream = await self.add_request(request_id, prompt, prompt_token_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def fail_all_requests(self, message: str) -> None:
        """Ends every request in the engine with an EngineError (the drain deadline of a shutdown)."""
        self._send(("fail", message))

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    # ---- engine thread ----

    def _run(self) -> None:
        while True:
            with self._wake:
                idle = False   # a second without work: the health check, then the engine's idle work
                while not idle and not self._commands and not self._stop and not self.engine.has_unfinished_requests():
                    idle = not self._wake.wait(timeout=1.0)
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            if idle and not self._healthy():
                break
            added = 0   # adds that entered the engine: they stop counting as pending at the next refresh
            try:
                for command in commands:
                    added += self._handle(command) is True
                if self.engine.has_unfinished_requests():
                    self._step(added)
                    added = 0
                elif self._streams:   # the engine dropped requests without a final output
                    self._fail_all(EngineError("the engine dropped the request"), abort=False)
                elif idle:   # (requests sent meanwhile wait for it: adaptive k's timing, seconds, once per graph set)
                    self.engine.idle()
            except Exception as e:   # never let the loop die
                logger.exception("engine loop iteration failed")
                self._fail_all(EngineError(f"engine failure: {type(e).__name__}: {e}"))
            self._refresh(added)
        dead = EngineDeadError("the engine was shut down")
        self._fail_all(dead, abort=False)
        with self._wake:
            for command in self._commands:
                if command[0] == "add":
                    command[-1].put(dead)

    def _fail_all(self, error: Exception, abort: bool = True) -> None:
        for rid, stream in list(self._streams.items()):
            if abort:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    logger.exception("abort_request(%r) failed", rid)
            stream.put(error)
        self._streams.clear()

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, rid, prompt, ids, params, add, stream = command
            try:
                if rid in self._streams:
                    raise ValueError(f"request_id {rid!r} is already running")
                if add is None:
                    self.engine.add_request(rid, prompt, ids, params)
                else:
                    add(self.engine, rid, prompt, ids, params)
            except Exception as e:   # ValueError naming the field, or anything else from the engine
                with self._wake:     # refused: no longer pending, before the caller can hear about it
                    self._pending_adds -= 1
                stream.put(e if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}"))
                return False
            self._streams[rid] = stream
            stream.put(ADDED)
            return True
        elif command[0] == "fail":
            if self._streams:
                logger.warning("failing %d unfinished requests: %s", len(self._streams), command[1])
            self._fail_all(EngineError(command[1]))
        elif command[0] == "call":
            try:
                command[1](self.engine)
            except Exception:
                logger.exception("a call on the engine thread failed")
        elif command[0] == "abort":
            rid = command[1]
            if self._streams.pop(rid, None) is not None:
                try:
                    self.engine.abort_request(rid)
                    if self.on_abort is not None:
                        self.on_abort(rid)
                except Exception:
                    logger.exception("abort_request(%r) failed", rid)

    def _step(self, num_adds: int) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._refresh(num_adds)
            self.num_step_errors += 1
            logger.exception("engine step failed; failing the %d requests in the engine", len(self._streams))
            self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            self._healthy()
            return
        self._refresh(num_adds)   # before delivery: a consumer that sees an output sees the stats after it
        if self.on_outputs is not None and outputs:   # before the consumers see them
            try:
                self.on_outputs(outputs, time.monotonic())
            except Exception:
                logger.exception("on_outputs failed")
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue   # aborted meanwhile
            items.append((stream, EngineError(f"the engine failed this request: {out.error}") if out.error else out))
            if out.finished:
                del self._streams[out.request_id]
        deliver(items)

    def _healthy(self) -> bool:
        """False (and the loop told to stop, on_fatal called) once the engine cannot run steps any more."""
        try:
            self.engine.check_health()
            return True
        except Exception as e:
            logger.error("engine is dead: %s", e)
            with self._wake:
                self._stop = True
            if self.on_fatal is not None:
                self.on_fatal()
            return False

    def _refresh(self, num_adds: int) -> None:
        """New snapshots; the adds just handled stop counting as pending in the same breath, so that
        num_waiting() never misses them."""
        try:
            stats, spec = dict(self.engine.get_stats()), dict(self.engine.get_metrics())
        except Exception:
            logger.exception("get_stats/get_metrics failed")
            stats, spec = self.stats, self.spec_metrics
        with self._wake:
            self.stats, self.spec_metrics = stats, spec
            self._pending_adds -= num_adds
