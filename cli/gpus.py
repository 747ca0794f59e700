"""`--gpus`: one engine per GPU, each in a child process pinned to it (workers/supervisor.py says
why children are exec'd, never forked). `pipeline worker` starts a worker child per GPU;
`pipeline run` a `pipeline resume` child per GPU over the job it made (data parallel: they
share its shards through the ledger's leases, as workers do).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

import click

from cli.errors import EXIT_JOB_NOT_COMPLETED, EXIT_USAGE, Fail
from jobs.settings import Settings, env_var

GPUS = click.option(
    "--gpus", metavar="all|N|0,2,5|none",
    help="One engine per GPU, each in a process of its own pinned to its GPU (CUDA_VISIBLE_DEVICES): all, "
         "a count (the first N), or a list (GPU 3 alone: `3,`), numbered as this process sees them; none: "
         "one engine in this process, on --device. On a CPU (no GPU visible) a count or list with "
         "--device cpu starts that many CPU engines, each still pinned by number.  [default: every "
         "visible GPU; none without a GPU or with --device cpu]")

NODE_NAME = click.option(
    "-n", "--node-name", metavar="NAME",
    help="The Celery node name, unique per worker (Flower, the shards' worker column, the metrics' worker "
         "label)  [default: celery@<host>; with --gpus, <name>-gpu<N> for GPU N's worker]")


def chosen_gpus(spec: str | None, engines: list[dict]) -> list:
    """The GPUs `--gpus spec` names for these engines' options ([]: this process alone)."""
    from workers.devices import choose_gpus

    on_cpu = bool(engines) and all(e.get("device") == "cpu" for e in engines)
    try:
        return choose_gpus(spec, on_cpu=on_cpu)
    except ValueError as e:
        raise Fail(str(e), EXIT_USAGE) from None


def _check_ports(base: int, gpus: list) -> None:
    """GPU N's child serves metrics on base + N (so two supervisors on one node, say GPUs 0-3
    and 4-7, share a base port without colliding)."""
    if base and base + max(g.index for g in gpus) > 65535:
        raise Fail(f"--metrics-port {base}: GPU {max(g.index for g in gpus)}'s port would pass 65535", EXIT_USAGE)


def _launcher() -> tuple[list[str], list[str]]:
    from workers.supervisor import this_command

    try:
        return this_command()
    except RuntimeError as e:
        raise Fail(str(e), EXIT_USAGE) from None


def _child_env(gpu) -> dict[str, str]:
    """Our environment, CUDA_VISIBLE_DEVICES naming the child's GPU; prometheus_client's
    multiprocess directory, if one is set, a subdirectory per child (each child's port adds up
    its own processes only, and clears only its own stale files)."""
    from workers.supervisor import child_environment

    env = child_environment(dict(os.environ), gpu.visible)
    if env.get("PROMETHEUS_MULTIPROC_DIR"):
        own = Path(env["PROMETHEUS_MULTIPROC_DIR"]) / f"gpu{gpu.index}"
        own.mkdir(parents=True, exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(own)
    return env


def _log_supervisor(loglevel: str, log_format: str) -> None:
    if log_format == "json":
        from workers.logs import log_to_stderr_as_json, set_node
        set_node(f"supervisor@{socket.gethostname()}")
        log_to_stderr_as_json(getattr(logging, loglevel.upper(), logging.INFO))
    else:
        logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s: %(levelname)s/supervisor] %(message)s")


def supervise_workers(gpus: list, node_name: str | None, loglevel: str, settings: Settings) -> None:
    """`pipeline worker --gpus`: this command again per GPU, pinned, as a plain worker (`--gpus
    none`) named <node>-gpu<N> and serving metrics on base + N; restarted when it dies; on
    SIGTERM or Ctrl-C each gets one SIGTERM (warm shutdown: its shards are released at the next
    engine step), a second signal sends SIGQUIT (Celery's cold shutdown). Returns once every
    child exited 0 after a stop; Fail (exit 1) after a crash loop or an unclean exit."""
    from workers.supervisor import ChildSpec, Supervisor, describe_exit

    _check_ports(settings.metrics_port, gpus)
    launcher, args = _launcher()
    node = node_name or f"celery@{socket.gethostname()}"
    specs = []
    for gpu in gpus:
        extra = ["--gpus", "none", "--node-name", f"{node}-gpu{gpu.index}"]   # the last of an option wins
        if settings.metrics_port:
            extra += ["--metrics-port", str(settings.metrics_port + gpu.index)]
        specs.append(ChildSpec(f"gpu{gpu.index}", [*launcher, *args, *extra], _child_env(gpu)))
    _log_supervisor(loglevel, settings.log_format)
    logging.getLogger(__name__).info("one worker per GPU: %s", ", ".join(
        f"{s.name} (CUDA_VISIBLE_DEVICES={s.env['CUDA_VISIBLE_DEVICES']})" for s in specs))
    outcome = Supervisor(specs, restart=lambda spec, rc: True).run()
    if outcome.gave_up:
        raise Fail(f"gave up: {outcome.gave_up}; the other workers were stopped")
    if not outcome.clean:
        raise Fail("not every worker stopped cleanly: " + ", ".join(
            f"{name} {describe_exit(rc)}" for name, rc in outcome.returncodes.items() if rc != 0))


