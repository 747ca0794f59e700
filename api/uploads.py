"""A multipart upload streamed straight to its place under the data root, at most N bytes.

Starlette's own form parser spools files into the system's temporary directory; this one
writes the file part through jobs.atomic.atomic_write to its final path (a hidden temporary
name beside it until the upload is complete), so nothing is ever written outside the data
root, and stops as soon as the file part passes the limit (the partial file is removed). A
request whose Content-Length already says it is too big is refused before a byte is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from api.errors import ApiError
from jobs.atomic import atomic_write

_MAX_FIELD_BYTES = 64 * 1024   # the form's other fields (purpose) are short words
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
    with atomic_write(dest, "wb") as out:
        part = _Part()

        def on_part_begin():
            part.reset()

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
                part.is_file = True
                upload.filename = disposition.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")

        def on_part_data(data, start, end):
            chunk = data[start:end]
            if part.is_file:
                upload.size += len(chunk)
                if upload.size > max_bytes:
                    raise _TooBig
                out.write(chunk)
            else:
                part.value += chunk
                if len(part.value) > _MAX_FIELD_BYTES:
                    raise ApiError(400, f"form field {part.name!r} is too long")

        def on_part_end():
            if not part.is_file and part.name:
                upload.fields[part.name] = part.value.decode("utf-8", "replace")

        parser = MultipartParser(params[b"boundary"], {
            "on_part_begin": on_part_begin, "on_header_field": on_header_field,
            "on_header_value": on_header_value, "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end})
        try:
            async for chunk in request.stream():
                parser.write(chunk)
            parser.finalize()
        except _TooBig:
            raise too_big(max_bytes) from None   # atomic_write removes what was written
        except ApiError:
            raise
        except Exception as e:   # python_multipart's parse errors
            raise ApiError(400, f"malformed multipart upload: {e}", param="file") from None
        if upload.filename is None:
            raise ApiError(400, f"the upload has no {file_field!r} part", param=file_field)
    return upload


class _Part:
    def __init__(self):
        self.reset()

    def reset(self):
        self.headers, self.header_name, self.header_value = {}, b"", b""
        self.name, self.is_file, self.value = "", False, b""
