"""Biased causal attention of a whole batch over SGLang's paged KV pool, on the Triton kernels.

Legend: B requests, n = sum_b q_b new (query) tokens, H_q / H_kv heads (G = H_q // H_kv),
D head dim, S pool slots, R x W the `req_to_token` table. Request b owns table row
`req_pool_indices[b]`, whose first n_b = `seq_lens[b]` entries are its KV slots; the last
q_b = `q_lens[b]` of them are its new tokens (decode: q_b = 1). New token i sits at position
p_b + i (p_b = n_b - q_b) and sees entries [0, p_b + i], each with logit q.k * scale + beta.

The kernels (`compaction_kernels/biased_attention/triton.py`, paged layout, page size 1) attend every
query of a kernel request to that request's whole KV set, so causality is built from the
slot tables: the new tokens of b are cut into blocks of C = `causal_block` tokens and
    blocks    block j of b is one kernel request whose tokens share entries [0, p_b + jC);
    diagonal  token i of block j is one kernel request over entries [p_b + jC, p_b + i];
the two partial results are merged by their LSE (`compaction_kernels/merge_state`). When every request
has one new token (decode) a single call over the rows [0, n_b) does it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compaction_kernels.biased_attention import AttentionOutput
from compaction_kernels.biased_attention.triton import BiasedPagedAttention
from compaction_kernels.merge_state.triton import merge_state

__all__ = [
    "BatchPlan",
    "check_batch",
    "gather_slots",
    "paged_biased_attention",
    "plan_batch",
    "plan_calls",
    "plan_causal",
    "run_batch",
    "run_causal",
]

Lengths = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class BatchPlan:
    """The planned kernel calls of one batch (device tables inside the wrappers).

    `blocks` covers the shared part of each block (the whole rows for decode); `diagonal` is
    None for decode batches.
    """

    num_tokens: int
    blocks: BiasedPagedAttention
    diagonal: BiasedPagedAttention | None


def plan_batch(
    req_to_token: torch.Tensor,
    req_pool_indices: Lengths,
    seq_lens: Lengths,
    q_lens: Lengths,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sm_scale: float | None = None,
    causal_block: int = 64,
) -> BatchPlan:
    """Build the slot tables on `req_to_token`'s device and plan the kernel calls.

    Args:
        req_to_token: [R, W] int32/int64 slot table (SGLang's `req_to_token_pool`).
        req_pool_indices, seq_lens, q_lens: [B] ints (tensors on any device, or lists).
        sm_scale: logit scale (None: 1/sqrt(D)).
        causal_block: C, new tokens that share one prefix call (>= 1).
    Raises:
        ValueError: inconsistent lengths or shapes; the message names the offending values.
    """
    rows, lens, qls = check_batch(req_to_token, req_pool_indices, seq_lens, q_lens)
    heads = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    blocks, diagonal = plan_causal(
        req_to_token, rows, torch.zeros_like(lens), lens, qls, sm_scale, causal_block, **heads
    )
    return BatchPlan(int(qls.sum()), blocks, diagonal)


def run_batch(
    plan: BatchPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_layer: torch.Tensor,
) -> torch.Tensor:
    """q [n, H_q, D] over k_cache/v_cache [S, H_kv, D] with beta_layer [S, H_kv] fp32.

    Returns out [n, H_q, D] in q's dtype; mutates nothing. ValueError on shapes that do not
    match the plan (raised by the kernel wrappers).
    """
    return run_causal(plan.blocks, plan.diagonal, q, k_cache, v_cache, beta_layer).out


def paged_biased_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_layer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Lengths,
    seq_lens: Lengths,
    q_lens: Lengths,
    scale: float | None = None,
    *,
    causal_block: int = 64,
) -> torch.Tensor:
    """One-shot `plan_batch` + `run_batch` (see the module legend).

    Args:
        q: [n, H_q, D], the new tokens of request 0, then request 1, ...
        k_cache, v_cache: [S, H_kv, D] one layer of the pool; beta_layer: [S, H_kv] fp32.
        req_to_token: [R, W]; req_pool_indices, seq_lens, q_lens: [B].
        scale: logit scale (None: 1/sqrt(D)).
    Returns:
        out [n, H_q, D] in q's dtype.
    Raises:
        ValueError: bad shapes or lengths, with the offending values.
    """
    if q.dim() != 3 or k_cache.dim() != 3:
        raise ValueError(
            f"q must be [n, H_q, D] and k_cache [S, H_kv, D], got {tuple(q.shape)} and "
            f"{tuple(k_cache.shape)}"
        )
    plan = plan_batch(
        req_to_token, req_pool_indices, seq_lens, q_lens,
        num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1], head_dim=k_cache.shape[2],
        sm_scale=scale, causal_block=causal_block,
    )  # fmt: skip
    if plan.num_tokens != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens, q_lens sum to {plan.num_tokens}")
    return run_batch(plan, q, k_cache, v_cache, beta_layer)


def _host(x: Lengths, name: str) -> torch.Tensor:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.tensor(list(x))
    if t.dim() != 1 or t.is_floating_point():
        raise ValueError(f"{name} must be a 1-D integer [B], got {t.dtype} {tuple(t.shape)}")
    return t.long()


def check_batch(
    req_to_token: torch.Tensor, req_pool_indices: Lengths, seq_lens: Lengths, q_lens: Lengths
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate one batch; returns rows, seq_lens, q_lens as host int64 [B] tensors."""
    rows = _host(req_pool_indices, "req_pool_indices")
    lens, qls = _host(seq_lens, "seq_lens"), _host(q_lens, "q_lens")
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"req_to_token must be [R, W] int32/int64, got {req_to_token.dtype} "
            f"{tuple(req_to_token.shape)}"
        )
    if not rows.numel() == lens.numel() == qls.numel():
        raise ValueError(
            f"req_pool_indices, seq_lens, q_lens must all be [B], got {rows.numel()}, "
            f"{lens.numel()}, {qls.numel()} entries"
        )
    num_rows, width = req_to_token.shape
    bad = (qls < 1) | (qls > lens) | (lens > width) | (rows < 0) | (rows >= num_rows)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"request {b}: need 1 <= q_len <= seq_len <= W={width} and 0 <= row < R={num_rows}, "
            f"got q_len={int(qls[b])} seq_len={int(lens[b])} row={int(rows[b])}"
        )
    return rows, lens, qls


