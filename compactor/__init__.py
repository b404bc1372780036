"""Compaction of shared-prefix KV caches (Attention Matching and friends).

Importing this package has no side effects: no torch import, no torch thread changes, no
model loading. The public surface below is imported lazily on first attribute access:

    CompactionSpec, QueryConfig       what a compaction computes (compactor.spec; torch-free)
    CompactedPrefix, prefix_hash      the result and the prefix identity (compactor.types)
    fingerprint                       a model directory's identity (compactor.models)
    CompactJob, run_compaction,       one compaction as the service runs it, and the model
    Worker                            replica that runs it (compactor.workers)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "CompactionSpec": "compactor.spec",
    "QueryConfig": "compactor.spec",
    "CompactedPrefix": "compactor.types",
    "prefix_hash": "compactor.types",
    "fingerprint": "compactor.models",
    "CompactJob": "compactor.workers.job",
    "run_compaction": "compactor.workers.worker",
    "Worker": "compactor.workers.worker",
}

__all__ = [
    "CompactJob",
    "CompactedPrefix",
    "CompactionSpec",
    "QueryConfig",
    "Worker",
    "__version__",
    "fingerprint",
    "prefix_hash",
    "run_compaction",
]

if TYPE_CHECKING:
    from compactor.models import fingerprint
    from compactor.spec import CompactionSpec, QueryConfig
    from compactor.types import CompactedPrefix, prefix_hash
    from compactor.workers.job import CompactJob
    from compactor.workers.worker import Worker, run_compaction


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compactor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
