"""Results in: each finished compaction started, waiting for slots or counted out; what an
install needs kept from when its prefix was sent; why a result was not installed.

A compaction takes seconds to minutes; under memory pressure the pool may evict the original
prefix meanwhile, which is exactly where compaction helps most. So nothing an install needs
may depend on the original still being cached when the result arrives:

- the magnitude bounds the install checks each layer against (`installer.original_bounds`)
  are read when the prefix is sent (the original is in the pool then) and kept by prefix
  hash until its result is installed or dropped (`Intake.sent`, `Intake.bounds`);
- a result whose slots the pool cannot give even after eviction waits (`Intake.wait`), at
  most `max_in_flight` of them and no longer than the compaction timeout, and is tried again
  at each poll; then it is dropped;
- every result not installed is counted by reason (`REASONS`, the `results_rejected`
  counter, `sglang:compaction_results_rejected_total{reason}`), with one log line.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from compactor import describe_error, prefix_hash
from sglang_ext.installer import LayerBounds, OriginalEvicted, original_bounds
from sglang_ext.metrics import CompactionStats
from sglang_ext.prefix_tree import PoolFull, TreeOps
from sglang_ext.trigger import CompactionTrigger

__all__ = ["REASONS", "Intake", "Waiting", "reason_of"]

logger = logging.getLogger("sglang_ext.lifecycle")

# why a result was not installed: the service failed (or timed out), the result failed a
# check, the pool had no slots for it within the wait, nothing was left to read bounds from
# (a result sent before bounds were kept, or installed directly), it was computed for
# weights since replaced, or the install raised something else (a device error)
REASONS = ("compactor", "check", "no_slots", "original_evicted", "stale", "install_error")


def reason_of(error: BaseException | None, from_service: bool = False) -> str:
    """The `REASONS` entry of a result that failed with `error` (`from_service`: the
    compaction itself failed, the service's error or a timeout)."""
    if from_service:
        return "compactor"
    if isinstance(error, OriginalEvicted):
        return "original_evicted"
    if isinstance(error, PoolFull):
        return "no_slots"
    return "check" if isinstance(error, ValueError) else "install_error"


@dataclass
class Waiting:
    """A result waiting for slots: the runner's job and until when it may wait."""

    job: Any
    deadline: float


class Intake:
    """The bounds of the prefixes in flight and the results waiting for slots, of one pool.

    Args:
        kvcache: the KV pool (`get_key_buffer`, `start_layer`, `layer_num`).
        tree: the tree whose original paths hold the prefixes' KV.
        stats: where rejected results are counted. trigger: told of each failed compaction
            (it may retry the prefix later).
        max_waiting: results that may wait for slots at once (more: dropped at once).
        wait_s: how long one may wait.
    """

    def __init__(self, kvcache: Any, tree: TreeOps[Any], stats: CompactionStats,
                 trigger: CompactionTrigger, max_waiting: int, wait_s: float):  # fmt: skip
        self.kvcache, self.tree, self.stats, self.trigger = kvcache, tree, stats, trigger
        self.max_waiting, self.wait_s = max_waiting, wait_s
        self.waiting: list[Waiting] = []
        # prefix hash -> bounds, oldest first; a few more than can be in flight at once
        self._bounds: OrderedDict[str, list[LayerBounds]] = OrderedDict()

    def take(self, job: Any, epoch: int, begin: Callable[..., Any],
             install_error: Callable[[BaseException], None]) -> None:  # fmt: skip
        """One finished job of the runner, or one waiting for slots: start its install
        (`begin(token_ids, prefix, fit_round=...)`, the lifecycle's), let it wait for slots,
        or count why not (`install_error` for what is neither a check nor a full pool).
        `epoch`: the runner's now (an older job's weights were replaced)."""
        waited = any(w.job is job for w in self.waiting)
        if not waited:
            self.stats.last_latency_s = job.latency_s
            logger.info(
                "sglang_ext: result for T=%d arrived: %.1f s after the request, %.1f s "
                "waiting for the scheduler", len(job.token_ids), job.latency_s,
                time.perf_counter() - job.done_at,
            )  # fmt: skip
        if job.epoch != epoch:
            self.stats.stale += 1
            self.rejected("stale")
            logger.info("sglang_ext: dropped a compaction started before a weight update")
        elif job.prefix is None:
            self.reject(job.token_ids, job.error, job.fit_round, reason="compactor")
        else:
            try:
                begin(job.token_ids, job.prefix, fit_round=job.fit_round)
            except PoolFull as e:
                if self.wait(job):
                    if not waited:
                        logger.info("sglang_ext: result for T=%d waits for slots: %s",
                                    len(job.token_ids), e)  # fmt: skip
                    return
                self.reject(job.token_ids, e, job.fit_round)
            except Exception as e:  # a failed check, or a device error (OOM, CUDA)
                device = isinstance(e, torch.OutOfMemoryError) or "CUDA" in str(e)
                if device or not isinstance(e, (ValueError, RuntimeError)):
                    install_error(e)
                self.reject(job.token_ids, e, job.fit_round)
        self.settle(job)

    def sent(self, phash: str, ids: list[int]) -> None:
        """A prefix is sent to compact: keep its original's bounds (none if nothing of the
        original is cached: its install will read them then, or fail). Two host syncs."""
        slots = self.tree.original_slots(ids)
        if slots.numel() == 0:
            return
        self._bounds[phash] = original_bounds(self.kvcache, slots)
        self._bounds.move_to_end(phash)
        while len(self._bounds) > 4 * max(self.max_waiting, 1) + 16:  # results never taken
            self._bounds.popitem(last=False)

    def bounds(self, phash: str, ids: list[int]) -> tuple[list[LayerBounds], bool]:
        """The bounds an install of `ids` checks against, and whether the original is gone
        from the pool (then they are the ones kept at sending). Raises OriginalEvicted when
        neither is there."""
        slots = self.tree.original_slots(ids)
        kept = self._bounds.get(phash)
        if kept is not None:
            return kept, slots.numel() == 0
        return original_bounds(self.kvcache, slots), False

    def done(self, phash: str) -> None:
        """The prefix's result was installed, or dropped: forget its bounds."""
        self._bounds.pop(phash, None)

    def wait(self, job: Any, now: float | None = None) -> bool:
        """Let `job`'s result wait for slots; False when it cannot (too many wait already,
        or its wait is over)."""
        now = time.monotonic() if now is None else now
        for w in self.waiting:
            if w.job is job:
                return now < w.deadline
        if len(self.waiting) >= self.max_waiting:
            return False
        self.waiting.append(Waiting(job, now + self.wait_s))
        return True

    def take_waiting(self) -> list[Any]:
        """The waiting jobs, to try again (they wait again through `wait`)."""
        return [w.job for w in self.waiting]

    def settle(self, job: Any) -> None:
        """`job` no longer waits (installed, or dropped)."""
        self.waiting = [w for w in self.waiting if w.job is not job]

    def clear(self) -> None:
        """Weights updated, or the tree flushed: nothing in flight installs any more."""
        self.waiting.clear()
        self._bounds.clear()

    def rejected(self, reason: str) -> None:
        """Count a result that is not installed (`reason` one of `REASONS`)."""
        self.stats.results_rejected[reason] = self.stats.results_rejected.get(reason, 0) + 1

    def reject(self, token_ids: Any, error: BaseException | None, fit_round: int = 0,
               reason: str | None = None) -> None:  # fmt: skip
        """A result for `token_ids` will not be installed: count it (`invalid` for a
        ValueError, a failed check, `failures` otherwise, and `results_rejected` by `reason`,
        by default `reason_of(error)`), tell the trigger, log one line. A failed refit
        (`fit_round` > 0) leaves the installed fit serving; a failed first fit the original."""
        invalid = isinstance(error, ValueError)
        self.stats.invalid += invalid
        self.stats.failures += not invalid
        why = reason or reason_of(error)
        self.rejected(why)
        if token_ids:
            self.done(prefix_hash([int(t) for t in token_ids]))
        what = f"result rejected ({why})" if invalid else f"failed ({why})"
        if fit_round:
            self.trigger.refit_failed(token_ids)
            logger.warning(
                "compaction refit %d %s, the installed fit keeps serving: %s",
                fit_round, what, describe_error(error),
            )  # fmt: skip
            return
        self.stats.fallbacks += 1
        retry = self.trigger.failed(token_ids)
        logger.warning(
            "compaction %s, prefix stays uncompacted%s: %s",
            what, " (may be retried)" if retry else " (retries spent: cooling down)",
            describe_error(error),
        )  # fmt: skip