def plan_causal(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    qls: torch.Tensor,
    sm_scale: float | None,
    causal_block: int,
    **heads: int,
) -> tuple[BiasedPagedAttention, BiasedPagedAttention | None]:
    """Plan blocks + diagonal (module legend) of request b over its row's entries
    [starts[b], lens[b]), whose last qls[b] are its new tokens (host int64 [B], validated;
    starts[b] <= lens[b] - qls[b]). All q_len 1: one call, diagonal None."""
    if causal_block < 1:
        raise ValueError(f"causal_block must be >= 1, got {causal_block}")
    if bool((qls == 1).all()):
        return plan_calls(req_to_token, rows, starts, lens - starts, None, sm_scale, **heads), None
    prefix = lens - qls
    c = causal_block
    num_blocks = (qls + c - 1) // c
    blk_req = torch.repeat_interleave(torch.arange(rows.numel()), num_blocks)
    j = torch.arange(blk_req.numel()) - (torch.cumsum(num_blocks, 0) - num_blocks)[blk_req]
    blk_q = torch.clamp(qls[blk_req] - j * c, max=c)
    qo_indptr = torch.zeros(blk_q.numel() + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(blk_q, 0)
    blk_start = starts[blk_req]
    blk_len = prefix[blk_req] + j * c - blk_start
    blocks = plan_calls(
        req_to_token, rows[blk_req], blk_start, blk_len, qo_indptr, sm_scale, **heads
    )
    tok_req = torch.repeat_interleave(torch.arange(rows.numel()), qls)
    i = torch.arange(int(qls.sum())) - (torch.cumsum(qls, 0) - qls)[tok_req]
    diag_start = prefix[tok_req] + (i // c) * c
    diagonal = plan_calls(
        req_to_token, rows[tok_req], diag_start, i % c + 1, None, sm_scale, **heads
    )
    return blocks, diagonal


def run_causal(
    blocks: BiasedPagedAttention,
    diagonal: BiasedPagedAttention | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta_layer: torch.Tensor,
) -> AttentionOutput:
    """Run `plan_causal`'s calls and merge them: out [n, H_q, D] (q's dtype), lse [n, H_q]."""
    part = blocks.run(q, k_cache, v_cache, beta_layer)
    if diagonal is None:
        return part
    diag = diagonal.run(q, k_cache, v_cache, beta_layer)
    return merge_state(part.out, part.lse, diag.out, diag.lse, out_dtype=q.dtype)


def gather_slots(
    req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment m = entries [starts[m], starts[m] + lens[m]) of row rows[m] (host int64 [M]):
    returns kv_indptr [M+1] and kv_indices [sum lens] int32 on req_to_token's device."""
    dev = req_to_token.device
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    total = int(indptr[-1])
    seg = torch.repeat_interleave(
        torch.arange(lens.numel(), device=dev), lens.to(dev), output_size=total
    )
    dev_indptr = indptr.to(dev)
    col = starts.to(dev)[seg] + torch.arange(total, device=dev) - dev_indptr[seg]
    indices = req_to_token[rows.to(dev)[seg], col].to(torch.int32)
    return dev_indptr.to(torch.int32), indices


def plan_calls(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    sm_scale: float | None,
    **heads: int,
) -> BiasedPagedAttention:
    """One planned call: segment m (see :func:`gather_slots`) attended by the queries
    qo_indptr[m]:qo_indptr[m+1] (None: one query each)."""
    kv_indptr, kv_indices = gather_slots(req_to_token, rows, starts, lens)
    wrapper = BiasedPagedAttention()
    qo = None if qo_indptr is None else qo_indptr.to(req_to_token.device)
    wrapper.plan(kv_indptr, kv_indices, qo_indptr=qo, sm_scale=sm_scale, **heads)
    return wrapper
