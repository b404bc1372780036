"""Off means off: without --compaction-endpoint the plugin adds its flags and nothing else.

SGLang calls `sglang_ext.register()` in every process it starts. The main process sets
`ACTIVE_ENV` only when it parses --compaction-endpoint, and the scheduler it spawns registers
the serving hooks (per request and per forward) only when it inherits it. (The real-server
half of this is in tests/integration/test_sglang_server.py.)
"""

from __future__ import annotations

import os

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_ext.adapter import hooks, surface
from sglang_ext.adapter.server_args import CONFIG_ATTR
from tests.sglang_ext._fixtures import parse_flags


def _ours() -> dict[str, int]:
    """Target -> how many of this plugin's hooks SGLang's registry holds for it."""
    ours = {hook for _, hook in (*hooks.FLAG_HOOKS, *hooks.SERVING_HOOKS)}
    return {t: sum(h in ours for _, h, _ in hs) for t, hs in HookRegistry._hooks.items()}


def _register_fresh(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Targets that one fresh `register()` call adds hooks to."""
    monkeypatch.setattr(hooks, "_registered", False)
    before = _ours()
    hooks.register()
    return {t: n - before.get(t, 0) for t, n in _ours().items() if n > before.get(t, 0)}


def test_without_the_marker_only_the_flag_hooks_are_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    added = _register_fresh(monkeypatch)
    assert set(added) == {t for t, _ in hooks.FLAG_HOOKS}
    # nothing per request or per forward; once per scheduler, the CPU prefill switch
    once = {surface.INIT_DISAGGREGATION}
    assert not any(
        "Scheduler" in t or "init_new" in t or "can_run_graph" in t for t in set(added) - once
    )


def test_with_the_marker_the_serving_hooks_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hooks.ACTIVE_ENV, "1")
    added = _register_fresh(monkeypatch)
    assert set(added) == {t for t, _ in (*hooks.FLAG_HOOKS, *hooks.SERVING_HOOKS)}
    assert "ForwardBatch.init_new" in hooks.installed_hooks()


def test_the_endpoint_sets_the_marker_and_its_absence_clears_it() -> None:
    args, ns = parse_flags(["--compaction-endpoint", "inproc://"])
    hooks._from_cli_args(args, type(args), ns)
    assert os.environ.get(hooks.ACTIVE_ENV) == "1" and hasattr(args, CONFIG_ATTR)

    args, ns = parse_flags([])  # a marker inherited from elsewhere does not turn a server on
    hooks._from_cli_args(args, type(args), ns)
    assert hooks.ACTIVE_ENV not in os.environ and not hasattr(args, CONFIG_ATTR)


def test_a_refused_config_sets_no_marker(capsys: pytest.CaptureFixture[str]) -> None:
    args, ns = parse_flags(["--compaction-endpoint", "inproc://", "--compaction-ratio", "2"])
    with pytest.raises(SystemExit, match="2"):
        hooks._from_cli_args(args, type(args), ns)
    assert "--compaction-ratio" in capsys.readouterr().err
    assert hooks.ACTIVE_ENV not in os.environ
