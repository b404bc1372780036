"""Whether SGLang applied the plugin's hooks: each target patched, holding the plugin's hook.

SGLang's `HookRegistry.apply_hooks` only logs a hook it cannot apply; `hook_problems` finds
such a hook after the fact (each target must be in `HookRegistry._patched` and hold a
`HookRegistry` wrapper around the hook), and `plugins_loaded` tells whether SGLang applied
hooks in this process at all. The targets and their versions: `sglang_ext.adapter.surface`.
"""

from __future__ import annotations

import pkgutil
import types
from collections.abc import Iterable, Iterator
from typing import Any

from sglang_ext.adapter.surface import PLUGINS_LOADED, sglang_version

__all__ = ["hook_problems", "plugins_loaded"]


def hook_problems(hooks: Iterable[tuple[str, Any]]) -> list[str]:
    """Problems with the given (target, hook) pairs after SGLang applied the hooks: each
    target must be in `HookRegistry._patched`, and its attribute must be a `HookRegistry`
    wrapper (a function built by `hook_registry._wrap_fn`) around the hook. One line per
    problem, naming the target and the installed SGLang version."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    version, problems = sglang_version(), []
    for target, hook in hooks:
        name = getattr(hook, "__name__", repr(hook))
        if target not in HookRegistry._patched:
            what = "not applied by SGLang's HookRegistry (not in HookRegistry._patched)"
        else:
            try:
                found = hook in _wrapped_hooks(_raw_attribute(target))
            except Exception as exc:
                what = f"cannot be resolved ({type(exc).__name__}: {exc})"
            else:
                what = "" if found else f"is not a HookRegistry wrapper around {name}"
        if what:
            problems.append(
                f"hook {target}: {what}, in SGLang {version} (hook: sglang_ext.adapter.hooks.{name})"
            )
    return problems


def _raw_attribute(target: str) -> Any:
    """The attribute `target` names as stored on its owner (a classmethod's function)."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = getattr(owner, name)
    if isinstance(owner, type):
        raw = next((vars(k)[name] for k in owner.__mro__ if name in vars(k)), raw)
    return getattr(raw, "__func__", raw) if isinstance(raw, classmethod | staticmethod) else raw


def _wrapped_hooks(fn: Any) -> Iterator[Any]:
    """The hooks of the `HookRegistry` wrappers along `fn`'s `__wrapped__` chain."""
    from sglang.srt.plugins.hook_registry import _wrap_fn

    codes = {c for c in _wrap_fn.__code__.co_consts if isinstance(c, types.CodeType)}
    for _ in range(64):  # a chain of wrappers, one per hook type and plugin; never a cycle
        code = getattr(fn, "__code__", None)
        if code in codes and "hook" in code.co_freevars:
            yield fn.__closure__[code.co_freevars.index("hook")].cell_contents
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return


def plugins_loaded() -> bool:
    """Whether SGLang's `load_plugins()` ran in this process, which applies the hooks (a
    server's processes: yes; a unit test calling the plugin's functions: no)."""
    try:
        return bool(pkgutil.resolve_name(PLUGINS_LOADED))
    except (ImportError, AttributeError):  # renamed: check_surface names it
        return False
