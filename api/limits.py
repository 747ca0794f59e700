"""The limit on every request body's size.

A pure ASGI middleware around the app. The upload route (POST /v1/files) streams its body
through api.uploads, which enforces the upload limit itself; every other body (the JSON of
POST /v1/batches) may be at most MAX_JSON_BODY_BYTES, refused from its Content-Length or,
chunked, as soon as it passes it. How long a body may take is the connection's business
(api.connections closes one whose body stalls or trickles); headers are bounded by uvicorn
(h11's 16 KiB) and in time by api.connections too.
"""
from __future__ import annotations

from api.errors import error_response

MAX_JSON_BODY_BYTES = 1024 * 1024
UPLOAD_PATH = "/v1/files"


class _Refused(BaseException):
    """Raised from receive(): a BaseException, so that no handler on the way (FastAPI turns an
    Exception while reading a body into a 400 "error parsing the body") swallows it."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class RequestLimits:
    def __init__(self, app, max_body_bytes: int = MAX_JSON_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = None if (scope["method"], scope["path"]) == ("POST", UPLOAD_PATH) else self.max_body_bytes
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        too_big = _Refused(413, f"the request body is larger than {self.max_body_bytes} bytes", "request_too_large")
        if limit is not None and length.isdigit() and int(length) > limit:
            return await error_response(too_big.status, too_big.message, code=too_big.code)(scope, receive, send)
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit is not None and received > limit:
                    raise too_big
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Refused as e:
            if started:
                raise
            await error_response(e.status, e.message, code=e.code)(scope, receive, send)
