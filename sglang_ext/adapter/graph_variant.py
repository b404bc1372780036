"""Compacted decode batches in CUDA graphs of their own, through SGLang's graph variants.

SGLang 0.5.23's decode graph runner captures one graph per (batch size, label of its
`attention_graph_variants`) and picks a batch's label with `select(forward_batch)` before
it replays. The plugin gives the runner two labels (`CompactedVariants`):

    stock      captured as before: the wrapped backend's own metadata, wrappers and plans;
    compacted  captured with the static cascade (`sglang_ext.attention.static_cascade`):
               every layer's attention over the node groups' compacted prefixes and the
               tails, in buffers allocated at start-up. The wrapped backend is not asked
               for metadata, so its per-batch-size wrappers keep their identity and plans.

The steps, and who calls them:

- start-up: SGLang calls the backend's `init_cuda_graph_state(max_bs, ...)`; the backend
  builds `CompactedGraphs` (logged with its buffers' size). The BEFORE hook on the runner's
  `capture` sets the runner's variants to `CompactedVariants`, unless SGLang set variants
  of its own (a model with several attention kinds): compacted batches then run eagerly.
- capture: SGLang sets the label being captured; the backend's
  `init_forward_metadata_out_graph(fb, in_capture=True)` asks `out_graph`, which takes the
  `compacted` capture (a plan without compacted rows) and leaves `stock` to the inner
  backend; the forwards of that capture take the static path (`capturing`).
- replay: the graph gate lets through a compacted decode batch the static cascade can serve
  (`refusal`; the others run eagerly and are counted by reason); `select` stages the
  batch's prefixes, read from the host marks; the backend's out-of-graph prep uploads the
  plan (`StaticCascade.prepare`: host work and one non-blocking copy); the graph replays,
  the tails' gather first. No step reads the device on the host.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from compaction_kernels.biased_attention.static import StaticAttention
from sglang_ext.attention.static_cascade import PrefixTables, StaticCascade
from sglang_ext.packing import PackedLayout

__all__ = [
    "COMPACTED",
    "STOCK",
    "CompactedGraphs",
    "CompactedVariants",
    "install_variants",
    "static_shape",
]

logger = logging.getLogger(__name__)
STOCK, COMPACTED = "stock", "compacted"
# the most node groups one graph step serves (more: the batch runs eagerly, reason `groups`)
MAX_GROUPS = 8


def static_shape(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, cuda: bool
) -> StaticAttention:
    """The launch shape on a GPU (tiles of 64, splits that fill the SMs for one group of
    64 decode tokens) or on the CPU (interpreted: small tiles, two splits)."""
    if cuda:
        return StaticAttention(num_qo_heads, num_kv_heads, head_dim, prefix_splits=8,
                               tail_splits=4, block_m=64, block_n=64)  # fmt: skip
    return StaticAttention(num_qo_heads, num_kv_heads, head_dim, prefix_splits=2, tail_splits=2)


class CompactedGraphs:
    """The compacted variant of one `CompactionBackend`'s decode graphs: its static cascade
    and the state between SGLang's calls (module docstring). `backend` is the wrapping
    backend (its pools, beta store, host decisions and KV write)."""

    def __init__(self, backend: Any, static: StaticCascade):
        self.backend, self.static = backend, static
        self.capturing = False  # the compacted label is being captured: forwards go static
        self.bs = 0  # the batch size of the step being captured or replayed
        self._staged: list[PackedLayout | None] | None = None

    @classmethod
    def build(cls, backend: Any, max_bs: int, cuda: bool) -> CompactedGraphs:
        """Buffers for steps up to `max_bs` requests over the backend's pools (KV heads and
        head dim from the pool, q heads per KV head from the model's config)."""
        pool, store = backend.token_to_kv_pool, backend.beta_store
        k0 = pool.get_key_buffer(pool.start_layer)
        config = backend.model_runner.model_config
        group = config.num_attention_heads // config.get_total_num_kv_heads()
        shape = static_shape(group * k0.shape[1], k0.shape[1], k0.shape[2], cuda)
        tables = PrefixTables(
            lambda i: pool.get_key_buffer(pool.start_layer + i),
            lambda i: pool.get_value_buffer(pool.start_layer + i),
            store.beta,
        )
        r2t = backend.req_to_token_pool.req_to_token
        static = StaticCascade(shape, num_layers=pool.layer_num, max_bs=max_bs,
                               max_groups=MAX_GROUPS, width=r2t.shape[1], tables=tables,
                               device=k0.device)  # fmt: skip
        logger.info(
            "sglang_ext: compacted decode graphs up to %d requests and %d prefixes a step "
            "(static buffers %.1f MiB); SGLang captures them beside the stock ones",
            max_bs, MAX_GROUPS, static.nbytes() / 2**20,
        )  # fmt: skip
        return cls(backend, static)

    # ---- decisions (host) -------------------------------------------------------------
    def refusal(self, forward_batch: Any, prefixes: list[PackedLayout | None]) -> str | None:
        """Why a compacted batch cannot replay the compacted graph (None: it can): `extend`
        (not a decode batch), or the static cascade's reason."""
        if not forward_batch.forward_mode.is_decode():
            return "extend"
        return self.static.refusal(prefixes)

    def stage(self, forward_batch: Any) -> bool:
        """SGLang's `select`: whether this batch replays the compacted graph; if so its
        prefixes are kept for the replay's prep (host marks only)."""
        batch = self.backend.compacted_batch(forward_batch)
        self._staged = None
        if batch is None or self.refusal(forward_batch, batch.prefixes) is not None:
            return False
        self._staged = list(batch.prefixes)
        return True

    # ---- SGLang's metadata calls ------------------------------------------------------
    def out_graph(self, forward_batch: Any, in_capture: bool) -> bool:
        """The backend's `init_forward_metadata_out_graph`: True when this call is the
        compacted variant's (captured here, or a staged replay), which the inner backend
        must not see. Host work and one upload."""
        if in_capture:
            from sglang.srt.model_executor.runner_utils.capture_mode import (
                get_capture_attention_variant,
            )

            self.capturing = get_capture_attention_variant() == COMPACTED
            if self.capturing:
                self.bs = int(forward_batch.batch_size)
                self.static.prepare(self.bs, [])
            return self.capturing
        self.capturing = False
        staged, self._staged = self._staged, None
        if staged is None:
            return False
        self.bs = int(forward_batch.batch_size)
        self.static.prepare(self.bs, staged)
        store = self.backend.beta_store
        store.compacted_forwards += 1
        store.compacted_rows += sum(p is not None for p in staged)
        return True

    def in_graph(self, forward_batch: Any) -> bool:
        """The backend's `init_forward_metadata_in_graph` while capturing the compacted
        variant: the tails' gather (the step's read of `req_to_token`, before SGLang's
        read-done marker). False: not ours."""
        if not self.capturing:
            return False
        r2t = self.backend.req_to_token_pool.req_to_token
        fb = forward_batch
        self.static.gather_tails(self.bs, r2t, fb.req_pool_indices, fb.seq_lens)
        return True

    def attend(self, q: torch.Tensor, layer: Any) -> torch.Tensor:
        """Layer `layer`'s attention of the step being captured: q [bs, H_q, D] ->
        [bs, H_q * D] (the new K/V already written)."""
        pool, store = self.backend.token_to_kv_pool, self.backend.beta_store
        i = layer.layer_id - pool.start_layer
        kv = (pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
              store.beta[i])  # fmt: skip
        out = self.static.attend(self.bs, i, q, kv, layer.scaling)
        return out.reshape(self.bs, -1)


