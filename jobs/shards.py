"""Input shard files: one writer for a new job's shards and for a retry's, and the reader.

A shard file holds up to shard_size request lines (RequestSpec.to_dict() as JSON), in
input order; each is written atomically, so a shard file is always complete.
"""
from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from jobs.atomic import atomic_write
from jobs.paths import JobPaths, input_shard_name
from jobs.spec import InvalidInput, Limits, RequestSpec, Scan, Validation


_encode = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode


def check_shard_size(shard_size: int) -> None:
    """ValueError unless a shard holds at least one request (the one check, before anything is made)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")


def write_shards(lines: Iterable[str], shard_dir: str | Path, shard_size: int) -> list[int]:
    """Write JSON lines (without their newline) into shard_dir, shard_size a shard; the sizes.

    Streaming: one shard's lines at a time are open, never the whole input. An exception
    raised by `lines` leaves the shard being written absent.
    """
    check_shard_size(shard_size)
    lines = iter(lines)
    sizes: list[int] = []
    while (first := next(lines, None)) is not None:
        with atomic_write(Path(shard_dir) / input_shard_name(len(sizes))) as f:
            n = 0
            for line in itertools.chain([first], itertools.islice(lines, shard_size - 1)):
                f.write(line + "\n")
                n += 1
        sizes.append(n)
    return sizes


def write_input_shards(path, shard_dir: str | Path, shard_size: int, limits: Limits = Limits(), *,
                       model: str | tuple[str, ...] | None = None,
                       key_of: Callable[[dict], str | None] | None = None) -> tuple[Validation, list[int]]:
    """Validate the input file `path` (against the job's `model`) and shard it, in one
    streaming pass; returns the validation and the shard sizes. key_of(line): the request
    key each shard line gets (jobs.request_key; None: the line has none).

    The shards are written into a hidden folder beside shard_dir, renamed to shard_dir
    only once the whole file is valid: InvalidInput (the file has an error) or any other
    failure leaves no shard_dir and no folder.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    shard_dir = Path(shard_dir)
    shard_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{shard_dir.name}.", suffix=".partial", dir=shard_dir.parent))
    try:
        scan = Scan(path, limits, model=model)
        sizes = write_shards((_encode(_keyed(spec.to_dict(), key_of)) for spec in scan), partial, shard_size)
        if not scan.validation.ok:
            raise InvalidInput(scan.validation)
        partial.rename(shard_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return scan.validation, sizes


def _keyed(line: dict, key_of) -> dict:
    if key_of is not None and (key := key_of(line)) is not None:
        line["key"] = key
    return line


def write_retry_shards(old: JobPaths, num_shards: int, wanted: Callable[[str], bool], shard_dir: str | Path,
                       shard_size: int) -> list[int]:
    """Copy the old job's shard lines whose id is wanted, in input order, into new shards."""
    def lines():
        for index in range(num_shards):
            with open(old.input_shard(index), encoding="utf-8") as f:
                for line in f:
                    if line.strip() and wanted(json.loads(line)["id"]):
                        yield line.rstrip("\n")

    return write_shards(lines(), shard_dir, shard_size)


def read_shard(path) -> list[RequestSpec]:
    """The requests of one shard file."""
    with open(path, encoding="utf-8") as f:
        return [RequestSpec.from_dict(json.loads(line)) for line in f if line.strip()]
