"""`pipeline metrics`: what only the ledger and the broker know, for Prometheus.

Workers export what they do (workers.metrics); this exporter adds the view from outside
them, read at each scrape: shards waiting in each broker queue, jobs by status, and for
each job that has not ended its requests and shards so far. Job ids label only these few
per-job series, which vanish once a job ends. A ledger or broker that does not answer
makes its `*_up` gauge 0 rather than failing the scrape.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.settings import Settings
from workers import broker

log = logging.getLogger(__name__)


class LedgerAndBrokerCollector:
    """A prometheus_client collector that reads the ledger and the broker when scraped."""

    def __init__(self, settings: Settings, Session: sessionmaker[Session], queues: Iterable[str] = ()):
        self.settings, self.Session = settings, Session
        self.queues = tuple(queues)   # none given: the queues of the engines served or asked for

    def collect(self) -> Iterator[Metric]:
        yield from self._broker()
        yield from self._ledger()

    def _broker(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pipeline_broker_up", "1 if the broker answered this scrape.")
        waiting = GaugeMetricFamily("pipeline_queue_messages",
                                    "Shard messages waiting in a broker queue (not yet delivered).", labels=["queue"])
        try:
            for queue in self.queues or self._engine_queues():
                waiting.add_metric([queue], broker.backlog(self.settings, queue))
            up.add_metric([], 1)
        except Exception as e:
            log.warning("metrics: reading the broker failed: %s", _first_line(e))
            up.add_metric([], 0)
            yield up
            return
        yield up
        yield waiting

    def _engine_queues(self) -> list[str]:
        """The default engine's queue, those of the engines live workers serve (an idle
        model's queue reads 0, not nothing) and those of the jobs that have not ended."""
        from pipeline.engine_key import engine_key
        keys = {engine_key({}), *broker.served_engine_keys(self.settings)}
        try:
            with self.Session() as s:
                keys.update(ledger.live_engine_keys(s))
        except Exception as e:   # the ledger's own gauge says so
            log.warning("metrics: reading the engine keys failed: %s", _first_line(e))
        return sorted(self.settings.queue_for(key) for key in keys)

    def _ledger(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pipeline_ledger_up", "1 if the ledger answered this scrape.")
        try:
            with self.Session() as s:
                by_status = ledger.jobs_by_status(s)
                live = ledger.live_jobs(s)
                shards = ledger.live_shards_by_status(s)
        except Exception as e:
            log.warning("metrics: reading the ledger failed: %s", _first_line(e))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily("pipeline_jobs", "Jobs in the ledger by status.", labels=["status"])
        for status, n in by_status.items():
            jobs.add_metric([status], n)
        yield jobs
        per_job = {
            "total_requests": GaugeMetricFamily("pipeline_job_requests", "Requests of a job that has not ended.",
                                                labels=["job_id"]),
            "completed_requests": GaugeMetricFamily("pipeline_job_requests_completed",
                                                    "Requests of a job that has not ended answered so far "
                                                    "(stop or length), as its shards commit.", labels=["job_id"]),
            "failed_requests": GaugeMetricFamily("pipeline_job_requests_failed",
                                                 "Requests of a job that has not ended that failed so far.",
                                                 labels=["job_id"]),
            "output_tokens": GaugeMetricFamily("pipeline_job_generated_tokens",
                                               "Output tokens of a job that has not ended, so far.", labels=["job_id"]),
        }
        for job in live:
            for column, family in per_job.items():
                family.add_metric([job.id], getattr(job, column))
        yield from per_job.values()
        job_shards = GaugeMetricFamily("pipeline_job_shards", "Shards of a job that has not ended, by status.",
                                       labels=["job_id", "status"])
        for (job_id, status), n in sorted(shards.items()):
            job_shards.add_metric([job_id, status], n)
        yield job_shards


def _first_line(error: Exception) -> str:
    # SQLAlchemy's messages go on with the statement and a link: one line a scrape is enough.
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def registry_for(settings: Settings, Session: sessionmaker[Session], queues: Iterable[str] = ()) -> CollectorRegistry:
    """A registry holding only the ledger and broker collector (no process metrics)."""
    registry = CollectorRegistry()
    registry.register(LedgerAndBrokerCollector(settings, Session, queues))
    return registry
