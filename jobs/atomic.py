"""Writing files so that a reader (or a crash) never sees half of one.

Every file the pipeline writes goes through here: `atomic_write` for a whole file
(written beside its final name, flushed to disk, then renamed over it), `write_durably`
for a file someone else renames later (a result attempt the ledger publishes), and
`replace_durably` for that rename.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def write_durably(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open path for writing (its directory made if needed); fsync it on a clean exit."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode, encoding=None if "b" in mode else "utf-8") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Write path whole or not at all: readers see the old file or the complete new one.

    The data goes to a hidden temporary name beside path, removed again on an error.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with write_durably(tmp, mode) as f:
            yield f
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_durably(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename src over dst and make the rename itself survive a crash (POSIX)."""
    os.replace(src, dst)
    try:
        fd = os.open(Path(dst).parent, os.O_RDONLY)
    except OSError:  # directories cannot be opened here (e.g. Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
