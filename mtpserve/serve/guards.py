"""ASGI middleware in front of the API: Host and Origin checks, the API key, a request-body size limit.

Plain ASGI classes (no per-request task or body re-parse). Order, outermost first: HostOriginGuard (a web page
cannot drive a local server: DNS rebinding needs a foreign Host, a cross-site request carries an Origin),
APIKeyGuard (everything but /health), BodyLimitGuard (reads the body, at most max_bytes, before the app does).
"""
import hmac

from fastapi.responses import JSONResponse

from mtpserve.serve.protocol import APIError, error_body

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = ("/health",)   # answered without a key (liveness probes)


async def send_error(err: APIError, scope, receive, send, close: bool = False) -> None:
    headers = dict(err.headers, **({"Connection": "close"} if close else {}))
    await JSONResponse(error_body(err), status_code=err.status, headers=headers)(scope, receive, send)


def _hostname(host: str) -> str:
    if host.startswith("["):                 # [::1]:8000
        return host[1:host.find("]")].lower()
    return host.rsplit(":", 1)[0].lower() if host.count(":") == 1 else host.lower()


class HostOriginGuard:
    """allowed_hosts: Host names accepted (None: any). allowed_origins: Origins accepted ("*": any); a request
    with an Origin header not listed gets 403 (browsers send one on cross-site requests; API clients do not)."""

    def __init__(self, app, allowed_hosts, allowed_origins, on_error):
        self.app, self.on_error = app, on_error
        self.hosts = None if allowed_hosts is None or "*" in allowed_hosts else {h.lower() for h in allowed_hosts}
        self.origins = set(allowed_origins or ())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1")
            if self.hosts is not None and _hostname(host) not in self.hosts:
                self.on_error(400)
                return await send_error(APIError(f"Host {host!r} is not allowed (--allowed-hosts)",
                                                 code="host_not_allowed"), scope, receive, send)
            origin = headers.get(b"origin")
            if origin is not None and "*" not in self.origins and origin.decode("latin-1") not in self.origins:
                self.on_error(403)
                return await send_error(APIError(f"Origin {origin.decode('latin-1')!r} is not allowed "
                                                 "(--allowed-origins)", status=403, type="permission_error",
                                                 code="origin_not_allowed"), scope, receive, send)
        await self.app(scope, receive, send)


class APIKeyGuard:
    """Every path but /health needs 'Authorization: Bearer <api_key>' (401 otherwise): the API, /metrics,
    /openapi.json, /docs."""

    def __init__(self, app, api_key: str, on_error):
        self.app, self.expected, self.on_error = app, f"Bearer {api_key}".encode(), on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.on_error(401)
                return await send_error(APIError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                                 status=401, type="authentication_error", code="invalid_api_key"),
                                        scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitGuard:
    """Reads a request's body up to max_bytes, then hands it to the app; a larger one gets 413 as soon as its
    Content-Length (or the bytes received) says so, and the connection is closed without reading the rest."""

    def __init__(self, app, max_bytes: int, on_error):
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def _too_large(self, scope, receive, send):
        self.on_error(413)
        await send_error(APIError(f"the request body is larger than {self.max_bytes} bytes (--max-request-body-bytes)",
                                  status=413, code="request_too_large"), scope, receive, send, close=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()   # (disconnect watching)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replay, send)
