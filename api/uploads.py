"""A multipart upload streamed straight to its place under the data root, at most N bytes.

Starlette's own form parser spools files into the system's temporary directory; this one
writes the file part through jobs.atomic_files.atomic_write to its final path (a hidden temporary
name beside it until the upload is complete), so nothing is ever written outside the data
root, and stops as soon as the file part passes the limit (the partial file is removed). A
request whose Content-Length already says it is too big is refused before a byte is read.

Strict, so that what is registered is exactly what the client sent: the form must end with
its closing boundary (a body cut short, by the client or by a Content-Length shorter than
what was sent, is refused: python_multipart's finalize() does not check this itself), it
has exactly one file part, and everything else in it (the other fields, part headers,
boundaries) is limited in size and count, whatever the transfer encoding. A file name the
ledger could not store (a NUL) is refused before a byte of the file is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from api.errors import ApiError
from jobs.atomic_files import atomic_write
from jobs.input.field_checks import Bad, storable

_MAX_FIELD_BYTES = 64 * 1024   # the form's other fields (purpose) are short words: all of them together
_MAX_PARTS = 16
_FORM_OVERHEAD = 64 * 1024     # boundaries and part headers around the file


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0


class _TooBig(Exception):
    pass


def too_big(max_bytes: int) -> ApiError:
    return ApiError(413, f"the file is larger than the upload limit of {max_bytes} bytes "
                         "(PIPELINE_MAX_UPLOAD_BYTES, `pipeline serve --max-upload-bytes`)",
                    code="file_too_large", param="file")


async def receive_upload(request: Request, dest: Path, max_bytes: int, file_field: str = "file") -> Upload:
    """Parse the request's multipart form: the part named file_field is written to dest
    (whole or not at all), the other parts are returned as fields. Raises ApiError 413 if
    the file is over max_bytes, 400 for a malformed form or one without the file."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise ApiError(400, "the upload must be multipart/form-data", param="file")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes + _FORM_OVERHEAD:
        raise too_big(max_bytes)
    upload = Upload()
    form = _Form()
    with atomic_write(dest, "wb") as out:
        part = _Part()

        def on_part_begin():
            part.reset()
            form.parts += 1
            if form.parts > _MAX_PARTS:
                raise ApiError(400, f"the form has more than {_MAX_PARTS} parts", param="file")

        def on_header_field(data, start, end):
            part.header_name += data[start:end]

        def on_header_value(data, start, end):
            part.header_value += data[start:end]

        def on_header_end():
            part.headers[part.header_name.decode("latin-1").lower()] = part.header_value
            part.header_name, part.header_value = b"", b""

        def on_headers_finished():
            _, disposition = parse_options_header(part.headers.get("content-disposition", b""))
            part.name = disposition.get(b"name", b"").decode("utf-8", "replace")
            if part.name == file_field:
                if upload.filename is not None:
                    raise ApiError(400, f"the form has more than one {file_field!r} part; upload one file a request",
                                   param=file_field)
                part.is_file = True
                upload.filename = disposition.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
                try:   # the ledger keeps the name (a NUL: PostgreSQL's text cannot hold one)
                    storable("the file's name", upload.filename)
                except Bad as e:
                    raise ApiError(400, f"{e}; rename the file", param=file_field) from None

        def on_part_data(data, start, end):
            chunk = data[start:end]
            if part.is_file:
                upload.size += len(chunk)
                if upload.size > max_bytes:
                    raise _TooBig
                out.write(chunk)
            else:
                part.value += chunk
                form.field_bytes += len(chunk)
                if form.field_bytes > _MAX_FIELD_BYTES:
                    raise ApiError(413, f"the form's fields other than {file_field!r} are larger than "
                                        f"{_MAX_FIELD_BYTES} bytes", code="request_too_large")

        def on_part_end():
            if not part.is_file and part.name:
                upload.fields[part.name] = part.value.decode("utf-8", "replace")

        def on_end():
            form.complete = True

        parser = MultipartParser(params[b"boundary"], {
            "on_part_begin": on_part_begin, "on_header_field": on_header_field,
            "on_header_value": on_header_value, "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end,
            "on_end": on_end})   # (no max_size: python_multipart drops what is past it silently)
        try:
            async for chunk in request.stream():
                form.body_bytes += len(chunk)
                if form.body_bytes > max_bytes + _FORM_OVERHEAD + _MAX_FIELD_BYTES:
                    raise _TooBig
                parser.write(chunk)
            parser.finalize()
            if not form.complete:
                raise ApiError(400, "the upload is incomplete: the form ended before its closing boundary (the "
                                    "body was cut short, or is shorter than its Content-Length); nothing was kept",
                               code="incomplete_upload", param="file")
        except _TooBig:
            raise too_big(max_bytes) from None   # atomic_write removes what was written
        except ApiError:
            raise
        except Exception as e:   # python_multipart's parse errors
            raise ApiError(400, f"malformed multipart upload: {e}", param="file") from None
        if upload.filename is None:
            raise ApiError(400, f"the upload has no {file_field!r} part", param=file_field)
    return upload


@dataclass
class _Form:
    parts: int = 0
    field_bytes: int = 0
    body_bytes: int = 0
    complete: bool = False   # the closing boundary was seen


class _Part:
    def __init__(self):
        self.reset()

    def reset(self):
        self.headers, self.header_name, self.header_value = {}, b"", b""
        self.name, self.is_file, self.value = "", False, b""
