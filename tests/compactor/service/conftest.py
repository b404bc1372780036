"""Fixtures of the service tests: the prepared model's fingerprint and the in-process
reference result the service must reproduce (helpers: `_fixtures`). Tests stay
synchronous: they talk to the server through real clients on loopback (ephemeral ports) and
reach into the engine only to observe it (pool load, counters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.compactor.service._fixtures import FAST, PREFIX


@pytest.fixture(scope="session")
def model_fp(prepared_model: Path) -> str:
    from compactor.models import fingerprint

    return fingerprint(prepared_model)


@pytest.fixture(scope="session")
def reference(prepared_model: Path, model_fp: str) -> Any:
    """`reference(ids)`: the in-process result of the worker's own function (one thread)."""
    import torch

    from compactor import hf
    from compactor.workers.job import CompactJob
    from compactor.workers.worker import run_compaction

    model, tok = hf.load_model(prepared_model)

    def compute(ids: list[int]) -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            job = CompactJob(model_fingerprint=model_fp, token_ids=tuple(ids), spec=FAST)
            return run_compaction(model, tok, model_fp, job).prefix
        finally:
            torch.set_num_threads(threads)

    return compute


@pytest.fixture(scope="session")
def reference_prefix(reference: Any) -> Any:
    return reference(PREFIX)
