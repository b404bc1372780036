"""Installing a compacted prefix: checks in the KV pool's dtype, writes spread over iterations.

Legend: L layers, H_kv KV heads, D head dim, T logical length, N physical slots, E_l the
entries layer l keeps.

A result reaches the scheduler already checked for structure (`CompactedPrefix.validate`
against the pool's shape, on the runner's thread). The radix cache then installs it at its
poll point in three steps:

1. `PendingInstall` is made by the cache after the echo checks (`check_echo`: fingerprint,
   T, prefix hash) with N freshly allocated slots (its `PackedLayout`) and the magnitude
   bounds of the original prefix's KV (`original_bounds`), read when the prefix was sent to
   compact: the original may have been evicted since, and the result is installed anyway.
2. `step(max_bytes)` casts, checks and writes the next layers, at most `max_bytes` of pool
   writes per call (one layer at least), so a large result does not stall every running
   request for one long copy. `check_layer` runs on the cast tensors: finite in the pool's
   dtype (fp32 -> fp16 overflows to inf), |K| <= KEY_SLACK x and |V| <= VALUE_SLACK x the
   original's max in that layer, beta <= ln T + BETA_SLACK. A failed check raises ValueError
   and the cache frees the slots: nothing of the result was reachable by a request.
3. once every layer is written the cache adds the node. `advance_installs` runs steps 2-3 for
   every pending install at each poll, within the install budgets.

The slack is measured (`benchmarks/server/magnitudes.py`, SmolLM2-135M, T=600, ratios 0.05-0.3,
four methods): kept keys are original keys (1.00x) for every method; least-squares values
reach 9.9x the original max (am-highest); beta stays below ln T. The bounds (2x keys, 24x
values, ln T + 4) keep about twice that headroom and stop overflow-class damage (values x 3e4
are finite in fp32 and wreck every answer on the prefix, values x 64 were let through before);
they cannot tell a plausible wrong result from a right one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from compactor import CompactedPrefix, prefix_hash
from sglang_ext.kv_store import BetaStore, write_layers
from sglang_ext.packing import PackedLayout

if TYPE_CHECKING:
    from sglang_ext.pool_shape import PoolShape

__all__ = [
    "BETA_SLACK",
    "KEY_SLACK",
    "VALUE_SLACK",
    "LayerBounds",
    "OriginalEvicted",
    "PendingInstall",
    "advance_installs",
    "check_echo",
    "check_layer",
    "check_structure",
    "fmt",
    "original_bounds",
]

KEY_SLACK = 2.0
VALUE_SLACK = 24.0
BETA_SLACK = 4.0


class OriginalEvicted(ValueError):
    """No KV of the original prefix is left to read bounds from."""


@dataclass(frozen=True)
class LayerBounds:
    """The largest |K| and |V| a compacted layer may hold, in the pool's units."""

    key_abs: float
    value_abs: float


def original_bounds(kvcache: Any, slots: torch.Tensor) -> list[LayerBounds]:
    """Per layer: KEY_SLACK x max |K| and VALUE_SLACK x max |V| over `slots` [n] int64 of
    `kvcache` (the original prefix's KV). Two host syncs, whatever L. The lifecycle reads
    them when it sends a prefix to compact, while the original is surely cached, and keeps
    them for the result's install.

    Raises:
        OriginalEvicted: `slots` is empty (the original prefix is no longer cached).
    """
    if slots.numel() == 0:
        raise OriginalEvicted(
            "the original prefix is no longer cached, so the result's magnitudes cannot be "
            "checked against it"
        )
    layers = range(kvcache.start_layer, kvcache.start_layer + kvcache.layer_num)
    dev = kvcache.get_key_buffer(kvcache.start_layer).device
    idx = slots.to(dev)
    k = torch.stack([kvcache.get_key_buffer(i)[idx].abs().amax().float() for i in layers])
    v = torch.stack([kvcache.get_value_buffer(i)[idx].abs().amax().float() for i in layers])
    return [
        LayerBounds(KEY_SLACK * kk, VALUE_SLACK * vv)
        for kk, vv in zip(k.tolist(), v.tolist(), strict=True)
    ]


def check_layer(
    layer: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    beta: torch.Tensor,
    bounds: LayerBounds,
    logical_length: int,
) -> None:
    """Raise ValueError naming the layer and the value when a cast layer is out of range.

    Args:
        keys, values: [E, D] in the pool's dtype (any shape with D last). beta: [E] fp32.
            One host sync.
    """
    stats = torch.stack(
        [keys.abs().amax().float(), values.abs().amax().float(), beta.amax().float()]
    ).tolist()
    k_max, v_max, b_max = stats
    beta_max = math.log(logical_length) + BETA_SLACK
    for name, got, limit, slack in (
        ("keys", k_max, bounds.key_abs, KEY_SLACK),
        ("values", v_max, bounds.value_abs, VALUE_SLACK),
    ):
        if not math.isfinite(got):
            raise ValueError(f"layer {layer}: {name} are not finite in {keys.dtype}")
        if got > limit:
            raise ValueError(
                f"layer {layer}: max |{name}| {got:.4g} > {limit:.4g} "
                f"({slack:g}x the original prefix's)"
            )
    if math.isnan(b_max) or b_max > beta_max:
        raise ValueError(
            f"layer {layer}: max beta {b_max:.4g} > ln T + {BETA_SLACK:g} = {beta_max:.4g}"
        )


