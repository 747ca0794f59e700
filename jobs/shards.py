"""Input shard files: one writer for a new job's shards and for a retry's, and the reader.

A shard file holds up to shard_size request lines (RequestSpec.to_dict() as JSON), in
input order; each is written atomically, so a shard file is always complete.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from jobs.atomic import atomic_write
from jobs.paths import JobPaths, input_shard_name
from jobs.spec import InvalidInput, LineError, Limits, RequestSpec, Validation, iter_lines, validate


def write_shards(lines: Iterable[str], shard_dir: str | Path, shard_size: int) -> list[int]:
    """Write JSON lines (without their newline) into shard_dir, shard_size a shard; the sizes.

    Streaming: one shard's lines at a time are open, never the whole input. An exception
    raised by `lines` leaves the shard being written absent.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
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
                       model: str | None = None) -> list[int]:
    """Validate the input file `path` (against the job's `model`), then shard it; the sizes.

    Raises InvalidInput (writing nothing) if the file has any error.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    validation = validate(path, limits, model=model)
    if not validation.ok:
        raise InvalidInput(validation)

    def lines():
        for _, item in iter_lines(path, limits, model=model):
            if isinstance(item, LineError):  # the file changed after validation
                raise InvalidInput(Validation(0, [item], 1, validation.input_format, validation.endpoint))
            yield json.dumps(item.to_dict(), ensure_ascii=False)

    return write_shards(lines(), shard_dir, shard_size)


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