def gpus_for_run(spec: str | None, engine_options: dict, settings: Settings) -> list:
    """`pipeline run --gpus spec`: the GPUs to start a child for, [] to run in this process
    (no GPU chosen, or only the first visible one: cuda:0 already, a child would only cost its
    start), in which case this process serves the metrics (PIPELINE_METRICS_PORT), as before."""
    from cli.job_commands import serve_metrics

    gpus = chosen_gpus(spec, [engine_options])
    if not gpus or (len(gpus) == 1 and gpus[0].index == 0):
        serve_metrics(settings)
        return []
    _check_ports(settings.metrics_port, gpus)
    return gpus


def run_on_gpus(Session, settings: Settings, job_id: str, gpus: list) -> None:
    """`pipeline run --gpus`: a `pipeline resume JOB` child per GPU, pinned; they share the
    job's shards through their leases, as workers do, so the results are the one job's. A
    child killed (OOM, SIGKILL) is started again while the job runs; its shards are taken
    over once their lease expires. Ctrl-C or SIGTERM cancels the job in the ledger, so every
    child stops at its next step and commits what finished (a second one sends them SIGTERM).
    A progress bar follows the ledger; each child's output goes to a log file, kept and named
    unless the job completed."""
    import shutil
    import tempfile

    from jobs import ledger
    from jobs.ledger.statuses import JobStatus
    from cli import render
    from cli.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
    from workers.supervisor import ChildSpec, Supervisor

    launcher, _ = _launcher()
    logs = Path(tempfile.mkdtemp(prefix=f"pipeline-{job_id}-"))
    # Our settings reach the children in their environment (a ledger URL's password stays out of `ps`)
    ours = {"data_dir": str(settings.data_dir), "database_url": settings.database_url,
            "shards_in_flight": str(settings.shards_in_flight),
            "tokenizer_processes": str(settings.tokenizer_processes),
            **({"cost_per_hour": str(settings.cost_per_hour)} if settings.cost_per_hour is not None else {})}
    specs = [ChildSpec(f"gpu{g.index}", [*launcher, "resume", job_id, "--gpus", "none"],
                       {**_child_env(g), **{env_var(name): value for name, value in ours.items()},
                        env_var("metrics_port"): str(settings.metrics_port + g.index if settings.metrics_port else 0)},
                       logs / f"gpu{g.index}.log") for g in gpus]

    def job():
        with Session() as s:
            return ledger.get_job(s, job_id)

    def cancel() -> None:
        with Session() as s:
            ledger.request_cancel(s, job_id)

    click.echo(f"job {job_id}: one engine per GPU ({', '.join(s.name for s in specs)}); their logs: {logs}", err=True)
    supervisor = Supervisor(specs, restart=lambda spec, rc: rc < 0 and job().finished_at is None,
                            stop_steps=(cancel, signal.SIGTERM))
    first = job()
    bar = render.Progress(first.total_requests)
    with bar:
        outcome = supervisor.run(tick=_every(1.0, lambda: bar.set((j := job()).completed_requests + j.failed_requests,
                                                                  j.failed_requests)))
    ended = job()
    if outcome.stop_signal is not None:
        how, code = ("terminated (SIGTERM)", EXIT_TERMINATED) if outcome.stop_signal == signal.SIGTERM else \
            ("interrupted", EXIT_INTERRUPTED)
        raise Fail(f"{how}: job {job_id} {ended.status} with {ended.completed_requests} of {ended.total_requests} "
                   f"requests answered; `pipeline retry {job_id} --local` runs the rest (logs: {logs})", code)
    if outcome.gave_up or ended.finished_at is None:
        why = outcome.gave_up or "its processes ended before it did"
        rest = (f"`pipeline resume {job_id}` finishes it here" if ended.finished_at is None else
                f"it ended {ended.status}; `pipeline retry {job_id} --local` runs the rest")
        raise Fail(f"job {job_id} did not finish: {why} (logs: {logs}); {rest}", EXIT_JOB_NOT_COMPLETED)
    render.print_summary(ended)
    if ended.status != JobStatus.COMPLETED:
        raise Fail(f"job {job_id} ended {ended.status} (logs: {logs})", EXIT_JOB_NOT_COMPLETED)
    shutil.rmtree(logs, ignore_errors=True)


def _every(seconds: float, action):
    """action, called at most once every `seconds` however often the result is."""
    import time
    last = [0.0]

    def call() -> None:
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            action()
    return call
