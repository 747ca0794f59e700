"""Commands that run the machinery: worker, recover, metrics, db upgrade, gc, bench."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from cli.errors import EXIT_USAGE, Fail
from cli.gpus import GPUS, NODE_NAME, chosen_gpus, supervise_workers
from cli.job_commands import check_broker, serve_metrics, sessions
from cli.options import engine_options, served_engine_options, settings_options


@click.command("worker")
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(min=1),
              help="Engine processes (prefork), each running one shard at a time; 1 (the default) "
                   "runs one engine in this process with --shards-in-flight shards sharing it.")
@click.option("--loglevel", default="info", show_default=True)
@GPUS
@NODE_NAME
@served_engine_options
@settings_options("broker_url", "shards_in_flight", "tokenizer_processes", "metrics_port", "log_format",
                  "cost_per_hour")
def worker_command(concurrency, loglevel, gpus, node_name, served_engines, settings):
    """Start a Celery worker that runs the shards of jobs for its engine, loaded at start-up.

    A worker serves one engine: --model DIR with the engine options given (the bundled
    model by default; or PIPELINE_WORKER_ENGINES). It consumes only that engine's queue,
    `<PIPELINE_QUEUE>.<engine key>` (the key `pipeline status` shows for a job: model, dtype,
    quantization and context length), so jobs for other models never make it reload.
    --device, the KV budget and the batch limits are the worker's own: they apply to every
    job it runs. --model A --model B serves both, one loaded at a time: it finishes the
    loaded model's queue before it switches.

    With one process, its shards in flight are Celery threads that feed one engine, so
    the next shard's requests run beside the last requests of the one finishing. It sends
    task events, so Flower (`celery -A workers.app flower`) shows every shard task.

    On a GPU machine it starts one worker per GPU (--gpus), each a process of its own pinned
    to its GPU, named <node>-gpu<N>, serving metrics on --metrics-port + N; it restarts one
    that dies, and on SIGTERM stops them all as one worker stops (exit 0 once all did).
    """
    if served_engines:
        settings = dataclasses.replace(settings, worker_engines=json.dumps(served_engines))
    gpu_list = chosen_gpus(gpus, settings.served_engine_options())
    if gpu_list:
        return supervise_workers(gpu_list, node_name, loglevel, settings)
    made_dir = None
    if concurrency > 1 and settings.metrics_port:
        made_dir = _metrics_across_processes()   # before anything imports prometheus_client
    if settings.log_format == "json":
        from workers.logs import log_to_stderr_as_json
        log_to_stderr_as_json()
    from workers.app import app, configure

    configure(settings)  # prefork children inherit it
    from workers import energy   # what each shard's energy and device time are charged from (and at what rate)
    energy.configure(settings, settings.served_engine_options()[0].get("device"), processes=concurrency)
    if concurrency > 1:
        pool, slots = "prefork", concurrency
        if settings.shards_in_flight > 1:
            logging.getLogger(__name__).warning(
                "--concurrency %d: %d engine processes, one shard each (--shards-in-flight applies to a "
                "single-process worker)", concurrency, concurrency)
    elif settings.shards_in_flight > 1:
        pool, slots = "threads", settings.shards_in_flight
    else:
        pool, slots = "solo", 1
    serve_metrics(settings)
    # Workers share nothing but the ledger: no gossip or mingle. Event heartbeats stay on so
    # that Flower sees the workers alive; --quiet drops the banner, which is not a log line.
    quiet = ["--quiet"] if settings.log_format == "json" else []
    named = [f"--hostname={node_name}"] if node_name else []
    try:
        app.worker_main([*quiet, "worker", f"--loglevel={loglevel}", f"--concurrency={slots}", f"--pool={pool}",
                         *named, "--without-gossip", "--without-mingle"])
    finally:
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)


def _metrics_across_processes() -> Path | None:
    """prometheus_client's multiprocess mode for this worker and the children it forks: each
    process writes its values to files in PROMETHEUS_MULTIPROC_DIR (a new temporary directory
    unless it is set), which the parent's endpoint adds up. Left-over files of an earlier run
    are removed: their values would count twice. Returns the directory if it made one."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before its multiprocess mode was chosen")
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    path = Path(given or tempfile.mkdtemp(prefix="pipeline-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return None if given else path


@click.command("recover")
@settings_options("max_attempts", "queued_grace_s", "broker_url")
def recover_command(settings):
    """One recovery pass (workers run it every PIPELINE_RECOVERY_INTERVAL s; use this from cron).

    Re-enqueues shards of dead workers and shards the broker lost, writes error rows for
    shards out of attempts, finalizes jobs left unfinished, and deletes the results and files
    past their keep (--keep, PIPELINE_KEEP_RESULTS, expires_after). Prints what it did as JSON.
    """
    from jobs import ledger
    from workers.recovery import recover_with_broker

    check_broker(settings)
    report = recover_with_broker(settings, ledger.open_sessions(settings.database_url))
    click.echo(json.dumps(report))
    if report["errors"]:
        raise Fail(f"{len(report['errors'])} recovery step(s) failed (see above)")


@click.command("metrics")
@click.option("--port", default=9401, show_default=True, type=click.IntRange(1, 65535),
              help="Serve at http://<host>:PORT/metrics.")
@click.option("--queue", "queues", multiple=True, metavar="QUEUE",
              help="A broker queue to report (repeatable)  [default: the queues of the default engine, of "
                   "the engines live workers serve and of the engines of the jobs not ended]")
@settings_options("broker_url")
def metrics_command(port, queues, settings):
    """Serve the ledger's and the broker's numbers for Prometheus until stopped.

    Shards waiting per queue, jobs by status, and for each job that has not ended its
    requests completed and failed and its shards by status, read at each scrape. Workers
    serve their own numbers (`pipeline worker --metrics-port`); scrape both.
    """
    import signal
    import threading

    from prometheus_client import start_http_server

    from jobs import ledger
    from workers.ledger_exporter import registry_for

    # Read-only: never migrates the ledger (a missing schema shows as pipeline_ledger_up 0).
    Session = ledger.session_factory(ledger.make_engine(settings.database_url))
    try:
        server, _ = start_http_server(port, registry=registry_for(settings, Session, queues))
    except OSError as e:
        raise Fail(f"cannot serve metrics on port {port}: {e}", EXIT_USAGE) from None
    click.echo(f"serving the ledger's and the broker's metrics at http://0.0.0.0:{port}/metrics", err=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # `docker stop`, a supervisor: a clean exit
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


@click.group("db")
def db_group():
    """The job ledger's schema."""


@db_group.command("upgrade")
@settings_options()
def db_upgrade_command(settings):
    """Migrate the ledger to the latest schema."""
    from jobs import ledger

    ledger.upgrade(settings.database_url)
    click.echo("the ledger schema is up to date")


def _age(ctx, param, value):
    """gc's age, read by the parser of the completion windows (jobs.scheduling); one too large
    to subtract from today is a usage error like a malformed one, never an OverflowError."""
    from jobs.scheduling import CENTURY, parse_duration
    try:
        return parse_duration(value, "an age", longest=CENTURY, longest_text=f"{CENTURY.days}d (a century)")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("gc")
@click.option("--older-than", required=True, callback=_age, metavar="AGE",
              help="Delete the results of jobs that ended longer ago than this, e.g. 30d, 12h (at most 36500d).")
@settings_options()
def gc_command(older_than, settings):
    """Delete old jobs' results and stats, and the index of their answers with them.

    Their ledger rows stay. Later jobs never take answers from deleted results: their
    requests are computed again. Prints the ids of the jobs whose results went, one a line.
    """
    from jobs.results.retention import collect_garbage

    deleted = collect_garbage(sessions(settings), settings.data_dir, older_than)
    for job_id in deleted:
        click.echo(job_id)
    click.echo(f"deleted the results of {len(deleted)} job(s)", err=True)


@click.command("bench")
@click.argument("requests", type=click.Path(exists=True, dir_okay=False))
@engine_options
def bench_command(requests, engine_options):
    """Time a workload file through the engine; prints one JSON line."""
    from jobs.atomic_files import describe_file_type
    from jobs.input.file_reading import open_regular_file
    from cli.bench import run_bench
    from pipeline.config import EngineConfig

    f, st = open_regular_file(requests)  # a FIFO or /dev/zero would hang the read
    if f is None:
        raise Fail(f"{requests} is {describe_file_type(st)}, not a regular file", EXIT_USAGE)
    f.close()
    try:
        result = run_bench(requests, EngineConfig(**engine_options))
    except ValueError as e:  # a bad workload line
        raise Fail(str(e), EXIT_USAGE) from None
    except RuntimeError as e:  # requests failed, or no GPU for --device cuda
        raise Fail(str(e)) from None
    click.echo(json.dumps(result))
