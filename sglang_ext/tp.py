"""Tensor parallelism: one decision, every rank's KV-head slice installed at the same poll.

Legend: L layers, H_kv KV heads of the model (what the service returns), T prefix tokens.

With `--tp-size` N > 1 every TP rank runs its own scheduler, radix cache and runner, and its
KV pool holds H_kv / N heads (one replicated head when H_kv < N). SGLang keeps the ranks'
trees and pools identical (same requests, same steps); the plugin keeps it so:

- Rank 0 decides: its trigger picks paths, its runner's `on_submit` puts each submission
  (a job id, the tokens, the follow-ups, the fit round) in the outbox. Other ranks' triggers never pick
  (`FollowerTrigger`).
- At every poll each rank takes part in one `all_gather_object` over the scheduler's TP CPU
  group (`TpSync.poll`): rank 0's new submissions, and from every rank the job ids whose
  result it holds (ready), has fully written (written) or failed. Every rank then applies
  the same `Agreement`, in the same order: other ranks submit rank 0's new requests under
  the same job id (the identical request: the service's single-flight and result cache,
  keyed on tokens, spec and dtype, make it one compaction); a job any rank failed is dropped
  everywhere (rank 0's trigger records the failure); a job every rank holds starts its
  install everywhere (as many slots on every rank, the most any rank's heads need packed,
  so the allocators stay equal) if every rank holds the same result (the sha256 each
  verified, `compactor.prefix_digest`: a result the service's cache evicted between two
  ranks' fetches and recomputed differently is dropped everywhere, not installed as two
  trees); a job every rank has written becomes a node everywhere.
- Each rank writes its own heads (`PoolShape.take`: heads [r*H_kv/N, (r+1)*H_kv/N), or head
  r*H_kv//N when H_kv < N) at its own pace; what changes the tree or the allocator (start,
  node, drop) happens only at agreed polls.

Nothing here runs when `--tp-size` is 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compactor import CompactedLayer, CompactedPrefix, describe_error, prefix_digest
from sglang_ext.trigger import CompactionTrigger, Submission

__all__ = [
    "Agreement",
    "FollowerTrigger",
    "RankReport",
    "TpSync",
    "agree",
    "head_range",
    "slice_heads",
]

logger = logging.getLogger(__name__)

# job id, tokens, follow-ups, fit round
Announcement = tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...], int]
Failure = tuple[int, bool, str]  # job id, invalid (a check failed, not the compactor), message


def head_range(model_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The heads [start, stop) of a result that TP rank `tp_rank` of `tp_size` holds.

    Raises:
        ValueError: the sizes do not split (SGLang refuses them too).
    """
    if not 0 <= tp_rank < tp_size or model_kv_heads < 1:
        raise ValueError(
            f"bad head split: rank {tp_rank} of tp_size {tp_size}, {model_kv_heads} KV heads"
        )
    if model_kv_heads >= tp_size:
        if model_kv_heads % tp_size:
            raise ValueError(f"{model_kv_heads} KV heads do not split over tp_size {tp_size}")
        per = model_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % model_kv_heads:
        raise ValueError(f"tp_size {tp_size} does not replicate {model_kv_heads} KV heads")
    start = tp_rank * model_kv_heads // tp_size
    return start, start + 1


def slice_heads(prefix: CompactedPrefix, start: int, stop: int) -> CompactedPrefix:
    """`prefix` with KV heads [start, stop) only (views of its tensors; one host sync per
    layer for the indptr). Metadata (hash, length, fingerprint) is kept.

    Raises:
        ValueError: the range is not inside the prefix's heads.
    """
    if not 0 <= start < stop <= prefix.num_kv_heads:
        raise ValueError(f"heads [{start}, {stop}) not in a result of {prefix.num_kv_heads}")
    layers = []
    for layer in prefix.layers:
        ip = layer.indptr.tolist()
        lo, hi = int(ip[start]), int(ip[stop])
        indptr = (layer.indptr[start : stop + 1].to(torch.int64) - lo).to(layer.indptr.dtype)
        kept = None if layer.kept_indices is None else layer.kept_indices[lo:hi]
        layers.append(
            CompactedLayer(layer.keys[lo:hi], layer.values[lo:hi], layer.beta[lo:hi], indptr, kept)
        )
    return dataclasses.replace(prefix, layers=layers, num_kv_heads=stop - start)


class FollowerTrigger(CompactionTrigger):
    """The trigger of a TP rank other than 0: keeps its bookkeeping, never picks."""

    def pick(self, path_tokens: Callable[[Any], list[int] | None]) -> Submission | None:
        self.candidates.clear()
        return None

    def next_refit(self) -> Submission | None:
        return None


