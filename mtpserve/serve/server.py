"""`mtpserve serve`: the server's flags, the engine behind it, uvicorn with a drain deadline on SIGTERM.

    mtpserve serve --model PATH --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
    python -m mtpserve.serve.openai_api ...   (the same)
"""
import argparse
import asyncio
import logging
import os

from mtpserve.engine_args import add_engine_args, engine_kwargs
from mtpserve.serve.guards import LOOPBACK_HOSTS
from mtpserve.serve.openai_api import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE_LEN, build_app
from mtpserve.serve.tools import PARSERS

logger = logging.getLogger("mtpserve.serve")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser)
    a = parser.add_argument_group("server").add_argument
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on")
    a("--served-model-name", nargs="+", default=None,
      help="name(s) clients use in 'model' (default: the --model value, or 'mtpserve-default')")
    a("--chat-template", default=None, help="a Jinja chat template (a file, or the template itself) replacing "
                                            "the tokenizer's")
    a("--enable-auto-tool-choice", action="store_true",
      help="tool_choice \"auto\": the model decides to call tools, its text read by --tool-call-parser")
    a("--tool-call-parser", choices=PARSERS, default=None, help="the model's tool-call format (DeepSeek-V3's)")
    a("--uvicorn-log-level", default="warning", help="uvicorn's log level")
    a = parser.add_argument_group("security and limits").add_argument
    a("--api-key", default=os.environ.get("MTPSERVE_API_KEY"),
      help="require 'Authorization: Bearer KEY' on every path but /health (default: $MTPSERVE_API_KEY, which "
           "keeps the key out of `ps`)")
    a("--allowed-hosts", nargs="+", default=None,
      help="Host header names served, '*' for any (default: the loopback names when --host is a loopback "
           "address, so a web page cannot reach the server by DNS rebinding; else any)")
    a("--allowed-origins", nargs="+", default=[],
      help="browser Origins served, with CORS headers ('*' for any); requests carrying any other Origin get 403 "
           "(default: none, so no web page can drive the server)")
    a("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    a("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
      help="requests waiting for a slot (beyond --max-num-seqs running) past which new ones get 503")
    a("--shutdown-timeout", type=float, default=30.0,
      help="seconds SIGTERM waits for running requests; the ones left then end with an error")
    a = parser.add_argument_group("disaggregated prefill / decode").add_argument
    a("--kv-transfer-config", default=None,
      help="disaggregated prefill/decode (JSON, vLLM's keys): kv_role kv_producer|kv_consumer|kv_both, kv_port, "
           "kv_ip, mtp_handoff drafts|hidden, kv_transfer_timeout, kv_pull_timeout (mtpserve/disagg/connector.py)")
    return parser


def build_engine(args):
    from mtpserve.engine.engine import LLMEngine
    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    engine.calibrate()
    return engine


def prefill_server_speculation(speculative_config: dict | None, kv_role: str) -> dict | None:
    """A prefill server (kv_producer) hands every request over after its prefill step: its only decode step is
    the decode server's, so adaptive k has nothing to learn from. Unless the config says "adaptive", MTP drafts a
    fixed k, without the calibration's 5-15 s and, in graph mode, with one k's graphs, not k + 1."""
    from mtpserve.config import SpeculativeConfig
    spec = speculative_config
    if kv_role != "kv_producer" or not isinstance(spec, dict) or "adaptive" in spec:
        return spec
    try:
        adapts = SpeculativeConfig.from_dict(spec).adaptive   # (the one place that knows the defaults)
    except (ValueError, TypeError):
        return spec   # (the engine names the error)
    if not adapts:
        return spec
    logger.info("kv_producer: MTP drafts a fixed %s tokens (add \"adaptive\": true to adapt them)",
                spec.get("num_speculative_tokens"))
    return {**spec, "adaptive": False}


def _tool_parser(args) -> str | None:
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise SystemExit("--enable-auto-tool-choice and --tool-call-parser go together")
    return args.tool_call_parser


def _chat_template(value: str | None) -> str | None:
    if value is None or not os.path.isfile(value):
        return value
    with open(value) as f:
        return f.read()


class DrainingServer:
    """uvicorn's server with a drain deadline: on SIGTERM it stops accepting and waits for running requests;
    after shutdown_timeout seconds the engine fails the ones left (their clients get an error), then it exits."""

    def __new__(cls, config, async_engine, shutdown_timeout: float):
        import uvicorn

        class _Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                loop = asyncio.get_running_loop()
                deadline = loop.call_later(shutdown_timeout, async_engine.fail_all_requests,
                                           f"the server is shutting down (--shutdown-timeout {shutdown_timeout:g} s)")
                try:
                    await super().shutdown(sockets)
                finally:
                    deadline.cancel()
        return _Server(config)


def check_serve_args(args) -> None:
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("--api-key (or MTPSERVE_API_KEY) is empty: give a key, or unset it to serve without one")
    for name in ("max_request_body_bytes", "max_queue_len"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be >= 0")
    if args.allowed_hosts is None:
        args.allowed_hosts = list(LOOPBACK_HOSTS) if args.host in LOOPBACK_HOSTS else None
    if args.cpu_threads is None:
        args.cpu_threads = serving_cpu_threads(args)


def serving_cpu_threads(args) -> int:
    """The model's threads per rank on the CPU when serving: the node's cores but one, divided among its ranks.
    The HTTP server's event loop (parsing, streaming every step's tokens) needs a core of its own: beside a
    model that used every core, it preempted one of the model's threads each step, and the others spun waiting
    for it (figures in docs/history.md)."""
    ranks_per_node = max(1, args.tensor_parallel_size * args.data_parallel_size // max(1, args.nnodes))
    return max(1, ((os.cpu_count() or 1) - 1) // ranks_per_node)


def run_server(args) -> None:
    import uvicorn

    from mtpserve.engine.async_engine import AsyncEngine
    from mtpserve.engine.setup import engine_config, run_non_front_ranks
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_serve_args(args)
    kv_config = None
    if args.kv_transfer_config:
        from mtpserve.disagg.connector import KVConnector, KVTransferConfig
        try:
            kv_config = KVTransferConfig.from_json(args.kv_transfer_config)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--kv-transfer-config: {e}")
        args.speculative_config = prefill_server_speculation(args.speculative_config, kv_config.kv_role)
    if run_non_front_ranks(engine_config(**engine_kwargs(args))):
        return   # a node after the first: its ranks served node 0's engine until it stopped
    server = None

    def stop_serving():   # a rank failed: the engine is dead, so is the server (clients got their errors)
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(build_engine(args), max_queue_len=args.max_queue_len, on_fatal=stop_serving)
    kv_connector = KVConnector(kv_config, async_engine) if kv_config else None
    names = args.served_model_name or [args.model or "mtpserve-default"]
    app = build_app(async_engine, names, args.api_key, async_engine.max_model_len, kv_connector,
                    allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                    max_body_bytes=args.max_request_body_bytes, chat_template=_chat_template(args.chat_template),
                    tool_parser=_tool_parser(args))
    logger.info("serving %s on http://%s:%d (max_model_len %d)", names, args.host, args.port,
                async_engine.max_model_len)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = DrainingServer(config, async_engine, args.shutdown_timeout)
    try:
        server.run()
    finally:
        if kv_connector is not None:
            kv_connector.close()
        async_engine.shutdown()
        async_engine.engine.shutdown()


def main(argv=None) -> None:
    from mtpserve.serve import openai_api
    parser = add_serve_args(argparse.ArgumentParser(prog="mtpserve serve", description=openai_api.__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
