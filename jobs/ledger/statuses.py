"""The states a job and a shard move through, as str-valued enums (the ledger stores the words)."""
from __future__ import annotations

from enum import Enum


class _Word(str, Enum):
    """An enum whose members print, format and compare as their plain word."""

    def __str__(self) -> str:
        return self.value


class JobStatus(_Word):
    """Job lifecycle (OpenAI batch statuses): queued -> in_progress -> finalizing ->
    completed | failed; cancelling -> cancelled; expiring -> expired (its completion
    window passed: like a cancel, but every request left without an answer gets an
    error row; "expiring" is ours, OpenAI's batch reports "expired" already)."""
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRING = "expiring"
    EXPIRED = "expired"

    @classmethod
    def terminal(cls) -> frozenset[JobStatus]:
        return _TERMINAL_JOB

    @classmethod
    def stopping(cls) -> tuple[JobStatus, ...]:
        """The statuses in which running shards stop at their next step, and none starts."""
        return (cls.CANCELLING, cls.EXPIRING)

    @classmethod
    def live(cls) -> tuple[JobStatus, ...]:
        """The statuses in which shards may still be claimed."""
        return (cls.QUEUED, cls.IN_PROGRESS)


SUBMITTER = "submit"   # the ledger's worker of a shard the submit answered from earlier jobs (jobs.reuse.stored_answers)


class ShardStatus(_Word):
    """Shard lifecycle: queued -> running -> completed | failed; cancelled."""

    @classmethod
    def unfinished(cls) -> tuple[ShardStatus, ...]:
        return (cls.QUEUED, cls.RUNNING)

    @classmethod
    def terminal(cls) -> frozenset[ShardStatus]:
        return frozenset(set(cls) - set(cls.unfinished()))

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


_TERMINAL_JOB = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})