class CompactedVariants:
    """SGLang's `AttentionGraphVariants` protocol: `capture_labels` in capture order (stock
    first, as SGLang captured alone before), and `select(forward_batch)`."""

    capture_labels: tuple[str, ...] = (STOCK, COMPACTED)

    def __init__(self, graphs: CompactedGraphs):
        self.graphs = graphs

    def select(self, forward_batch: Any) -> str:
        return COMPACTED if self.graphs.stage(forward_batch) else STOCK


def install_variants(runner: Any) -> None:
    """BEFORE hook on `DecodeCudaGraphRunner.capture(self)`: give the runner the stock and
    compacted labels when its backend built compacted graphs (logged either way; mutates
    `runner.attention_graph_variants`)."""
    graphs = getattr(getattr(runner, "attn_backend", None), "graphs", None)
    current = getattr(runner, "attention_graph_variants", None)
    if not isinstance(graphs, CompactedGraphs) or isinstance(current, CompactedVariants):
        return
    if current is not None:
        logger.warning(
            "sglang_ext: SGLang captures its own attention graph variants (%s) for this "
            "model; batches on a compacted prefix run eagerly (counted as reason "
            "'variants')", type(current).__name__,
        )  # fmt: skip
        return
    runner.attention_graph_variants = CompactedVariants(graphs)
