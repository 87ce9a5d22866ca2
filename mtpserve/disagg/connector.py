"""A server's side of prefill/decode disaggregation: `--kv-transfer-config` (vLLM's flag and key names).

    {"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector": "ZmqConnector", "kv_port": 14579,
     "kv_ip": "127.0.0.1", "mtp_handoff": "drafts" | "hidden", "kv_transfer_timeout": 120, "kv_pull_timeout": 30}

A producer (prefill server) answers a request carrying `kv_transfer_params: {"do_remote_decode": true}` with
its first token and the params a decode server needs; the request's KV blocks stay held until pulled, or until
kv_transfer_timeout. A consumer (decode server) given `kv_transfer_params: {"do_remote_prefill": true, ...}`
pulls the hand-off (kv_pull_timeout) and continues the request. `mtp_handoff` picks vllm-ascend's scheme
(disagg/handoff.py); a request may override it in its kv_transfer_params.
"""
import asyncio
import json
import time
from dataclasses import dataclass, fields

from mtpserve.disagg.handoff import SCHEMES, Handoff, export_handoff, import_handoff
from mtpserve.disagg.transport import KVEndpoint, pull

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("ZmqConnector",)


@dataclass
class KVTransferConfig:
    kv_role: str                        # "kv_producer" (prefill) | "kv_consumer" (decode) | "kv_both"
    kv_connector: str = "ZmqConnector"  # the KV moves over ZeroMQ (the only connector)
    kv_port: int = 14579                # producer: the port of its KV endpoint
    kv_ip: str = "127.0.0.1"            # where decode servers reach this server's KV endpoint
    mtp_handoff: str = "drafts"         # "drafts" (scheme 1: first token + drafts) | "hidden" (scheme 2: hidden state)
    kv_transfer_timeout: float = 120.0  # producer: seconds a prefilled request waits to be pulled
    kv_pull_timeout: float = 30.0       # consumer: seconds to wait for the prefill side's answer

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_transfer_config: not JSON: {e}")
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or "kv_role" not in raw or set(raw) - known:
            raise ValueError(f"kv_transfer_config: a JSON object with kv_role and any of {sorted(known)}; "
                             f"got {text!r}")
        cfg = cls(**raw)
        if cfg.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role = {cfg.kv_role!r}: must be one of {ROLES}")
        if cfg.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector = {cfg.kv_connector!r}: must be one of {CONNECTORS} "
                             "(NCCL transfers between CUDA devices are not built)")
        if cfg.mtp_handoff not in SCHEMES:
            raise ValueError(f"kv_transfer_config: mtp_handoff = {cfg.mtp_handoff!r}: must be one of {SCHEMES}")
        if not (isinstance(cfg.kv_port, int) and 0 < cfg.kv_port < 65536):
            raise ValueError(f"kv_transfer_config: kv_port = {cfg.kv_port!r}: must be a port number")
        for name in ("kv_transfer_timeout", "kv_pull_timeout"):
            if not (isinstance(getattr(cfg, name), (int, float)) and getattr(cfg, name) > 0):
                raise ValueError(f"kv_transfer_config: {name} = {getattr(cfg, name)!r}: must be > 0 seconds")
        return cfg

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


class KVConnector:
    def __init__(self, config: KVTransferConfig, async_engine):
        from mtpserve.disagg.offline import single_process
        single_process(async_engine.engine)
        self.config, self.async_engine = config, async_engine
        self.pulls, self.pull_seconds, self.pull_bytes = 0, 0.0, 0   # decode side, cumulative
        self.endpoint = None
        if config.produces:
            self.endpoint = KVEndpoint("0.0.0.0", config.kv_port, config.kv_transfer_timeout, self._export,
                                       self.release)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    # ---- prefill side ----
    def _export(self, request_id: str, scheme: str) -> Handoff:
        """(the endpoint's thread) The held request's hand-off; its blocks are not reused until released."""
        engine = self.async_engine.engine
        return export_handoff(engine, engine.scheduler.held[request_id], scheme)

    def release(self, request_id: str) -> None:
        self.async_engine.call_soon(lambda engine: engine.release_kv(request_id))

    def park(self, request_id: str, finish_reason: str | None, scheme: str | None) -> dict | None:
        """A finished prefill: the params that let a decode server pull it (None: it ended at its first token,
        nothing to continue; its blocks are freed)."""
        if finish_reason == "stop":
            self.release(request_id)
            return None
        scheme = scheme or self.config.mtp_handoff
        transfer_id = self.endpoint.park(request_id, scheme)
        return dict(do_remote_prefill=True, remote_host=self.config.kv_ip, remote_port=self.config.kv_port,
                    transfer_id=transfer_id, mtp_handoff=scheme)

    # ---- decode side ----
    async def pull(self, params: dict) -> Handoff:
        for key in ("remote_host", "remote_port", "transfer_id"):
            if key not in params:
                raise ValueError(f"kv_transfer_params: {key} is missing (do_remote_prefill needs remote_host, "
                                 "remote_port and transfer_id, as a prefill server returns them)")
        start = time.perf_counter()
        handoff = await asyncio.to_thread(pull, params["remote_host"], int(params["remote_port"]),
                                          str(params["transfer_id"]), self.config.kv_pull_timeout)
        self.pulls += 1
        self.pull_seconds += time.perf_counter() - start
        self.pull_bytes += sum(t.numel() * t.element_size() for t in handoff.kv)
        return handoff

    def counters(self) -> dict:
        """Hand-offs served (prefill side) and pulled (decode side), for /metrics."""
        sent = (self.endpoint.transfers, self.endpoint.bytes_sent) if self.endpoint else (0, 0)
        return dict(sent=sent[0], sent_bytes=sent[1], pulled=self.pulls, pulled_kv_bytes=self.pull_bytes,
                    pull_seconds=self.pull_seconds, parked=self.endpoint.num_parked() if self.endpoint else 0)

    @staticmethod
    def importer(handoff: Handoff):
        """How the engine takes the decode request: the hand-off's KV and tokens, the request's own params."""
        def add(engine, request_id, prompt, prompt_token_ids, params):
            import_handoff(engine, handoff, request_id, params)
        return add
