"""The probe's fixture (`unified_cache_probe`): a real `UnifiedRadixCache` on CPU with a tiny KV
pool, page size 1 and the FULL component only, that records what its allocator is given back.

Sizes: POOL KV slots; a compacted prefix of L logical tokens keeps T slots; K < L tokens of a
shorter shared prefix; token ids BASE_ID .. BASE_ID + L - 1.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

__all__ = ["ALIAS_SLOT", "BASE_ID", "POOL", "K", "L", "Probe", "T", "ids", "key"]

POOL = 64  # KV slots
L, T, K = 16, 4, 6  # logical tokens, kept slots, a shorter shared prefix (K < L)
ALIAS_SLOT = 0  # SGLang's padding slot, the plugin's alias entry (sglang_ext's kv store)
BASE_ID = 1000  # token ids of the compacted prefix: BASE_ID .. BASE_ID + L - 1


def key(ids: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", ids), None)


def ids(n: int = L) -> list[int]:
    return list(range(BASE_ID, BASE_ID + n))


def _slot_full() -> type:
    """A FULL component that counts and frees a compacted value's physical slots only: the
    Python tree core's per-component hooks (`reclaimable_value_len`, `evict_component`)."""
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

    class SlotFull(FullComponent):
        def reclaimable_value_len(self, node: Any) -> int:
            value = node.component_data[self.component_type].value
            return 0 if value is None else int((value != ALIAS_SLOT).sum())

        def evict_component(self, node, device_frees, host_frees, cache_actions, *a, **kw):  # type: ignore[no-untyped-def]
            cd = node.component_data[self.component_type]
            full = cd.value
            if full is not None:
                cd.value = full[full != ALIAS_SLOT]  # what the allocator gets back
            try:
                return super().evict_component(
                    node, device_frees, host_frees, cache_actions, *a, **kw
                )
            finally:
                if full is not None:
                    cd.value = full  # the tree core clears it itself

    return SlotFull


class Probe:
    """One `UnifiedRadixCache` with a tiny pool; records what the allocator is given back."""

    def __init__(self, core: str, custom_full: bool = False):
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        kv = MHATokenToKVPool(POOL, 1, torch.float32, 1, 8, 1, "cpu", False)
        self.alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kv, False)
        self.freed: list[int] = []
        self._freeing = False
        for name in ("free", "free_segment", "free_full_segment"):
            self._record(name)
        override = {ComponentType.FULL: _slot_full()} if custom_full else None
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(4, 4 * L, "cpu", False),
            token_to_kv_pool_allocator=self.alloc,
            page_size=1,
            tree_components=(ComponentType.FULL,),
            component_registry_override=override,
            tree_core_backend=core,
        )
        from sglang.srt.mem_cache.unified_cache import tree_core_registry

        # why the registry builds the Python core for a Rust request (None: it does not)
        self.fallback = tree_core_registry._rust_fallback_reason(params)
        self.cache = UnifiedRadixCache(params)
        self.core = type(self.cache.tree_core).__name__
        self.full = ComponentType.FULL

    def _record(self, name: str) -> None:
        inner = getattr(self.alloc, name)

        def wrapped(indices: torch.Tensor, *a: Any, **kw: Any) -> Any:
            outer = not self._freeing  # free_segment calls free: count the outer call only
            if outer:
                self.freed.extend(int(i) for i in indices.flatten())
            self._freeing = True
            try:
                return inner(indices, *a, **kw)
            finally:
                self._freeing = not outer

        setattr(self.alloc, name, wrapped)

    def slots(self, n: int) -> torch.Tensor:
        out = self.alloc.alloc(n)
        assert out is not None
        return out.to(torch.int64)

    def compacted_value(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(t physical slots, the L-long value the plugin stores for them)."""
        phys = self.slots(T)
        return phys, torch.cat([phys, torch.full((L - T,), ALIAS_SLOT, dtype=torch.int64)])

    def insert(self, ids: list[int], value: torch.Tensor) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        return self.cache.insert(InsertParams(key=key(ids), value=value))

    def match(self, ids: list[int]) -> tuple[Any, list[int]]:
        """The match and the device indices it hands a request (the first device_prefix_len
        of the path's values, as `prefix_device_indices` does)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        m = self.cache.match_prefix(MatchPrefixParams(key=key(ids)))
        path = self.cache.tree_core.collect_full_device_indices(
            m.last_device_node, self.cache.root_node_handle()
        )
        return m, [int(i) for i in path[: m.device_prefix_len]]

    def sizes(self) -> dict[str, int]:
        return {
            "evictable": int(self.cache.evictable_size()),
            "protected": int(self.cache.protected_size()),
        }

    def insert_and_lock(self, value: torch.Tensor) -> tuple[dict[str, int], dict[str, int]]:
        """Insert `value` for the probe's ids; the sizes unlocked, then under a lock (released)."""
        res = self.insert(ids(), value)
        unlocked = self.sizes()
        lock = self.cache.lock(res.last_device_node)
        locked = self.sizes()
        self.cache.unlock(lock)
        return unlocked, locked