@dataclass(frozen=True)
class RankReport:
    """What one rank says at a poll (picklable; small but for rank 0's new token lists)."""

    rank: int
    submissions: tuple[Announcement, ...] = ()
    ready: tuple[int, ...] = ()
    digests: tuple[str, ...] = ()  # the sha256 of each `ready` result, in the same order
    written: tuple[int, ...] = ()
    failed: tuple[Failure, ...] = ()
    broken: str = ""  # why this rank's tree may differ from the others' ("" when it does not)


@dataclass(frozen=True)
class Agreement:
    """What every rank does after a poll's exchange, in this order: submit, drop, begin,
    finish (job ids; `drop` maps a job to the first failure reported for it). A non-empty
    `halt` (a rank whose agreed finish failed) stops compaction on every rank instead."""

    submissions: tuple[Announcement, ...]
    drop: dict[int, Failure]
    begin: tuple[int, ...]
    finish: tuple[int, ...]
    halt: str = ""


def agree(reports: Sequence[RankReport]) -> Agreement:
    """The same decision on every rank from all ranks' reports (ordered by rank 0's)."""
    drop: dict[int, Failure] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        for job, invalid, msg in report.failed:
            drop.setdefault(job, (job, invalid, f"rank {report.rank}: {msg}"))
    first = min(reports, key=lambda r: r.rank)

    def everywhere(attr: str) -> tuple[int, ...]:
        sets = [set(getattr(r, attr)) for r in reports]
        return tuple(j for j in getattr(first, attr) if j not in drop and all(j in s for s in sets))

    begin = everywhere("ready")
    held = {r.rank: dict(zip(r.ready, r.digests, strict=True)) for r in reports}
    for job in begin:
        seen = {rank: digests[job] for rank, digests in held.items()}
        if len(set(seen.values())) > 1:
            drop[job] = (job, False, f"ranks hold different results (sha256 {seen})")
    begin = tuple(j for j in begin if j not in drop)
    halt = next((f"rank {r.rank}: {r.broken}" for r in sorted(reports, key=lambda r: r.rank)
                 if r.broken), "")  # fmt: skip
    return Agreement(first.submissions, drop, begin, everywhere("written"), halt)


