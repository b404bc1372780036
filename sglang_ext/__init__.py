"""SGLang plugin for compacted shared prefixes.

SGLang discovers this package through the `sglang.srt.plugins` entry point (see
pyproject.toml) and calls `register()` early in every SGLang process (server, scheduler,
detokenizer). Importing the package has no side effects; `register()` installs hooks through
SGLang's own `HookRegistry`, which applies them after all plugins have run.

Status: the foundation registers one hook, after SGLang's `configure_logger`, that announces
the plugin in each process's log (logging is not configured yet when `register()` runs, so a
plain log line there would be dropped). The compaction radix cache, flags and attention
backend arrive with their own issue.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["PLUGIN_NAME", "register"]

PLUGIN_NAME = "compaction"
ANNOUNCEMENT = "sglang_ext: compaction plugin active"
logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Entry point called by SGLang's plugin loader (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.utils.common.configure_logger", _announce, HookType.AFTER)
    _registered = True


def _announce(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on `configure_logger`: log that the plugin is loaded in this process."""
    logger.info(ANNOUNCEMENT)
