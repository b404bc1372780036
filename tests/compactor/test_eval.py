"""compactor.eval: metrics are zero for the uncompacted/identity prefix; CLI smoke."""

from __future__ import annotations

import json

import pytest
import torch

from compactor.cli import main
from compactor.eval import EvalCase, attention_errors, build_reference, evaluate_prefix
from compactor.pipeline import Hooks, compact_prefix
from compactor.spec import CompactionSpec, QueryConfig
from compactor.types import CompactedLayer, CompactedPrefix
from tests._tiny import random_ids
from tests.compactor import _methods  # noqa: F401  (registers the test-identity method)


def test_attention_errors_identity_and_drop():
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(2, 20, 8, generator=g) for _ in range(3))
    ident = CompactedLayer(
        k.reshape(40, 8),
        v.reshape(40, 8),
        torch.zeros(40),
        torch.tensor([0, 20, 40], dtype=torch.int32),
    )
    err = attention_errors(q, k, v, ident)
    assert err.output_rel_err.abs().max() < 1e-5 and err.mass_rel_err.abs().max() < 1e-5
    # keeping half of the keys loses mass; beta = log 2 on the kept half roughly restores it
    half = CompactedLayer(
        k[:, :10].reshape(20, 8),
        v[:, :10].reshape(20, 8),
        torch.zeros(20),
        torch.tensor([0, 10, 20], dtype=torch.int32),
    )
    e_half = attention_errors(q, k, v, half)
    assert bool((e_half.mass_rel_err > 0.2).all()) and bool((e_half.output_rel_err > 0.05).all())
    with pytest.raises(ValueError, match="queries"):
        attention_errors(q[:1], k, v, ident)


def test_eval_full_and_identity_are_zero(tiny):
    case = EvalCase("t", random_ids(30), [random_ids(4, 1), random_ids(3, 2)])
    ref = build_reference(tiny, None, case, answer_tokens=4)
    assert len(ref.answers) == 2 and ref.heldout[0].shape == (2, 2 * (8 + 7), 16)
    full = evaluate_prefix(tiny, None, ref, None)
    assert full["output_rel_err"] == 0 and full["logppl_gap"] == 0 and full["agreement"] == 1.0
    spec = CompactionSpec(
        method="test-identity", ratio=1.0, queries=QueryConfig(sources=("repeat-prefill",))
    )
    prefix, _ = compact_prefix(tiny, None, case.prefix_ids, spec, hooks=Hooks(progress=False))
    ident = evaluate_prefix(tiny, None, ref, prefix)
    assert ident["output_rel_err"] < 1e-5 and ident["mass_rel_err"] < 1e-5
    assert abs(ident["logppl_gap"]) < 1e-4 and ident["agreement"] == 1.0


def test_eval_detects_damage(tiny):
    case = EvalCase("t", random_ids(30, 3), [random_ids(4, 4)])
    ref = build_reference(tiny, None, case, answer_tokens=4)
    pre = ref.prefill
    layers = [
        CompactedLayer(
            k[:, :3].reshape(6, 16),
            v[:, :3].reshape(6, 16),
            torch.zeros(6),
            torch.tensor([0, 3, 6], dtype=torch.int32),
        )
        for k, v in zip(pre.keys, pre.values)
    ]
    bad = CompactedPrefix("fp", 30, "h", "first3", {}, layers, 16, 2, torch.float32)
    res = evaluate_prefix(tiny, None, ref, bad)
    assert res["output_rel_err"] > 0.05 and res["mass_rel_err"] > 0.5
    with pytest.raises(ValueError, match="logical_length"):
        evaluate_prefix(
            tiny, None, ref, CompactedPrefix("fp", 29, "h", "x", {}, layers, 16, 2, torch.float32)
        )


def test_cli_compact_and_eval_smoke(prepared_model, tmp_path, capsys):
    from compactor.models import fingerprint

    text = tmp_path / "doc.txt"
    text.write_text(
        "The lighthouse on the north cape shows two red flashes. The keeper is Anna. " * 3
    )
    out = tmp_path / "p.safetensors"
    rc = main(
        [
            "compact",
            "--model",
            str(prepared_model),
            "--input",
            str(text),
            "--method",
            "am-omp-fast",
            "--ratio",
            "0.3",
            "--output",
            str(out),
            "--query-sources",
            "repeat-prefill",
            "--no-progress",
        ]
    )
    assert rc == 0
    prefix = CompactedPrefix.load(out)
    prefix.validate(expected_fingerprint=fingerprint(prepared_model), num_layers=30)
    js = tmp_path / "e.json"
    rc = main(
        [
            "eval",
            "--model",
            str(prepared_model),
            "--input",
            str(text),
            "--methods",
            "full,am-omp-fast",
            "--ratios",
            "0.3",
            "--answer-tokens",
            "3",
            "--json",
            str(js),
            "--query-sources",
            "repeat-prefill",
            "--no-progress",
        ]
    )
    assert rc == 0
    recs = json.loads(js.read_text())["records"]
    assert [r["method"] for r in recs] == ["full", "am-omp-fast"]
    assert recs[0]["output_rel_err"] == 0 and recs[0]["logppl_gap"] == 0
    assert 0 < recs[1]["kept_per_head"] <= 0.3 * recs[0]["kept_per_head"] + 1
    for key in ("output_rel_err", "mass_rel_err", "logppl_gap", "seconds", "kept_tokens"):
        assert key in recs[1]
    assert "am-omp-fast" in capsys.readouterr().out


def test_parse_method_spec() -> None:
    from compactor.eval.runner import parse_method_spec

    assert parse_method_spec("am-omp") == ("am-omp", {})
    assert parse_method_spec("snapkv:refit=am:window=32:p=0.5") == (
        "snapkv",
        {"refit": "am", "window": 32, "p": 0.5},
    )
    assert parse_method_spec("kvzip:layerwise=true:non_uniform=False") == (
        "kvzip",
        {"layerwise": True, "non_uniform": False},
    )
    with pytest.raises(ValueError, match="use name:key=value"):
        parse_method_spec("snapkv:refit")
