"""Compaction of shared-prefix KV caches (Attention Matching and friends).

Importing this package has no side effects: no torch import, no torch thread changes, no
model loading. The public surface below is imported lazily on first attribute access; the
SGLang plugin (`sglang_ext`) uses nothing else of this package:

    CompactionSpec, QueryConfig       what a compaction computes (compactor.spec; torch-free)
    add_spec_args, add_field_args,    the spec as command-line flags (compactor.spec)
    spec_from_args, field_values,
    usage_error
    CompactedPrefix, CompactedLayer,  the result and the prefix identity (compactor.types)
    prefix_hash
    fingerprint, resolve_checkpoint   a model directory's identity and location (compactor.models)
    CompactJob, run_compaction,       one compaction as the service runs it, and the model
    Worker                            replica that runs it (compactor.workers)
    AsyncCompactorClient, TlsFiles    the service's client (compactor.client); describe_error:
                                      an error (a gRPC status and details) for one log line
    is_loopback, endpoint_host        whether an endpoint stays on this machine (compactor.endpoints)
    TokenFile, TOKEN_HEADER           the bearer token a client sends (compactor.service.auth)
    max_result_bytes, prefix_digest   the largest valid result of a request, and a result's sha256
                                      (compactor.service.result_stream)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "CompactionSpec": "compactor.spec",
    "QueryConfig": "compactor.spec",
    "add_field_args": "compactor.spec",
    "add_spec_args": "compactor.spec",
    "field_values": "compactor.spec",
    "spec_from_args": "compactor.spec",
    "usage_error": "compactor.spec",
    "CompactedLayer": "compactor.types",
    "CompactedPrefix": "compactor.types",
    "prefix_hash": "compactor.types",
    "fingerprint": "compactor.models",
    "resolve_checkpoint": "compactor.models",
    "CompactJob": "compactor.workers.job",
    "run_compaction": "compactor.workers.worker",
    "Worker": "compactor.workers.worker",
    "AsyncCompactorClient": "compactor.client",
    "TlsFiles": "compactor.client",
    "describe_error": "compactor.client",
    "endpoint_host": "compactor.endpoints",
    "is_loopback": "compactor.endpoints",
    "TokenFile": "compactor.service.auth",
    "TOKEN_HEADER": "compactor.service.auth",
    "max_result_bytes": "compactor.service.result_stream",
    "prefix_digest": "compactor.service.result_stream",
}

__all__ = [
    "TOKEN_HEADER",
    "AsyncCompactorClient",
    "CompactJob",
    "CompactedLayer",
    "CompactedPrefix",
    "CompactionSpec",
    "QueryConfig",
    "TlsFiles",
    "TokenFile",
    "Worker",
    "__version__",
    "add_field_args",
    "add_spec_args",
    "describe_error",
    "endpoint_host",
    "field_values",
    "fingerprint",
    "is_loopback",
    "max_result_bytes",
    "prefix_digest",
    "prefix_hash",
    "resolve_checkpoint",
    "run_compaction",
    "spec_from_args",
    "usage_error",
]

if TYPE_CHECKING:
    from compactor.client import AsyncCompactorClient, TlsFiles, describe_error
    from compactor.endpoints import endpoint_host, is_loopback
    from compactor.models import fingerprint, resolve_checkpoint
    from compactor.service.auth import TOKEN_HEADER, TokenFile
    from compactor.service.result_stream import max_result_bytes, prefix_digest
    from compactor.spec.cli_args import (
        add_field_args,
        add_spec_args,
        field_values,
        spec_from_args,
        usage_error,
    )
    from compactor.spec.compaction import CompactionSpec
    from compactor.spec.query_config import QueryConfig
    from compactor.types import CompactedLayer, CompactedPrefix, prefix_hash
    from compactor.workers.job import CompactJob
    from compactor.workers.worker import Worker, run_compaction


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compactor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
