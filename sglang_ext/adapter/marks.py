"""Host marks: each request's compacted prefix, stored on the ForwardBatch from its ScheduleBatch.

`mark_forward_batch` runs in the AFTER hook on `ForwardBatch.init_new`, which still sees the
ScheduleBatch's requests: it walks each request's `last_node` up to the radix root's child
(`compacted_ancestor`; a compacted prefix hangs off the root) and stores its row and the
prefix's layout. No device memory is read, so the overlap scheduler keeps its lead; the
attention backend and the compacted graph variant decide from these marks.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from sglang_ext.adapter.compacted_node import compacted_ancestor
from sglang_ext.kv_store import BetaStore
from sglang_ext.packing import PackedLayout

__all__ = ["MARKS_ATTR", "HostMarks", "mark_forward_batch"]

logger = logging.getLogger(__name__)
# The ForwardBatch attribute `mark_forward_batch` sets.
MARKS_ATTR = "compaction_marks"


class HostMarks(NamedTuple):
    """Per request of a ForwardBatch, from its ScheduleBatch: the req_to_token row and the
    layout of the compacted prefix it sits on (None: none)."""

    rows: list[int]
    prefixes: list[PackedLayout | None]


def mark_forward_batch(forward_batch: Any, schedule_batch: Any) -> None:
    """Store `HostMarks` on `forward_batch` when its requests are known and a compacted
    prefix is installed (mutates `forward_batch`; host work only)."""
    cache = getattr(schedule_batch, "tree_cache", None)
    store = getattr(cache, "beta_store", None)
    reqs = getattr(schedule_batch, "reqs", None)
    rows_cpu = getattr(schedule_batch, "req_pool_indices_cpu", None)  # host [B] int64
    if not isinstance(store, BetaStore) or not store.prefixes or not reqs or rows_cpu is None:
        return
    rows = [int(r) for r in rows_cpu.tolist()]
    if len(rows) != len(reqs):
        return
    infos = [compacted_ancestor(getattr(r, "last_node", None)) for r in reqs]
    prefixes = [None if i is None else i.layout for i in infos]
    setattr(forward_batch, MARKS_ATTR, HostMarks(rows, prefixes))
    if not store.marks_seen:
        store.marks_seen = True
        logger.info("sglang_ext: compacted requests are marked on the host from now on")
