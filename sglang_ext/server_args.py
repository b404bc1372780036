"""How the plugin's config meets SGLang's `ServerArgs`: the backends it selects, the layouts it
refuses.

`apply_to_server_args` runs in the AFTER hook on `ServerArgs.from_cli_args` when
`--compaction-endpoint` is given: it stores the `CompactionConfig` on the record
(`config.CONFIG_ATTR`), selects the `compaction` radix-cache backend and the attention
backend (`compaction-triton` on CUDA, `compaction` elsewhere), and refuses, with a
ValueError naming the flag, what the plugin cannot serve with (no radix cache, paging,
another radix-cache backend, split prefill/decode attention backends, explicit CUDA
graphs with the Triton backend, and the parallel layouts of `check_parallelism`).
Each setting it changes is noted on the record, old value -> new value with the reason, and
logged by `log_changes` once SGLang has configured logging (the `configure_logger` hook of the
main process: `from_cli_args` runs before any log handler exists).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_ext.config import (
    ATTENTION_BACKEND,
    CONFIG_ATTR,
    RADIX_CACHE_BACKEND,
    TRITON_ATTENTION_BACKEND,
    CompactionConfig,
)

__all__ = ["CHANGES_ATTR", "apply_to_server_args", "check_parallelism", "log_changes"]

logger = logging.getLogger(__name__)
CHANGES_ATTR = "compaction_changes"  # [(logging level, message)] not yet logged


def apply_to_server_args(server_args: Any, cfg: CompactionConfig) -> None:
    """Store `cfg` on the record and select the plugin's backends (mutates `server_args`).

    Attention: `compaction-triton` on a CUDA device (or for `--attention-backend triton`),
    which also disables CUDA graphs (a replayed graph would skip beta); `compaction` (torch)
    elsewhere or for `--attention-backend torch_native`.

    Raises:
        ValueError: the record selects something the plugin cannot serve with.
    """
    if getattr(server_args, "disable_radix_cache", False):
        raise ValueError("--compaction-endpoint needs the radix cache; drop --disable-radix-cache")
    check_parallelism(server_args, cfg)
    page_size = getattr(server_args, "page_size", None)
    if page_size not in (None, 1):
        raise ValueError(f"--compaction-endpoint supports page_size 1 only, got {page_size}")
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend not in (None, RADIX_CACHE_BACKEND):
        raise ValueError(
            f"--compaction-endpoint selects --radix-cache-backend {RADIX_CACHE_BACKEND!r}; "
            f"got {backend!r}"
        )
    attention = _attention_backend(server_args)
    if attention == TRITON_ATTENTION_BACKEND:
        _require_no_cuda_graph(server_args)
    setattr(server_args, CONFIG_ATTR, cfg)
    _change(server_args, "radix_cache_backend", RADIX_CACHE_BACKEND,
            "the plugin's cache, which serves requests from compacted prefixes")  # fmt: skip
    why = "triton + beta" if attention == TRITON_ATTENTION_BACKEND else "torch_native + beta"
    _change(server_args, "attention_backend", attention, f"the plugin's beta-aware backend, {why}")
    graphs_on = not getattr(server_args, "disable_cuda_graph", False)
    if attention == TRITON_ATTENTION_BACKEND and graphs_on:
        server_args.disable_cuda_graph = True
        _note(server_args, logging.WARNING,
              "sglang_ext: CUDA graphs disabled (--disable-cuda-graph False -> True): a replayed "
              f"graph would skip the compaction biases of {TRITON_ATTENTION_BACKEND!r}")  # fmt: skip


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


def _attention_backend(server_args: Any) -> str:
    attn = getattr(server_args, "attention_backend", None)
    split = {
        name: getattr(server_args, name, None)
        for name in ("prefill_attention_backend", "decode_attention_backend")
    }
    given = [f"--{k.replace('_', '-')} {v!r}" for k, v in split.items() if v is not None]
    if given:
        raise ValueError(
            "--compaction-endpoint selects one attention backend for prefill and decode; "
            f"drop {', '.join(given)}"
        )
    device = _device(server_args)
    if attn in ("triton", TRITON_ATTENTION_BACKEND) or (attn is None and device == "cuda"):
        if device != "cuda":
            raise ValueError(
                f"--attention-backend {attn!r} with --compaction-endpoint needs a CUDA device, "
                f"got device {device!r}"
            )
        return TRITON_ATTENTION_BACKEND
    if attn in (None, "torch_native", ATTENTION_BACKEND):
        return ATTENTION_BACKEND
    raise ValueError(
        f"--compaction-endpoint serves with {ATTENTION_BACKEND!r} (torch_native + beta) or, on "
        f"CUDA, {TRITON_ATTENTION_BACKEND!r} (triton + beta); got --attention-backend {attn!r}"
    )


def _require_no_cuda_graph(server_args: Any) -> None:
    """ValueError when CUDA graphs were asked for explicitly (they would skip beta)."""
    asked = {
        name: value
        for name in ("cuda_graph_config", "cuda_graph_backend_decode", "cuda_graph_backend_prefill")
        if (value := getattr(server_args, name, None)) not in (None, "disabled")
    }
    if asked:
        raise ValueError(
            f"{TRITON_ATTENTION_BACKEND!r} runs without CUDA graphs (a replayed graph would skip "
            f"the compaction biases); got {asked}"
        )


def check_parallelism(server_args: Any, cfg: CompactionConfig) -> None:
    """ValueError naming the flag for a layout the plugin cannot serve with.

    Tensor parallelism works (`sglang_ext.tp`) with a compaction service, not `inproc://`
    (every rank would compact). Data-parallel replicas (`--dp-size`) each have their own
    scheduler, cache and TP group: they compact independently (the service's cache makes a
    shared document one compaction). Refused: pipeline parallelism (a rank holds some
    layers), prefill/decode disaggregation (KV moves between servers), attention data
    parallelism, context parallelism (KV split by tokens) and speculative decoding (draft
    KV and verify steps the compacted prefix does not cover).
    """
    refusals: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
        ("pp_size", "--pp-size", lambda v: v not in (None, 1)),
        ("disaggregation_mode", "--disaggregation-mode", lambda v: v not in (None, "null")),
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
    tp_size = getattr(server_args, "tp_size", None) or 1
    if tp_size > 1 and cfg.in_process:
        raise ValueError(
            f"--compaction-endpoint inproc:// would compact on each of --tp-size {tp_size} "
            "ranks; give a compaction service's address"
        )
