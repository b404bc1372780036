"""The inproc:// compactor's worker function: the plugin's spec becomes a service CompactJob
and runs through `compactor.Worker` (the service's single compaction path), on a tiny llama."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compactor import CompactionSpec, QueryConfig, Worker
from compactor.workers.errors import ModelMismatch
from sglang_ext import compactors
from sglang_ext.config import PLUGIN_SPEC
from tests._tiny import tiny_llama

IDS = [(7 * i + 3) % 120 + 1 for i in range(40)]
FOLLOW_UPS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Worker:
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(path)
    return Worker(str(path), torch_threads=None)


def _compact(monkeypatch: pytest.MonkeyPatch, worker: Worker, spec: CompactionSpec,
             follow_ups: list[list[int]], fp: str | None = None) -> Any:  # fmt: skip
    monkeypatch.setattr(compactors, "_WORKER", worker)
    return compactors._worker_compact(spec, fp or worker.fingerprint, IDS, follow_ups)


def test_flags_reach_the_compaction(monkeypatch: pytest.MonkeyPatch, worker: Worker) -> None:
    # a method with uniform budgets and on-policy fitting, so every head shows the 9 tokens
    spec = PLUGIN_SPEC.replace(
        method="am-highest", on_policy=True, tokens=9, ratio=None,
        queries={"follow_up_answer_tokens": 0},
    )  # fmt: skip
    prefix = _compact(monkeypatch, worker, spec, FOLLOW_UPS)
    prefix.validate(expected_fingerprint=worker.fingerprint)
    assert prefix.logical_length == len(IDS) and prefix.method == "am-highest"
    assert prefix.budget.tokens_asked == 9 and prefix.budget.ratio_asked is None
    assert prefix.params["on_policy"] is True
    assert prefix.params["query_sources"] == list(PLUGIN_SPEC.queries.sources)
    assert all(n == 9 for layer in prefix.kept_per_head() for n in layer)


def test_no_follow_ups_falls_back_to_the_default_source(
    monkeypatch: pytest.MonkeyPatch, worker: Worker
) -> None:
    spec = PLUGIN_SPEC.replace(ratio=0.25, on_policy=False, queries={"follow_up_answer_tokens": 0})
    # what both compactors send for a prefix without follow-ups
    prefix = _compact(monkeypatch, worker, spec.for_follow_ups([]), [])
    assert prefix.params["query_sources"] == ["repeat-turn"]
    assert prefix.budget.ratio_asked == 0.25 and prefix.budget.budget_per_head == 10


def test_for_follow_ups_drops_only_a_missing_source() -> None:
    both = CompactionSpec(queries=QueryConfig(sources=("follow-up", "self-study")))
    assert both.for_follow_ups([]).queries.sources == ("self-study",)
    assert both.for_follow_ups([[1]]) is both
    assert PLUGIN_SPEC.for_follow_ups([]).queries.sources == ("repeat-turn",)
    assert PLUGIN_SPEC.for_follow_ups([]).queries.follow_up_answer_tokens == 32


def test_other_model_is_refused(monkeypatch: pytest.MonkeyPatch, worker: Worker) -> None:
    spec = PLUGIN_SPEC.replace(queries={"follow_up_answer_tokens": 0})
    with pytest.raises(ModelMismatch, match="request is for model 'not-this-one'"):
        _compact(monkeypatch, worker, spec, FOLLOW_UPS, fp="not-this-one")


def test_worker_used_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compactors, "_WORKER", None)
    with pytest.raises(RuntimeError, match="before its initializer"):
        compactors._worker_compact(PLUGIN_SPEC, "fp", IDS, [])


def test_plugin_uses_only_the_public_surface() -> None:
    """Every module of sglang_ext reaches compactor through the names `compactor/__init__`
    exports (no submodule), and compaction_kernels through its public modules only; the config
    module imports no torch."""
    import ast

    import compactor

    root = Path(__file__).resolve().parents[2]
    wrong = []
    for path in sorted((root / "sglang_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom | ast.Import) or getattr(node, "level", 0):
                continue
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names]  # fmt: skip
            for mod in mods:
                top, *rest = mod.split(".")
                where = f"{path.relative_to(root)}:{node.lineno} {mod}"
                if top == "compactor" and (rest or isinstance(node, ast.Import)):
                    wrong.append(where)  # a submodule
                elif top == "compactor":
                    names = [a.name for a in node.names]
                    wrong += [f"{where}.{n}" for n in names if n not in compactor.__all__]
                elif top == "compaction_kernels" and any(p.startswith("_") for p in rest):
                    wrong.append(where)  # a private module
    assert wrong == []
    code = "import sys, sglang_ext.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
