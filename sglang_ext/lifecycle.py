"""How results become installed compacted prefixes (a mixin of `CompactionRadixCache`).

At the scheduler's poll point (`poll_compactions`) finished jobs are taken from the runner:
a job of an older epoch (submitted before a weight update) is dropped as `stale`, a failed
one is counted (`invalid` for a ValueError: a checksum, shape, echo or magnitude check;
`failures` otherwise) and the path may be retried; a result starts a `PendingInstall`
(`sglang_ext.installer`) whose slots count as protected (SGLang's pool accounting stays
exact while it is written) and whose layers are written `install_chunk_mb` (and about
`install_step_ms`) at a time across
iterations, then becomes a node; a refit (`fit_round` n > 0 of an installed prefix) takes the
installed node's place at that moment (`_supersede`). Structure checks (`check_result`) run on the runner's
thread, never the scheduler's.

With tensor parallelism (`tp` set: `sglang_ext.tp.TpSync`) the ranks agree at each poll on
what starts, becomes a node or is dropped; each writes its own KV-head slice in between.

`on_weights_updated` (called by the plugin's hooks on SGLang's `update_weights_*`) drops
every compacted prefix (unmatchable at once, freed when their requests let go), pending
installs and results in flight, and sets the fingerprint results must carry from then on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from compactor.types import CompactedPrefix, prefix_hash
from sglang_ext.compacted_node import compaction_info, new_compacted_node
from sglang_ext.installer import PendingInstall, original_bounds
from sglang_ext.kv_store import head_counts

if TYPE_CHECKING:
    from sglang_ext.compactors import PoolShape
    from sglang_ext.config import CompactionConfig
    from sglang_ext.guard import HookGuard
    from sglang_ext.kv_store import BetaStore
    from sglang_ext.metrics import CompactionStats
    from sglang_ext.tp import TpSync
    from sglang_ext.trigger import CompactionTrigger

__all__ = ["InstallLifecycle", "budget_of"]

logger = logging.getLogger("sglang_ext.radix_cache")


class InstallLifecycle:
    """Result intake, chunked installs and weight updates of `CompactionRadixCache`."""

    tp: TpSync | None = None  # set by the factory when --tp-size > 1

    if TYPE_CHECKING:  # what the cache (and SGLang's RadixCache under it) provides
        config: CompactionConfig
        fingerprint: str | None
        runner: Any
        stats: CompactionStats
        trigger: CompactionTrigger
        guard: HookGuard  # its breaker calls `trip`
        kvcache: Any
        pool_shape: PoolShape
        beta_store: BetaStore
        root_node: TreeNode
        token_to_kv_pool_allocator: Any
        evictable_size_: int
        protected_size_: int
        _compacted: dict[str, TreeNode]
        _dropped: dict[str, TreeNode]
        _superseded: set[TreeNode]
        _pending: list[PendingInstall]
        _retired: set[TreeNode]

        def _alloc(self, n: int) -> torch.Tensor: ...
        def _reap(self) -> None: ...
        def _retire_original(self, key: RadixKey) -> None: ...
        def _original_slots(self, ids: list[int]) -> torch.Tensor: ...
        def _refresh_gauges(self) -> None: ...
        def _export(self, latency_s: float | None = None) -> None: ...
        def _update_leaf_status(self, node: TreeNode) -> None: ...

    def poll_compactions(self) -> int:
        """Take finished compactions, write pending installs (at most `install_chunk_mb` per
        call), free retired nodes, read pool gauges; returns the installs completed. With
        `tp`, every rank must call it at the same scheduler iteration (a collective)."""
        done = 0
        if self.runner is not None:
            jobs = self.runner.drain()
            if self.tp is not None:
                done += self.tp.poll(self, jobs)
            else:
                for job in jobs:
                    self._take(job)
        done += self._advance_installs()
        self._reap()
        alloc = self.token_to_kv_pool_allocator
        pending = sum(int(p.slots.numel()) for p in self._pending)
        tree = self.evictable_size_ + self.protected_size_ - pending
        mismatches = self.beta_store.mark_mismatches
        changed = mismatches != self.stats.host_mark_mismatches
        self.stats.host_mark_mismatches = mismatches
        if self.stats.read_pool(alloc.available_size(), tree, alloc.size) or changed:
            self._export()
        return done

    def install(self, token_ids: Any, prefix: CompactedPrefix) -> TreeNode:
        """Check `prefix` for `token_ids` [T], write it into the pool at once, add its node.

        Mutates the KV pool, the beta store and the tree; returns the compacted node (the
        existing one for a prefix installed before). The scheduler's path is the same, its
        writes spread over iterations (`poll_compactions`).
        Raises:
            ValueError: the prefix is for another model, tokens or pool shape, or out of range.
            RuntimeError: the pool cannot give t_max slots even after eviction.
        """
        self.check_result(prefix)
        t_max = int(head_counts(prefix).max())
        pending = self._begin(token_ids, self.pool_shape.take(prefix), t_max=t_max)
        if pending is None:
            node = self._compacted.get(prefix.prefix_hash)
            if node is None:
                raise RuntimeError(f"prefix {prefix.prefix_hash[:12]} is being installed already")
            return node
        try:
            while not pending.done:
                pending.step(self.kvcache, self.beta_store, 1 << 62)
        finally:
            self._pending.remove(pending)
            if not pending.done:
                self._abort(pending)
        return self._finish(pending)

    def check_result(self, prefix: CompactedPrefix) -> None:
        """Structure checks of a result (every KV head of the model, not only this rank's)
        against this pool and model (ValueError); run on the compaction runner's thread for
        results that arrive through it."""
        if self.fingerprint is None:
            raise ValueError("compaction is off since the weights were updated")
        pool = self.pool_shape
        prefix.validate(
            expected_fingerprint=self.fingerprint,
            num_layers=pool.num_layers,
            num_kv_heads=pool.num_kv_heads,
            head_dim=pool.head_dim,
        )

    def on_weights_updated(self, fingerprint: str | None) -> None:
        """The served weights changed: compacted prefixes stop matching at once (freed when
        their requests let go), pending installs and results in flight are dropped, and
        `fingerprint` (None: weights no service holds) is what results must carry now."""
        if self.runner is not None:
            self.runner.new_epoch()
        if self.tp is not None:
            self.tp.clear()
        for pending in self._pending:
            self._abort(pending)
        self._pending.clear()
        dropped = len(self._compacted)
        for phash, node in list(self._compacted.items()):
            del self._compacted[phash]
            self._dropped[phash] = node
            self._retire_descendants(node)
        self.trigger.reset()
        old, self.fingerprint = self.fingerprint, fingerprint
        logger.warning(
            "sglang_ext: weights updated: %d compacted prefix(es) dropped, fingerprint %s -> %s%s",
            dropped, old, fingerprint,
            "" if fingerprint else " (compaction off: no service holds these weights)",
        )  # fmt: skip
        self._reap()

    def _take(self, job: Any) -> None:
        """One finished job from the runner: start its install or count why not."""
        self.stats.last_latency_s = job.latency_s
        if self.runner is not None and job.epoch != self.runner.epoch:
            self.stats.stale += 1
            logger.info("sglang_ext: dropped a compaction started before a weight update")
        elif job.prefix is None:
            self._fallback(job.token_ids, job.error, job.fit_round)
        else:
            try:
                self._begin(job.token_ids, job.prefix, fit_round=job.fit_round)
            except Exception as e:  # a failed check, no slots, or a device error
                if not isinstance(e, (ValueError, RuntimeError)) or _device_error(e):
                    self.install_error(e)
                self._fallback(job.token_ids, e, job.fit_round)
        self._export(job.latency_s)

    def _fallback(self, token_ids: Any, error: BaseException | None, fit_round: int = 0) -> None:
        """Count a result that will not be installed: `invalid` for a ValueError (it failed a
        check: checksum, shape, echo, magnitude), `failures` otherwise. A failed refit
        (`fit_round` > 0) leaves the installed fit serving; a failed first fit the original
        prefix."""
        invalid = isinstance(error, ValueError)
        self.stats.invalid += invalid
        self.stats.failures += not invalid
        what = "result rejected" if invalid else "failed"
        if fit_round:
            self.trigger.refit_failed(token_ids)
            logger.warning(
                "compaction refit %d %s, the installed fit keeps serving: %r",
                fit_round, what, error,
            )  # fmt: skip
            return
        self.stats.fallbacks += 1
        retry = self.trigger.failed(token_ids)
        logger.warning(
            "compaction %s, prefix stays uncompacted%s: %r",
            what, " (may be retried)" if retry else " (retries spent: cooling down)", error,
        )  # fmt: skip

    def _begin(
        self,
        token_ids: Any,
        prefix: CompactedPrefix,
        t_max: int | None = None,
        fit_round: int = 0,
    ) -> PendingInstall | None:
        """Echo checks (fingerprint, T, prefix hash), bounds from what is left of the original
        prefix (`_original_slots`), slots (`t_max`: the full result's longest head when
        `prefix` is this rank's slice, so every TP rank allocates alike); None if being
        installed already, or installed at this `fit_round` or a later one."""
        ids = [int(t) for t in token_ids]
        T = len(ids)
        if self.fingerprint is None or prefix.model_fingerprint != self.fingerprint:
            raise ValueError(
                f"model fingerprint {prefix.model_fingerprint!r} != {self.fingerprint!r} served"
            )
        if prefix.logical_length != T:
            raise ValueError(f"logical length {prefix.logical_length} != {T} requested tokens")
        phash = prefix_hash(ids)
        if prefix.prefix_hash != phash:
            raise ValueError(f"prefix hash {prefix.prefix_hash!r} != {phash!r} of the tokens")
        current = self._compacted.get(phash)
        info = None if current is None else compaction_info(current)
        newer = info is not None and fit_round > info.fit_round
        if (current is not None and not newer) or any(p.phash == phash for p in self._pending):
            self.stats.double_installs += 1
            return None
        t_max = int(head_counts(prefix).max()) if t_max is None else t_max
        if not 0 < t_max <= T:  # (t_max = T saves nothing: an identity fit, for checks)
            raise ValueError(f"compacted prefix keeps t_max={t_max} of T={T} tokens")
        bounds = original_bounds(self.kvcache, self._original_slots(ids))
        pending = PendingInstall(ids, phash, prefix, self._alloc(t_max), bounds, fit_round)
        self.protected_size_ += t_max  # held, not evictable, until the node takes them
        self._pending.append(pending)
        return pending

    def _advance_installs(self) -> int:
        """Write pending installs in order, `install_chunk_mb` and about `install_step_ms` at
        most; returns how many finished. With `tp`, a written or failed install waits for the
        ranks' agreement (`TpSync.poll`) instead of becoming a node or being freed here."""
        budget, done = self.config.install_chunk_mb << 20, 0
        deadline = time.perf_counter() + self.config.install_step_ms / 1000
        wrote, tp = False, self.tp  # one layer at least per call, then within the budgets
        for pending in list(self._pending):
            if budget <= 0 or (wrote and time.perf_counter() >= deadline):
                break
            if pending.done or (tp is not None and tp.is_failed(pending)):
                continue
            wrote = True
            try:
                budget -= pending.step(self.kvcache, self.beta_store, budget, deadline)
            except Exception as e:  # a failed check, or a device error (CUDA OOM) mid-copy
                if not isinstance(e, ValueError):
                    self.install_error(e)
                if tp is not None:
                    tp.failed_install(pending, e)
                    continue
                self._pending.remove(pending)
                self._abort(pending)
                self._fallback(pending.token_ids, e)
                continue
            if pending.done and tp is None:
                self._pending.remove(pending)
                self._finish(pending)
                done += 1
        return done

    def install_error(self, error: BaseException) -> None:
        """An install raised something other than a failed check: count it (its install is
        aborted by the caller) and tell the hook guard, whose breaker stops compaction after
        repeated errors."""
        self.stats.install_errors += 1
        self.guard.failed("an install", error)

    def trip(self, reason: str) -> None:
        """The circuit breaker opened: no further compaction in this process (results in
        flight are dropped, new ones refused); installed prefixes keep serving."""
        if self.runner is not None:
            self.runner.new_epoch()
        self.fingerprint = None
        self.stats.breaker_open = 1
        self._export()
        logger.error("sglang_ext: compaction off in this server: %s", reason)

    def _abort(self, pending: PendingInstall) -> None:
        self.protected_size_ -= int(pending.slots.numel())
        self.beta_store.clear(pending.slots)
        self.token_to_kv_pool_allocator.free(pending.slots)
        self._refresh_gauges()

    def _finish(self, pending: PendingInstall) -> TreeNode:
        """Add the node of a fully written prefix and retire its original path, or, for a
        refit, the fit it replaces."""
        prefix, ids, t_max = pending.prefix, pending.token_ids, int(pending.slots.numel())
        old = self._compacted.get(pending.phash)
        node = new_compacted_node(
            self.root_node, ids, pending.slots, pending.phash, prefix.method, pending.fit_round
        )
        self._compacted[pending.phash] = node
        self.protected_size_ -= t_max
        self.evictable_size_ += t_max
        self._update_leaf_status(node)
        self._update_leaf_status(self.root_node)
        if old is None:
            self._retire_original(node.key)
        else:
            self._supersede(old)
        self._reap()
        self.trigger.installed(ids)
        self.stats.installed += 1
        self.stats.refits += old is not None
        self._refresh_gauges()
        ratio, error = budget_of(prefix)
        self.stats.chosen_ratio, self.stats.estimated_error = ratio or 0.0, error or 0.0
        logger.info(
            "sglang_ext: installed compacted prefix hash=%s method=%s T=%d slots=%d (%.1fx) "
            "ratio=%s estimated_error=%s%s",
            pending.phash[:12], prefix.method, len(ids), t_max, len(ids) / t_max,
            _fmt(ratio), _fmt(error), f" refit={pending.fit_round}" if old is not None else "",
        )  # fmt: skip
        return node

    def _supersede(self, old: TreeNode) -> None:
        """`old` was replaced by a refit: it and everything below it stop being reachable by
        new requests (no longer in `_compacted`; the refit's node matches) and are freed
        when their requests let go (`_reap`)."""
        self._superseded.add(old)
        self._retire_descendants(old)

    def _retire_descendants(self, node: TreeNode) -> None:
        """Mark every node below `node` for freeing when it is an unlocked leaf (`_reap`)."""
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            self._retired.add(child)
            stack.extend(child.children.values())


def budget_of(prefix: CompactedPrefix) -> tuple[float | None, float | None]:
    """(the kept fraction the compactor used, its held-out error estimate) from the result's
    params: the ratio a `target_error` search chose (or the method's own choice, GVote), else
    the spec's; the estimate only when a target was set."""
    params = prefix.params
    search = params.get("budget_search") or {}
    ratio = params.get("chosen_ratio")
    if ratio is None:
        ratio = params.get("ratio")
    error = search.get("estimated_error")
    return (
        float(ratio) if isinstance(ratio, (int, float)) else None,
        float(error) if isinstance(error, (int, float)) else None,
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _device_error(exc: BaseException) -> bool:
    """A torch device error (OOM, CUDA error) rather than a refusal of the result."""
    return isinstance(exc, torch.OutOfMemoryError) or "CUDA" in str(exc)
