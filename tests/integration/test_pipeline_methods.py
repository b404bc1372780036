"""Every registered method compacts a real prefix end to end through `compact_prefix`.

Context methods (gvote, compresskv) get their LayerContext from the pipeline, KVCompose its
global per-layer budgets; the result is a valid CompactedPrefix for the real model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from compactor import hf
from compactor.cli import main as cli_main
from compactor.eval.niah import make_niah
from compactor.pipeline import Hooks, compact_prefix
from compactor.spec import CompactionSpec, QueryConfig

RATIO = 0.25


@pytest.fixture(scope="module")
def model_and_ids(prepared_model: Path) -> Iterator[tuple[Any, list[int]]]:
    torch.set_num_threads(1)
    model, tok = hf.load_model(prepared_model)
    case = make_niah(tok, 160, kind="single", seed=3)
    yield model, list(tok(case.prefix, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def calibration(prepared_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calib") / "compresskv.json"
    argv = ["calibrate", "compresskv", "--model", str(prepared_model)]
    argv += ["--cases", "2", "--tokens", "128", "--out", str(out)]
    assert cli_main(argv) == 0
    return out


def _compact(model: Any, ids: list[int], method: str, **params: Any) -> Any:
    spec = CompactionSpec(
        method=method,
        method_params=params,
        ratio=RATIO,
        queries=QueryConfig(sources=("repeat-prefill",)),
    )
    prefix, _ = compact_prefix(model, None, ids, spec, hooks=Hooks(progress=False))
    return prefix


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("snapkv", {}),
        ("h2o", {}),
        ("streamingllm", {"n_sink": 0}),
        ("kvzip", {"layerwise": True}),
        ("snapkv", {"refit": "am"}),
    ],
)
def test_fixed_budget_methods(
    model_and_ids: tuple[Any, list[int]], method: str, params: dict[str, Any]
) -> None:
    model, ids = model_and_ids
    prefix = _compact(model, ids, method, **params)
    budget = round(RATIO * len(ids))
    assert prefix.method == method and prefix.logical_length == len(ids)
    for layer in prefix.layers:
        kept = layer.head_lengths()
        assert sum(kept) <= budget * len(kept)  # the layer's budget (sinks included)
        assert sum(kept) > 0.5 * budget * len(kept)
        if method != "kvzip":  # kvzip spreads a layer's budget unevenly across its heads
            assert max(kept) <= budget
    refit = params.get("refit") == "am"
    betas = torch.cat([layer.beta for layer in prefix.layers])
    assert bool((betas != 0).any()) == refit  # beta is only fitted with the AM refit


@pytest.mark.parametrize(("method", "params"), [("kvcompose", {"group_size": 3}), ("kvzip", {})])
def test_layer_planners_spread_budget_across_layers(
    model_and_ids: tuple[Any, list[int]], method: str, params: dict[str, Any]
) -> None:
    model, ids = model_and_ids
    prefix = _compact(model, ids, method, **params)
    per_layer = [sum(layer.head_lengths()) / prefix.num_kv_heads for layer in prefix.layers]
    assert len(set(per_layer)) > 1  # layer-adaptive, not uniform
    mean = sum(per_layer) / len(per_layer)
    assert abs(mean - round(RATIO * len(ids))) <= 0.15 * mean


def test_kv_compress_varies_budgets_under_the_total(model_and_ids: tuple[Any, list[int]]) -> None:
    model, ids = model_and_ids
    prefix = _compact(model, ids, "kv-compress")
    t, L, H = prefix.budget.budget_per_head, len(prefix.layers), prefix.num_kv_heads
    per_layer = [sum(layer.head_lengths()) for layer in prefix.layers]
    assert sum(per_layer) == L * H * t  # the total every method gets, sinks included
    assert len(set(per_layer)) > 1  # layers trade budget
    assert any(len(set(layer.head_lengths())) > 1 for layer in prefix.layers)  # and heads


def test_gvote_chooses_its_own_budget(model_and_ids: tuple[Any, list[int]]) -> None:
    model, ids = model_and_ids
    prefix = _compact(model, ids, "gvote")
    chosen = prefix.budget.ratio_chosen
    assert chosen is not None and 0 < chosen <= 1
    lengths = [c for layer in prefix.layers for c in layer.head_lengths()]
    assert len(set(lengths)) > 1  # per-head variable budgets
    assert len(prefix.params["method_report"]) == len(prefix.layers)


def test_compresskv_uses_calibration(
    model_and_ids: tuple[Any, list[int]], calibration: Path
) -> None:
    model, ids = model_and_ids
    prefix = _compact(model, ids, "compresskv", calibration=str(calibration))
    for layer in prefix.layers:  # one token set per layer, shared by its KV heads
        lengths = layer.head_lengths()
        assert len(set(lengths)) == 1
        heads = [layer.kept_indices[a:b] for a, b in zip(layer.indptr[:-1], layer.indptr[1:])]
        assert all(torch.equal(heads[0], h) for h in heads[1:])
    report = prefix.params["method_report"]
    assert len(report) == len(prefix.layers) and all(r["srh_heads"] for r in report)
