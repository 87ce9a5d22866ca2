"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

    python -m mtpserve.serve.openai_api --model PATH --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'

Endpoints: /v1/completions, /v1/chat/completions (both with "stream"), /v1/models, /health, /metrics.
Errors come back in OpenAI's format {"error": {"message", "type", "param", "code"}}.
"""
import argparse
import asyncio
import copy
import hmac
import json
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpserve.serve import generation, protocol
from mtpserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from mtpserve.serve.protocol import APIError

logger = logging.getLogger(__name__)


async def _first_of(*tasks: asyncio.Future) -> None:
    """Waits until one task ends (the work, or the client going away), then cancels and reaps them all."""
    try:
        await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that stops its body (aborting the engine requests) as soon as the client
    disconnects, even while no chunk is being sent."""

    async def __call__(self, scope, receive, send):
        sending = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await _first_of(sending, watching)
        finally:
            await self.body_iterator.aclose()
        if not sending.cancelled() and sending.exception() is not None and \
                not isinstance(sending.exception(), OSError):
            logger.error("streaming response failed", exc_info=sending.exception())


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _own_copy(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception:   # a tokenizer that cannot be copied: share it
        logger.warning("could not copy the tokenizer; sharing the engine's")
        return tokenizer


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(protocol.error_body(err), status_code=err.status, headers=err.headers)


class APIKeyMiddleware:
    """Plain ASGI middleware: /v1/* needs 'Authorization: Bearer <api_key>' (401 otherwise)."""

    def __init__(self, app, api_key: str, metrics: ServerMetrics):
        self.app, self.expected, self.metrics = app, f"Bearer {api_key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.count_error(401)
                err = APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                               type="authentication_error", code="invalid_api_key")
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine, served_model_name, api_key: str | None = None, max_model_len: int | None = None,
              kv_connector=None) -> FastAPI:
    """engine: an AsyncEngine. served_model_name: a name or a list of names (the first one is reported).
    kv_connector: this server's side of disaggregated prefill/decode (mtpserve/disagg/), or None."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    max_model_len = max_model_len or engine.max_model_len
    tokenizer = _own_copy(engine.tokenizer)   # the engine thread uses its tokenizer concurrently
    metrics = ServerMetrics(engine, names[0])
    engine.on_outputs, engine.on_abort = metrics.on_outputs, metrics.on_abort
    if kv_connector is not None:
        from mtpserve.serve.metrics import TransferCollector
        metrics.registry.register(TransferCollector(kv_connector, names[0]))
    app = FastAPI(title="mtpserve", docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, metrics
    created = int(time.time())

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        metrics.count_error(err.status)
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error")
        metrics.count_error(500)
        return _error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                        type="internal_server_error"))

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": created, "owned_by": "mtpserve",
                 "root": names[0], "max_model_len": max_model_len} for name in names]
        return {"object": "list", "data": data}

    async def serve(request: Request, chat: bool):
        try:
            body = json.loads(await request.body(), parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"malformed JSON body: {e}")
        req = protocol.parse_chat_request(body) if chat else protocol.parse_completion_request(body)
        if req.model is not None and req.model not in names:
            raise APIError(f"the model '{req.model}' does not exist; this server serves {names}", status=404,
                           type="not_found_error", param="model", code="model_not_found")
        model = req.model or names[0]
        prompts = generation.prepare_prompts(req, tokenizer, max_model_len, chat)
        params = [generation.make_params(req, len(ids), max_model_len, chat) for _, ids in prompts]
        request_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        disagg = None
        if req.kv_transfer_params is not None:
            from mtpserve.disagg import serving
            disagg = await serving.prepare(kv_connector, req.kv_transfer_params, req, prompts, params,
                                           lambda n: generation.make_params(req, n, max_model_len, chat))
            prompts, params = disagg.prompts, disagg.params
        try:
            streams = await generation.start_requests(engine, request_id, prompts, params,
                                                      disagg.add if disagg else None)
        except APIError as e:
            if disagg is not None and e.status == 400:
                e.param = "kv_transfer_params" if "handoff" in str(e) else e.param
            raise
        if disagg is not None and disagg.park:
            return await _prefill_only(request, streams, req, request_id, model, chat)

        if req.stream:   # stream_sse aborts the requests when it is closed early
            return EngineStreamingResponse(generation.stream_sse(streams, req, request_id, model, chat),
                                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collecting = asyncio.ensure_future(generation.collect(streams, req, request_id, model, chat))
        watching = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await _first_of(collecting, watching)
        finally:
            for s in streams:
                s.abort()
        if not collecting.done() or collecting.cancelled():
            return Response(status_code=499)   # the client went away
        return JSONResponse(collecting.result())

    async def _prefill_only(request, streams, req, request_id, model, chat):
        """A prefill server's answer: the first token, and where a decode server pulls the rest from."""
        engine_request_id, parked = f"{request_id}-0", False
        try:
            collecting = asyncio.ensure_future(generation.collect(streams, req, request_id, model, chat))
            await _first_of(collecting, asyncio.ensure_future(_wait_for_disconnect(request)))
            if not collecting.done() or collecting.cancelled():
                return Response(status_code=499)
            result = collecting.result()
            result["kv_transfer_params"] = kv_connector.park(engine_request_id, result["choices"][0]["finish_reason"],
                                                             req.kv_transfer_params.get("mtp_handoff"))
            parked = result["kv_transfer_params"] is not None
            return JSONResponse(result)
        finally:
            for s in streams:
                s.abort()
            if not parked:   # (no-op unless the request finished with its blocks held)
                kv_connector.release(engine_request_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from mtpserve.cli import add_graph_args, add_parallel_args, add_quantization_arg
    a = parser.add_argument
    a("--model", default=None, help="HF checkpoint directory (default: the shipped default model)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--served-model-name", nargs="+", default=None,
      help="name(s) clients use in 'model' (default: the --model value, or 'mtpserve-default')")
    a("--speculative-config", default=None,
      help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\' (default: no speculation)')
    a("--max-num-seqs", type=int, default=64)
    a("--max-model-len", type=int, default=None)
    a("--max-num-batched-tokens", type=int, default=None)
    a("--num-kv-blocks", type=int, default=None)
    add_graph_args(parser)
    add_parallel_args(parser)
    add_quantization_arg(parser)
    a("--dtype", default="auto")
    a("--seed", type=int, default=0)
    a("--api-key", default=os.environ.get("MTPSERVE_API_KEY"),
      help="require 'Authorization: Bearer KEY' on /v1/* (default: $MTPSERVE_API_KEY)")
    a("--max-queue-len", type=int, default=None, help="waiting requests beyond which new ones get 503")
    a("--kv-transfer-config", default=None,
      help="disaggregated prefill/decode (JSON, vLLM's keys): kv_role kv_producer|kv_consumer|kv_both, kv_port, "
           "kv_ip, mtp_handoff drafts|hidden, kv_transfer_timeout, kv_pull_timeout (mtpserve/disagg/connector.py)")
    a("--uvicorn-log-level", default="warning")
    return parser


def engine_kwargs(args) -> dict:
    from mtpserve.cli import graph_kwargs, parallel_kwargs
    spec = None
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except ValueError as e:
            raise SystemExit(f"--speculative-config is not valid JSON: {e}")
    kwargs = dict(model=args.model, speculative_config=spec, **graph_kwargs(args),
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  num_kv_blocks=args.num_kv_blocks, dtype=args.dtype, seed=args.seed, quantization=args.quantization,
                  **parallel_kwargs(args))
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def build_engine(args):
    from mtpserve.engine.engine import LLMEngine
    return LLMEngine.from_kwargs(**engine_kwargs(args))


def run_server(args) -> None:
    import uvicorn

    from mtpserve.engine.async_engine import AsyncEngine
    from mtpserve.engine.setup import engine_config, run_non_front_ranks
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if run_non_front_ranks(engine_config(**engine_kwargs(args))):
        return   # a node after the first: its ranks served node 0's engine until it stopped
    server = None

    def stop_serving():   # a rank failed: the engine is dead, so is the server (clients got their errors)
        if server is not None:
            server.should_exit = True

    kv_config = None
    if args.kv_transfer_config:
        from mtpserve.disagg.connector import KVConnector, KVTransferConfig
        try:
            kv_config = KVTransferConfig.from_json(args.kv_transfer_config)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--kv-transfer-config: {e}")
    async_engine = AsyncEngine(build_engine(args), max_queue_len=args.max_queue_len, on_fatal=stop_serving)
    kv_connector = KVConnector(kv_config, async_engine) if kv_config else None
    names = args.served_model_name or [args.model or "mtpserve-default"]
    app = build_app(async_engine, names, args.api_key, async_engine.max_model_len, kv_connector)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", names, args.host, args.port,
                async_engine.max_model_len)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level))
    try:
        server.run()
    finally:
        if kv_connector is not None:
            kv_connector.close()
        async_engine.shutdown()
        async_engine.engine.shutdown()


def main(argv=None) -> None:
    parser = add_serve_args(argparse.ArgumentParser(prog="mtpserve serve", description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