@dataclass
class PendingInstall:
    """A result being written into the pool, `next_layer` onwards still to do.

    Attributes:
        token_ids: the prefix [T]. phash: its prefix hash. layout: where its entries go,
            in N slots allocated for it and in no tree node yet. bounds: `original_bounds` of the
            prefix.
            fit_round: 0 for a first fit, n for the n-th refit (replaces the installed fit).
            evicted: the original prefix was evicted before the result arrived (its bounds
            were read when it was sent).
    """

    token_ids: list[int]
    phash: str
    prefix: CompactedPrefix
    layout: PackedLayout
    bounds: list[LayerBounds]
    fit_round: int = 0
    evicted: bool = False
    next_layer: int = 0

    @property
    def done(self) -> bool:
        return self.next_layer >= self.prefix.num_layers

    @property
    def slots(self) -> torch.Tensor:
        """[N] int64, the slots the install writes."""
        return self.layout.slots

    def layer_bytes(self, kvcache: Any) -> int:
        """Pool bytes one layer of this prefix writes on average (K and V)."""
        k0 = kvcache.get_key_buffer(kvcache.start_layer)
        per_layer = -(-self.layout.kept_entries // max(self.prefix.num_layers, 1))
        return 2 * per_layer * k0.shape[2] * k0.element_size()

    def step(
        self, kvcache: Any, store: BetaStore, max_bytes: int, deadline: float = math.inf
    ) -> int:
        """Cast, check and write the next layers: at most `max_bytes` of pool writes, and no
        layer started after `deadline` (`time.perf_counter()`), one layer at least. Returns
        the bytes written; mutates the pool, `store` and `next_layer`.

        Raises:
            ValueError: a layer fails `check_layer` (nothing of it was written).
        """
        per_layer = self.layer_bytes(kvcache)
        n = max(1, max_bytes // max(per_layer, 1))
        stop = min(self.prefix.num_layers, self.next_layer + n)
        T, written = len(self.token_ids), 0

        def check(i: int, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> None:
            check_layer(i, k, v, beta, self.bounds[i], T)

        while self.next_layer < stop and (written == 0 or time.perf_counter() < deadline):
            i = self.next_layer
            write_layers(kvcache, store, self.prefix, self.layout, range(i, i + 1), check)
            self.next_layer, written = i + 1, written + per_layer
        return written


def fmt(x: float | None) -> str:
    """`x` in 3 significant digits, "-" for None."""
    return "-" if x is None else f"{x:.3g}"


def check_structure(prefix: CompactedPrefix, fingerprint: str | None, pool: PoolShape) -> None:
    """Structure checks of a result (every KV head of the model, not only this rank's)
    against the pool and the weights served (`fingerprint`; None: compaction is off);
    ValueError naming what differs."""
    if fingerprint is None:
        raise ValueError("compaction is off since the weights were updated")
    prefix.validate(
        expected_fingerprint=fingerprint,
        num_layers=pool.num_layers,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
    )


def check_echo(prefix: CompactedPrefix, fingerprint: str | None, ids: list[int]) -> str:
    """A result is for the weights served (`fingerprint`) and for the tokens `ids` asked:
    its fingerprint, logical length and prefix hash; returns the hash (ValueError naming
    what differs)."""
    if fingerprint is None or prefix.model_fingerprint != fingerprint:
        raise ValueError(
            f"model fingerprint {prefix.model_fingerprint!r} != {fingerprint!r} served"
        )
    if prefix.logical_length != len(ids):
        raise ValueError(f"logical length {prefix.logical_length} != {len(ids)} requested tokens")
    phash = prefix_hash(ids)
    if prefix.prefix_hash != phash:
        raise ValueError(f"prefix hash {prefix.prefix_hash!r} != {phash!r} of the tokens")
    return phash


def advance_installs(
    pending: list[PendingInstall],
    kvcache: Any,
    store: BetaStore,
    config: Any,
    idle: bool,
    done_with: Callable[[PendingInstall, BaseException | None], bool],
    tp: Any = None,
) -> int:
    """Write the `pending` installs in order, `config.install_chunk_mb` and about
    `config.install_step_ms` at most (no bound when `idle`); returns how many finished.
    `done_with(p, error)` takes an install out of `pending` when it is written (error None:
    it becomes a node, True if it did) or failed (it is aborted). With `tp` (the TP
    agreement), a written or failed install waits for the ranks' agreement instead."""
    budget, done = config.install_chunk_mb << 20, 0
    deadline = time.perf_counter() + config.install_step_ms / 1000
    if idle:
        budget, deadline = 1 << 62, float("inf")
    wrote = False  # one layer at least per call, then within the budgets
    for p in list(pending):
        if budget <= 0 or (wrote and time.perf_counter() >= deadline):
            break
        if p.done or (tp is not None and tp.is_failed(p)):
            continue
        wrote = True
        try:
            budget -= p.step(kvcache, store, budget, deadline)
        except Exception as e:  # a failed check, or a device error (CUDA OOM) mid-copy
            if tp is not None:
                tp.failed_install(p, e)
            else:
                done_with(p, e)
            continue
        if p.done and tp is None:
            done += done_with(p, None)
    return done
