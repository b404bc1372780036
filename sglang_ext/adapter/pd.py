"""Prefill/decode (PD) disaggregation: where the plugin serves, what it refuses, and the one
switch a CPU prefill server needs.

The plugin runs on PD **decode** servers that keep their own radix cache
(`--disaggregation-decode-enable-radix-cache`): it compacts the decode side's tree exactly as
on a single server. A later request matches the whole compacted prefix on decode, which then
tells prefill (`decode_prefix_len`) to send only the KV after it; prefill stays stock and
nothing new crosses the wire. `check_disaggregation` (called by
`sglang_ext.adapter.server_args.check_parallelism`) refuses, with a ValueError naming the
flag, what breaks that (SGLang 0.5.23, read there):

- `--disaggregation-mode prefill`: prefill sends its prompt KV as ordinary token KV, so a
  compacted prefix would reach decode as packed entries without their beta;
- decode without `--disaggregation-decode-enable-radix-cache`: decode keeps no tree, nothing
  to compact;
- decode HiCache (`--enable-hierarchical-cache`, refused for every server by
  `check_cache_features`), decode KV offload (`--disaggregation-decode-enable-offload-kvcache`),
  host-pool retraction (`--disaggregation-decode-retraction-backup host_pool`) and decode
  host receive (`--disaggregation-decode-host-receive-threshold` < 1): all keep KV in
  `UnifiedRadixCache`'s host pool, which the plugin's cache replaces;
- a retraction backup other than `cpu_tensor` or `none`, unset included (SGLang then also
  sets up HiCache host memory for a decode server, `arg_groups/hicache_hook.py` 62-70). With
  `cpu_tensor` a retracted request resumes on its compacted prefix
  (`sglang_ext.adapter.retraction`); with `none` it is aborted (503) for the client to send
  again.

`cpu_prefill_switch` runs in every SGLang scheduler process (an AFTER hook on
`Scheduler.init_disaggregation`, installed with the plugin's flags, so also on a stock
prefill server without `--compaction-endpoint`): on a CPU prefill server with the Mooncake
backend it sets `MooncakeKVSender.supports_host_tensor_indices` False, with a warning.
SGLang's `_send_kv_chunk` (`disaggregation/prefill.py` 1746-1759) otherwise copies the page
indices into pinned host memory and records a `torch.cuda.Event`, which a CPU-only process
cannot; with False it takes its own CPU branch (`kv_to_page_indices`). One more CUDA-only
step has a supported SGLang setting, which the switch names in a warning rather than changes:
with overlap scheduling, prefill's early send of its cached prefix
(`maybe_send_cached_prefix_chunk`, `disaggregation/prefill.py` 1495-1497) records a `torch.cuda.Event`; it runs whenever decode
holds less of a prompt than prefill caches, i.e. always once decode serves a compacted prefix.
On CPU set `SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0` (or `--disable-overlap-schedule`)
on prefill.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_ext.adapter.surface import EARLY_SEND, MOONCAKE_HOST_INDICES

__all__ = ["EARLY_SEND_ENV", "check_disaggregation", "cpu_prefill_switch"]

logger = logging.getLogger(__name__)
# SGLang's switch for prefill's early send of its cached prefix (see `_warn_early_send`).
EARLY_SEND_ENV = EARLY_SEND

_PREFILL_WHY = (
    "a prefill server sends its prompt KV to decode as ordinary token KV, so a compacted "
    "prefix would arrive there as packed entries without their beta (wrong answers); run the "
    "plugin on the decode servers (--disaggregation-mode decode "
    "--disaggregation-decode-enable-radix-cache) and leave prefill stock"
)
_HOST_POOL = (
    "which keeps KV in SGLang's UnifiedRadixCache host pool, replaced by the plugin's cache"
)


def check_disaggregation(server_args: Any) -> None:
    """ValueError naming the flag for a PD setting the plugin cannot serve with (see the
    module docstring); nothing for a server without `--disaggregation-mode` or a decode server
    set up as the plugin needs it."""
    mode = getattr(server_args, "disaggregation_mode", None)
    if mode in (None, "null"):
        return
    if mode != "decode":
        why = _PREFILL_WHY if mode == "prefill" else "the plugin runs on decode servers only"
        raise ValueError(
            f"--compaction-endpoint does not support --disaggregation-mode {mode!r}: {why}"
        )
    if not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        raise ValueError(
            "--compaction-endpoint with --disaggregation-mode decode needs "
            "--disaggregation-decode-enable-radix-cache: without it the decode server keeps "
            "no radix tree, so there is no prefix to compact"
        )
    if getattr(server_args, "disaggregation_decode_enable_offload_kvcache", False):
        raise ValueError(
            "--compaction-endpoint does not support "
            f"--disaggregation-decode-enable-offload-kvcache (decode KV offload, {_HOST_POOL})"
        )
    threshold = getattr(server_args, "disaggregation_decode_host_receive_threshold", 1)
    if threshold is not None and threshold < 1:
        raise ValueError(
            "--compaction-endpoint does not support "
            f"--disaggregation-decode-host-receive-threshold {threshold} (decode host "
            f"receive, {_HOST_POOL}); leave it at 1"
        )
    backup = getattr(server_args, "disaggregation_decode_retraction_backup", None)
    if backup not in ("cpu_tensor", "none"):
        why = (
            f"host_pool {_HOST_POOL}"
            if backup == "host_pool"
            else "unset, SGLang also sets up HiCache host memory for a decode server"
        )
        raise ValueError(
            "--compaction-endpoint with --disaggregation-mode decode needs "
            f"--disaggregation-decode-retraction-backup cpu_tensor or none, got {backup!r} "
            f"({why})"
        )


def cpu_prefill_switch(scheduler: Any) -> bool:
    """On a CPU prefill scheduler with the Mooncake backend, set
    `MooncakeKVSender.supports_host_tensor_indices` False (mutates that SGLang class in this
    process) and log it at WARNING, old -> new with the reason. Returns whether it did."""
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    backend = getattr(getattr(scheduler, "transfer_backend", None), "value", None)
    device = str(getattr(scheduler, "device", "")).split(":", 1)[0]
    if mode != "prefill" or backend != "mooncake" or device != "cpu":
        return False
    import pkgutil

    owner, attr = MOONCAKE_HOST_INDICES.rsplit(".", 1)
    sender = pkgutil.resolve_name(owner)
    cls_name = owner.rsplit(".", 1)[1]
    _warn_early_send(scheduler)
    old = getattr(sender, attr)
    if old is False:
        return False
    setattr(sender, attr, False)
    logger.warning(
        "sglang_ext: %s.%s %s -> False on this CPU prefill server (SGLang's _send_kv_chunk "
        "would otherwise pin host memory and record a torch.cuda.Event for the page indices, "
        "which a CPU-only process cannot; with False it takes its own CPU branch)",
        cls_name, attr, old,
    )  # fmt: skip
    return True


def _warn_early_send(scheduler: Any) -> None:
    """Warn when a CPU prefill scheduler will early-send cached prefixes under overlap
    scheduling: `maybe_send_cached_prefix_chunk` (`disaggregation/prefill.py` 1495-1497)
    records a `torch.cuda.Event` there, which fails on CPU whenever decode holds less of a
    prompt than prefill's own cache (always, once decode serves a compacted prefix)."""
    import os

    early = os.environ.get(EARLY_SEND_ENV, "1").lower() not in ("0", "false", "no", "off")
    if early and getattr(scheduler, "enable_overlap", False):
        logger.warning(
            "sglang_ext: this CPU prefill server early-sends cached prefixes with overlap "
            "scheduling, which records a torch.cuda.Event and fails once decode holds less of "
            "a prompt than prefill caches; set %s=0 or pass --disable-overlap-schedule",
            EARLY_SEND_ENV,
        )
