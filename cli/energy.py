"""`pipeline status`'s energy, device time and cost lines (workers.energy measures, jobs.ledger.usage sums)."""
from __future__ import annotations

NO_RATE = "not computed: a worker that ran it had no rate (`--cost-per-hour`, PIPELINE_COST_PER_HOUR)"


def energy_rows(job, usage: dict | None = None) -> list[tuple[str, str]]:
    """(field, value) rows: the job's figures once it ended, else `usage` (jobs.ledger.job_usage:
    its shards committed so far); where joules are null, why."""
    ended = job.finished_at is not None or usage is None
    figures = ({k: getattr(job, k) for k in ("joules", "device_seconds", "cost", "energy_unmeasured")} if ended
               else usage)
    joules, seconds, cost, why = (figures[k] for k in ("joules", "device_seconds", "cost", "energy_unmeasured"))
    so_far = "" if ended else " so far"
    if not ended and seconds is None:
        return [("energy", "none charged yet: no shard of it has committed")]
    if joules is not None:
        per_joule = f", {job.tokens_per_joule:.2f} tokens/J" if ended and job.tokens_per_joule is not None else ""
        energy = f"{joules:.1f} J{so_far}{per_joule}"
    else:
        energy = f"not measured ({why or 'nothing was recorded for it'})"
    rows = [("energy", energy)]
    if seconds is not None:
        rows.append(("device time", f"{seconds:.1f} device-s{so_far}"))
        rows.append(("cost", f"{cost:.6g}{so_far} (device-seconds at the workers' --cost-per-hour)"
                     if cost is not None else NO_RATE))
    return rows
