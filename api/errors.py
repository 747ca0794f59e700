"""Every failure as an OpenAI error object: {"error": {"message", "type", "param", "code"}}.

The openai client turns the HTTP status into its exception (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 409 ConflictError, ...) and shows the message.
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, code=self.code, param=self.param, type=self.type)


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a message or param that quotes what the
    client sent (a lone surrogate from a "\\ud800" escape, which UTF-8 cannot carry) is
    still written, as the escape it came as, instead of failing the response with a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   type: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return _AsciiJSONResponse(body, status_code=status, headers=headers)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    """The same answer for an object that does not exist and one of another key: nothing tells them apart."""
    return ApiError(404, f"No such {kind} object: {object_id}", param=param)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):   # unknown routes, wrong methods
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(400, message, param=where or None)
