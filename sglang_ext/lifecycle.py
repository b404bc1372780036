"""The compacted-prefix state machine: results become installs, installs become nodes.

A compacted prefix is *pending* (a `PendingInstall`, `sglang_ext.installer`: N slots
allocated and counted as protected while its layers are written `install_chunk_mb`, and
about `install_step_ms`, at a time across busy iterations, or whole in an idle one), then
*installed* (a node new requests match; its original path, if still cached, is *retired*:
freed once no request holds it), then *superseded* (a refit took its place), *dropped* (the
weights changed) or evicted. Superseded and dropped nodes stop matching and are freed, with
what hangs below them, when their requests let go (`_reap`). A result that fails a check or
a write frees its slots: the prefix stays uncompacted (or the installed fit keeps serving).
What a result needs from when it was sent, and why one is not installed: `sglang_ext.intake`.

`InstallLifecycle` holds that state and runs the transitions at the scheduler's poll point
(`poll`); structure checks (`check_result`) run on the runner's thread. It reaches the tree
only through `TreeOps` (`sglang_ext.prefix_tree`), which the adapter implements over SGLang's
radix cache. With tensor parallelism the TP strategy (`tp`: `sglang_ext.tp.TpSync`) makes the
ranks agree at each poll on what starts, becomes a node or is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic

from compactor import CompactedPrefix, prefix_hash
from sglang_ext.guard import HookGuard
from sglang_ext.installer import (
    PendingInstall,
    advance_installs,
    check_echo,
    check_structure,
    fmt,
)
from sglang_ext.intake import Intake
from sglang_ext.kv_store import BetaStore, head_counts
from sglang_ext.metrics import CompactionStats, PrometheusExporter
from sglang_ext.packing import PackedLayout
from sglang_ext.prefix_tree import CompactionInfo, N, TreeOps
from sglang_ext.trigger import CompactionTrigger

if TYPE_CHECKING:
    from sglang_ext.config import CompactionConfig
    from sglang_ext.pool_shape import PoolShape
    from sglang_ext.tp import TpSync

__all__ = ["InstallLifecycle"]

logger = logging.getLogger("sglang_ext.lifecycle")


class InstallLifecycle(Generic[N]):
    """The compacted prefixes of one KV pool and their transitions (module docstring).

    Args:
        tree: the tree the prefixes hang in. kvcache: the KV pool it indexes (duck-typed:
            `get_key_buffer`, `start_layer`, `layer_num`), written with its `beta_store`.
        pool_shape: what results must fit. runner: the `CompactionRunner` (None: installs
            only through `install`). exporter: Prometheus series of `stats` (None: none). tp:
            the TP agreement strategy (None: one rank decides alone).
    """

    def __init__(
        self,
        tree: TreeOps[N],
        config: CompactionConfig,
        fingerprint: str | None,
        kvcache: Any,
        beta_store: BetaStore,
        pool_shape: PoolShape,
        runner: Any = None,
        exporter: PrometheusExporter | None = None,
        tp: TpSync | None = None,
    ):
        self.tree, self.config, self.fingerprint = tree, config, fingerprint
        self.kvcache, self.beta_store, self.pool_shape = kvcache, beta_store, pool_shape
        self.runner, self.exporter, self.tp = runner, exporter, tp
        self.stats = CompactionStats()
        self.trigger = CompactionTrigger(config)
        self.guard = HookGuard(self.trip)  # its breaker calls `trip`
        self.pending: list[PendingInstall] = []
        self._compacted: dict[str, N] = {}  # installed, by prefix hash
        self._superseded: set[N] = set()  # replaced by a refit, freed when unlocked
        self._dropped: dict[str, N] = {}  # compacted for old weights, freed when unlocked
        self._retired: set[N] = set()  # original paths, freed when unlocked leaves
        self.intake = Intake(kvcache, tree, self.stats, self.trigger, config.max_in_flight,
                             config.timeout)  # fmt: skip
        if runner is not None:
            runner.check = self.check_result

    # ---- state, read by the tree ------------------------------------------------------
    @property
    def installed(self) -> Mapping[str, N]:
        """The installed compacted nodes by prefix hash (what new requests match)."""
        return self._compacted

    @property
    def dropped(self) -> Mapping[str, N]:
        """Compacted nodes of older weights by prefix hash (never matched, freed unlocked)."""
        return self._dropped

    # ---- the poll point ---------------------------------------------------------------
    def poll(self, idle: bool = False) -> int:
        """Take finished compactions, write pending installs (at most `install_chunk_mb` per
        call; all of them when `idle`: no request runs or waits, so none is stalled), free
        retired nodes, read pool gauges; returns the installs completed. With `tp`, every
        rank must call it at the same scheduler iteration (a collective)."""
        done, before = 0, replace(self.stats)
        if self.runner is not None:
            jobs = self.runner.drain()
            if self.tp is not None:
                done += self.tp.poll(self, jobs)
            else:
                epoch = self.runner.epoch
                for job in [*self.intake.take_waiting(), *jobs]:  # waiting ones first
                    self.intake.take(job, epoch, self.begin, self.install_error)
                    self.export(job.latency_s)
        done += advance_installs(self.pending, self.kvcache, self.beta_store, self.config, idle,
                                 self._done_with, self.tp)  # fmt: skip
        self._reap()
        tree, free, size = self.tree.slot_counts()
        tree -= sum(int(p.slots.numel()) for p in self.pending)
        self.stats.read_store(self.beta_store)
        self.stats.read_pool(free, tree, size)
        if self.stats != before:  # an install failing in the poll that began it counts too
            self.export()
        return done

    def install(self, token_ids: Any, prefix: CompactedPrefix) -> N:
        """Check `prefix` for `token_ids` [T], write it into the pool at once, add its node
        (returned; the existing one for a prefix installed before): `poll`'s path, its writes
        not spread. Mutates pool, store, tree. Raises ValueError (another model, tokens or
        pool shape, or out of range) or PoolFull (no slots even after eviction)."""
        self.check_result(prefix)
        shape = self.pool_shape
        pending = self.begin(token_ids, shape.take(prefix), shape.slots_for(prefix))
        if pending is None:
            node = self._compacted.get(prefix.prefix_hash)
            if node is None:
                raise RuntimeError(f"prefix {prefix.prefix_hash[:12]} is being installed already")
            return node
        try:
            while not pending.done:
                pending.step(self.kvcache, self.beta_store, 1 << 62)
        finally:
            self.pending.remove(pending)
            if not pending.done:
                self.abort(pending)
        return self.finish(pending)

    def check_result(self, prefix: CompactedPrefix) -> None:
        """`installer.check_structure` against the weights served now (the runner's thread)."""
        check_structure(prefix, self.fingerprint, self.pool_shape)

    def submit_next(self, path_tokens: Callable[[Any], list[int] | None]) -> None:
        """Send the trigger's pick (a refit first) to the runner, unless `max_in_flight`
        results are pending (back-pressure: the candidates are found again at their next
        hit). `path_tokens(node)`: the tokens from the root to a trigger candidate."""
        trigger = self.trigger
        if self.runner is None or self.fingerprint is None:
            return
        if not trigger.candidates and not trigger.refit_asked:
            return
        in_flight = self.runner.pending + len(self.pending) + len(self.intake.waiting)
        if in_flight >= self.config.max_in_flight:
            self.stats.deferred += bool(trigger.candidates)
            trigger.candidates.clear()
            return
        picked = trigger.next_refit() or trigger.pick(path_tokens)
        if picked is None:
            return
        self.stats.requested += 1
        logger.info(
            "sglang_ext: compaction requested T=%d hash=%s follow_ups=%d%s",
            len(picked.tokens), prefix_hash(picked.tokens)[:12], len(picked.follow_ups),
            f" (refit {picked.fit_round})" if picked.fit_round else "",
        )  # fmt: skip
        self.send(picked.tokens, picked.follow_ups, fit_round=picked.fit_round)
        self.export()

    def send(self, tokens: list[int], follow_ups: Any, **kwargs: Any) -> None:
        """Send a prefix to compact (`runner.submit`'s arguments), its original's bounds
        kept for the result's install (`Intake.sent`): the original may be evicted meanwhile."""
        self.intake.sent(prefix_hash(tokens), tokens)
        self.runner.submit(tokens, follow_ups, **kwargs)

    # ---- events from SGLang -----------------------------------------------------------
    def on_weights_updated(self, fingerprint: str | None) -> None:
        """The served weights changed: compacted prefixes stop matching at once (freed when
        their requests let go), pending installs and results in flight are dropped, and
        `fingerprint` (None: weights no service holds) is what results must carry now."""
        if self.runner is not None:
            self.runner.new_epoch()
        if self.tp is not None:
            self.tp.clear()
        for pending in self.pending:
            self.abort(pending)
        self.pending.clear()
        self.intake.clear()
        dropped = len(self._compacted)
        for phash, node in list(self._compacted.items()):
            del self._compacted[phash]
            self._dropped[phash] = node
            self._retired.update(self.tree.descendants(node))
        self.trigger.reset()
        old, self.fingerprint = self.fingerprint, fingerprint
        logger.warning(
            "sglang_ext: weights updated: %d compacted prefix(es) dropped, fingerprint %s -> %s%s",
            dropped, old, fingerprint,
            "" if fingerprint else " (compaction off: no service holds these weights)",
        )  # fmt: skip
        self._reap()

    def reset(self) -> None:
        """The tree is flushed (the caller frees its nodes): forget every compacted prefix,
        pending install and retired node, give their beta back, drop results in flight."""
        store = self.beta_store
        for node in [*self._compacted.values(), *self._dropped.values(), *self._superseded]:
            info = self.tree.info(node)
            if info is not None:
                store.clear(info.slots)
        for pending in self.pending:
            store.clear(pending.slots)
        held: Any
        for held in (self._compacted, self._dropped, self._superseded, self.pending, self._retired):
            held.clear()
        self.trigger.reset()
        self.intake.clear()
        if self.runner is not None:
            self.runner.new_epoch()
        if self.tp is not None:
            self.tp.clear()

    def install_error(self, error: BaseException) -> None:
        """An install raised something other than a failed check: count it (aborted by the
        caller) and tell the guard, whose breaker stops compaction after repeated errors."""
        self.stats.install_errors += 1
        self.guard.failed("an install", error)

    def trip(self, reason: str) -> None:
        """The breaker opened: no more compaction here; installed prefixes keep serving."""
        if self.runner is not None:
            self.runner.new_epoch()
        self.fingerprint = None
        self.stats.breaker_open = 1
        self.export()
        logger.error("sglang_ext: compaction off in this server: %s", reason)

    # ---- events from the tree ---------------------------------------------------------
    def freeing(self, node: N, info: CompactionInfo) -> None:
        """The tree frees compacted `node` (evicted, or a replaced or dropped one let go): its
        beta goes back to 0; an evicted prefix may be compacted again."""
        self.beta_store.clear(info.slots)
        if node not in self._superseded:  # (a replaced fit is freed, not evicted)
            self.stats.evicted += 1
            self.trigger.forget(info.prefix_hash)

    def removed(self, node: N, info: CompactionInfo) -> None:
        """Compacted `node` left the tree: no state refers to it any more."""
        for held in (self._compacted, self._dropped):
            if held.get(info.prefix_hash) is node:
                del held[info.prefix_hash]
        self._superseded.discard(node)

    def refresh_gauges(self) -> None:
        """Logical and physical tokens, bytes saved and beta slots of the compacted prefixes."""
        infos = [i for n in self._compacted.values() if (i := self.tree.info(n)) is not None]
        self.stats.read_prefixes(infos, self.kvcache, self.beta_store)

    def export(self, latency_s: float | None = None) -> None:
        if self.exporter is not None:
            self.exporter.update(self.stats, latency_s)

    # ---- transitions (also the TP strategy's) -----------------------------------------
    def begin(
        self,
        token_ids: Any,
        prefix: CompactedPrefix,
        num_slots: int | None = None,
        fit_round: int = 0,
    ) -> PendingInstall | None:
        """Start installing `prefix` for `token_ids` (pending): echo checks (fingerprint, T,
        prefix hash), the bounds kept when it was sent (`Intake.bounds`), slots
        (`num_slots`: the most any TP rank's share needs packed, so all allocate alike;
        default: this prefix's own); None if being installed already, or installed at this
        `fit_round` or a later one. Raises ValueError (a check) or PoolFull (no slots)."""
        ids = [int(t) for t in token_ids]
        T = len(ids)
        phash = check_echo(prefix, self.fingerprint, ids)
        current = self._compacted.get(phash)
        info = None if current is None else self.tree.info(current)
        newer = info is not None and fit_round > info.fit_round
        if (current is not None and not newer) or any(p.phash == phash for p in self.pending):
            self.stats.double_installs += 1
            return None
        tree = self.tree
        bounds, evicted = self.intake.bounds(phash, ids)
        layout = PackedLayout.allocate(head_counts(prefix), T, tree.alloc, tree.free, num_slots)
        self.pending.append(PendingInstall(ids, phash, prefix, layout, bounds, fit_round, evicted))
        tree.hold(layout.num_slots)  # held, not evictable, until the node takes them
        return self.pending[-1]

    def finish(self, pending: PendingInstall) -> N:
        """A written prefix becomes a node (its original path retired, or the fit it refits
        superseded); if the node cannot be made its slots are freed. A later raise is a bug."""
        prefix, ids = pending.prefix, pending.token_ids
        old = self._compacted.get(pending.phash)
        info = CompactionInfo(pending.layout, pending.phash, prefix.method, pending.fit_round)
        try:
            node = self.tree.add_node(ids, info)
        except Exception:
            self.abort(pending)  # written but never reachable: the slots go back
            raise
        self._compacted[pending.phash] = node
        if old is None:
            self._retired.update(self.tree.original_path(ids))
        else:  # the old fit stops matching; freed with what hangs below it when let go
            self._superseded.add(old)
            self._retired.update(self.tree.descendants(old))
        self._reap()
        self.trigger.installed(ids)
        self.intake.done(pending.phash)
        self.stats.installed += 1
        self.stats.installed_evicted += pending.evicted
        self.stats.refits += old is not None
        self.refresh_gauges()
        budget = prefix.budget  # checked when the result was read (`BudgetReport.from_dict`)
        ratio, error = (
            (None, None) if budget is None else (budget.ratio_used, budget.estimated_error)
        )
        self.stats.chosen_ratio, self.stats.estimated_error = ratio or 0.0, error or 0.0
        logger.info(
            "sglang_ext: installed compacted prefix hash=%s method=%s T=%d slots=%d (%.1fx) "
            "entries=%d longest_head=%d ratio=%s estimated_error=%s%s%s",
            pending.phash[:12], prefix.method, len(ids), info.num_slots,
            len(ids) / info.num_slots, info.kept_entries, info.layout.width,
            fmt(ratio), fmt(error), f" refit={pending.fit_round}" if old is not None else "",
            " (its original had been evicted meanwhile)" if pending.evicted else "",
        )  # fmt: skip
        return node

    def abort(self, pending: PendingInstall) -> None:
        """Free a pending install's slots (never reachable by a request)."""
        self.tree.hold(-int(pending.slots.numel()))
        self.beta_store.clear(pending.slots)
        self.tree.free(pending.slots)
        self.refresh_gauges()

    def _done_with(self, pending: PendingInstall, error: BaseException | None) -> bool:
        """A written install becomes a node (True), or a failed one is aborted; a failure
        other than a check is an install error too."""
        self.pending.remove(pending)
        if error is None:
            try:
                self.finish(pending)
                return True
            except Exception as e:  # counted as not installed (`finish` says when)
                self.install_error(e)
                error = e
        else:
            self.abort(pending)
            if not isinstance(error, ValueError):
                self.install_error(error)
        self.intake.reject(pending.token_ids, error)
        return False

    def _reap(self) -> None:
        """Free superseded, dropped and retired nodes that are now unlocked leaves (repeats
        up the path; a retired node no longer in the tree is forgotten)."""
        tree = self.tree
        for node in [*self._dropped.values(), *self._superseded]:
            if tree.unlocked_leaf(node):
                tree.free_node(node)
        progress = True
        while progress and self._retired:
            progress = False
            for node in list(self._retired):
                if not tree.attached(node):
                    self._retired.discard(node)
                elif tree.unlocked_leaf(node):
                    self.stats.retired_tokens_freed += tree.free_node(node)
                    self._retired.discard(node)
                    progress = True
