"""Reading an input file: regular files only, within the size limit, and its lines bounded in
length, streamed."""
from __future__ import annotations

import os
import stat
from typing import BinaryIO, Iterator

from jobs.atomic_files import describe_file_type
from jobs.input.validation import LineError, Limits

_SKIP_CHUNK = 1 << 20


def open_regular_file(path) -> tuple[BinaryIO | None, os.stat_result]:
    """Open path for reading if it is a regular file: (file, its stat); else (None, its stat).

    A FIFO or a device is never read: a FIFO blocks its reader until some writer comes and
    serves one pass only, /dev/zero never ends and has no newline, and their size reads 0.
    It is looked at before it is opened (opening a device can have effects) and again
    after (it could have been swapped), without blocking on a FIFO in between.
    """
    if not stat.S_ISREG((before := os.stat(path)).st_mode):
        return None, before
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        return None, opened
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), opened


def open_input(path, limits: Limits) -> tuple[BinaryIO | None, LineError | None]:
    """The input file opened for reading, or the file-level problem that refuses it."""
    f, st = open_regular_file(path)
    if f is None:
        return None, LineError(None, f"the input is {describe_file_type(st)}, not a regular file; give a file "
                                     "(or - to read standard input once)")
    if st.st_size > limits.max_file_bytes:
        f.close()
        return None, LineError(None, f"the input file is {st.st_size} bytes; the limit is {limits.max_file_bytes} bytes")
    return f, None


def read_lines(f: BinaryIO, max_bytes: int, first_line: int = 1, end: int | None = None,
               ) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line number, line without its newline), or None for a line over max_bytes, from
    f's position (line number first_line) up to byte `end` (a line start; None: the end).

    readline is bounded, so an over-long line is never held whole: it is skipped in chunks.
    """
    with f:
        number = first_line - 1
        left = None if end is None else end - f.tell()   # bytes of the range not read yet
        while (left is None or left > 0) and (chunk := f.readline(max_bytes + 1)):
            number += 1
            if left is not None:
                left -= len(chunk)
            if chunk.endswith(b"\n"):
                yield number, chunk[:-1]
            elif len(chunk) <= max_bytes:  # the last line, without a newline
                yield number, chunk
            else:
                while (rest := f.readline(_SKIP_CHUNK)):
                    if left is not None:
                        left -= len(rest)
                    if rest.endswith(b"\n"):
                        break
                yield number, None
