"""What a compaction result must fit in this server's KV pool, and the echo of what was asked.

`PoolShape` (layers, the model's KV heads, head dim, dtype, and this TP rank's share of the
heads) gives the slots a result takes packed and the largest valid result for a prefix, which
bounds the stream a client accepts; `echo_check` refuses a result of another method or over
its budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compactor import CompactedPrefix

__all__ = ["METADATA_BYTES", "PoolShape", "echo_check"]


# The metadata JSON a result may carry: ~1 KB for the plugin's methods on SmolLM2; GVote's
# per-(layer, chunk) reports reach ~1 MiB on large models.
METADATA_BYTES = 4 << 20


@dataclass(frozen=True)
class PoolShape:
    """What a result must fit: L, the model's H_kv (a result has every head), D, the pool's
    dtype, and the heads [head_start, head_start + pool_heads) this rank's pool holds (all of
    them without tensor parallelism; see `sglang_ext.tp.head_range`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype
    head_start: int = 0
    pool_heads: int | None = None  # None: num_kv_heads

    def __post_init__(self) -> None:
        heads = self.pool_heads if self.pool_heads is not None else self.num_kv_heads
        if not (self.head_start >= 0 and 0 < heads <= self.num_kv_heads - self.head_start):
            raise ValueError(
                f"pool heads [{self.head_start}, {self.head_start + heads}) not in the model's "
                f"{self.num_kv_heads} KV heads"
            )

    @classmethod
    def of(
        cls, kvcache: Any, model_kv_heads: int | None = None, tp_rank: int = 0, tp_size: int = 1
    ) -> PoolShape:
        """The shape of `kvcache`; with `model_kv_heads`, of TP rank `tp_rank` of `tp_size`.

        Raises:
            ValueError: the pool does not hold that rank's share of the model's heads.
        """
        from sglang_ext.tp import head_range

        k0 = kvcache.get_key_buffer(kvcache.start_layer)  # [S, H_kv / tp, D]
        layers, pool_heads, dim = int(kvcache.layer_num), int(k0.shape[1]), int(k0.shape[2])
        if model_kv_heads is None:
            return cls(layers, pool_heads, dim, k0.dtype)
        start, stop = head_range(int(model_kv_heads), tp_rank, tp_size)
        if stop - start != pool_heads:
            raise ValueError(
                f"KV pool holds {pool_heads} heads; rank {tp_rank} of tp_size {tp_size} should "
                f"hold {stop - start} of the model's {model_kv_heads}"
            )
        return cls(layers, int(model_kv_heads), dim, k0.dtype, start, pool_heads)

    @property
    def sliced(self) -> bool:
        """Whether this pool holds only some of a result's heads."""
        return self.pool_heads is not None and self.pool_heads != self.num_kv_heads

    def take(self, prefix: CompactedPrefix) -> CompactedPrefix:
        """This pool's heads of a full `prefix` [L layers x H_kv heads] (views; `prefix`
        itself when the pool holds every head)."""
        if self.pool_heads is None or not self.sliced:
            return prefix
        from sglang_ext.tp import slice_heads

        return slice_heads(prefix, self.head_start, self.head_start + self.pool_heads)

    def slots_for(self, prefix: CompactedPrefix) -> int:
        """The slots a full `prefix` takes packed in every rank's pool (`packing`): the most
        any rank's share of its heads needs, so every TP rank allocates alike."""
        from sglang_ext.kv_store import head_counts
        from sglang_ext.packing import slots_needed

        counts = head_counts(prefix)
        per = self.pool_heads or self.num_kv_heads
        return max(slots_needed(counts[:, h : h + per]) for h in range(0, counts.shape[1], per))

    def max_result_bytes(self, logical_length: int, budget_tokens: int | None = None) -> int:
        """The largest valid result for a prefix of T = `logical_length` tokens (keys and
        values in the pool's dtype): at most L * H_kv * min(T, 2t) entries with the spec's
        per-head budget t = `budget_tokens`, every head keeping T without one."""
        from compactor import max_result_bytes

        return max_result_bytes(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            logical_length,
            self.dtype,
            budget_tokens,
            metadata_allowance=METADATA_BYTES,
        )


def echo_check(prefix: CompactedPrefix, method: str, T: int, budget: int | None) -> None:
    """The result is what was asked for: `method`'s, and within the budget (at most
    L * H_kv * min(T, 2 * budget) entries; any count up to T a head without one). Raises
    ValueError naming what differs (the cache counts it invalid and keeps the prefix)."""
    if prefix.method != method:
        raise ValueError(f"result of method {prefix.method!r}, asked for {method!r}")
    per_head = T if budget is None else min(T, 2 * budget)
    cap = prefix.num_layers * prefix.num_kv_heads * per_head
    kept = prefix.kept_tokens()
    if kept > cap:
        raise ValueError(f"result keeps {kept} entries, over {cap} for budget {budget} of T={T}")
