"""The one exception -> gRPC status table (INTERNAL, with a logged traceback, by default).

An unexpected exception's text never reaches the client: it gets "internal error
(incident <id>)", and the server log has the traceback under the same incident id.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from compactor.workers import errors as job_errors

__all__ = ["STATUS_TABLE", "ServerDraining", "status_for"]

log = logging.getLogger(__name__)


class ServerDraining(Exception):
    """The server is shutting down: it takes no new compactions (or gave up on this one)."""


STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (job_errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (job_errors.ModelMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (
        job_errors.PoisonedJob,
        grpc.StatusCode.FAILED_PRECONDITION,
    ),  # not UNAVAILABLE: not to be retried
    (job_errors.QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (job_errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (asyncio.TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (job_errors.Cancelled, grpc.StatusCode.CANCELLED),
    (job_errors.WorkerLost, grpc.StatusCode.UNAVAILABLE),
    (ServerDraining, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException, where: str = "") -> tuple[grpc.StatusCode, str]:
    """(status code, details) for `exc`. Anything unexpected is INTERNAL with a generic
    message naming a short incident id; its traceback is logged under that id."""
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code, str(exc) or cls.__name__
    incident = uuid.uuid4().hex[:12]
    log.error(
        "internal error (incident %s)%s", incident, f" in {where}" if where else "", exc_info=exc
    )
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident})"
