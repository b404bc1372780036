"""The inproc:// compactor's worker function: the plugin's flags become a service CompactJob
and run through `run_compaction` (the service's single compaction path), on a tiny llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compactor.workers.errors import ModelMismatch
from sglang_ext import compactors
from sglang_ext.config import CompactionConfig
from tests.unit._tiny import tiny_llama

IDS = [(7 * i + 3) % 120 + 1 for i in range(40)]
FOLLOW_UPS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def worker_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    from compactor.models import fingerprint

    path = tmp_path_factory.mktemp("tiny")
    return tiny_llama(path), fingerprint(str(path))


def _compact(monkeypatch: pytest.MonkeyPatch, worker_model: Any, cfg: CompactionConfig,
             follow_ups: list[list[int]], fp: str | None = None) -> Any:  # fmt: skip
    model, fingerprint = worker_model
    monkeypatch.setattr(compactors, "_WORKER_MODEL", (model, None, fingerprint))
    return compactors._worker_compact(cfg, fp or fingerprint, IDS, follow_ups)


def test_flags_reach_the_compaction(monkeypatch: pytest.MonkeyPatch, worker_model: Any) -> None:
    cfg = CompactionConfig(
        endpoint="inproc://", method="am-highest", tokens=9, query_sources=("follow-up",),
        on_policy=True, follow_up_answer_tokens=0,
    )  # fmt: skip
    prefix = _compact(monkeypatch, worker_model, cfg, FOLLOW_UPS)
    prefix.validate(expected_fingerprint=worker_model[1])
    assert prefix.logical_length == len(IDS) and prefix.method == "am-highest"
    assert prefix.params["tokens"] == 9 and prefix.params["ratio"] is None
    assert prefix.params["on_policy"] is True
    assert prefix.params["query_sources"] == ["follow-up"]
    assert all(n == 9 for layer in prefix.kept_per_head() for n in layer)


def test_no_follow_ups_falls_back_to_repeat_prefill(
    monkeypatch: pytest.MonkeyPatch, worker_model: Any
) -> None:
    cfg = CompactionConfig(endpoint="inproc://", ratio=0.25, query_sources=("follow-up",),
                           on_policy=False, follow_up_answer_tokens=0)  # fmt: skip
    prefix = _compact(monkeypatch, worker_model, cfg, [])
    assert prefix.params["query_sources"] == ["repeat-prefill"]
    assert prefix.params["ratio"] == 0.25 and prefix.params["budget_per_head"] == 10


def test_other_model_is_refused(monkeypatch: pytest.MonkeyPatch, worker_model: Any) -> None:
    cfg = CompactionConfig(endpoint="inproc://", follow_up_answer_tokens=0)
    with pytest.raises(ModelMismatch, match="request is for model 'not-this-one'"):
        _compact(monkeypatch, worker_model, cfg, FOLLOW_UPS, fp="not-this-one")


def test_worker_used_before_init(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(compactors, "_WORKER_MODEL", None)
    with pytest.raises(RuntimeError, match="before its initializer"):
        compactors._worker_compact(CompactionConfig(endpoint="inproc://"), "fp", IDS, [])
