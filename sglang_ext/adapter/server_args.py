"""How the plugin's config meets SGLang's `ServerArgs`: the backends it selects, the layouts it
refuses.

`apply_to_server_args` runs in the AFTER hook on `ServerArgs.from_cli_args` when
`--compaction-endpoint` is given: it stores the `CompactionConfig` on the record
(`CONFIG_ATTR`, read back in the scheduler by `get_config`), selects the `compaction` radix-cache backend and the `compaction`
attention backend, which wraps the user's `--attention-backend` (its name stored on the record,
`INNER_ATTR`; `sglang_ext.adapter.wrapped_backend`): batches without compacted prefixes run the
user's backend, CUDA graphs included. It refuses, with a ValueError naming the flag, what the
plugin cannot serve with (no radix cache, paging, another radix-cache backend, the features of
SGLang's default cache in `check_cache_features`, split prefill/decode attention backends, and
the parallel layouts of `check_parallelism` (prefill/decode disaggregation:
`sglang_ext.adapter.pd`); the wrapper refuses MLA, fp8 KV and the like when
it is built).
Each setting it changes is noted on the record, old value -> new value with the reason, and
logged by `log_changes` once SGLang has configured logging (the `configure_logger` hook of the
main process: `from_cli_args` runs before any log handler exists).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from sglang_ext.adapter.pd import check_disaggregation
from sglang_ext.adapter.surface import METADATA_GLUE_ENV
from sglang_ext.config import (
    ATTENTION_BACKEND,
    CPU_INNER_BACKEND,
    RADIX_CACHE_BACKEND,
    CompactionConfig,
)

__all__ = [
    "CHANGES_ATTR",
    "CONFIG_ATTR",
    "DEFAULT_CACHE_FEATURES",
    "EVICTION_POLICIES",
    "INNER_ATTR",
    "apply_to_server_args",
    "check_cache_features",
    "check_parallelism",
    "get_config",
    "log_changes",
]

logger = logging.getLogger(__name__)
# What the plugin keeps on SGLang's `ServerArgs`: the record is the one object SGLang hands
# from the main process (where the flags are parsed) to the scheduler process it spawns (where
# the backends are built), pickling its attributes across; no object of the plugin's own
# crosses that boundary. The config and the wrapped backend's name ride there for that reason.
CONFIG_ATTR = "_compaction_config"
# The user's --attention-backend that `compaction` wraps (None: SGLang's default for the model,
# resolved in the scheduler).
INNER_ATTR = "_compaction_inner_attention"
# [(logging level, message)] not yet logged: noted while `from_cli_args` runs (before SGLang
# configures logging), logged and dropped by the main process's `configure_logger` hook.
CHANGES_ATTR = "compaction_changes"
# What SGLang 0.5.23 builds into its default cache (`UnifiedRadixCache` and the selection
# chain of `sglang.srt.mem_cache.registry`), which `--radix-cache-backend compaction`
# replaces: (ServerArgs attribute, flag, what it is). With the plugin's cache SGLang would
# ignore them, or fail only once the scheduler builds its cache (sessions, HiCache). SGLang's
# own checks of some of them against --radix-cache-backend run before the plugin sets it.
DEFAULT_CACHE_FEATURES: tuple[tuple[str, str, str], ...] = (
    ("enable_hierarchical_cache", "--enable-hierarchical-cache", "HiCache (host/storage KV tiers)"),
    ("hicache_storage_backend", "--hicache-storage-backend",
     "HiCache's storage tier (the scheduler then asks the cache for storage prefetches)"),
    ("enable_lmcache", "--enable-lmcache", "the LMCache connector"),
    ("enable_flexkv", "--enable-flexkv", "FlexKV offload"),
    ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker",
     "the external KV store linker"),
    ("enable_session_radix_cache", "--enable-session-radix-cache", "session references"),
    ("enable_streaming_session", "--enable-streaming-session", "streaming sessions"),
    ("enable_int8_mamba_checkpoint", "--enable-int8-mamba-checkpoint", "int8 mamba checkpoints"),
)  # fmt: skip
# The eviction policies the plugin's cache honours: SGLang's RadixCache strategies over a
# node's last access, creation time and priority, which compacted nodes keep too. Refused:
# `lfu` and `slru` (a compacted node's hit count stays 0, its requests count their hits on
# the nodes below it: LFU would evict the most shared prefix first, SLRU never protect it)
# and `tlru` (per-node conversation lengths only UnifiedRadixCache keeps).
EVICTION_POLICIES = ("lru", "priority", "fifo", "mru", "filo")
_POLICY_WHY = {
    "lfu": "a compacted prefix keeps no hit count, so it would be evicted first",
    "slru": "a compacted prefix keeps no hit count, so it would never be protected",
    "tlru": "it needs UnifiedRadixCache's per-conversation bookkeeping",
}


def apply_to_server_args(server_args: Any, cfg: CompactionConfig) -> None:
    """Store `cfg` on the record and select the plugin's backends (mutates `server_args`).

    Attention: `compaction`, wrapping the user's `--attention-backend` (stored as
    `INNER_ATTR`); unset, it wraps `torch_native` on CPU (the engine this project
    serves on there) and, elsewhere, SGLang's default for the model, resolved in the scheduler
    (`INNER_ATTR` None). CUDA graphs stay as the user set them.

    Raises:
        ValueError: the record selects something the plugin cannot serve with.
    """
    check_parallelism(server_args, cfg)  # first: a PD decode server names its own flag
    if getattr(server_args, "disable_radix_cache", False):
        raise ValueError("--compaction-endpoint needs the radix cache; drop --disable-radix-cache")
    page_size = getattr(server_args, "page_size", None)
    if page_size not in (None, 1):
        raise ValueError(f"--compaction-endpoint supports page_size 1 only, got {page_size}")
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend not in (None, RADIX_CACHE_BACKEND):
        raise ValueError(
            f"--compaction-endpoint selects --radix-cache-backend {RADIX_CACHE_BACKEND!r}; "
            f"got {backend!r}"
        )
    check_cache_features(server_args)
    inner = _inner_backend(server_args)
    setattr(server_args, CONFIG_ATTR, cfg)
    setattr(server_args, INNER_ATTR, inner)
    _change(server_args, "radix_cache_backend", RADIX_CACHE_BACKEND,
            "the plugin's cache, which serves requests from compacted prefixes")  # fmt: skip
    wrapped = inner if inner is not None else "SGLang's default for the model"
    _change(server_args, "attention_backend", ATTENTION_BACKEND,
            f"wraps {wrapped}: stock kernels for batches without compacted prefixes")  # fmt: skip


def get_config(server_args: Any) -> CompactionConfig | None:
    """The config stored on a ServerArgs record (None: plugin inactive)."""
    cfg = getattr(server_args, CONFIG_ATTR, None)
    return cfg if isinstance(cfg, CompactionConfig) else None


def log_changes(server_args: Any) -> int:
    """Log, one line each, the changes `apply_to_server_args` noted on the record, and drop
    them from it (mutates `server_args`; processes started later see none). Returns how many."""
    changes = getattr(server_args, CHANGES_ATTR, None) or []
    if hasattr(server_args, CHANGES_ATTR):
        delattr(server_args, CHANGES_ATTR)
    for level, message in changes:
        logger.log(level, "%s", message)
    return len(changes)


def _change(server_args: Any, name: str, new: str, why: str) -> None:
    """Set `server_args.<name>` to `new` and note the change (nothing when already `new`)."""
    old = getattr(server_args, name, None)
    setattr(server_args, name, new)
    if old != new:
        flag = "--" + name.replace("_", "-")
        shown = "unset" if old is None else old
        _note(server_args, logging.INFO, f"sglang_ext: {flag} {shown} -> {new} ({why})")


def _note(server_args: Any, level: int, message: str) -> None:
    """Append one change for `log_changes` to the record (mutates `server_args`)."""
    changes = getattr(server_args, CHANGES_ATTR, None)
    if changes is None:
        changes = []
        setattr(server_args, CHANGES_ATTR, changes)
    changes.append((level, message))


def _device(server_args: Any) -> str:
    """The record's device without index; None resolves as SGLang does for cuda vs cpu."""
    device = getattr(server_args, "device", None)
    if device is None:
        import os

        import torch

        cpu_engine = os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"
        device = "cuda" if torch.cuda.is_available() and not cpu_engine else "cpu"
    return str(device).split(":", 1)[0]


