"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

    python -m mtpserve.serve.openai_api --model PATH --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'

Endpoints: /v1/completions, /v1/chat/completions (both with "stream"), /v1/models, /health, /metrics.
Errors come back in OpenAI's format {"error": {"message", "type", "param", "code"}}: 4xx for the client's
mistakes (naming the field and the limit), 500 only for server faults, whose details go to the log under an
error id, never to the client. Bodies are parsed and prompts tokenised on a worker thread, never on the event
loop, so /health and running streams are not held up by a large request.
"""
import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpserve.engine import validation
from mtpserve.serve import generation, protocol, responses
from mtpserve.serve.guards import APIKeyGuard, BodyLimitGuard, HostOriginGuard
from mtpserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from mtpserve.serve.protocol import APIError

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_QUEUE_LEN = 512

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


def _own_copy(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception:   # a tokenizer that cannot be copied: share it
        logger.warning("could not copy the tokenizer; sharing the engine's")
        return tokenizer


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(protocol.error_body(err), status_code=err.status, headers=err.headers)


def build_app(engine, served_model_name, api_key: str | None = None, max_model_len: int | None = None,
              kv_connector=None, allowed_hosts=None, allowed_origins=(), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              chat_template: str | None = None, tool_parser: str | None = None) -> FastAPI:
    """engine: an AsyncEngine. served_model_name: a name or a list of names (the first one is reported).
    kv_connector: this server's side of disaggregated prefill/decode (mtpserve/disagg/), or None.
    allowed_hosts: Host names served (None: any); allowed_origins: browser Origins served ("*": any).
    chat_template: a Jinja template replacing the tokenizer's. tool_parser: how "auto" tool calls are read from
    the model's text (--enable-auto-tool-choice --tool-call-parser; None: "auto" is refused)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    max_model_len = max_model_len or engine.max_model_len
    tokenizer = _own_copy(engine.tokenizer)   # the engine thread uses its tokenizer concurrently
    loop_tokenizer = _own_copy(engine.tokenizer)   # the event loop's, for logprob tokens and echoed prompts
    if chat_template is not None and tokenizer is not None:
        tokenizer.chat_template = chat_template
    # one thread parses bodies and tokenises prompts (the tokenizer copy is not shared between threads)
    prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="mtpserve-tokenize")
    metrics = ServerMetrics(engine, names[0])
    engine.on_outputs, engine.on_abort = metrics.on_outputs, metrics.on_abort
    if kv_connector is not None:
        from mtpserve.serve.metrics import TransferCollector
        metrics.registry.register(TransferCollector(kv_connector, names[0]))
    app = FastAPI(title="mtpserve", docs_url="/docs", redoc_url=None)
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
        error_id = uuid.uuid4().hex[:12]
        logger.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        metrics.count_error(500)
        return _error_response(APIError(f"internal server error (error id {error_id}; details in the server log)",
                                        status=500, type="internal_server_error", code="internal_error"))

    # (added last = outermost): host/origin, then the key, then the body limit
    app.add_middleware(BodyLimitGuard, max_bytes=max_body_bytes, on_error=metrics.count_error)
    if api_key:
        app.add_middleware(APIKeyGuard, api_key=api_key, on_error=metrics.count_error)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(HostOriginGuard, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                       on_error=metrics.count_error)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():   # (behind the API key, as every path but /health)
        engine.call_soon(lambda e: e.reset_prefix_cache())
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": created, "owned_by": "mtpserve",
                 "root": names[0], "max_model_len": max_model_len} for name in names]
        return {"object": "list", "data": data}

    def parse_and_prepare(raw: bytes, chat: bool):   # (on the prepare thread)
        req = generation.parse_request(raw, chat, tool_parser)
        if req.model is not None and req.model not in names:
            raise APIError(f"the model {req.model!r} does not exist; this server serves {names}", status=404,
                           type="not_found_error", param="model", code="model_not_found")
        prompts = generation.prepare_prompts(req, tokenizer, max_model_len, chat)
        params = [generation.make_params(req, len(ids), max_model_len, chat) for _, ids in prompts]
        if req.structured_field is not None:   # compiled here, off the event loop; the engine finds it cached
            try:
                validation.grammar_compiler(engine.engine).compile(params[0].structured_outputs)
            except ValueError as e:
                raise APIError(str(e), param=req.structured_field)
        return req, prompts, params

    async def serve(request: Request, chat: bool):
        raw = await request.body()
        req, prompts, params = await asyncio.get_running_loop().run_in_executor(prepare_pool, parse_and_prepare,
                                                                                raw, chat)
        model = req.model or names[0]
        request_id = responses.new_id("chatcmpl" if chat else "cmpl")
        disagg = None
        if req.kv_transfer_params is not None:
            from mtpserve.serve import kv_transfer
            disagg = await kv_transfer.prepare(kv_connector, req.kv_transfer_params, req, prompts, params,
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
            return EngineStreamingResponse(generation.stream_sse(streams, req, request_id, model, chat, loop_tokenizer),
                                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collecting = asyncio.ensure_future(generation.collect(streams, req, request_id, model, chat, loop_tokenizer))
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
            collecting = asyncio.ensure_future(generation.collect(streams, req, request_id, model, chat,
                                                                  loop_tokenizer))
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


def main(argv=None) -> None:
    from mtpserve.serve.server import main as serve_main
    serve_main(argv)


if __name__ == "__main__":
    main()
