"""A batch's output and error files, written once the batch has ended.

They are the export of `pipeline results --format openai` (jobs.results.openai_output), written the
first time anyone looks at the ended batch, under the data root like an upload, and
recorded as the job's files (purpose "batch_output", owned by the job's key), expiring
with the job's results (output_expires_after, anchored at the job's end: their created_at). Their ids are
derived from the job id, so two requests that both write them end with the same two rows.
"""
from __future__ import annotations

import hashlib

from jobs import ledger
from jobs.results.openai_output import PIPELINE_ENDPOINT, write_openai_files
from jobs.paths import JobPaths, file_path
from jobs.results.parquet_files import iter_job_rows

KINDS = ("output", "error")


def output_file_ids(Session, root, job) -> tuple[str | None, str | None]:
    """(output file id, error file id) of an ended job, writing the files the first time;
    None for a file without lines (OpenAI gives no file then). Every request has its line:
    the ones a cancel or an expiry left unrun are errors (batch_cancelled / batch_expired)."""
    ids = tuple(_file_id(job.id, kind) for kind in KINDS)
    with Session() as s:
        rows = ledger.files_of_job(s, job.id)
    if rows:   # written already; a file deleted (or expired) since stays deleted (its row is kept, marked)
        kept = {f.id for f in rows if f.deleted_at is None and not ledger.file_expired(f)}
        return tuple(file_id if file_id in kept else None for file_id in ids)
    expires_at = ledger.results_expire_at(job)   # output_expires_after: from the job's end
    if job.results_expired_at is not None or (expires_at is not None and expires_at <= ledger.utcnow()):
        return None, None   # its results are gone (or about to go: the recovery sweep deletes them)
    paths = [file_path(root, file_id) for file_id in ids]
    created = int((job.finished_at or job.created_at).timestamp())
    counts = write_openai_files(iter_job_rows(JobPaths(root, job.id), job.num_shards), *paths,
                                endpoint=job.endpoint or PIPELINE_ENDPOINT, model=job.model, created=created,
                                overwrite=True)
    with Session() as s:
        for kind, file_id, path, lines in zip(KINDS, ids, paths, counts):
            if lines:
                ledger.add_file(s, id=file_id, api_key_id=job.api_key_id, purpose="batch_output",
                                filename=f"{job.id}_{kind}.jsonl", bytes=path.stat().st_size, job_id=job.id,
                                expires_at=expires_at)
            else:
                path.unlink(missing_ok=True)
    return tuple(file_id if lines else None for file_id, lines in zip(ids, counts))


def _file_id(job_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{job_id}:{kind}".encode()).hexdigest()[:24]
