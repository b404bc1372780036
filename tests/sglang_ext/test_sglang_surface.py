"""`sglang_ext.adapter.surface`: every SGLang name the plugin depends on is checked at start-up, and a
process that serves compacted prefixes refuses to start when one is missing or unapplied.

Each hook target in turn is made unresolvable, left unapplied, or replaced by its original
function; each override and private method is deleted from SGLang's base class; each private
counter is no longer set by SGLang's code; the version is moved out of range: the refusal must
name it. The installed SGLang passes. Hooks are applied by SGLang's own `HookRegistry` in a
fresh registry (`applied`), and every patched attribute is put back afterwards.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import os
import pkgutil
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang.srt.plugins
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_ext.adapter import hooks as plugin
from sglang_ext.adapter import surface
from tests.sglang_ext._fixtures import serving_registration

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [*plugin.FLAG_HOOKS, *plugin.SERVING_HOOKS, *plugin.SERVING_BEFORE_HOOKS]
TARGETS = [t for t, _ in HOOKS]
OVERRIDES = [s.target for s in surface.SURFACE if s.kind == "override"]
PRIVATE_METHODS = [s.target for s in surface.SURFACE if s.kind == "private" and s.params]
COUNTERS = [
    s.target for s in surface.SURFACE if s.kind == "private" and "RadixCache" in s.target
    and not s.params
]  # fmt: skip


def _short(target: str) -> str:
    return ".".join(target.split(".")[-2:])


def _owner(target: str) -> tuple[Any, str]:
    owner_path, name = target.rsplit(".", 1)
    return pkgutil.resolve_name(owner_path), name


def _raw(owner: Any, name: str) -> Any:
    return vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)


def _delete(mp: pytest.MonkeyPatch, target: str) -> None:
    """Make `target` unresolvable: delete it from its owner and the bases it would inherit
    it from."""
    owner, name = _owner(target)
    for klass in owner.__mro__[:-1] if isinstance(owner, type) else (owner,):
        if name in vars(klass):
            mp.delattr(klass, name)


@contextlib.contextmanager
def applying(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plugin registered as a serving process and its hooks applied by SGLang's
    `HookRegistry.apply_hooks`, in a fresh registry. On exit each target gets its original
    back, also in the modules `apply_hooks` propagated the wrapper to. (A test that patches a
    hooked attribute does so in a `pytest.MonkeyPatch.context()`, undone before this exit.)"""
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(plugin, "_serving", plugin._serving)
    monkeypatch.setattr(plugin, "_verified", set())
    monkeypatch.setattr(sglang.srt.plugins, "_plugins_loaded", True)  # as in a server process
    saved = [(*_owner(t), _raw(*_owner(t))) for t in TARGETS]
    ext = serving_registration(monkeypatch)
    try:
        HookRegistry.apply_hooks()
        undo: dict[int, Any] = {}
        for owner, name, raw in saved:
            wrapped = _raw(owner, name)
            undo[id(wrapped)] = raw
            undo[id(getattr(wrapped, "__func__", wrapped))] = getattr(raw, "__func__", raw)
        yield ext
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)
        for mod in list(sys.modules.values()):
            names = getattr(mod, "__dict__", None)
            if isinstance(names, dict):
                for key, value in list(names.items()):
                    if id(value) in undo and value is not undo[id(value)]:
                        setattr(mod, key, undo[id(value)])


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`applying` for one test."""
    with applying(monkeypatch) as ext:
        yield ext


# ---- the installed SGLang ---------------------------------------------------------------


def test_the_installed_sglang_passes(applied: Any) -> None:
    assert surface.in_supported(surface.sglang_version())
    assert surface.check_surface(True) == [] and surface.check_surface(False) == []
    assert plugin.check_hooks_applied(True) == [] and plugin.check_hooks_applied(False) == []
    plugin.verify_process(True)  # no RuntimeError
    applied._announce(None, None)  # the scheduler's check at configure_logger passes


def test_the_table_names_every_hook_target_once() -> None:
    hooks = [s for s in surface.SURFACE if s.kind == "hook"]
    assert sorted(s.target for s in hooks) == sorted(TARGETS)
    flag_targets = {t for t, _ in plugin.FLAG_HOOKS}
    assert {s.target for s in hooks if not s.serving} == flag_targets
    assert len({s.target for s in surface.SURFACE}) == len(surface.SURFACE)


def test_the_table_names_every_sglang_import() -> None:
    imported = set()
    for path in sorted((ROOT / "sglang_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang."):
                imported |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("sglang.") for a in node.names), path
    assert imported <= {s.target for s in surface.SURFACE}, imported


@pytest.mark.parametrize(
    ("plugin_cls", "base_path"),
    [
        ("sglang_ext.adapter.radix_cache.CompactionRadixCache", surface._RADIX),
        ("sglang_ext.adapter.wrapped_backend.CompactionBackend", surface._BACKEND),
    ],
)
def test_the_table_names_every_override_as_the_plugin_defines_it(
    plugin_cls: str, base_path: str
) -> None:
    """Each method the plugin's class body redefines (not the generated forwards) that an
    SGLang base defines is listed, with the plugin's own parameter names."""
    cls, base = pkgutil.resolve_name(plugin_cls), pkgutil.resolve_name(base_path)
    mine = {
        name: fn
        for klass in cls.__mro__
        if klass.__module__.startswith("sglang_ext.")
        for name, fn in vars(klass).items()
        if inspect.isfunction(fn) and fn.__qualname__.startswith(klass.__name__ + ".")
        and any(name in vars(k) for k in base.__mro__[:-1])
    }  # fmt: skip
    listed = {s.target.rsplit(".", 1)[1]: s for s in surface.SURFACE
              if s.kind == "override" and s.target.startswith(base_path + ".")}  # fmt: skip
    assert set(mine) == set(listed)
    for name, sym in listed.items():
        have = tuple(inspect.signature(mine[name]).parameters)
        if name != "__init__":
            assert have[: len(sym.params or ())] == sym.params, name


