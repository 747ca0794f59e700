"""/v1/files: upload a batch input file (validated as `pipeline submit` validates), read,
list, download and delete a key's files."""
from __future__ import annotations

import os
import time
from typing import Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.auth import caller
from api.errors import ApiError, not_found
from api.retention import form_expires_after
from api.uploads import receive_upload
from jobs import ledger
from jobs.input import file_scan
from jobs.input.validation import Validation
from jobs.paths import check_file_id, file_path, files_dir, new_file_id
from jobs.input.field_checks import Bad, storable

router = APIRouter()
_CHUNK = 1 << 16


def file_object(row: ledger.File) -> dict:
    """The OpenAI FileObject of a file row."""
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": int(row.created_at.timestamp()),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "status_details": None,
            "expires_at": int(row.expires_at.timestamp()) if row.expires_at else None}


def owned_file(request: Request, key: ledger.ApiKey, file_id: str) -> ledger.File:
    """The key's file with that id; 404 if it is malformed, unknown or another key's."""
    try:
        check_file_id(file_id)
    except ValueError:
        raise not_found("File", file_id) from None
    with request.app.state.config.Session() as s:
        row = ledger.get_file(s, file_id)
    if row is None or row.api_key_id != key.id:
        raise not_found("File", file_id)
    return row


def invalid_input(name: str, validation: Validation, what: str) -> ApiError:
    """The line-numbered errors of a file, as `pipeline submit` prints them, in one error object."""
    first = validation.errors[0] if validation.errors else None
    return ApiError(400, validation.describe(name, what), code="invalid_file", param=f"{first.unit} {first.line}" if first and first.line
                    else "file")


@router.post("/files")
async def upload_file(request: Request, key: ledger.ApiKey = Depends(caller)):
    config = request.app.state.config
    file_id = new_file_id()
    path = file_path(config.settings.data_dir, file_id)
    upload = await receive_upload(request, path, config.max_upload_bytes)
    try:
        if upload.fields.get("purpose") != "batch":
            raise ApiError(400, f"purpose must be 'batch', got {upload.fields.get('purpose')!r} (this server runs "
                                "batches only)", param="purpose")
        created_at = ledger.utcnow()
        expires_at = form_expires_after(upload.fields, created_at)
        validation = await run_in_threadpool(file_scan.validate, path, config.limits, model=config.model_names)
        if not validation.ok:
            raise invalid_input(upload.filename, validation, "nothing was uploaded")

        def record():
            with config.Session() as s:
                return ledger.add_file(s, id=file_id, api_key_id=key.id, purpose="batch",
                                       filename=upload.filename, bytes=upload.size, created_at=created_at,
                                       expires_at=expires_at)
        row = await run_in_threadpool(record)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return file_object(row)


@router.get("/files")
def list_files(request: Request, key: ledger.ApiKey = Depends(caller), purpose: str | None = None,
               after: str | None = None, limit: int = Query(10000, ge=1, le=10000),
               order: Literal["asc", "desc"] = "desc"):
    if purpose is not None:   # compared in SQL: no NUL (PostgreSQL's text cannot hold one)
        try:
            storable("purpose", purpose)
        except Bad as e:
            raise ApiError(400, str(e), param="purpose") from None
    cursor = owned_file(request, key, after) if after else None
    with request.app.state.config.Session() as s:
        rows = ledger.list_files(s, key.id, purpose=purpose, after=cursor, limit=limit + 1,
                                 newest_first=order == "desc")
    return page([file_object(row) for row in rows[:limit]], has_more=len(rows) > limit)


LEFTOVER_GRACE_S = 3600.0


def sweep_leftovers(Session, root, grace_s: float = LEFTOVER_GRACE_S) -> int:
    """Remove what a server killed mid-request left under <root>/files, older than grace_s:
    hidden temporary uploads (jobs.atomic_files's `.<name>.<hex>.tmp`) and published files that
    no ledger row names (killed between writing and registering). Returns the number removed."""
    directory = files_dir(root)
    if not directory.is_dir():
        return 0
    cutoff = time.time() - grace_s
    removed = 0
    for path in directory.iterdir():
        try:
            if not path.is_file() or path.stat().st_mtime > cutoff:
                continue
        except FileNotFoundError:
            continue
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            stale = True
        else:
            try:
                file_id = check_file_id(path.name.removesuffix(".jsonl"))
            except ValueError:
                continue   # not ours: leave it
            with Session() as s:
                stale = ledger.get_file(s, file_id) is None
        if stale:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def page(data: list[dict], *, has_more: bool) -> dict:
    """A cursor page (the openai client asks for the next one with after=last_id)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.get("/files/{file_id}")
def retrieve_file(request: Request, file_id: str, key: ledger.ApiKey = Depends(caller)):
    return file_object(owned_file(request, key, file_id))


@router.get("/files/{file_id}/content")
def file_content(request: Request, file_id: str, key: ledger.ApiKey = Depends(caller)):
    row = owned_file(request, key, file_id)
    # Opened before the response starts, and the handle kept: a file deleted meanwhile is
    # either served whole from it (POSIX keeps an unlinked open file) or not found, never cut.
    try:
        f = open(file_path(request.app.state.config.settings.data_dir, row.id), "rb")
    except FileNotFoundError:
        raise not_found("File", file_id) from None
    size = os.fstat(f.fileno()).st_size

    def chunks():   # streamed: a large output file is never held in memory
        with f:
            while data := f.read(_CHUNK):
                yield data
    return StreamingResponse(chunks(), media_type="application/octet-stream", headers={
        "Content-Length": str(size), "Content-Disposition": _attachment(row.filename)})


def _attachment(filename: str) -> str:
    """The Content-Disposition of a download, as Starlette's FileResponse writes it."""
    quoted = quote(filename)
    return f'attachment; filename="{filename}"' if quoted == filename else f"attachment; filename*=utf-8''{quoted}"


@router.delete("/files/{file_id}")
def delete_file(request: Request, file_id: str, key: ledger.ApiKey = Depends(caller)):
    config = request.app.state.config
    row = owned_file(request, key, file_id)
    with config.Session() as s:
        ledger.delete_file(s, row.id)
    file_path(config.settings.data_dir, row.id).unlink(missing_ok=True)
    return {"id": row.id, "object": "file", "deleted": True}
