"""CompactionSpec: validation, JSON round trip, identity, budgets; the generated flags."""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from compactor.spec import CompactionSpec, QueryConfig, SpecError, WorkLimits, spec_fields
from compactor.spec.cli_args import UsageError, add_spec_args, spec_flags, spec_from_args

FULL = CompactionSpec(
    method="am-omp-fast",
    method_params={"k": 2},
    tokens=64,
    queries=QueryConfig(sources=("repeat-prefill", "random"), random_count=8, seed=3),
    on_policy=True,
    keep_sink_tokens=2,
    chunk_size=128,
    head_budgets="auto",
)


def test_defaults_are_the_ones_chosen_on_the_ruler_dev_seeds() -> None:
    s = CompactionSpec()
    assert (s.method, s.method_params, s.ratio, s.tokens) == ("kvzip", {}, None, None)
    assert s.queries == QueryConfig() and s.queries.sources == ("repeat-turn",)
    assert s.queries.max_queries_per_head == 16384 == WorkLimits().max_queries  # at the cap
    assert (s.on_policy, s.keep_sink_tokens, s.chunk_size, s.head_budgets) == (
        False, 4, None, "uniform",
    )  # fmt: skip
    assert s.is_auto


def test_json_round_trip_and_key() -> None:
    d = FULL.to_dict()
    assert json.loads(json.dumps(d)) == d  # JSON-safe
    assert d["queries"]["sources"] == ["repeat-prefill", "random"]
    back = CompactionSpec.from_dict(json.loads(json.dumps(d)))
    assert back == FULL and back.key() == FULL.key() and hash(back) == hash(FULL)
    assert CompactionSpec.from_dict({}) == CompactionSpec()  # missing keys = defaults
    assert FULL.replace(chunk_size=None).key() != FULL.key()
    assert FULL.replace(queries={"seed": 4}).key() != FULL.key()
    assert pickle.loads(pickle.dumps(FULL)) == FULL


@pytest.mark.parametrize(
    ("data", "field", "match"),
    [
        ({"method": "x", "bogus": 1}, "bogus", r"unknown spec key\(s\) \['bogus'\]"),
        ({"queries": {"seeds": 1}}, "queries.seeds", r"\['queries.seeds'\]"),
        ({"queries": {"sources": []}}, "queries.sources", "sources is empty"),
        ({"queries": {"random_count": 0}}, "queries.random_count", "random_count must be >= 1"),
        ({"queries": [1]}, "queries", "queries must be an object"),
        ([1, 2], "", "must be a JSON object"),
    ],
)
def test_from_dict_rejects(data: object, field: str, match: str) -> None:
    with pytest.raises(SpecError, match=match) as info:
        CompactionSpec.from_dict(data)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("change", "field", "match"),
    [
        ({"method": "nosuch"}, "method", "unknown method 'nosuch'; available: .*am-highest"),
        ({"method": ""}, "method", "non-empty"),
        ({"method_params": {"bogus": 1}}, "method_params", r"no parameter\(s\) \['bogus'\]"),
        ({"method_params": {"k": object()}}, "method_params", "not JSON-able"),
        ({"ratio": 0.0}, "ratio", r"ratio must be in \(0, 1\], got 0.0"),
        ({"ratio": float("nan")}, "ratio", "ratio must be in"),
        ({"ratio": True}, "ratio", "ratio must be in"),
        ({"tokens": 0}, "tokens", "tokens must be an int >= 1, got 0"),
        ({"tokens": 3, "ratio": 0.5}, "ratio", r"exactly one of ratio \(0.5\) and tokens \(3\)"),
        ({"on_policy": "yes"}, "on_policy", "on_policy must be true or false"),
        ({"keep_sink_tokens": -1}, "keep_sink_tokens", "keep_sink_tokens must be >= 0, got -1"),
        ({"chunk_size": 0}, "chunk_size", "chunk_size must be >= 1, got 0"),
        ({"head_budgets": ""}, "head_budgets", "head_budgets must be"),
    ],
)
def test_validate_names_field_and_value(change: dict, field: str, match: str) -> None:
    spec = CompactionSpec(method="am-highest").replace(**{"tokens": None, **change})
    with pytest.raises(SpecError, match=match) as info:
        spec.validate()
    assert info.value.field == field
    assert pickle.loads(pickle.dumps(info.value)).field == field


def test_budget_per_head() -> None:
    assert CompactionSpec(ratio=0.1).budget_per_head(100, 4) == 10
    assert CompactionSpec(ratio=0.01).budget_per_head(100, 4) == 5  # at least sinks + 1
    assert CompactionSpec(tokens=500).budget_per_head(100, 4) == 100  # at most T
    assert CompactionSpec(keep_sink_tokens=4).sink_tokens(3) == 2
    with pytest.raises(ValueError, match="budget 'auto'"):
        CompactionSpec().budget_per_head(100, 4)
    assert CompactionSpec().resolve_auto(0.3).ratio == 0.3
    assert CompactionSpec(tokens=9).resolve_auto(0.3).tokens == 9


def test_import_is_torch_free() -> None:
    code = (
        "import sys, compactor, compactor.spec, compactor.spec.cli_args\n"
        "compactor.CompactionSpec().to_dict()\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def _parser(**kw: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_spec_args(p, **kw)  # type: ignore[arg-type]
    return p


def test_generated_flags_round_trip_every_knob() -> None:
    argv = [
        "--method", "am-omp-fast", "--param", "k=2", "--tokens", "64",
        "--query-sources", "repeat-prefill, random", "--random-queries", "8",
        "--query-seed", "3", "--on-policy", "--keep-sink-tokens", "2",
        "--chunk-size", "128", "--head-budgets", "auto",
    ]  # fmt: skip
    assert spec_from_args(_parser().parse_args(argv)) == FULL
    assert set(spec_flags()) == {path for path, _ in spec_fields()}


def test_prefix_defaults_fields_and_renamed_flags() -> None:
    base = CompactionSpec(method="am-highest", ratio=0.1, on_policy=True)
    p = _parser(prefix="x-", defaults=base)
    assert spec_from_args(p.parse_args([]), "x-") == base
    ns = p.parse_args(["--x-tokens", "9", "--no-x-on-policy"])
    assert spec_from_args(ns, "x-") == base.replace(ratio=None, tokens=9, on_policy=False)
    # only some knobs, one under another name: the others keep the defaults' values
    p = _parser(
        defaults=base, fields=("method", "queries.sources"), flags={"queries.sources": "--fit"}
    )
    spec = spec_from_args(p.parse_args(["--fit", "random"]))
    assert spec == base.replace(queries={"sources": ("random",)})
    assert "--query-sources" not in p._option_string_actions
    with pytest.raises(ValueError, match="unknown spec field"):
        _parser(fields=("nope",))


def test_errors_name_the_flag() -> None:
    p = _parser(prefix="x-")
    with pytest.raises(UsageError, match="ratio must be in") as info:
        spec_from_args(p.parse_args(["--x-ratio", "2"]), "x-")
    assert info.value.flag == "--x-ratio"
    assert info.value.with_flag().startswith("--x-ratio: ratio must be in")
    with pytest.raises(UsageError, match="is not JSON") as info:
        spec_from_args(p.parse_args(["--x-param", "k={"]), "x-")
    assert info.value.flag == "--x-param"
    with pytest.raises(argparse.ArgumentError, match="not allowed with"):
        p.parse_args(["--x-ratio", "0.1", "--x-tokens", "3"])
    # no validation asked for: a spec the service would resolve or refuse
    assert spec_from_args(_parser().parse_args(["--method", "nosuch"]), validate=False).is_auto
