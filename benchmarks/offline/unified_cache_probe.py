"""Can a compacted prefix live in SGLang's default cache, `UnifiedRadixCache`? A probe.

A compacted node keeps its logical key of L tokens but holds t < L KV slots: the plugin
stores it as a value L long, the t physical slots then L - t copies of `ALIAS_SLOT`
(`sglang_ext.kv_store`), counts t in the evictable/protected sizes, frees only the t slots,
is matched whole or not at all, carries its compaction info, and hangs beside the ordinary
path of the same tokens until that path is retired (the plugin's `CompactionRadixCache`).

This script builds a real `UnifiedRadixCache` on CPU (a 64-slot KV pool, page size 1, the
FULL component only) for each tree core, SGLang's Python `UnifiedTreeCore` and the Rust
`RustUnifiedTreeCore`, and tries each operation a compacted node needs through the cache's
own API. Per tree core and operation it records `status` (`ok`: the cache does what the
node needs; `wrong`: it accepts the operation and gives a result the node cannot use;
`error`: it raises, with the exact message) and the figures measured.

    .venv/bin/python -m benchmarks.offline.unified_cache_probe [--out FILE]
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
from pathlib import Path
from typing import Any

from benchmarks import RESULTS
from benchmarks.offline._unified_cache import ALIAS_SLOT, POOL, K, L, Probe, T, ids
from harness.provenance import provenance

CORES = ("python", "rust")


def _error(e: BaseException) -> dict[str, Any]:
    return {"status": "error", "error": f"{type(e).__name__}: {e}"}


def _run(op: Any) -> dict[str, Any]:
    try:
        out: dict[str, Any] = op()
        return out
    except Exception as e:  # the finding is the exception itself
        return _error(e)


def _verdict(good: bool, **figures: Any) -> dict[str, Any]:
    return {"status": "ok" if good else "wrong", **figures}


def probe_core(core: str) -> dict[str, Any]:
    """Every operation on a fresh cache of tree core `core`: {operation: record}, plus
    `tree_core` (the class actually built: a Rust request the registry resolves to the
    Python core says so)."""
    try:
        base = Probe(core)
    except Exception as e:
        return {"tree_core": None, "construct": _error(e)}
    ops: dict[str, Any] = {"tree_core": base.core, "construct": {"status": "ok"}}

    def insert_short_value() -> dict[str, Any]:
        """(a) a value of t slots for a key of L tokens, as the node holds them."""
        p = Probe(core)
        res = p.insert(ids(), p.slots(T))
        m, got = p.match(ids(L + 2))
        return _verdict(
            m.device_prefix_len == L,
            inserted_prefix_len=res.prefix_len,
            match_device_prefix_len=m.device_prefix_len,
            match_full_kv_hit_length=m.full_kv_hit_length,
            served_indices=got,
            logical_length=L,
            note="accepted; a match through it reports device_prefix_len "
            f"{m.device_prefix_len} for {L} cached tokens",
        )

    def insert_padded_and_match() -> dict[str, Any]:
        """The plugin's form: L entries, t slots then ALIAS_SLOT; a whole match through it."""
        p = Probe(core)
        _, value = p.compacted_value()
        p.insert(ids(), value)
        m, got = p.match(ids(L + 2))
        return _verdict(
            m.device_prefix_len == L and got == value.tolist(),
            match_device_prefix_len=m.device_prefix_len,
            indices_are_the_value=got == value.tolist(),
        )

    def slot_accounting() -> dict[str, Any]:
        """(d) evictable, then protected under a lock: t slots, not L tokens."""
        p = Probe(core)
        _, value = p.compacted_value()
        unlocked, locked = p.insert_and_lock(value)
        return _verdict(
            unlocked["evictable"] == T and locked["protected"] == T,
            unlocked=unlocked,
            locked=locked,
            physical_slots=T,
        )

    def adjust_size_then_lock() -> dict[str, Any]:
        """(d) the tree core's `adjust_component_size`: count t, then lock, unlock, evict."""
        p = Probe(core)
        _, value = p.compacted_value()
        res = p.insert(ids(), value)
        p.cache.tree_core.adjust_component_size(res.last_device_node, p.full, T - L)
        adjusted = p.sizes()
        lock = p.cache.lock(res.last_device_node)
        locked = p.sizes()
        p.cache.unlock(lock)
        unlocked = p.sizes()
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        ev = p.cache.evict(EvictParams(num_tokens=L))
        after = p.sizes()
        good = (
            adjusted["evictable"] == T
            and locked["protected"] == T
            and unlocked["evictable"] == T
            and after["evictable"] == 0
            and ev.num_tokens_evicted == T
        )
        return _verdict(
            good,
            adjusted=adjusted,
            locked=locked,
            unlocked=unlocked,
            evicted=ev.num_tokens_evicted,
            after_evict=after,
        )

    def split_inside() -> dict[str, Any]:
        """(c) a key sharing only the first K < L tokens: the node must match whole or not at
        all (its slots stand for the whole prefix, not for positions 0..K-1)."""
        p = Probe(core)
        _, value = p.compacted_value()
        res = p.insert(ids(), value)
        m, got = p.match([*ids(K), 7, 8, 9])
        return _verdict(
            m.device_prefix_len == 0,
            match_device_prefix_len=m.device_prefix_len,
            served_indices=got,
            node_split=m.last_device_node != res.last_device_node,
            note=f"a {K}-token partial match is served the first {m.device_prefix_len} "
            "entries of the compacted value",
        )

    def evict() -> dict[str, Any]:
        """Eviction frees the t physical slots only, never ALIAS_SLOT."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        p = Probe(core)
        phys, value = p.compacted_value()
        p.insert(ids(), value)
        p.freed.clear()
        ev = p.cache.evict(EvictParams(num_tokens=L))
        return _verdict(
            sorted(p.freed) == sorted(phys.tolist()),
            num_tokens_evicted=ev.num_tokens_evicted,
            freed_alias_slot=p.freed.count(ALIAS_SLOT),
            freed=len(p.freed),
            physical_slots=T,
        )

    def install_beside_original() -> dict[str, Any]:
        """The same L tokens already cached in full (the original path, retired only after
        the install): the compacted node must hang beside it and be what a match returns."""
        p = Probe(core)
        p.insert(ids(), p.slots(L))
        phys, value = p.compacted_value()
        p.freed.clear()
        res = p.insert(ids(), value)
        _, got = p.match(ids(L + 2))
        return _verdict(
            got == value.tolist(),
            insert_prefix_len=res.prefix_len,
            compacted_slots_freed=sorted(set(p.freed) & set(phys.tolist()))
            == sorted(phys.tolist()),
            freed_alias_slot=p.freed.count(ALIAS_SLOT),
            match_returns_original=got[:T] != phys.tolist(),
        )

    def per_node_data() -> dict[str, Any]:
        """(b) compaction info on the node, still on the whole node after a split."""
        p = Probe(core)
        _, value = p.compacted_value()
        res = p.insert(ids(), value)
        node = p.cache.tree_core.node_by_id(res.last_device_node)
        node.compaction = "info"
        m, _ = p.match([*ids(K), 7, 8, 9])
        front = p.cache.tree_core.node_by_id(m.last_device_node)
        return _verdict(
            getattr(front, "compaction", None) == "info",
            attached=True,
            front_after_split_has_it=getattr(front, "compaction", None) == "info",
            tail_after_split_has_it=getattr(node, "compaction", None) == "info",
            tail_key_len=len(node.key),
        )

    def custom_full_component() -> dict[str, Any]:
        """(d, e) a FULL component that counts and frees the physical slots only, through
        `CacheInitParams.component_registry_override`."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        p = Probe(core, custom_full=True)
        phys, value = p.compacted_value()
        unlocked, locked = p.insert_and_lock(value)
        p.freed.clear()
        ev = p.cache.evict(EvictParams(num_tokens=L))
        good = (
            p.core == base.core
            and unlocked["evictable"] == T
            and locked["protected"] == T
            and sorted(p.freed) == sorted(phys.tolist())
        )
        return _verdict(
            good,
            tree_core=p.core,
            note=f"the Python tree core built instead: {p.fallback}"
            if p.core != base.core
            else "hooks honoured by this tree core",
            unlocked=unlocked,
            locked=locked,
            evicted=ev.num_tokens_evicted,
            freed_alias_slot=p.freed.count(ALIAS_SLOT),
        )

    for op in (
        insert_short_value,
        insert_padded_and_match,
        slot_accounting,
        adjust_size_then_lock,
        split_inside,
        evict,
        install_beside_original,
        per_node_data,
        custom_full_component,
    ):
        ops[op.__name__] = {"what": " ".join((op.__doc__ or "").split()), **_run(op)}
    return ops


def interface() -> dict[str, Any]:
    """What the tree-core interface offers a match hook, read from its signatures."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
        UnifiedTreeCoreInterface,
    )

    args = list(inspect.signature(UnifiedTreeCoreInterface.match_prefix).parameters)
    return {
        "match_prefix_args": args,
        "match_prefix_params_fields": list(MatchPrefixParams.__dataclass_fields__),
        "note": "the walk always starts at the root: no entry point continues a match below "
        "a given node, and child keys come from the token key (no private child key)",
    }


def run() -> dict[str, Any]:
    """The probe's findings: {"sizes", "interface", "cores": {core: {operation: record}}}."""
    import sglang

    return {
        "sglang": sglang.__version__,
        "sizes": {"pool_slots": POOL, "logical_tokens": L, "kept_slots": T, "shared_prefix": K},
        "interface": interface(),
        "cores": {core: probe_core(core) for core in CORES},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "unified_cache_probe.json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = {"provenance": provenance(argv), **run()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    for core, ops in out["cores"].items():
        print(f"{core}: {ops.get('tree_core')}")
        for name, rec in ops.items():
            if isinstance(rec, dict):
                print(f"  {name:26s} {rec['status']:7s} {rec.get('error', '')}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
