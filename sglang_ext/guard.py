"""Exception guards for the plugin's hooks that run in SGLang's scheduler, and the circuit
breaker behind them.

SGLang's scheduler loop stops (and the server with it) when anything it calls raises; the
plugin's hooks run inside that loop (the install poll after `Scheduler.ingest_requests`, the
CUDA-graph gate, batch marking, weight updates). `HookGuard.call` runs a hook and, when it
raises, logs it, counts it and answers the caller's safe fallback instead; after
`BREAKER_AFTER` consecutive failures the breaker opens and `on_trip` runs once (the cache
stops compacting; installed prefixes keep serving). A successful call closes the count again.
Install errors themselves (a CUDA OOM while a layer is copied) are handled where they happen
(`lifecycle`: the install is aborted and its slots returned) and reach the breaker through
`failed`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from compactor import describe_error

__all__ = ["BREAKER_AFTER", "HookGuard"]

BREAKER_AFTER = 3  # consecutive failures that open the breaker
logger = logging.getLogger(__name__)
T = TypeVar("T")


class HookGuard:
    """Counts hook failures of one process; `open` once `BREAKER_AFTER` came in a row.

    Args:
        on_trip: called once, with a reason, when the breaker opens.
    """

    def __init__(self, on_trip: Callable[[str], None] | None = None) -> None:
        self.errors = 0  # every failure since start
        self.in_a_row = 0
        self.open = False
        self.on_trip = on_trip

    def call(self, name: str, fallback: T, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, or `fallback` if it raised (logged and counted)."""
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            self.failed(name, exc)
            return fallback
        self.in_a_row = 0
        return out

    def failed(self, name: str, exc: BaseException) -> None:
        """Count one failure of `name`; open the breaker at `BREAKER_AFTER` in a row."""
        self.errors += 1
        self.in_a_row += 1
        logger.error("sglang_ext: %s raised (%d in a row)", name, self.in_a_row, exc_info=exc)
        if self.in_a_row >= BREAKER_AFTER and not self.open:
            self.open = True
            reason = f"{self.in_a_row} failures in a row, the last in {name}: {describe_error(exc)}"
            logger.error("sglang_ext: circuit breaker open, compaction stops: %s", reason)
            if self.on_trip is not None:
                self.on_trip(reason)
