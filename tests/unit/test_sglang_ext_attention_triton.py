"""The Triton path for compacted prefixes: `attention_triton` against `biased_sdpa` per
request (CPU under TRITON_INTERPRET=1, and on CUDA; no SGLang needed), and
`CompactionTritonBackend`'s stock-or-biased dispatch (needs SGLang)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_ext.attention_triton import paged_biased_attention, plan_batch, row_slots
from sglang_ext.kv_store import ALIAS_SLOT, BetaStore
from sglang_ext.sdpa import biased_sdpa

S, H_KV, G, D = 96, 2, 3, 32
H_Q = H_KV * G
SCALE = 0.3
# Per request: compacted slots, aliases, own tokens. Request 1 touches no compacted slot.
LAYOUT = [(9, 4, 12), (0, 0, 17), (6, 7, 5)]
POOL_ROWS = [2, 0, 3]  # req_pool_indices


class Batch(SimpleNamespace):
    k: torch.Tensor  # [S, H_kv, D]
    v: torch.Tensor
    beta: torch.Tensor  # [S, H_kv]
    r2t: torch.Tensor  # [4, 48] int32
    rows: list[torch.Tensor]  # per request: its slots in row order
    compacted: torch.Tensor  # [S] bool


def make_batch(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Shuffled slots; compacted ones get random beta (-inf on one head's padding)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(S, H_KV, D, generator=g), torch.randn(S, H_KV, D, generator=g)
    k[ALIAS_SLOT] = v[ALIAS_SLOT] = 0
    beta = torch.zeros(S, H_KV)
    beta[ALIAS_SLOT] = float("-inf")
    compacted = torch.zeros(S, dtype=torch.bool)
    compacted[ALIAS_SLOT] = True
    free = (torch.randperm(S - 1, generator=g) + 1).tolist()
    r2t = torch.randint(1, S, (4, 48), generator=g, dtype=torch.int32)  # junk past seq_len
    rows = []
    for (n_comp, n_alias, n_own), row in zip(LAYOUT, POOL_ROWS):
        comp = torch.tensor([free.pop() for _ in range(n_comp)], dtype=torch.long)
        beta[comp] = torch.randn(n_comp, H_KV, generator=g)
        beta[comp[n_comp * 2 // 3 :], 1] = float("-inf")  # head 1 kept fewer entries
        compacted[comp] = True
        own = torch.tensor([free.pop() for _ in range(n_own)], dtype=torch.long)
        slots = torch.cat([comp, torch.full((n_alias,), ALIAS_SLOT), own])
        r2t[row, : slots.numel()] = slots.int()
        rows.append(slots)
    return Batch(k=k.to(device, dtype), v=v.to(device, dtype), beta=beta.to(device),
                 r2t=r2t.to(device), rows=rows, compacted=compacted.to(device))  # fmt: skip


def sdpa_per_request(b: Batch, q: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """`biased_sdpa` one request at a time, in fp32 on the CPU. q [n, H_q, D]."""
    outs, start = [], 0
    for slots, q_len in zip(b.rows, q_lens):
        n = slots.numel()
        qr = q[start : start + q_len].float().cpu().movedim(0, 1)  # [H_q, q, D]
        k = b.k.float().cpu()[slots].movedim(0, 1)  # [H_kv, n, D]
        v = b.v.float().cpu()[slots].movedim(0, 1)
        outs.append(biased_sdpa(qr, k, v, b.beta.cpu()[slots], n - q_len, SCALE).movedim(0, 1))
        start += q_len
    return torch.cat(outs)


def extend_q_lens(b: Batch) -> list[int]:
    return [11, b.rows[1].numel(), 1]  # a suffix, a fresh prompt (no prefix), one token


@pytest.mark.parametrize(("mode", "causal_block"), [("decode", 64), ("extend", 4), ("extend", 64)])
def test_matches_biased_sdpa_per_request(mode: str, causal_block: int) -> None:
    b = make_batch()
    q_lens = [1, 1, 1] if mode == "decode" else extend_q_lens(b)
    q = torch.randn(sum(q_lens), H_Q, D, generator=torch.Generator().manual_seed(1))
    seq_lens = [r.numel() for r in b.rows]
    got = paged_biased_attention(q, b.k, b.v, b.beta, b.r2t, torch.tensor(POOL_ROWS), seq_lens,
                                 q_lens, SCALE, causal_block=causal_block)  # fmt: skip
    want = sdpa_per_request(b, q, q_lens)
    assert got.shape == (sum(q_lens), H_Q, D) and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_plan_shapes_decode_single_call_extend_blocks() -> None:
    b = make_batch()
    heads = dict(num_qo_heads=H_Q, num_kv_heads=H_KV, head_dim=D)
    seq_lens = [r.numel() for r in b.rows]
    decode = plan_batch(b.r2t, POOL_ROWS, seq_lens, [1, 1, 1], **heads)
    assert decode.diagonal is None and decode.num_tokens == 3
    extend = plan_batch(b.r2t, POOL_ROWS, seq_lens, extend_q_lens(b), causal_block=4, **heads)
    assert extend.diagonal is not None and extend.num_tokens == 29
    assert extend.blocks.planned.qo_indptr.tolist() == [0, 4, 8, 11, 15, 19, 23, 27, 28, 29]
    assert extend.diagonal.planned.kv_indptr.numel() == 30  # one kernel request per token
    slots = row_slots(b.r2t, POOL_ROWS, seq_lens)
    assert torch.equal(slots, torch.cat(b.rows))


def test_rejects_bad_inputs() -> None:
    b = make_batch()
    q = torch.zeros(3, H_Q, D)
    args = (q, b.k, b.v, b.beta, b.r2t, POOL_ROWS)
    with pytest.raises(ValueError, match=r"request 1: .* got q_len=30 seq_len=17"):
        paged_biased_attention(*args, [25, 17, 18], [1, 30, 1])
    with pytest.raises(ValueError, match=r"must all be \[B\], got 3, 2, 3"):
        paged_biased_attention(*args, [25, 17], [1, 1, 1])
    with pytest.raises(ValueError, match="q has 3 tokens, q_lens sum to 4"):
        paged_biased_attention(*args, [25, 17, 18], [2, 1, 1])
    with pytest.raises(ValueError, match="row=7"):
        paged_biased_attention(q, b.k, b.v, b.beta, b.r2t, [2, 7, 3], [25, 17, 18], [1, 1, 1])
    with pytest.raises(ValueError, match=r"q must be \[n, H_q, D\]"):
        paged_biased_attention(q[0], *args[1:], [25, 17, 18], [1, 1, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_matches_biased_sdpa_on_cuda(mode: str) -> None:
    b = make_batch(device="cuda", dtype=torch.bfloat16)
    q_lens = [1, 1, 1] if mode == "decode" else extend_q_lens(b)
    q = torch.randn(sum(q_lens), H_Q, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([r.numel() for r in b.rows], device="cuda")
    got = paged_biased_attention(q, b.k, b.v, b.beta, b.r2t, torch.tensor(POOL_ROWS, device="cuda"),
                                 seq_lens, torch.tensor(q_lens, device="cuda"), SCALE,
                                 causal_block=4)  # fmt: skip
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), sdpa_per_request(b, q, q_lens),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


# --- CompactionTritonBackend dispatch (SGLang's TritonAttnBackend parts stubbed) ---


class FakePool:
    """One layer of an MHA pool: the buffers, and set_kv_buffer as SGLang's writes them."""

    start_layer, layer_num = 0, 1

    def __init__(self, b: Batch):
        self.k, self.v, self.writes = b.k, b.v, 0

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v

    def set_kv_buffer(self, layer: Any, loc: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[loc.loc], self.v[loc.loc] = k.view(-1, H_KV, D), v.view(-1, H_KV, D)
        self.writes += 1


def make_backend(b: Batch, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_ext.triton_backend import CompactionTritonBackend

    stock: list[str] = []

    def stub(name: str) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> str:
            stock.append(name)
            return "stock"

        return run

    monkeypatch.setattr(TritonAttnBackend, "init_forward_metadata", lambda self, fb: None)
    for name in ("forward_decode", "forward_extend"):
        monkeypatch.setattr(TritonAttnBackend, name, stub(name))
    be = CompactionTritonBackend.__new__(CompactionTritonBackend)
    be.token_to_kv_pool, be.req_to_token = FakePool(b), b.r2t
    be.use_mla, be.dcp_size = False, 1
    be.forward_metadata = SimpleNamespace(swa_out_cache_loc=None)
    be._setup()
    store: BetaStore = be.beta_store
    store.enable_alias()
    store.beta[0], store.compacted[:] = b.beta, b.compacted
    return be, stock


def layer(**kw: Any) -> Any:
    from sglang.srt.layers.radix_attention import AttentionType

    base = dict(layer_id=0, tp_q_head_num=H_Q, tp_k_head_num=H_KV, qk_head_dim=D, v_head_dim=D,
                scaling=SCALE, is_cross_attention=False, sliding_window_size=-1, logit_cap=0.0,
                attn_type=AttentionType.DECODER, k_scale=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def forward_batch(b: Batch, mode: str, requests: list[int], q_lens: list[int]) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    new = torch.cat([b.rows[i][b.rows[i].numel() - q :] for i, q in zip(requests, q_lens)])
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
        req_pool_indices=torch.tensor([POOL_ROWS[i] for i in requests]),
        seq_lens=torch.tensor([b.rows[i].numel() for i in requests]), seq_lens_cpu=None,
        extend_seq_lens_cpu=q_lens, encoder_lens=None, out_cache_loc=new,
        out_cache_loc_is_physical=False,
    )  # fmt: skip


def test_backend_plain_batch_takes_stock_path(monkeypatch: pytest.MonkeyPatch) -> None:
    b = make_batch()
    be, stock = make_backend(b, monkeypatch)
    fb = forward_batch(b, "decode", [1], [1])
    be.init_forward_metadata(fb)
    q = torch.zeros(1, H_Q * D)
    assert be.forward_decode(q, q, q, layer(), fb) == "stock" and stock == ["forward_decode"]
    fb = forward_batch(b, "extend", [1], [17])
    be.init_forward_metadata(fb)
    assert be.forward_extend(q, q, q, layer(), fb) == "stock" and be.token_to_kv_pool.writes == 0


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_backend_biased_batch_saves_kv_and_matches(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_batch(seed=2)
    want_k, want_v = b.k.clone(), b.v.clone()
    be, stock = make_backend(b, monkeypatch)
    q_lens = [1, 1, 1] if mode == "decode" else extend_q_lens(b)
    fb = forward_batch(b, mode, [0, 1, 2], q_lens)
    be.init_forward_metadata(fb)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), H_Q * D, generator=g)
    k, v = (
        torch.randn(sum(q_lens), H_KV * D, generator=g),
        torch.randn(sum(q_lens), H_KV * D, generator=g),
    )
    want_k[fb.out_cache_loc], want_v[fb.out_cache_loc] = k.view(-1, H_KV, D), v.view(-1, H_KV, D)
    forward = be.forward_decode if mode == "decode" else be.forward_extend
    out = forward(q, k, v, layer(), fb)
    assert stock == [] and be.token_to_kv_pool.writes == 1
    assert torch.equal(b.k, want_k) and torch.equal(b.v, want_v)
    want = sdpa_per_request(b, q.view(-1, H_Q, D), q_lens)
    torch.testing.assert_close(out, want.reshape(-1, H_Q * D), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("kw", "what"), [({"sliding_window_size": 64}, "sliding window"),
                                          ({"is_cross_attention": True}, "cross attention"),
                                          ({"logit_cap": 30.0}, "logit soft cap")])  # fmt: skip
def test_backend_rejects_unsupported_layers(
    kw: dict[str, Any], what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_batch()
    be, _ = make_backend(b, monkeypatch)
    fb = forward_batch(b, "decode", [0], [1])
    be.init_forward_metadata(fb)
    q = torch.zeros(1, H_Q * D)
    with pytest.raises(ValueError, match=what):
        be.forward_decode(q, q, q, layer(**kw), fb)


def test_backend_rejects_speculative_modes_on_compacted_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = make_batch()
    be, _ = make_backend(b, monkeypatch)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = forward_batch(b, "decode", [0], [1])
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(ValueError, match="do not support forward mode"):
        be.init_forward_metadata(fb)
    be.init_forward_metadata(forward_batch(b, "decode", [1], [1]))  # plain rows: stock, no error
    assert be._batch is None
