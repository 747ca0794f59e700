"""Turning an input file into a queued job: validate, write the input shards, record the job.

All or nothing: an invalid file raises jobs.spec.InvalidInput before anything exists, and
any later failure removes the job's directory again, so no half-created job is left.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger, spec
from jobs.paths import JobPaths, new_job_id


def create_job_from_file(
    Session: sessionmaker[Session], root, path, *, model: str, engine_options: dict,
    shard_size: int, limits: spec.Limits = spec.Limits(), metadata: dict | None = None,
) -> tuple[str, list[int]]:
    """Validate `path`, shard it under the data root and insert a queued job.

    Returns (job_id, requests per shard). Raises spec.InvalidInput (with every bad line)
    when the file has errors, creating nothing.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    # write_shards validates too, but it does not report the format and endpoint the job needs.
    validation = spec.validate(path, limits)
    if not validation.ok:
        raise spec.InvalidInput(validation)
    job_id = new_job_id()
    job_paths = JobPaths(root, job_id)
    try:
        shard_sizes = spec.write_shards(path, job_paths.input_dir, shard_size, limits)
        with Session() as s:
            ledger.create_job(
                s, job_id=job_id, model=model, engine_options=engine_options,
                input_format=validation.input_format, endpoint=validation.endpoint,
                input_path=str(Path(path).resolve()), results_path=str(job_paths.results_dir),
                shard_size=shard_size, shard_sizes=shard_sizes, metadata=metadata)
    except BaseException:
        shutil.rmtree(job_paths.dir, ignore_errors=True)
        raise
    return job_id, shard_sizes
