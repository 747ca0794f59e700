"""Input shard files: the format of a line, one writer for a new job's shards and for a
retry's, and the reader.

A shard file holds up to shard_size request lines (RequestSpec.to_dict() as JSON), in
input order; each is written atomically, so a shard file is always
complete. A new job's shards are written by the pass that validates its file (jobs.input.file_scan).
"""
from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from jobs.atomic_files import SyncedFolder, replace_durably
from jobs.paths import JobPaths, input_shard_name
from jobs.input.line_checks import RequestSpec

_encode = msgspec.json.Encoder().encode   # C speed: a 1,000,000-line file makes 1,000,000 of these
_decode = msgspec.json.Decoder().decode


def check_shard_size(shard_size: int) -> None:
    """ValueError unless a shard holds at least one request (the one check, before anything is made)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")


def write_shards(lines: Iterable[bytes], shard_dir: str | Path, shard_size: int) -> list[int]:
    """Write JSON lines (bytes without their newline) into shard_dir, shard_size a shard; the sizes.

    Streaming: one shard's lines at a time are held, never the whole input. shard_dir is a
    new folder that nobody reads before it is complete (it is published whole, or belongs
    to a job not made yet); its files are on disk when this returns. An exception raised
    by `lines` leaves the shard being written absent.
    """
    check_shard_size(shard_size)
    lines = iter(lines)
    sizes: list[int] = []
    with SyncedFolder(shard_dir) as folder:
        while shard := list(itertools.islice(lines, shard_size)):
            with folder.create(input_shard_name(len(sizes))) as f:
                shard.append(b"")   # each line ends with a newline, the last too
                f.write(b"\n".join(shard))
            sizes.append(len(shard) - 1)
    return sizes


def group_by_model(shard_dir: str | Path, num_shards: int, model_of: Callable[[str | None], int], num_models: int,
                   shard_size: int) -> tuple[list[int], list[int]]:
    """Rewrite a job of several models' shards so that each holds the lines of one model: model 0's
    lines first, in input order, then model 1's, ...; model_of: a line's `model` -> its model's index.
    Returns (the new shards' sizes, each one's model index). The new shards are written beside
    shard_dir and replace it whole (one pass over the shards per model: no line is held)."""
    shard_dir = Path(shard_dir)
    grouped = Path(tempfile.mkdtemp(prefix=f".{shard_dir.name}.", suffix=".grouped", dir=shard_dir.parent))
    sizes: list[int] = []
    models: list[int] = []
    try:
        with SyncedFolder(grouped) as folder:
            for model in range(num_models):
                def lines():
                    for index in range(num_shards):
                        with open(shard_dir / input_shard_name(index), "rb") as f:
                            for line in f:
                                if line.strip() and model_of(json.loads(line).get("model")) == model:
                                    yield line.rstrip(b"\n")

                new = _write_into(folder, lines(), shard_size, len(sizes))
                sizes += new
                models += [model] * len(new)
        ungrouped = grouped.with_suffix(".ungrouped")   # a folder is not renamed over a full one
        shard_dir.rename(ungrouped)
        replace_durably(grouped, shard_dir)
        shutil.rmtree(ungrouped)
    finally:
        shutil.rmtree(grouped, ignore_errors=True)
    return sizes, models


def _write_into(folder: SyncedFolder, lines: Iterable[bytes], shard_size: int, first: int) -> list[int]:
    """write_shards' loop: shards numbered from `first` into an open folder."""
    lines = iter(lines)
    sizes: list[int] = []
    while shard := list(itertools.islice(lines, shard_size)):
        with folder.create(input_shard_name(first + len(sizes))) as f:
            shard.append(b"")
            f.write(b"\n".join(shard))
        sizes.append(len(shard) - 1)
    return sizes


def shard_line(line: dict) -> bytes:
    """A request line (jobs.input.request_spec.request_line) as written to its shard."""
    return _encode(line)


def write_retry_shards(old: JobPaths, num_shards: int, wanted: Callable[[str], bool], shard_dir: str | Path,
                       shard_size: int) -> list[int]:
    """Copy the old job's shard lines whose id is wanted, in input order, into new shards."""
    def lines():
        for index in range(num_shards):
            with open(old.input_shard(index), "rb") as f:
                for line in f:
                    if line.strip() and wanted(json.loads(line)["id"]):
                        yield line.rstrip(b"\n")

    return write_shards(lines(), shard_dir, shard_size)


def read_shard_lines(path) -> list[dict]:
    """The lines of one shard file as written (by the scan, each its request's
    RequestSpec.to_dict(); a retry's are its old job's lines, copied): what a request's answer
    key is made of (jobs.reuse.answer_key), the submit's and the worker's alike. Read by
    msgspec, which wrote them: 0.8 us a chat line against json's 3.5."""
    with open(path, "rb") as f:
        return [_decode(line) for line in f if line.strip()]


def read_shard(path) -> list[RequestSpec]:
    """The requests of one shard file."""
    return [RequestSpec.from_dict(line) for line in read_shard_lines(path)]
