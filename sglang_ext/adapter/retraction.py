"""PD decode retraction with a `cpu_tensor` backup, for requests served from a compacted
prefix.

SGLang's decode retraction (`release_req`, `managers/schedule_batch.py` 2360-2395) copies the
request's row to the host (`backup_kv_cache` -> `Req.offload_kv_cache`), releases the row,
which unlocks the request's tree node, and clears `last_node` and `lock`. On resume
(`resume_retracted_reqs`, `disaggregation/decode.py` 1021-1100) `_pre_alloc` allocates fresh
slots for the whole row and `restore_kv_cache` (`Req.load_kv_cache`) writes the copy there: the
compacted prefix's packed entries would become `T` plain tokens without beta, and the request
would no longer be marked as compacted. Three AFTER hooks (serving processes only) keep it
right:

- `retain` (after `backup_kv_cache`, before the row is released): lock the compacted node on
  the request's path for the request (`RETAINED_ATTR`), so it cannot be evicted meanwhile;
- `repoint` (after `restore_kv_cache`): point the row's first `T` positions back at the
  compacted node's slots, free the fresh slots `_pre_alloc` gave them, and make the node the
  request's `last_node`, its lock the request's `lock`, `prefix_len` and `cache_protected_len`
  `T` (a request that matched the compacted prefix at admission has the same); the rest of the
  row keeps the restored copy of the request's own KV;
- `release` (after `discard_kv_cache_backup`, which decode and the scheduler's abort of a
  retracted request call): unlock it for a request that never resumes.

The hooks sit on the functions where SGLang defines them (`mem_cache/common.py`); its hook
registry carries them to the modules that imported them.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_ext.adapter.compacted_node import compaction_info

__all__ = ["RETAINED_ATTR", "release", "repoint", "retain"]

logger = logging.getLogger(__name__)
# The request's lock on its compacted node while it is retracted (a SGLang TreeLock).
RETAINED_ATTR = "compaction_retained"


def retain(req: Any, tree_cache: Any, backend: str) -> bool:
    """Lock the compacted node on `req`'s path for it, stored as `RETAINED_ATTR` (mutates
    `req` and the tree's lock counts). Only for a `cpu_tensor` backup of a request served
    from a compacted prefix; returns whether it locked."""
    if backend != "cpu_tensor" or getattr(req, RETAINED_ATTR, None) is not None:
        return False
    node = _compacted_node(getattr(req, "last_node", None))
    if node is None:
        return False
    setattr(req, RETAINED_ATTR, tree_cache.lock(node))
    return True


def repoint(req: Any, tree_cache: Any, req_to_token_pool: Any, allocator: Any) -> int:
    """After SGLang restored `req`'s row into fresh slots: point its first `T` positions at
    the retained compacted node's slots, free the fresh ones, and bind the request to the
    node (mutates the row, the allocator, `req`). Returns `T` (0: nothing retained)."""
    lock = getattr(req, RETAINED_ATTR, None)
    if lock is None:
        return 0
    setattr(req, RETAINED_ATTR, None)
    node = lock.node
    prefix = node.value  # [T] slot indices of the compacted prefix, as a match returns them
    n = len(prefix)
    row = req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    fresh = row[:n].clone()
    row[:n] = prefix.to(device=row.device, dtype=row.dtype)
    allocator.free(fresh)
    req.last_node = node
    req.lock = lock
    req.prefix_len = n
    req.kv.cache_protected_len = n
    logger.info(
        "sglang_ext: request %s resumed after retraction on its compacted prefix (%d tokens)",
        getattr(req, "rid", "?"), n,
    )  # fmt: skip
    return n


def release(req: Any, tree_cache: Any) -> bool:
    """Unlock the compacted node retained for `req` (its backup was discarded: it never
    resumes). Returns whether there was one."""
    lock = getattr(req, RETAINED_ATTR, None)
    if lock is None:
        return False
    setattr(req, RETAINED_ATTR, None)
    tree_cache.unlock(lock)
    return True


def _compacted_node(node: Any) -> Any:
    """The compacted node on the path from the root to `node`, or None."""
    while node is not None:
        if compaction_info(node) is not None:
            return node
        node = getattr(node, "parent", None)
    return None
