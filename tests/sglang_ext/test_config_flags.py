"""CompactionConfig's `--compaction-*` serving flags are generated from its fields
(`compactor.spec.cli_args.add_field_args`): one definition per setting, flag, default, help, bound."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import pytest

from compactor.spec.cli_args import add_field_args, field_values
from sglang_ext.config import SPEC_PREFIX, CompactionConfig, add_cli_args, config_from_namespace

FLAGGED = [f for f in dataclasses.fields(CompactionConfig) if "flag" in f.metadata]
SETTINGS = [f for f in FLAGGED if f.name != "endpoint"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p


def test_every_setting_has_its_generated_flag() -> None:
    actions = parser()._option_string_actions
    assert len(SETTINGS) == 15
    for f in FLAGGED:
        action = actions[f"--{SPEC_PREFIX}{f.metadata['flag']}"]
        default = None if f.default is dataclasses.MISSING else f.default
        assert (action.dest, action.default) == (
            "compaction_" + f.metadata["flag"].replace("-", "_"),
            default,
        )
        assert action.help == f.metadata["help"] and action.metavar is None  # as written before
    assert actions["--compaction-retry-backoff"].dest == "compaction_retry_backoff"
    assert CompactionConfig.boundary_margin == 32  # class attributes stay the defaults


def _other_value(f: dataclasses.Field[Any]) -> tuple[str, Any]:
    """A command-line text for `f` other than its default, and the value it parses to."""
    if f.name == "refit_at":
        return "4,16", (4, 16)
    default: Any = f.default
    value = default + (0.5 if f.metadata["kind"] == "float" else 1)
    return str(value), value


def test_every_setting_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_COMPACTION_TOKEN", raising=False)
    argv = ["--compaction-endpoint", "inproc://"]
    expected = {}
    for f in SETTINGS:
        text, value = _other_value(f)
        argv += [f"--{SPEC_PREFIX}{f.metadata['flag']}", text]
        expected[f.name] = value
    cfg = config_from_namespace(parser().parse_args(argv))
    assert cfg is not None and {n: getattr(cfg, n) for n in expected} == expected
    default = config_from_namespace(parser().parse_args(["--compaction-endpoint", "127.0.0.1:1"]))
    assert default == CompactionConfig(
        endpoint="127.0.0.1:1"
    )  # the flags' defaults are the fields'


def test_no_flag_carries_a_secret() -> None:
    """The token comes from the environment or a file: no field value is read from argv."""
    ns = parser().parse_args(["--compaction-endpoint", "inproc://"])
    values = field_values(ns, CompactionConfig, SPEC_PREFIX)
    assert "token" not in values and not any(f.name.startswith("token") for f in FLAGGED)
    with pytest.raises(SystemExit):
        parser().parse_args(["--compaction-endpoint", "inproc://", "--compaction-token", "t0k"])


@pytest.mark.parametrize("f", [f for f in SETTINGS if {"at_least", "above"} & set(f.metadata)],
                         ids=lambda f: f.name)  # fmt: skip
def test_each_bound_names_its_flag_and_value(f: dataclasses.Field[Any]) -> None:
    key = "at_least" if "at_least" in f.metadata else "above"
    op, bound = {"at_least": ">=", "above": ">"}[key], f.metadata[key]
    bad = bound - 1 if op == ">=" else bound
    flag = f"--{SPEC_PREFIX}{f.metadata['flag']}"
    with pytest.raises(ValueError, match=f"{flag} must be {op} {bound}, got {bad}$"):
        _config(**{f.name: bad})
    if f.metadata["kind"] == "float":
        with pytest.raises(ValueError, match=f"{flag} must be {op} {bound}, got nan$"):
            _config(**{f.name: math.nan})
    _config(**{f.name: bound + 1})


def _config(**kw: Any) -> CompactionConfig:
    return CompactionConfig(endpoint="h:1", **kw)


def test_refit_at_parses_counts_and_is_checked() -> None:
    for text, steps in (("none", ()), ("", ()), ("8", (8,)), ("8,32", (8, 32))):
        ns = parser().parse_args(
            ["--compaction-endpoint", "127.0.0.1:1", "--compaction-refit-at", text]
        )
        cfg = config_from_namespace(ns)
        assert cfg is not None and cfg.refit_at == steps
    with pytest.raises(SystemExit):  # argparse: "expected comma-separated question counts"
        parser().parse_args(
            ["--compaction-endpoint", "127.0.0.1:1", "--compaction-refit-at", "8,x"]
        )
    with pytest.raises(ValueError, match=r"--compaction-refit-at must be increasing .*\(8, 4\)"):
        config_from_namespace(
            parser().parse_args(
                ["--compaction-endpoint", "127.0.0.1:1", "--compaction-refit-at", "8,4"]
            )
        )
    assert _config(refit_at=[4, 8]).refit_at == (4, 8)  # a list (JSON) becomes a tuple


@dataclasses.dataclass(frozen=True)
class _Toy:
    name: str = dataclasses.field(metadata={"flag": "name", "help": "a name", "kind": "str"})
    n: int = dataclasses.field(default=3, metadata={"flag": "n", "help": "a count", "kind": "int"})
    on: bool = dataclasses.field(default=True, metadata={"flag": "on", "help": "x", "kind": "bool"})
    hidden: int = 0


def test_add_field_args_on_any_dataclass() -> None:
    p = argparse.ArgumentParser()
    add_field_args(p, _Toy, "toy-")
    ns = p.parse_args(["--toy-name", "a", "--no-toy-on"])
    assert field_values(ns, _Toy, "toy-") == {"name": "a", "n": 3, "on": False}
    assert p._option_string_actions["--toy-n"].help == "a count (default: 3)"
    with pytest.raises(ValueError, match=r"no flag field\(s\) \['hidden'\]"):
        add_field_args(argparse.ArgumentParser(), _Toy, fields=["hidden"])

    @dataclasses.dataclass(frozen=True)
    class Bad:
        xs: dict[str, Any] = dataclasses.field(
            default_factory=dict, metadata={"flag": "x", "help": "h", "kind": "params"}
        )

    with pytest.raises(ValueError, match="kind 'params' is for spec knobs only"):
        add_field_args(argparse.ArgumentParser(), Bad)