def _inner_backend(server_args: Any) -> str | None:
    """The backend `compaction` wraps: the user's `--attention-backend`; when it is unset (or
    `compaction` itself), `torch_native` on CPU and None (SGLang's default for the model,
    resolved in the scheduler) elsewhere."""
    attn = getattr(server_args, "attention_backend", None)
    split = {
        name: getattr(server_args, name, None)
        for name in ("prefill_attention_backend", "decode_attention_backend")
    }
    given = [f"--{k.replace('_', '-')} {v!r}" for k, v in split.items() if v is not None]
    if given:
        raise ValueError(
            "--compaction-endpoint wraps one attention backend for prefill and decode; "
            f"drop {', '.join(given)}"
        )
    if attn == ATTENTION_BACKEND:  # set up already, or asked for by name: wrap the default
        if hasattr(server_args, INNER_ATTR):
            inner: str | None = getattr(server_args, INNER_ATTR)
            return inner
        attn = None
    if attn is None and _device(server_args) == "cpu":
        return CPU_INNER_BACKEND
    return None if attn is None else str(attn)


def check_cache_features(server_args: Any) -> None:
    """ValueError naming the flag for a feature of SGLang's default cache
    (`DEFAULT_CACHE_FEATURES`) or an eviction policy outside `EVICTION_POLICIES`: the plugin's
    cache (`CompactionRadixCache`, a `RadixCache`) replaces that cache and would not apply it.
    """
    for name, flag, what in DEFAULT_CACHE_FEATURES:
        if getattr(server_args, name, False):
            raise ValueError(
                f"--compaction-endpoint does not support {flag}: the plugin's cache replaces "
                f"SGLang's default radix cache, which provides {what}"
            )
    policy = getattr(server_args, "radix_eviction_policy", None)
    if policy is not None and str(policy).lower() not in EVICTION_POLICIES:
        why = _POLICY_WHY.get(str(policy).lower(), "the plugin's cache does not implement it")
        raise ValueError(
            f"--compaction-endpoint does not support --radix-eviction-policy {policy!r} ({why}); "
            "use lru (the default) or priority"
        )


