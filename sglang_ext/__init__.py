"""SGLang plugin for compacted shared prefixes: an SGLang-free core and a thin adapter.

The core (the modules of this package: flags, trigger, TP agreement, beta store, installs and
the compacted-prefix state machine, compactor clients, attention kernels' callers) imports
no SGLang and sets nothing on SGLang's objects; `sglang_ext.adapter` does both.

SGLang discovers the plugin through the `sglang.srt.plugins` entry point `sglang_ext:register`
(pyproject.toml) and calls `register()` early in every SGLang process. Importing this package
has no side effects and imports neither SGLang nor the adapter.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """SGLang's plugin entry point (idempotent): see `sglang_ext.adapter.hooks.register`."""
    from sglang_ext.adapter.hooks import register as register_hooks

    register_hooks()
