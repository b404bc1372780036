"""The service checks a worker's result against the request before caching or sending it."""

from __future__ import annotations

import dataclasses

import pytest

from compactor.service.engine import ModelSummary, _check_result
from compactor.spec import CompactionSpec
from compactor.types import prefix_hash
from compactor.workers.job import CompactJob
from tests._results import make_prefix

MODEL = ModelSummary("fp", "m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                     vocab_size=None)  # fmt: skip


def test_only_the_result_asked_for_passes() -> None:
    prefix = make_prefix([[2, 3], [1, 2]], T=20)  # fingerprint "fp", T 20, am-highest
    job = CompactJob("fp", tuple(range(20)), CompactionSpec(method="am-highest", ratio=0.2))
    assert prefix.prefix_hash == prefix_hash(job.token_ids)
    _check_result(prefix, job, MODEL)
    with pytest.raises(RuntimeError, match="not \\(21"):
        _check_result(prefix, dataclasses.replace(job, token_ids=tuple(range(21))), MODEL)
    with pytest.raises(RuntimeError, match="'am-omp-fast'"):
        _check_result(prefix, dataclasses.replace(job, spec=job.spec.replace(method="am-omp-fast")),
                      MODEL)  # fmt: skip
    with pytest.raises(RuntimeError, match="invalid result"):
        _check_result(prefix, dataclasses.replace(job, model_fingerprint="other"), MODEL)