def check_parallelism(server_args: Any, cfg: CompactionConfig) -> None:
    """ValueError naming the flag for a layout the plugin cannot serve with.

    Tensor parallelism works (`sglang_ext.tp`) with a compaction service, not `inproc://`
    (every rank would compact). Data-parallel replicas (`--dp-size`) each have their own
    scheduler, cache and TP group: they compact independently (the service's cache makes a
    shared document one compaction). Refused: pipeline parallelism (a rank holds some
    layers), attention data parallelism, context parallelism (KV split by tokens) and
    speculative decoding (draft KV and verify steps the compacted prefix does not cover), and
    SGLang's metadata glue graph (`SGLANG_ENABLE_METADATA_GLUE_GRAPH`: one captured preparation
    per batch size, whatever the graph variant).
    Prefill/decode disaggregation: on decode servers with their own radix cache only, as
    `sglang_ext.adapter.pd.check_disaggregation` says.
    """
    refusals: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
        ("pp_size", "--pp-size", lambda v: v not in (None, 1)),
        ("enable_dp_attention", "--enable-dp-attention", bool),
        ("attn_dp_size", "--attn-dp-size", lambda v: v not in (None, 1)),
        ("attn_cp_size", "--attn-cp-size", lambda v: v not in (None, 1)),
        ("dcp_size", "--dcp-size", lambda v: v not in (None, 1)),
        ("speculative_algorithm", "--speculative-algorithm", lambda v: v is not None),
    )
    for name, flag, refused in refusals:
        value = getattr(server_args, name, None)
        if refused(value):
            raise ValueError(f"--compaction-endpoint does not support {flag} {value!r}")
    check_disaggregation(server_args)
    if os.environ.get(METADATA_GLUE_ENV, "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(
            f"--compaction-endpoint does not support {METADATA_GLUE_ENV}=1 (its metadata "
            "graph would replay the stock graphs' preparation for compacted batches); unset it"
        )
    tp_size = getattr(server_args, "tp_size", None) or 1
    if tp_size > 1 and cfg.in_process:
        raise ValueError(
            f"--compaction-endpoint inproc:// would compact on each of --tp-size {tp_size} "
            "ranks; give a compaction service's address"
        )
