"""`compactor methods`: every registered method with its parameters (table and JSON)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compactor.cli import main
from compactor.methods import get_method, list_methods


def test_table_lists_every_method_with_its_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    blocks = {b.splitlines()[0].split()[0]: b for b in out.strip().split("\n\n")}
    assert sorted(blocks) == list_methods()
    for name in list_methods():
        for f in dataclasses.fields(get_method(name)):
            assert f"    {f.name} " in blocks[name], (name, f.name)
    assert "= 0.95" in blocks["gvote"] and "needs context" in blocks["gvote"]
    assert "tuple[float, float]  = (-3.0, 3.0)" in blocks["am-highest"]


def test_json_has_types_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods", "--json"]) == 0
    rows = {m["name"]: m for m in json.loads(capsys.readouterr().out)["methods"]}
    assert sorted(rows) == list_methods()
    for name, row in rows.items():
        method = get_method(name)
        assert row["doc"] and "\n" not in row["doc"]
        assert [p["name"] for p in row["params"]] == list(method.params())
    omp = {p["name"]: p for p in rows["am-omp"]["params"]}
    assert omp["k"] == {"name": "k", "type": "int", "default": 1, "required": False}
    bounds = {p["name"]: p for p in rows["snapkv"]["params"]}["refit_beta_bounds"]
    assert bounds["default"] == [-3.0, 3.0]
    assert rows["keep-only"]["selects"] and not rows["am-omp"]["needs_context"]


def test_names_filter_and_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods", "kvzip", "--json"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)["methods"]] == ["kvzip"]
    with pytest.raises(SystemExit, match="unknown compaction method 'nope'"):
        main(["methods", "nope"])
