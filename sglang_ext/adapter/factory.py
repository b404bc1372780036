"""Registration of the plugin's backends and the radix-cache factory run in the scheduler.

`register_backends()` adds the name `compaction` to SGLang's radix-cache registry, and the
attention backend `compaction` (`wrapped_backend.CompactionBackend`, wrapping the user's
`--attention-backend`, `server_args.INNER_ATTR`) to its attention-backend registry and
`--attention-backend` choices (called from `register()`; idempotent). The factory builds `CompactionRadixCache` with the scheduler's pools, the
model fingerprint and a `CompactionRunner` for the configured endpoint (with `--tp-size` > 1,
a `sglang_ext.tp.TpSync` over the scheduler's TP CPU group on every rank, rank 0 deciding and
each rank's pool shape naming its KV heads); `check_model` resolves
and fingerprints the checkpoint (a directory, or a Hub ID in the local Hugging Face cache)
right after argument parsing, before any weights load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from sglang_ext.adapter.server_args import INNER_ATTR, get_config
from sglang_ext.config import ATTENTION_BACKEND, CPU_INNER_BACKEND, RADIX_CACHE_BACKEND

__all__ = [
    "attach_tp",
    "check_model",
    "create_compaction_cache",
    "inner_attention_backend",
    "register_backends",
    "resolve_model_dir",
]

logger = logging.getLogger(__name__)


def register_backends(verify: Callable[[], None]) -> None:
    """Make `compaction` a radix-cache backend and an attention backend (idempotent).

    `verify` runs before either factory builds (the plugin's start-up check of SGLang's
    surface and hooks, `hooks.verify_serving`; passed in, so this module does not import the
    hooks that import it).
    """
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if get_radix_cache_factory(RADIX_CACHE_BACKEND) is None:
        register_radix_cache_backend(
            RADIX_CACHE_BACKEND, partial(create_compaction_cache, verify=verify)
        )
    if ATTENTION_BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(ATTENTION_BACKEND)(
            partial(_create_attention_backend, verify=verify)
        )
    if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTENTION_BACKEND])


def _create_attention_backend(runner: Any, *, verify: Callable[[], None]) -> Any:
    from sglang_ext.adapter.wrapped_backend import CompactionBackend

    verify()  # done at configure_logger already, unless that hook is missing
    name = inner_attention_backend(runner)
    backend = CompactionBackend(runner, name)
    logger.info("sglang_ext: attention backend %r wraps %r", ATTENTION_BACKEND, name)
    return backend


def inner_attention_backend(runner: Any) -> str:
    """The backend `compaction` wraps in this model runner: the name stored on the record
    (`server_args.INNER_ATTR`, from the user's `--attention-backend`), else SGLang's default for
    the runner's device and model (`get_default_attn_backend`; `torch_native` on CPU)."""
    server_args = getattr(runner, "server_args", None)
    name = getattr(server_args, INNER_ATTR, None)
    if name is not None:
        return str(name)
    if str(getattr(runner, "device", "cpu")).split(":", 1)[0] == "cpu":
        return CPU_INNER_BACKEND
    from sglang.srt.arg_groups.model_override_base import get_default_attn_backend

    return str(get_default_attn_backend(server_args, runner.use_mla_backend, runner.model_config))


def create_compaction_cache(ctx: Any, *, verify: Callable[[], None]) -> Any:
    """`RadixCacheFactory`: build the compaction radix cache from a TreeCacheBuildContext,
    after `verify()` (see `register_backends`).

    Raises:
        RuntimeError: SGLang's surface is not what the plugin needs (from `verify`).
        ValueError: the backend was selected without `--compaction-endpoint`, or with a
            model/cache layout the plugin does not serve (hybrid SWA/SSM, paging), or the
            checkpoint cannot be found or fingerprinted (see `resolve_model_dir`).
    """
    from compactor import fingerprint
    from sglang_ext.adapter.radix_cache import CompactionRadixCache
    from sglang_ext.compactors import make_compactor
    from sglang_ext.metrics import PrometheusExporter
    from sglang_ext.pool_shape import PoolShape
    from sglang_ext.runner import CompactionRunner

    verify()  # done at configure_logger already, unless that hook is missing
    cfg = get_config(ctx.server_args)
    if cfg is None:
        raise ValueError(
            f"--radix-cache-backend {RADIX_CACHE_BACKEND!r} is selected by "
            "--compaction-endpoint; give that flag instead"
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "compacted prefixes need a plain full-attention KV cache, got "
            f"hybrid_swa={ctx.is_hybrid_swa} hybrid_ssm={ctx.is_hybrid_ssm} "
            f"hierarchical={ctx.enable_hierarchical_cache}"
        )
    model_dir = str(resolve_model_dir(ctx.server_args))
    fp = fingerprint(model_dir)
    tp_size, tp_rank = int(getattr(ctx, "tp_size", 1) or 1), int(getattr(ctx, "tp_rank", 0) or 0)
    kvcache = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    if tp_size > 1:
        heads = int(ctx.model_config.get_total_num_kv_heads())
        pool = PoolShape.of(kvcache, heads, tp_rank, tp_size)
    else:
        pool = PoolShape.of(kvcache)
    runner = CompactionRunner(make_compactor(cfg, model_dir, fp, pool), cfg.timeout)
    labels = {"tp_rank": str(tp_rank)} if tp_size > 1 else None
    exporter = PrometheusExporter(labels) if ctx.params.enable_metrics else None
    cache = CompactionRadixCache(ctx.params, cfg, fp, runner=runner, exporter=exporter)
    if tp_size > 1:
        attach_tp(cache, ctx.tp_group.cpu_group, tp_rank, tp_size, pool)
    logger.info(
        "sglang_ext: compaction radix cache ready: %s fingerprint=%s tp_rank=%d/%d heads=[%d, %d)",
        cfg.as_dict(), fp, tp_rank, tp_size, pool.head_start,
        pool.head_start + (pool.pool_heads or pool.num_kv_heads),
    )  # fmt: skip
    return cache


def attach_tp(cache: Any, group: Any, tp_rank: int, tp_size: int, pool: Any) -> Any:
    """Make `cache` one rank of a TP group (mutates its lifecycle): the TP strategy, a pool
    shape that names the rank's heads, rank 0's runner announcing submissions, other ranks'
    triggers never picking. Returns the `TpSync`."""
    from sglang_ext.tp import FollowerTrigger, TpSync

    if cache.config.in_process:
        raise ValueError(
            "--compaction-endpoint inproc:// would compact on every TP rank; give a "
            "compaction service's address with --tp-size > 1"
        )
    sync, lc = TpSync(group, tp_rank, tp_size), cache.lifecycle
    lc.pool_shape = pool
    lc.tp = sync
    if sync.leads:
        lc.runner.on_submit = sync.on_submit
    else:
        lc.trigger = FollowerTrigger(lc.config)
    return sync


def resolve_model_dir(server_args: Any) -> Path:
    """The local checkpoint directory SGLang loads `server_args.model_path` from.

    A directory as given, or a Hugging Face Hub ID's snapshot in `--download-dir` or the
    local hub cache at `--revision` (SGLang's own lookup; nothing is downloaded).

    Raises:
        ValueError: not a directory, and no snapshot in the cache (names where it looked).
    """
    from compactor import resolve_checkpoint

    return resolve_checkpoint(
        str(server_args.model_path),
        revision=getattr(server_args, "revision", None),
        cache_dir=getattr(server_args, "download_dir", None),
    )


def check_model(server_args: Any) -> str | None:
    """Resolve and fingerprint the checkpoint before SGLang loads its weights.

    Returns the fingerprint, or None for a Hub ID not yet in the local cache while the hub
    may be reached (SGLang downloads it while loading; the cache factory checks it then), or
    when `server_args` names no model path (yet).

    Raises:
        ValueError: the checkpoint has no config.json or no weight file SGLang loads, or it is
            a Hub ID missing from the cache with HF_HUB_OFFLINE set.
    """
    from compactor import fingerprint

    if not getattr(server_args, "model_path", None):
        return None
    try:
        model_dir = resolve_model_dir(server_args)
    except ValueError as exc:
        if _hub_offline():
            raise
        logger.info("sglang_ext: %s; checking it again once SGLang has fetched it", exc)
        return None
    return fingerprint(model_dir)


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/ON/YES/TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
