"""Compaction workers: the job/result types, the worker (one model replica), the pool of
replicas (in-process threads or Ray actors) and its table of poison prefixes (prefixes that
killed workers), single-flight and the byte-bounded result cache.

Only the picklable dataclasses of :mod:`compactor.workers.job` and tensors cross the Ray
boundary. Nothing here imports grpc; :mod:`compactor.service` builds on it.
"""

from compactor.workers.errors import (
    Cancelled,
    CompactionError,
    DeadlineExceeded,
    InvalidRequest,
    ModelMismatch,
    PoisonedJob,
    QueueFull,
    WorkerLost,
)
from compactor.workers.job import CompactJob, JobResult

__all__ = [
    "Cancelled",
    "CompactJob",
    "CompactionError",
    "DeadlineExceeded",
    "InvalidRequest",
    "JobResult",
    "ModelMismatch",
    "PoisonedJob",
    "QueueFull",
    "WorkerLost",
]
