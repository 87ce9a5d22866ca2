"""Hand-offs between processes over ZeroMQ (pyzmq): the prefill server's KV endpoint and the decode side's pull.

The prefill server binds a ROUTER socket on `kv_port`; a request it has prefilled waits there, its KV blocks
held, under a transfer id. A decode server pulls it with a DEALER socket: ["pull", id] -> ["ok", header,
tensor frames...] (or ["error", why]), then ["done", id], upon which the prefill side frees the blocks. The
header is JSON (tokens, drafts, the engine identity, each tensor's dtype and shape); each tensor travels as one
frame of its raw bytes, sent without a copy. The endpoint runs on a thread of its own, so the engine keeps
stepping while a transfer is in flight; the decode side pulls off its event loop for the same reason.
"""
import json
import logging
import threading
import time
import uuid

import torch
import zmq

from mtpserve.disagg.handoff import Handoff

logger = logging.getLogger("mtpserve")


class TransferError(RuntimeError):
    """A hand-off could not be pulled (the prefill side is gone, slow, or does not know it)."""


def _frame(t: torch.Tensor):
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy() if t.numel() else b""


def _tensor(meta: dict, frame) -> torch.Tensor:
    dtype = getattr(torch, meta["dtype"])
    raw = torch.frombuffer(bytearray(frame.buffer if hasattr(frame, "buffer") else frame), dtype=torch.uint8) \
        if meta["shape"] and all(meta["shape"]) else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).view(meta["shape"])


def encode(h: Handoff) -> list:
    tensors = {f"kv{i}": t for i, t in enumerate(h.kv)}
    for name in ("draft_probs", "last_hidden"):
        if getattr(h, name) is not None:
            tensors[name] = getattr(h, name)
    header = dict(request_id=h.request_id, prompt=h.prompt, prompt_token_ids=h.prompt_token_ids,
                  output_token_ids=h.output_token_ids, draft_token_ids=h.draft_token_ids,
                  finish_reason=h.finish_reason, identity=h.identity,
                  tensors=[dict(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                           for n, t in tensors.items()])
    return [json.dumps(header).encode()] + [_frame(t) for t in tensors.values()]


def decode(frames: list) -> Handoff:
    header = json.loads(bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]))
    tensors = {m["name"]: _tensor(m, f) for m, f in zip(header["tensors"], frames[1:])}
    kv = [tensors[f"kv{i}"] for i in range(sum(n.startswith("kv") for n in tensors))]
    return Handoff(header["request_id"], header["prompt"], header["prompt_token_ids"], None,
                   header["output_token_ids"], kv, header["draft_token_ids"], tensors.get("draft_probs"),
                   header["finish_reason"], tensors.get("last_hidden"),
                   header["identity"])


class KVEndpoint:
    """Prefill side. `park` registers a finished request (KV blocks held by the engine); a pull exports and
    sends it (`export(request_id, scheme)`), "done" or the timeout releases it (`release(request_id)`)."""

    def __init__(self, bind_host: str, port: int, timeout: float, export, release):
        self.timeout, self.export, self.release = timeout, export, release
        self.parked: dict[str, tuple[str, str, float]] = {}   # transfer id -> (request id, scheme, deadline)
        self.lock = threading.Lock()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://{bind_host}:{port}")
        self.bytes_sent = self.transfers = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="mtpserve-kv-endpoint", daemon=True)
        self._thread.start()

    def park(self, request_id: str, scheme: str) -> str:
        transfer_id = uuid.uuid4().hex
        with self.lock:
            self.parked[transfer_id] = (request_id, scheme, time.monotonic() + self.timeout)
        return transfer_id

    def num_parked(self) -> int:
        with self.lock:
            return len(self.parked)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)

    def _take(self, transfer_id: str):
        with self.lock:
            return self.parked.pop(transfer_id, None)

    def _serve(self) -> None:
        try:
            while not self._stop:
                if self.socket.poll(100):
                    self._answer(self.socket.recv_multipart())
                self._expire()
        finally:
            self.socket.close()
            self.context.term()

    def _answer(self, message: list) -> None:
        peer, verb, transfer_id = message[0], message[1], message[2].decode()
        if verb == b"done":
            entry = self._take(transfer_id)
            if entry is not None:
                self.release(entry[0])
            return
        with self.lock:
            entry = self.parked.get(transfer_id)
        if entry is None:
            self.socket.send_multipart([peer, b"error", f"unknown or expired transfer id {transfer_id}".encode()])
            return
        try:
            frames = encode(self.export(entry[0], entry[1]))
        except Exception as e:
            logger.exception("exporting %s failed", entry[0])
            self.socket.send_multipart([peer, b"error", f"{type(e).__name__}: {e}".encode()])
            return
        self.socket.send_multipart([peer, b"ok"] + frames, copy=False)
        self.transfers += 1
        self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            expired = [tid for tid, (_, _, deadline) in self.parked.items() if deadline < now]
            entries = [self.parked.pop(tid) for tid in expired]
        for request_id, _, _ in entries:
            logger.warning("hand-off of %s was not pulled within %.0f s: its KV blocks are freed", request_id,
                           self.timeout)
            self.release(request_id)


def pull(host: str, port: int, transfer_id: str, timeout: float) -> Handoff:
    """Decode side: fetches a parked hand-off and tells the prefill side it may free it."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(f"tcp://{host}:{port}")
    try:
        socket.send_multipart([b"pull", transfer_id.encode()])
        if not socket.poll(int(timeout * 1000)):
            raise TransferError(f"the prefill server's KV endpoint {host}:{port} did not answer within {timeout:g} s")
        reply = socket.recv_multipart(copy=False)
        verb = bytes(reply[0].buffer)
        if verb != b"ok":
            raise TransferError(f"the prefill server {host}:{port} refused the hand-off: "
                                f"{bytes(reply[1].buffer).decode()}")
        handoff = decode(reply[1:])
        socket.send_multipart([b"done", transfer_id.encode()])
        return handoff
    finally:
        socket.close()
