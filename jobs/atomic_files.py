"""Writing files so that a reader (or a crash) never sees half of one.

Every file the pipeline writes goes through here: `atomic_write` for a whole file
(written beside its final name, flushed to disk, then renamed over it), `write_durably`
for a file someone else renames later (a result attempt the ledger publishes),
`replace_durably` for that rename, and `SyncedFolder` for many new files of a folder that
is published whole (a job's input shards).

`atomic_write` writes user-named files too (exports), so it trusts nothing at the target:
its temporary file has a fresh, unpredictable name and is created exclusively (a link
planted there is never followed), and it only ever replaces a regular file: a device
node, a FIFO, a directory or a symbolic link at the target is refused (TargetRefused),
as is an existing file when overwrite=False (TargetExists).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class TargetRefused(ValueError):
    """A path atomic_write will not write; the message says why."""


class TargetExists(TargetRefused):
    """The target exists and overwrite=False."""


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
def atomic_write(path: str | os.PathLike, mode: str = "w", *, overwrite: bool = True) -> Iterator[IO]:
    """Write path whole or not at all: readers see the old file or the complete new one.

    Missing directories are made. The data goes to a new hidden file beside path, removed
    again on an error. Raises TargetRefused (before writing anything) unless path is
    missing or a regular file, and TargetExists if it exists and overwrite is False.
    """
    path = Path(path)
    check_target(path, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _create_temporary(path)
    try:
        with open(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path, overwrite)
    finally:
        tmp.unlink(missing_ok=True)


def check_target(path: str | os.PathLike, *, overwrite: bool = True) -> None:
    """Raise TargetRefused unless atomic_write(path, overwrite=overwrite) may write path."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise TargetRefused(f"{path} is {describe_file_type(st)}, not a regular file; it is never replaced")
    if not overwrite:
        raise TargetExists(f"{path} already exists")


def same_target(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same directory entry (so writing one replaces the other)."""
    a, b = Path(a).absolute(), Path(b).absolute()
    return (a.parent.resolve(), a.name) == (b.parent.resolve(), b.name)


class SyncedFolder:
    """New files written one after another into a folder and made durable together: each
    file is fsynced by a background thread while the next is written (an fsync waits on
    the disk, not the CPU: one each in turn cost a 1,000,000-line submit seconds), and the
    folder's entries once all are, on a clean exit (which raises the first failed fsync).
    For a folder that no reader sees until it is complete (published by replace_durably)."""

    _IN_FLIGHT = 64   # files written but not yet synced, at most

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fsync")
        self._pending: list[Future] = []

    @contextlib.contextmanager
    def create(self, name: str) -> Iterator[IO[bytes]]:
        """A new file of the folder, open for binary writing; removed again on an error."""
        path = self.directory / name
        f = open(path, "xb")
        try:
            yield f
            f.flush()
        except BaseException:
            f.close()
            path.unlink(missing_ok=True)
            raise
        self._pending.append(self._pool.submit(_sync_and_close, f))
        if len(self._pending) > self._IN_FLIGHT:
            self._pending.pop(0).result()

    def __enter__(self) -> "SyncedFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failure = None
        for future in self._pending:
            if (error := future.exception()) is not None and failure is None:
                failure = error
        self._pool.shutdown(wait=True)
        if exc_type is None:
            if failure is not None:
                raise failure
            sync_directory(self.directory)


def _sync_and_close(f: IO[bytes]) -> None:
    try:
        os.fsync(f.fileno())
    finally:
        f.close()


def replace_durably(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename src over dst and make the rename itself survive a crash (POSIX)."""
    os.replace(src, dst)
    sync_directory(Path(dst).parent)


def describe_file_type(st: os.stat_result) -> str:
    """What kind of file an (l)stat result is, for error messages ("a FIFO (named pipe)")."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISREG, "a regular file")):
        if test(st.st_mode):
            return kind
    return "not a regular file"


def _create_temporary(path: Path) -> tuple[Path, int]:
    # A fixed name (<out>.tmp) could be a link planted by someone else; a fresh random name
    # created with O_EXCL is ours alone. Mode 0o666 lets the umask decide, as for open().
    while True:
        tmp = path.with_name(f".{path.name[:100]}.{secrets.token_hex(8)}.tmp")
        try:
            return tmp, os.open(tmp, _CREATE_NEW, 0o666)
        except FileExistsError:
            continue


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    check_target(path, overwrite=overwrite)  # again: it may have been swapped while we wrote
    if overwrite:
        replace_durably(tmp, path)
        return
    try:
        os.link(tmp, path)  # unlike a rename, a link never replaces a file that appeared meanwhile
    except FileExistsError:
        raise TargetExists(f"{path} already exists") from None
    except OSError:  # a filesystem without hard links: the check above has to do
        os.replace(tmp, path)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # directories cannot be opened here (e.g. Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
