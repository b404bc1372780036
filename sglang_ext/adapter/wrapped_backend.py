"""`CompactionBackend`: the user's attention backend, wrapped; beta only for batches that need it.

`--compaction-endpoint` selects the attention backend `compaction`, which builds the backend
SGLang would have built for the user's `--attention-backend` (`inner = ATTENTION_BACKENDS[name]
(runner)`; the name rides on the record, `sglang_ext.adapter.server_args.INNER_ATTR`) and wraps it:

- Per forward (`init_forward_metadata`, or earlier in SGLang's CUDA-graph gate) it decides
  whether any request sits on a compacted prefix, on the host, from the ForwardBatch's host
  marks (`sglang_ext.adapter.marks`). A ForwardBatch built elsewhere (no marks) falls back
  to the row's first slot, `BetaStore.prefix_of(req_to_token[row_b, 0])` (one copy of B
  ints to the host). On CPU both are computed and must agree (a disagreement is logged and
  the slot look-up, the ground truth, serves). Cost: none while no compacted prefix is
  installed.
- No compacted request: every call (metadata, `forward`, `forward_extend`, `forward_decode`,
  the CUDA-graph hooks, any other attribute) goes to `inner` unchanged, with the same
  arguments, and returns its result.
- Compacted requests, eagerly: `inner`'s metadata is still built; each layer writes the new
  K/V into the pool as the stock code does, gathers each compacted prefix's entries of that
  layer from their packed cells (`sglang_ext.packing.PackedLayout`, once per prefix), then
  attends them + the tails with beta: on CPU `attention.attend_rows` (torch SDPA per
  request, each head padded to the longest), on CUDA `cascade.run_cascade` (Triton, each
  compacted prefix once per group and ragged per KV head, tails causal, merged by LSE). The
  prefix calls are planned once per (node groups, their new tokens) and kept
  (`cascade.PrefixPlans`): decode steps of the same requests re-plan only their tails.
- Compacted decode batches under CUDA graphs: SGLang captures a `compacted` graph per batch
  size beside the stock one (`sglang_ext.adapter.graph_variant`): the static cascade, with
  no host sync in the step and the inner backend not asked. `graph_gate`, an AFTER hook on
  the decode and prefill graph runners' `can_run_graph`, sends what that graph cannot serve
  (extend batches, too many prefixes, a layout of another shape, no compacted graphs) to
  the eager path, and the next metadata call counts it by reason
  (`BetaStore.eager_batches`, exported as `compaction_eager_batches_total{reason}`). A
  batch with a compacted request never replays a stock graph.

Refused with a ValueError naming the flag (`backend_checks.check_runner` at construction, `check_layer` at a
biased forward): MLA, decode context parallelism, KV caches other than fp16/bf16/fp32 (fp8),
encoder-decoder models, sliding-window, cross, non-causal, soft-capped or scaled-KV layers,
and speculative / dLLM forward modes on compacted rows.

Legend: B requests, n new tokens, H_q / H_kv heads, D head dim, S pool slots.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.adapter.backend_checks import check_layer, check_runner
from sglang_ext.adapter.compacted_node import beta_store_of
from sglang_ext.adapter.graph_variant import CompactedGraphs, CompactedVariants
from sglang_ext.adapter.marks import MARKS_ATTR, HostMarks
from sglang_ext.attention.rows import PrefixPart, attend_rows
from sglang_ext.config import ATTENTION_BACKEND
from sglang_ext.packing import PackedLayout

__all__ = ["CompactionBackend", "graph_gate"]

logger = logging.getLogger(__name__)
_B = TypeVar("_B", bound=type)
# AttentionBackend attributes SGLang sets on the backend it built: kept on the wrapper
_OWN = frozenset({"prefill_attention_backend_str", "decode_attention_backend_str"})


class _Batch:
    """Host copies of a batch with compacted requests: rows, seq_lens, q_lens [B] int64,
    prefixes [B] the layout of each request's compacted prefix or None, and the cascade
    plans by (scale, heads)."""

    def __init__(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        q_lens: torch.Tensor,
        prefixes: list[PackedLayout | None],
    ):
        self.rows, self.seq_lens, self.q_lens, self.prefixes = rows, seq_lens, q_lens, prefixes
        self.plans: dict[tuple[Any, ...], Any] = {}  # cascade.CascadePlan


def _forwards_base_api(cls: _B) -> _B:
    """Class decorator: every AttentionBackend attribute and method `cls` does not define is
    forwarded to `self.inner` (class attributes as properties, methods as calls)."""

    def attribute(name: str) -> property:
        def get(self: Any) -> Any:
            return getattr(self.inner, name)

        def set_(self: Any, value: Any) -> None:
            setattr(self.inner, name, value)

        return property(get, set_)

    def method(name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, name)(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        return call

    own = vars(cls)
    for name, value in vars(AttentionBackend).items():
        if name.startswith("_") or name in own or name in _OWN:
            continue
        setattr(cls, name, method(name) if callable(value) else attribute(name))
    return cls


@_forwards_base_api
class CompactionBackend(AttentionBackend):
    """SGLang's backend `inner_name` (the user's `--attention-backend`), wrapped (module
    docstring). `cascade`: run compacted batches through `cascade.run_cascade` (None: on CUDA
    only; True also serves CPU tensors under TRITON_INTERPRET=1, for tests).

    Attributes not defined here are read from `inner` (`__getattr__`); AttentionBackend's own
    public attributes and methods are forwarded to it explicitly (`_forwards_base_api`).
    """

    def __init__(self, model_runner: Any, inner_name: str):
        if inner_name == ATTENTION_BACKEND or inner_name not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend {inner_name!r} cannot be wrapped by {ATTENTION_BACKEND!r}"
            )
        inner = ATTENTION_BACKENDS[inner_name](model_runner)
        check_runner(model_runner, inner, inner_name)
        self.inner, self.inner_name = inner, inner_name
        self.cascade: bool | None = None
        self.prefix_plans: Any = None  # cascade.PrefixPlans, made at the first cascade
        self._batch: _Batch | None = None
        self._decided: tuple[Any, _Batch | None] | None = None
        self.graphs: CompactedGraphs | None = None  # the compacted decode graphs (CUDA)
        self._eager: tuple[Any, str] | None = None  # (batch, why the graph gate refused it)
        self.model_runner = model_runner
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.beta_store = beta_store_of(self.token_to_kv_pool)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- the decision ---------------------------------------------------------------------
    def compacted_batch(self, forward_batch: Any) -> _Batch | None:
        """The batch's compacted requests (None: none, the stock path). Memoized per
        ForwardBatch object until the next metadata call. ValueError for a forward mode the
        biased path does not serve when a request is compacted."""
        decided = self._decided
        if decided is not None and decided[0] is forward_batch:
            return decided[1]
        batch = self._plan(forward_batch)
        self._decided = (forward_batch, batch)
        return batch

    def _plan(self, fb: Any) -> _Batch | None:
        store = self.beta_store
        if not store.prefixes or fb.seq_lens is None or fb.forward_mode.is_idle():
            return None
        if fb.seq_lens.numel() == 0:
            return None
        lens = _host(fb, "seq_lens")
        marks = getattr(fb, MARKS_ATTR, None)
        if isinstance(marks, HostMarks) and len(marks.rows) == lens.numel():
            rows, prefixes = torch.tensor(marks.rows, dtype=torch.int64), marks.prefixes
            if self.req_to_token_pool.req_to_token.device.type == "cpu":  # free here: check
                prefixes = self._checked(marks, self._by_first_slot(rows, lens))
        else:
            rows = _host(fb, "req_pool_indices")
            prefixes = self._by_first_slot(rows, lens)
        if all(p is None for p in prefixes):
            return None
        mode = fb.forward_mode
        if mode.is_decode():
            q_lens = torch.ones_like(lens)
        elif mode.is_extend() and not (mode.is_target_verify() or mode.is_dllm_extend()):
            ext = getattr(fb, "extend_seq_lens_cpu", None)
            q_lens = torch.tensor(ext) if ext is not None else fb.extend_seq_lens.cpu()
        else:
            raise ValueError(f"compacted prefixes do not support forward mode {mode!r}")
        return _Batch(rows, lens, q_lens.long(), prefixes)

    def _by_first_slot(self, rows: torch.Tensor, lens: torch.Tensor) -> list[PackedLayout | None]:
        """Each request's prefix from its row's first slot (B ints read from the device)."""
        r2t = self.req_to_token_pool.req_to_token
        first = r2t[rows.to(r2t.device), 0].tolist()
        store = self.beta_store
        return [store.prefix_of(s) if n > 0 else None for s, n in zip(first, lens.tolist())]

    def _checked(
        self, marks: HostMarks, truth: list[PackedLayout | None]
    ) -> list[PackedLayout | None]:
        """`truth` (the slot look-up); a disagreement with the host marks is counted in
        `BetaStore.mark_mismatches` and logged."""
        if marks.prefixes != truth:
            self.beta_store.mark_mismatches += 1
            logger.error(
                "sglang_ext: host marks %s disagree with the rows' first slots %s (rows %s); "
                "serving the slot look-up",
                marks.prefixes, truth, marks.rows,
            )  # fmt: skip
        return truth

    # ---- metadata -------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> Any:
        """Decide stock vs biased for this forward (consumes `compacted_batch`'s memo; a
        compacted one is counted in `BetaStore.compacted_forwards` / `compacted_rows`), then
        the inner backend's own metadata."""
        self._batch = batch = self.compacted_batch(forward_batch)
        self._decided = None
        if self.graphs is not None:
            self.graphs.capturing = False
        if batch is not None:  # what the identity check reads: requests served from a prefix
            store = self.beta_store
            store.compacted_forwards += 1
            store.compacted_rows += sum(p is not None for p in batch.prefixes)
            eager = self._eager
            why = eager[1] if eager is not None and eager[0] is forward_batch else "no_graph"
            store.eager_batches[why] += 1
        self._eager = None
        return self.inner.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, *args: Any, **kwargs: Any) -> Any:
        """SGLang's decode graph runner sizes the graphs: the inner backend's state, then the
        compacted variant's buffers (on CUDA; with `cascade` also on the CPU, for tests)."""
        result = self.inner.init_cuda_graph_state(max_bs, *args, **kwargs)
        cuda = self.token_to_kv_pool.get_key_buffer(self.token_to_kv_pool.start_layer).is_cuda
        if cuda if self.cascade is None else self.cascade:
            self.graphs = CompactedGraphs.build(self, max_bs, cuda)
        return result

    def init_forward_metadata_out_graph(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Graph capture / replay: the compacted variant's (`CompactedGraphs.out_graph`),
        else the inner backend's."""
        self._batch = None
        self._decided = None
        in_capture = bool(args[0] if args else kwargs.get("in_capture", False))
        if self.graphs is not None and self.graphs.out_graph(forward_batch, in_capture):
            return None
        return self.inner.init_forward_metadata_out_graph(forward_batch, *args, **kwargs)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> Any:
        """Inside a captured graph: the compacted variant's tail gather, else the inner's."""
        if self.graphs is not None and self.graphs.in_graph(forward_batch):
            return None
        return self.inner.init_forward_metadata_in_graph(forward_batch)

    # ---- forwards -------------------------------------------------------------------------
    def forward(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        batch = self._batch
        if self.graphs is not None and self.graphs.capturing:
            self._save_kv(q, k, v, layer, forward_batch, args, kwargs)
            return self.graphs.attend(q.reshape(q.shape[0], -1, layer.qk_head_dim), layer)
        if batch is None:
            return self.inner.forward(q, k, v, layer, forward_batch, *args, **kwargs)
        return self._forward_biased(batch, q, k, v, layer, forward_batch, args, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        batch = self._batch
        if batch is None:
            return self.inner.forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)
        return self._forward_biased(batch, q, k, v, layer, forward_batch, args, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        batch = self._batch
        if self.graphs is not None and self.graphs.capturing:
            self._save_kv(q, k, v, layer, forward_batch, args, kwargs)
            return self.graphs.attend(q.reshape(q.shape[0], -1, layer.qk_head_dim), layer)
        if batch is None:
            return self.inner.forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)
        return self._forward_biased(batch, q, k, v, layer, forward_batch, args, kwargs)

    def _forward_biased(
        self,
        batch: _Batch,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Save K/V like the stock code, then biased attention for the whole batch.

        q [n, H_q * D] (or [n, H_q, D]); returns [n, H_q * D]. Mutates the KV pool.
        """
        self._save_kv(q, k, v, layer, forward_batch, args, kwargs)
        h_q, h_kv, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        pool = self.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        i = layer.layer_id - pool.start_layer
        store = self.beta_store
        r2t = self.req_to_token_pool.req_to_token
        q3 = q.reshape(-1, h_q, dim)

        bufs = (
            lambda j: pool.get_key_buffer(pool.start_layer + j),
            lambda j: pool.get_value_buffer(pool.start_layer + j),
            store.beta,
        )
        if not (q.device.type == "cuda" if self.cascade is None else self.cascade):
            parts = {
                id(p): PrefixPart(*p.read(i, *bufs, q.dtype), p.logical_length)
                for p in batch.prefixes if p is not None
            }  # fmt: skip
            out = attend_rows(
                q3, k_buf, v_buf, store.beta[i], r2t, batch.rows.tolist(),
                batch.seq_lens.tolist(), batch.q_lens.tolist(),
                [None if p is None else parts[id(p)] for p in batch.prefixes], layer.scaling,
            )  # fmt: skip
            return out.reshape(-1, h_q * dim)
        from sglang_ext.attention.cascade import (
            PrefixPlans,
            plan_cascade,
            run_cascade,
            stack_groups,
        )

        key = (layer.scaling, h_q, h_kv, dim)
        plan = batch.plans.get(key)
        if plan is None:
            if self.prefix_plans is None:
                self.prefix_plans = PrefixPlans()
            plan = plan_cascade(
                r2t, batch.rows, batch.seq_lens, batch.q_lens, batch.prefixes,
                num_qo_heads=h_q, num_kv_heads=h_kv, head_dim=dim, sm_scale=layer.scaling,
                cache=self.prefix_plans,
            )  # fmt: skip
            batch.plans[key] = plan
        ragged = [p.read_ragged(i, *bufs, k_buf.dtype) for p in plan.layouts]
        prefix_kv = stack_groups(ragged) if ragged else None
        out = run_cascade(plan, q3, k_buf, v_buf, store.beta[i], i, prefix_kv)
        return out.reshape(-1, h_q * dim)

    def _save_kv(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 layer: Any, forward_batch: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:  # fmt: skip
        """Refuse a layer the biased path does not serve (`check_layer`), then write the new
        K/V into the pool as the stock code does (unless `save_kv_cache` is False)."""
        extras = dict(kwargs)
        save_kv_cache = args[0] if args else extras.pop("save_kv_cache", True)
        check_layer(layer, forward_batch, {**extras, "positional": args[1:] or None})
        if save_kv_cache and k is not None and v is not None:
            h_kv, dim = layer.tp_k_head_num, layer.qk_head_dim
            loc = KVWriteLoc.for_batch(forward_batch)
            self.token_to_kv_pool.set_kv_buffer(
                layer, loc, k.view(-1, h_kv, dim), v.view(-1, h_kv, dim)
            )


def graph_gate(
    result: Any, graph_runner: Any, forward_batch: Any = None, *a: Any, **kw: Any
) -> Any:
    """AFTER hook on SGLang's `DecodeCudaGraphRunner.can_run_graph` and
    `PrefillCudaGraphRunner.can_run_graph`: False for a batch with a compacted request that
    the compacted decode graph cannot serve (it then runs eagerly, with beta; the reason is
    counted when its metadata is built), else None (SGLang's answer stands)."""
    if not result or forward_batch is None:
        return None
    backend = getattr(graph_runner, "attn_backend", None)
    if backend is None:
        backend = getattr(getattr(graph_runner, "model_runner", None), "attn_backend", None)
    if not isinstance(backend, CompactionBackend):
        return None
    batch = backend.compacted_batch(forward_batch)
    if batch is None:
        return None
    variants = getattr(graph_runner, "attention_graph_variants", None)
    if backend.graphs is None:
        why: str | None = "no_static_graphs"
    elif not isinstance(variants, CompactedVariants):
        why = "extend" if not forward_batch.forward_mode.is_decode() else "variants"
    else:
        why = backend.graphs.refusal(forward_batch, batch.prefixes)
    if why is None:
        return None
    backend._eager = (forward_batch, why)
    return False


def _host(forward_batch: Any, name: str) -> torch.Tensor:
    """`forward_batch.<name>` as a host int64 tensor, from its `<name>_cpu` copy if it has one."""
    cpu = getattr(forward_batch, f"{name}_cpu", None)
    return (cpu if cpu is not None else getattr(forward_batch, name)).cpu().long()
