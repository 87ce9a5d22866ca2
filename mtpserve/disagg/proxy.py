"""`mtpserve proxy`: an OpenAI-compatible front for disaggregated serving (FastAPI + httpx).

    mtpserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each /v1/completions or /v1/chat/completions request goes to a prefill server with max_tokens 1 and
`kv_transfer_params: {"do_remote_decode": true}`; the decode server then gets the original request plus the
`kv_transfer_params` the prefill server returned, and its answer (streamed or not) is the client's. Servers of
each role are picked round-robin. A side that cannot be reached makes the proxy answer 502 (OpenAI-style
error); a side's own error status and body are passed through.
"""
import argparse
import itertools
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)


def build_proxy(prefill_urls: list[str], decode_urls: list[str], mtp_handoff: str | None = None,
                timeout: float = 600.0) -> FastAPI:
    app = FastAPI(title="mtpserve proxy", docs_url=None, redoc_url=None)
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))   # (lives as long as the process)

    def forward_headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def prefill(url: str, body: dict, headers: dict):
        """(kv_transfer_params, None) or (None, the response to give the client)."""
        asked = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        asked.pop("stream_options", None)
        if mtp_handoff:
            asked["kv_transfer_params"]["mtp_handoff"] = mtp_handoff
        try:
            r = await client.post(url, json=asked, headers=headers)
        except httpx.HTTPError as e:
            return None, _error(502, f"prefill server {url} unreachable: {type(e).__name__}: {e}", "prefill_unreachable")
        if r.status_code != 200:
            return None, Response(r.content, status_code=r.status_code, media_type="application/json")
        result = r.json()
        if result.get("kv_transfer_params") is None:   # it ended at its first token: that is the answer
            result.pop("kv_transfer_params", None)
            return None, JSONResponse(result)
        return result["kv_transfer_params"], None

    async def route(request: Request, path: str):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return JSONResponse({"error": {"message": f"malformed JSON body: {e}", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        headers = forward_headers(request)
        if body.get("max_tokens") == 1:   # the prefill is the whole answer: nothing to hand over
            return await passthrough(next(prefills) + path, body, headers)
        params, answer = await prefill(next(prefills) + path, body, headers)
        if answer is not None:
            return answer
        return await passthrough(next(decodes) + path, dict(body, kv_transfer_params=params), headers, "decode")

    async def passthrough(url: str, body: dict, headers: dict, role: str = "prefill"):
        """The upstream's answer, streamed or not, as the client's."""
        try:
            if not body.get("stream"):
                r = await client.post(url, json=body, headers=headers)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            upstream = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)
        except httpx.HTTPError as e:
            return _error(502, f"{role} server {url} unreachable: {type(e).__name__}: {e}", f"{role}_unreachable")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            r = await client.get(decode_urls[0] + "/v1/models", headers=forward_headers(request))
        except httpx.HTTPError as e:
            return _error(502, f"decode server unreachable: {e}", "decode_unreachable")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        for url in prefill_urls + decode_urls:
            try:
                if (await client.get(url + "/health", timeout=5.0)).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, help="a prefill server's base URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mtp-handoff", choices=["drafts", "hidden"], default=None,
                   help="ask the prefill servers for this scheme (default: each server's own mtp_handoff)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take upstream")


def run_proxy(args) -> None:
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_proxy([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode],
                      args.mtp_handoff, args.timeout)
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
