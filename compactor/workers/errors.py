"""Domain errors of the compaction service; compactor.service.errors maps each to a gRPC status."""

from __future__ import annotations


class CompactionError(Exception):
    """Base of the errors below (picklable: one message argument)."""


class InvalidRequest(CompactionError, ValueError):
    """Unknown method, bad parameters / budget / query source, prefix too long."""


class ModelMismatch(CompactionError):
    """The request's model fingerprint is not the model this service compacts for."""


class QueueFull(CompactionError):
    """Too many requests waiting for a worker."""


class DeadlineExceeded(CompactionError):
    """The request's deadline passed before its compaction finished."""


class Cancelled(CompactionError):
    """The compaction was stopped because nobody waits for it any more."""


class WorkerLost(CompactionError):
    """Workers died on this request more often than the retry bound allows."""


class PoisonedJob(CompactionError):
    """Workers died on this prefix too often (across requests): it is refused for a while
    without running it, so that retries cannot take down replica after replica. Not
    retryable (unlike WorkerLost)."""
