"""Retention in the API: `output_expires_after` of POST /v1/batches and `expires_after` of
POST /v1/files, as OpenAI takes them ({"anchor": "created_at", "seconds": 3600 .. 2592000})."""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from api.errors import ApiError

MIN_SECONDS, MAX_SECONDS = 3600, 2592000   # OpenAI's bounds: an hour to 30 days


class ExpiresAfter(BaseModel):
    """A file's (or a batch's output files') expiration policy."""
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(strict=True, ge=MIN_SECONDS, le=MAX_SECONDS)]


def form_expires_after(fields: dict[str, str], created_at: datetime) -> datetime | None:
    """An upload's expires_at from its form's `expires_after[anchor]` and `expires_after[seconds]`
    (how the openai client sends the object in multipart); None without them; 400 if malformed."""
    given = {k: v for k, v in fields.items() if k.startswith("expires_after")}
    if not given:
        return None
    anchor, seconds = given.pop("expires_after[anchor]", None), given.pop("expires_after[seconds]", None)
    if given:
        raise ApiError(400, f"unknown field(s) {', '.join(sorted(given))}; expires_after has anchor and seconds",
                       param="expires_after")
    if anchor != "created_at":
        raise ApiError(400, f"expires_after.anchor must be 'created_at', got {anchor!r}", param="expires_after.anchor")
    if seconds is None or not seconds.isascii() or not seconds.isdigit() \
            or not MIN_SECONDS <= int(seconds) <= MAX_SECONDS:
        raise ApiError(400, f"expires_after.seconds must be a whole number from {MIN_SECONDS} (an hour) to "
                            f"{MAX_SECONDS} (30 days), got {seconds!r}", param="expires_after.seconds")
    return created_at + timedelta(seconds=int(seconds))