@dataclass
class TpSync:
    """One rank's side of the TP agreement (see the module docstring).

    Attributes:
        group: the torch.distributed group to exchange over (the scheduler's TP CPU group,
            gloo). rank / size: this rank and the TP size.
        exchange_fn: replaces the all_gather (tests); gets this rank's report, returns all.
    """

    group: Any
    rank: int
    size: int
    exchange_fn: Callable[[RankReport], list[RankReport]] | None = None
    polls: int = 0
    _outbox: list[Announcement] = field(default_factory=list)
    _tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)  # job -> prefix [T]
    _rounds: dict[int, int] = field(default_factory=dict)  # job -> fit round (refits only)
    _held: dict[int, tuple[CompactedPrefix, int, str]] = field(
        default_factory=dict
    )  # + slots, sha256
    _begun: dict[int, Any] = field(default_factory=dict)  # job -> PendingInstall
    _failed: dict[int, tuple[bool, str]] = field(default_factory=dict)
    _dropped: set[int] = field(default_factory=set)  # decided before this rank's result came
    _broken: str = ""  # an agreed finish failed here: this rank's tree may differ
    _halted: bool = False  # a rank reported itself broken: compaction is off everywhere

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} not in [0, {self.size})")

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @property
    def held(self) -> int:
        """Results this rank holds that are not yet installing (waiting for other ranks)."""
        return len(self._held)

    def on_submit(
        self, job: int, token_ids: Sequence[int], follow_ups: Any, fit_round: int = 0
    ) -> None:
        """Rank 0's runner hook: announce the submission at the next poll."""
        tokens = tuple(int(t) for t in token_ids)
        self._tokens[job] = tokens
        if fit_round:
            self._rounds[job] = fit_round
        fus = tuple(tuple(int(t) for t in f) for f in follow_ups)
        self._outbox.append((job, tokens, fus, fit_round))

    def failed_install(self, pending: Any, error: BaseException) -> None:
        """A layer of `pending` failed its check here: stop writing it, drop it everywhere
        at the next poll (its slots stay held until then)."""
        for job, p in self._begun.items():
            if p is pending:
                self._failed[job] = (isinstance(error, ValueError), str(error))

    def is_failed(self, pending: Any) -> bool:
        return any(p is pending and job in self._failed for job, p in self._begun.items())

    def clear(self) -> None:
        """Weights updated (on every rank at the same poll): forget every job."""
        held: Any
        for held in (
            self._outbox,
            self._tokens,
            self._rounds,
            self._held,
            self._begun,
            self._failed,
        ):
            held.clear()
        self._dropped.clear()

    def poll(self, lc: Any, jobs: Sequence[Any]) -> int:
        """Take this rank's finished `jobs`, exchange reports, apply the agreement to `lc`
        (the rank's `sglang_ext.lifecycle.InstallLifecycle`: its runner, transitions and
        stats); returns the installs completed. Mutates `lc` and this object; every rank
        must call it at the same poll."""
        for job in jobs:
            self._intake(lc, job)
        alive = {id(p) for p in lc.pending}  # a cache reset drops pending installs
        for job in [j for j, p in self._begun.items() if id(p) not in alive]:
            del self._begun[job]
            self._tokens.pop(job, None)
            self._rounds.pop(job, None)
            self._failed.pop(job, None)
        deal = agree(self._exchange(self._report()))
        self.polls += 1
        if deal.halt:  # the trees may differ: no rank compacts again (installed ones serve)
            if not self._halted:
                self._halted = True
                lc.trip(f"tp ranks out of step ({deal.halt})")
            return 0
        if not self.leads:
            for job, tokens, fus, fit_round in deal.submissions:
                self._tokens[job] = tokens
                if fit_round:
                    self._rounds[job] = fit_round
                lc.stats.requested += 1
                lc.send(list(tokens), [list(f) for f in fus], job_id=job, fit_round=fit_round)
        for job, failure in deal.drop.items():
            self._drop(lc, job, failure)
        for job in deal.begin:
            self._begin(lc, job)
        done = 0
        for job in deal.finish:
            pending = self._begun.pop(job)
            self._tokens.pop(job, None)
            self._rounds.pop(job, None)
            lc.pending.remove(pending)
            try:
                lc.finish(pending)
            except Exception as e:  # the other ranks finished it: say so at the next poll
                self._broken = f"finishing job {job}: {describe_error(e)}"
                logger.error("sglang_ext: tp rank %d: %s", self.rank, self._broken)
                return done
            done += 1
        return done

    # ---- helpers ----------------------------------------------------------------------
    def _report(self) -> RankReport:
        written = tuple(j for j, p in self._begun.items() if p.done and j not in self._failed)
        failed = tuple((j, inv, msg) for j, (inv, msg) in self._failed.items())
        subs, self._outbox = tuple(self._outbox), []
        digests = tuple(held[2] for held in self._held.values())
        return RankReport(
            self.rank, subs, tuple(self._held), digests, written, failed, self._broken
        )

    def _exchange(self, report: RankReport) -> list[RankReport]:
        if self.exchange_fn is not None:
            return self.exchange_fn(report)
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, report, group=self.group)
        return out

    def _intake(self, lc: Any, job: Any) -> None:
        """One finished job of this rank's runner: hold its head slice, or note its failure."""
        lc.stats.last_latency_s = job.latency_s
        lc.export(job.latency_s)
        if job.epoch != lc.runner.epoch:
            lc.stats.stale += 1
            return
        if job.job_id in self._dropped:
            self._dropped.discard(job.job_id)
            return
        if job.job_id not in self._tokens:
            logger.warning(
                "sglang_ext: tp rank %d: result of unknown job %d", self.rank, job.job_id
            )
            return
        error: BaseException | None = job.error
        if job.prefix is not None:
            try:
                slots = lc.pool_shape.slots_for(job.prefix)
                mine = lc.pool_shape.take(job.prefix)
                self._held[job.job_id] = (mine, slots, prefix_digest(job.prefix))
                return
            except ValueError as e:
                error = e
        self._failed[job.job_id] = (isinstance(error, ValueError), describe_error(error))

    def _begin(self, lc: Any, job: int) -> None:
        prefix, slots, _ = self._held.pop(job)
        try:
            pending = lc.begin(
                self._tokens[job], prefix, num_slots=slots, fit_round=self._rounds.get(job, 0)
            )
        except Exception as e:  # any failure to start: dropped everywhere at the next poll
            self._failed[job] = (isinstance(e, ValueError), describe_error(e))
            return
        if pending is None:  # installed or being installed already (the same on every rank)
            self._tokens.pop(job, None)
            self._rounds.pop(job, None)
        else:
            self._begun[job] = pending

    def _drop(self, lc: Any, job: int, failure: Failure) -> None:
        _, invalid, msg = failure
        known = job in self._held or job in self._begun or job in self._failed
        self._held.pop(job, None)
        self._failed.pop(job, None)
        pending = self._begun.pop(job, None)
        if pending is not None:
            lc.pending.remove(pending)
            lc.abort(pending)
        if not known:
            self._dropped.add(job)  # this rank's result is still to come: discard it then
        tokens = self._tokens.pop(job, ())
        error = ValueError(msg) if invalid else RuntimeError(msg)
        lc.intake.reject(tokens, error, self._rounds.pop(job, 0))
