"""Bearer keys: a request without a live key of the ledger (`pipeline keys add`) gets 401."""
from __future__ import annotations

from fastapi import Request

from api.errors import ApiError
from jobs import ledger


def caller(request: Request) -> ledger.ApiKey:
    """The key of the request (a FastAPI dependency, run before any body is read)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer KEY' "
                            "(`pipeline keys add NAME` makes one).")
    with request.app.state.config.Session() as s:
        found = ledger.find_key(s, key.strip())
    if found is None:
        raise _unauthorized("Incorrect API key provided (unknown or revoked).")
    return found


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")