# ---- hooks: unresolvable, unapplied, replaced ---------------------------------------------


@pytest.mark.parametrize("target", TARGETS, ids=_short)
def test_an_unresolvable_hook_target_is_named(
    target: str, applied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _delete(mp, target)
        problems = surface.check_surface(True)
        hook_problems = plugin.check_hooks_applied(True)
        with pytest.raises(RuntimeError, match=f"hook {target}"):
            plugin.verify_process(True)
    assert len(problems) == 1 and problems[0].startswith(f"hook {target}: cannot be resolved")
    assert f"in SGLang {surface.sglang_version()}" in problems[0]
    assert [p.split(":", 1)[0] for p in hook_problems] == [f"hook {target}"]


@pytest.mark.parametrize("target", TARGETS, ids=_short)
def test_an_unapplied_hook_is_named(
    target: str, applied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(HookRegistry, "_patched", HookRegistry._patched - {target})
    problems = plugin.check_hooks_applied(True)
    assert problems == [
        f"hook {target}: not applied by SGLang's HookRegistry (not in HookRegistry._patched), "
        f"in SGLang {surface.sglang_version()} (hook: sglang_ext.adapter.hooks.{dict(HOOKS)[target].__name__})"
    ]
    with pytest.raises(RuntimeError, match=f"hook {target}"):
        plugin.verify_process(True)


@pytest.mark.parametrize("target", TARGETS, ids=_short)
def test_a_hook_replaced_by_the_original_is_named(
    target: str, applied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name = _owner(target)
    raw = _raw(owner, name)
    original = getattr(raw, "__func__", raw).__wrapped__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, type(raw)(original) if isinstance(raw, classmethod) else original)
        problems = plugin.check_hooks_applied(True)
        with pytest.raises(RuntimeError, match=f"hook {target}"):
            plugin.verify_process(True)
    assert len(problems) == 1 and problems[0].startswith(f"hook {target}: is not a HookRegistry")


def test_retraction_hooks_reach_every_caller(applied: Any) -> None:
    """The retraction hooks are registered where SGLang defines the functions; SGLang's
    `HookRegistry` carries the wrapper to each module that imported them, where PD decode's
    retraction, resume and the scheduler's abort call them."""
    from sglang_ext.adapter.applied_hooks import _wrapped_hooks

    for target, hook, callers in (
        (surface.RETRACT_BACKUP, plugin._retain, ["sglang.srt.managers.schedule_batch"]),
        (surface.RETRACT_RESTORE, plugin._repoint, ["sglang.srt.disaggregation.decode"]),
        (surface.RETRACT_DISCARD, plugin._release,
         ["sglang.srt.disaggregation.decode", "sglang.srt.managers.scheduler"]),
    ):  # fmt: skip
        name = target.rsplit(".", 1)[1]
        for module in callers:
            assert hook in _wrapped_hooks(getattr(sys.modules[module], name)), (module, name)


def test_serving_hooks_are_checked_only_where_compaction_is_on(
    applied: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = surface.GRAPH_GATES[0]
    monkeypatch.setattr(HookRegistry, "_patched", HookRegistry._patched - {gate})
    with pytest.MonkeyPatch.context() as mp:
        _delete(mp, gate)
        assert plugin.check_hooks_applied(False) == [] and surface.check_surface(False) == []
        assert plugin.check_hooks_applied(True) and surface.check_surface(True)


def test_with_compaction_off_problems_are_only_logged(
    applied: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "_serving", False)  # a server without the endpoint
    monkeypatch.setattr(
        HookRegistry, "_patched", HookRegistry._patched - {surface.CONFIGURE_LOGGER}
    )
    with caplog.at_level(logging.WARNING, logger="sglang_ext.adapter.surface"):
        applied._announce(None, None)  # no RuntimeError: the server runs stock
    assert f"hook {surface.CONFIGURE_LOGGER}: not applied" in caplog.text


# ---- the CUDA-graph gate: a compacted batch never replays a stock graph -------------------


@pytest.mark.parametrize("gate", surface.GRAPH_GATES, ids=_short)
def test_a_graph_gate_sglang_failed_to_apply_refuses_to_serve(
    gate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang logs a hook it cannot apply and goes on: the scheduler's configure_logger hook
    (and the backend and cache factories) then refuse, naming the gate."""
    original = HookRegistry._apply_target.__func__  # type: ignore[attr-defined]

    def failing(cls: Any, target: str, hooks: Any) -> None:
        if target == gate:
            raise AttributeError(f"{target} moved")
        original(cls, target, hooks)

    monkeypatch.setattr(HookRegistry, "_apply_target", classmethod(failing))
    with applying(monkeypatch) as ext:
        assert gate not in HookRegistry._patched
        with pytest.raises(RuntimeError, match=f"hook {gate}: not applied"):
            ext._announce(None, None)
        from sglang_ext.adapter.factory import _create_attention_backend, create_compaction_cache

        for factory in (_create_attention_backend, create_compaction_cache):
            with pytest.raises(RuntimeError, match=f"hook {gate}: not applied"):
                factory(None, verify=ext.verify_serving)


# ---- overrides, private methods and counters ----------------------------------------------


@pytest.mark.parametrize("target", OVERRIDES + PRIVATE_METHODS, ids=_short)
def test_a_deleted_override_or_private_method_is_named(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name = _owner(target)
    monkeypatch.delattr(owner, name)
    problems = surface.check_surface(True)
    # the first problem names it (deleting __init__ also loses what it set: more follow)
    assert problems and problems[0].split(":", 1)[0].endswith(f" {target}")
    assert f"in SGLang {surface.sglang_version()}" in problems[0]
    assert len(problems) == 1 or name == "__init__"


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    monkeypatch.setattr(RadixCache, "_insert_helper", lambda self, node, key, value: None)
    (problem,) = surface.check_surface(True)
    assert problem.startswith(f"override {surface._RADIX}._insert_helper: takes (self, node, key")


@pytest.mark.parametrize("target", COUNTERS, ids=_short)
def test_a_counter_sglang_no_longer_sets_is_named(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name = _owner(target)
    for klass in owner.__mro__[:-1]:
        for attr, value in list(vars(klass).items()):
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            if code is not None and surface._stores(code, name):
                monkeypatch.setattr(klass, attr, lambda *a, **k: None)
    problems = [p for p in surface.check_surface(True) if p.startswith(f"private {target}:")]
    assert problems and "neither defined nor set" in problems[0]


def test_a_model_runner_that_no_longer_asks_the_gate_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate is only safe while SGLang consults `can_run_graph` before a replay."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    assert surface._loads(ModelRunner._forward_raw.__code__, "can_run_graph")
    monkeypatch.setattr(ModelRunner, "_forward_raw", lambda self, forward_batch: None)
    (problem,) = surface.check_surface(True)
    assert problem.startswith("private sglang.srt.model_executor.model_runner.ModelRunner."
                              "_forward_raw: no longer calls can_run_graph")  # fmt: skip


# ---- the version --------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.24", "0.6.0", "0.5.22", "1.0", "unknown"])
def test_a_version_out_of_range_is_refused(
    version: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(surface, "sglang_version", lambda: version)
    monkeypatch.setattr(plugin, "_verified", set())
    problems = surface.check_surface(False)
    assert problems and problems[0].startswith(f"sglang {version}: outside")
    with pytest.raises(RuntimeError, match=f"sglang {version}"):
        plugin.verify_process(True, hooks=False)
    with caplog.at_level(logging.WARNING, logger="sglang_ext.adapter.surface"):
        plugin.verify_process(False, hooks=False)  # compaction off: stock, only a warning
    assert f"sglang {version}" in caplog.text


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23rc1", "v0.5.23"])
def test_versions_in_range(version: str) -> None:
    assert surface.in_supported(version)


def test_the_main_process_refuses_at_argument_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sglang_ext._fixtures import parse_flags

    monkeypatch.setattr(surface, "sglang_version", lambda: "0.6.0")
    monkeypatch.setattr(plugin, "_verified", set())
    args, ns = parse_flags(["--compaction-endpoint", "inproc://"])
    with pytest.raises(RuntimeError, match=r"sglang 0\.6\.0: outside"):
        plugin._from_cli_args(args, type(args), ns)
    assert plugin.ACTIVE_ENV not in os.environ
    args, ns = parse_flags([])
    plugin._from_cli_args(args, type(args), ns)  # without the endpoint: stock, no check


def test_flags_are_not_added_when_their_reader_is_not_applied(applied: Any) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    applied._add_cli_args(None, parser)
    assert "--compaction-endpoint" in parser.format_help()
    HookRegistry._patched.discard(surface.FROM_CLI_ARGS)
    parser = argparse.ArgumentParser()
    applied._add_cli_args(None, parser)  # --compaction-endpoint would be parsed and ignored
    assert "--compaction-endpoint" not in parser.format_help()


# ---- a real server ------------------------------------------------------------------------

_BREAK = """
import os
from sglang.srt.plugins.hook_registry import HookRegistry
_apply = HookRegistry._apply_target.__func__
def _failing(cls, target, hooks):
    if target == os.environ["SURFACE_TEST_BREAK"]:
        raise AttributeError(f"{target} moved")
    return _apply(cls, target, hooks)
HookRegistry._apply_target = classmethod(_failing)
"""


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_server_refuses_without_the_graph_gate(prepared_model: Path, tmp_path: Path) -> None:
    """A CPU server with --compaction-endpoint in which SGLang fails to apply the decode
    graph gate (a sitecustomize makes `_apply_target` raise for it in every process) exits
    during start-up, its scheduler naming the gate (~45 s: it dies before loading the model)."""
    from harness.launch import ServerStartError, SGLangServer

    (tmp_path / "sitecustomize.py").write_text(_BREAK)
    gate = surface.GRAPH_GATES[0]
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    server = SGLangServer(
        prepared_model, log_path=tmp_path / "server.log", max_total_tokens=4096,
        extra_args=["--compaction-endpoint", "inproc://"],
        env={"PYTHONPATH": path, "SURFACE_TEST_BREAK": gate},
    )  # fmt: skip
    with pytest.raises(ServerStartError), server:
        pass
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert f"refuses to serve compacted prefixes on this SGLang: hook {gate}: not applied" in log
    assert "sglang_ext: compaction radix cache ready" not in log
