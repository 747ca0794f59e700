"""Running a job in this process, or watching one the workers run: progress bars, exit codes."""
from __future__ import annotations

import time


from jobs.settings import Settings
from jobs.ledger.statuses import JobStatus
from cli import render
from cli.errors import EXIT_INTERRUPTED, EXIT_JOB_NOT_COMPLETED, EXIT_TERMINATED, Fail


def run_here(Session, settings: Settings, job_id: str, engine_options: dict, gpus: list = ()) -> None:
    """Run a job's shards in this process until it ends, with a progress bar and a summary;
    with gpus (cli.gpus.gpus_for_run), in one child process per GPU instead.

    Ctrl-C or SIGTERM stop it at the next engine step: the job is cancelled, what finished is kept.
    """
    from jobs import ledger
    from workers import local_run

    if gpus:
        from cli.gpus import run_on_gpus
        return run_on_gpus(Session, settings, job_id, list(gpus))

    root = settings.data_dir
    with Session() as s:
        job = ledger.get_job(s, job_id)
    from workers import energy   # the meter of this process's device, the rate (--cost-per-hour)
    energy.configure(settings, (engine_options or {}).get("device"))
    bar = render.Progress(job.total_requests)
    try:
        with local_run.sigterm_as_interrupt(), local_run.cancelled_on_interrupt(Session, root, job_id):
            with bar as advance:
                bar.set(job.completed_requests + job.failed_requests, job.failed_requests)
                job = local_run.run_job(Session, root, job_id, engine_options,
                                        shards_in_flight=settings.shards_in_flight, lease_s=settings.lease_s,
                                        on_result=lambda row: row["choice"] or advance(row["finish_reason"]),  # a request's first answer
                                        on_wait=WaitNotes(bar), tokenizer_processes=settings.tokenizer_processes)
    except local_run.EngineDidNotStart as e:
        raise Fail(f"job {job_id} failed: {e}", EXIT_JOB_NOT_COMPLETED) from None
    except KeyboardInterrupt as e:
        with Session() as s:
            job = ledger.get_job(s, job_id)
        how, code = ("terminated (SIGTERM)", EXIT_TERMINATED) if isinstance(e, local_run.Terminated) else \
            ("interrupted", EXIT_INTERRUPTED)
        raise Fail(f"{how}: job {job_id} {job.status} with {job.completed_requests} of {job.total_requests} "
                   f"requests answered; `pipeline retry {job_id} --local` runs the rest", code) from None
    render.print_summary(job)
    if job.status != JobStatus.COMPLETED:
        raise Fail(f"job {job_id} ended {job.status}", EXIT_JOB_NOT_COMPLETED)


class WaitNotes:
    """run_job's on_wait: say once which shards are left to the live processes holding them."""

    def __init__(self, bar: render.Progress):
        self.bar, self.said = bar, None

    def __call__(self, job, held) -> None:
        self.bar.set(job.completed_requests + job.failed_requests, job.failed_requests)  # their commits
        said = [(sh.index, sh.attempt) for sh in held]
        if held and said != self.said:
            self.bar.note("; ".join(f"shard {sh.index} is held by {sh.worker} (lease until "
                                    f"{sh.lease_expires_at:%H:%M:%S} UTC)" for sh in held)
                          + ": each is left to its holder, and taken over here if its lease expires")
        self.said = said


def wait_until_completed(Session, job_id: str, poll_s: float = 1.0) -> None:
    """Show a job's progress from the ledger until it ends; Fail unless it completed."""
    from jobs import ledger

    with Session() as s:
        total = ledger.get_job(s, job_id).total_requests
    bar = render.Progress(total)
    with bar:
        while True:
            with Session() as s:
                job = ledger.get_job(s, job_id)
            bar.set(job.completed_requests + job.failed_requests, job.failed_requests)
            if job.status in JobStatus.terminal():
                break
            time.sleep(poll_s)
    if job.status != JobStatus.COMPLETED:
        raise Fail(f"job {job_id} ended {job.status}", EXIT_JOB_NOT_COMPLETED)
