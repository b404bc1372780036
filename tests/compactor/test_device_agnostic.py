"""Compaction follows its inputs' device: nothing is allocated on the default device.

Shape legend: T prefix tokens, n reference queries per query head, H_kv KV heads,
H_q query heads, G = H_q // H_kv, D head dim, E hidden size.

The CPU tests run each path on CPU inputs inside ``with torch.device("meta")``: every
allocation that names no device then lands on the meta device, and mixing it with the CPU
inputs (or reading it back with ``.item()``) raises, so an unchanged, bit-identical result
proves every tensor followed an input. The ``gpu`` tests run the same paths on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from compactor import hf
from compactor.head_budgets.curves import sensitivity_curve
from compactor.methods import CompactionMethod, LayerInput, get_method, list_methods
from compactor.methods.compresskv import layer_budgets
from compactor.methods.context import LayerContext
from compactor.solvers import NNLSOptions, attend, lstsq_values, nnls, nnls_gram
from compactor.types import CompactedLayer
from tests._tiny import tiny_llama

H_KV, G, T, D, N, E = 2, 3, 64, 16, 32, 24
H_Q = H_KV * G
PREFIX_IDS = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(5)).tolist()
# every registered method with its defaults, plus the options that take other code paths
# (windows below the smallest budget: the window tokens tie at the top and are all kept)
# Every method the project registers; "test-*" names are fakes other test modules register
# (present or not depending on collection order), not the project's methods.
PROJECT_METHODS = [name for name in list_methods() if not name.startswith("test-")]
CASES: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in PROJECT_METHODS] + [
    ("snapkv", {"window": 4, "refit": "am"}),
    ("h2o", {"window": 4}),
    ("streamingllm", {"refit": "am"}),
    ("kvcompose", {"group_size": G, "refit": "am"}),
    ("compresskv", {"window": 4}),
    ("gvote", {"refit": "am"}),
    ("kv-compress", {"window": 4, "refit": "am"}),
]


def _layer(seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Peaked synthetic layer: keys/values [H_kv, T, D], fit and held-out queries
    [H_kv, G*N, D] (GQA-pooled), budgets, and a LayerContext for G query heads per KV head."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(H_KV, 8, D, generator=g) * 2.0

    def around(m: int) -> torch.Tensor:
        a = torch.randint(0, 8, (H_KV, m), generator=g)
        picked = torch.gather(centers, 1, a.unsqueeze(-1).expand(-1, -1, D))
        return picked + torch.randn(H_KV, m, D, generator=g)

    keys, values = around(T), torch.randn(H_KV, T, D, generator=g)
    q_fit, q_eval = around(G * N), around(G * N)
    hidden = torch.randn(T, E, generator=g)
    inv = 1.0 / (100.0 ** (torch.arange(0, D, 2).float() / D))
    ctx = LayerContext(
        layer=1,
        num_layers=2,
        hidden=hidden,
        q_weight=torch.randn(H_Q * D, E, generator=g) / E**0.5,
        q_bias=None,
        inv_freq=inv,
        rope_scale=1.0,
        last_query=torch.zeros(H_Q, D),
        num_q_heads=H_Q,
        head_dim=D,
    )
    ctx = LayerContext(**{**ctx.__dict__, "last_query": q_fit.reshape(H_Q, N, D)[:, -1] * 0.5})
    parts: dict[str, Any] = {"keys": keys, "values": values, "q_fit": q_fit, "q_eval": q_eval}
    out: dict[str, Any] = {k: v.to(device) for k, v in parts.items()}
    out["ctx"] = ctx.to(device)
    out["budgets"] = [9, 6]
    return out


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory with a CompressKV calibration for 2 layers of H_q query heads."""
    d = tmp_path_factory.mktemp("calib")
    srh = [[0.1, 0.9, 0.3, 0.2, 0.5, 0.4], [0.7, 0.1, 0.2, 0.3, 0.9, 0.0]]
    (d / "compresskv_calibration.json").write_text(
        json.dumps({"srh_scores": srh, "layer_errors": [1.0, 2.0]})
    )
    return str(d)


def _input(
    method: CompactionMethod, params: dict[str, Any], lay: dict[str, Any], calib: str
) -> LayerInput:
    """The method's LayerInput for the synthetic layer (a context when it needs one)."""
    ctx = None
    if method.needs_context:
        ctx = LayerContext(**{**lay["ctx"].__dict__, "model_dir": calib})
    q = lay["q_fit"]
    if params.get("window"):  # window queries: the last `window` tokens' own, per query head
        w = params["window"]
        q = q.reshape(H_KV, G, N, D)[:, :, -w:].reshape(H_KV, G * w, D)
    return LayerInput(lay["keys"], lay["values"], q, tuple(lay["budgets"]), context=ctx)


def _compact(name: str, params: dict[str, Any], lay: dict[str, Any], calib: str) -> CompactedLayer:
    method = get_method(name, **params)
    return method.compact(_input(method, params, lay, calib)).layer


def _assert_same(a: CompactedLayer, b: CompactedLayer) -> None:
    for x, y in [
        (a.keys, b.keys),
        (a.values, b.values),
        (a.beta, b.beta),
        (a.indptr, b.indptr),
        (a.kept_indices, b.kept_indices),
    ]:
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert (x.device, x.dtype) == (y.device, y.dtype)
            assert torch.equal(x, y)
    assert a.head_lengths() == b.head_lengths()


def _assert_equal_outputs(ref: list[Any], got: list[Any]) -> None:
    """Tensors: on the CPU and equal; anything else (token / budget lists): equal."""
    assert len(ref) == len(got)
    for x, y in zip(ref, got):
        if isinstance(x, torch.Tensor):
            assert y.device.type == "cpu" and torch.equal(x, y)
        else:
            assert x == y


def _heldout_error(layer: CompactedLayer, lay: dict[str, Any]) -> float:
    """Mean over KV heads of the relative held-out attention-output error (fp32, CPU)."""
    q, keys, values = lay["q_eval"], lay["keys"], lay["values"]
    ref, _ = attend(q, keys, values)
    errs = []
    for h in range(H_KV):
        k, v, b = layer.head(h)
        o, _ = attend(q[h], k, v, b)
        errs.append(float((o - ref[h]).norm() / ref[h].norm()))
    return sum(errs) / len(errs)


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_compact_layer_allocates_nothing_on_the_default_device(
    name: str, params: dict[str, Any], calib_dir: str
) -> None:
    lay = _layer()
    ref = _compact(name, params, lay, calib_dir)
    with torch.device("meta"):
        got = _compact(name, params, lay, calib_dir)
    assert got.keys.device.type == "cpu"
    _assert_same(ref, got)


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_methods_are_stateless(name: str, params: dict[str, Any], calib_dir: str) -> None:
    """compact mutates nothing on the method (its attributes are its hyper-parameters and
    stay equal) and gives the same layer and report when called again."""
    method = get_method(name, **params)
    assert set(vars(method)) == {f.name for f in dataclasses.fields(method)}
    before = copy.deepcopy(vars(method))
    x = _input(method, params, _layer(2), calib_dir)
    first, again = method.compact(x), method.compact(x)
    assert vars(method) == before
    _assert_same(first.layer, again.layer)
    assert first.report == again.report
    assert (first.report != {}) == (name in ("gvote", "compresskv", "kvzip", "kv-compress"))


def test_solvers_and_budget_helpers_allocate_nothing_on_the_default_device() -> None:
    g = torch.Generator().manual_seed(3)
    A, b = torch.rand(2, 20, 6, generator=g), torch.rand(2, 20, generator=g)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    lower, prior = torch.full((2, 6), 0.01), torch.randn(2, 6, 5, generator=g)
    Y = torch.randn(2, 20, 5, generator=g)
    lay = _layer(1)
    method = get_method("am-highest")
    kvc = get_method("kvcompose")
    keys3, q3 = [lay["keys"]] * 3, [lay["q_fit"]] * 3

    def run() -> list[Any]:
        G_ = A.transpose(1, 2) @ A
        c = (A.transpose(1, 2) @ b.unsqueeze(-1)).squeeze(-1)
        return [
            nnls(A, b, NNLSOptions(lower, 3.0, mask=mask, ridge=1e-6)),
            nnls(A[0], b[0]),
            nnls_gram(G_, c, NNLSOptions(0.0, None, mask=mask)),
            lstsq_values(A, Y, ridge=1e-3, prior=prior, mask=mask),
            lstsq_values(A[1], Y[1], ridge=0.0),
            *attend(lay["q_fit"], lay["keys"], lay["values"], beta=None),
            sensitivity_curve(lay["keys"], lay["values"], lay["q_fit"], [0.1, 0.5], method),
            kvc.plan_layer_budgets(keys3, q3, 8),  # type: ignore[attr-defined]
            layer_budgets([1.0, 3.0, 2.0], 8, T, 0.5, 2.0),
        ]

    ref = run()
    with torch.device("meta"):
        got = run()
    _assert_equal_outputs(ref, got)


def _prefix(model: Any, on_policy: bool) -> Any:
    """am-omp-fast on a 48-token prefix; query sources that cover the reservoir, random and
    prefix queries and generated follow-up answers (the decode path)."""
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec, QueryConfig

    cfg = QueryConfig(
        sources=("repeat-prefill", "context-prefill", "random", "follow-up"),
        max_queries_per_head=40,
        random_count=6,
        follow_up_answer_tokens=3,
    )
    torch.manual_seed(0)
    spec = CompactionSpec(method="am-omp-fast", ratio=0.25, queries=cfg, on_policy=on_policy)
    hooks = Hooks(progress=False, model_fingerprint="tiny")
    prefix, _ = compact_prefix(model, None, PREFIX_IDS, spec, [[5, 6, 7], [9, 10]], hooks)
    return prefix


@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
def test_compact_prefix_allocates_nothing_on_the_default_device(tiny: Any, on_policy: bool) -> None:
    """The whole call runs under the meta default device, the model's forwards included
    (transformers allocates on its inputs' device), so no wrapping of the fits is needed."""
    ref = _prefix(tiny, on_policy)
    with torch.device("meta"):
        got = _prefix(tiny, on_policy)
    got.validate()
    for a, b in zip(ref.layers, got.layers):
        _assert_same(a, b)


def test_decoding_after_a_compacted_prefix_allocates_nothing_on_the_default_device(
    tiny: Any,
) -> None:
    prefix = _prefix(tiny, on_policy=False)

    pad = torch.tensor([[True, False, False], [False, False, False]])
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def run() -> list[Any]:
        state = hf.PrefixState.from_compacted(prefix)
        logits = state.forward(tiny, rows, pad=pad)
        gen = torch.Generator(device="cpu").manual_seed(1)
        sampled = hf.greedy_generate(tiny, state.fork(), [9, 8], 4, temperature=0.9, generator=gen)
        batch = hf.batched_generate(tiny, state.fork(), [[3], [4, 5]], 3)
        return [logits, sampled, batch]

    ref = run()
    with torch.device("meta"):
        got = run()
    _assert_equal_outputs(ref, got)


# ---- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_compact_layer_on_cuda_matches_cpu_quality(
    name: str, params: dict[str, Any], calib_dir: str
) -> None:
    """Same head lengths and held-out error within 1e-3 (indices may differ on float ties)."""
    cpu, cuda = _layer(2), _layer(2, device="cuda")
    ref = _compact(name, params, cpu, calib_dir)
    got = _compact(name, params, cuda, calib_dir)
    assert got.keys.device.type == "cuda" and got.indptr.device.type == "cuda"
    got.validate(head_dim=D, num_kv_heads=H_KV, dtype=torch.float32, logical_length=T)
    assert got.head_lengths() == ref.head_lengths()
    err_cpu, err_cuda = _heldout_error(ref, cpu), _heldout_error(got.to("cpu"), cpu)
    assert abs(err_cuda - err_cpu) <= 1e-3, (err_cpu, err_cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
def test_worker_compaction_on_cuda_returns_a_cpu_prefix_the_service_encodes(
    tmp_path: Path, on_policy: bool
) -> None:
    """The worker path on a CUDA model: a valid prefix on the CPU, picklable for Ray and
    encoded by the service, with the CPU run's head lengths and about its decode quality."""
    from compactor.service.gen.compactor.v1 import compactor_pb2 as pb
    from compactor.service.result_stream import Assembler, EncodedPrefix, encode_prefix
    from compactor.spec import CompactionSpec, QueryConfig
    from compactor.workers.job import CompactJob
    from compactor.workers.worker import run_compaction

    model = tiny_llama(tmp_path / "tiny")
    ids = tuple(torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(7)).tolist())
    spec = CompactionSpec(
        method="am-omp-fast", ratio=0.25, queries=QueryConfig(sources=("repeat-prefill",)),
        on_policy=on_policy,
    )  # fmt: skip
    job = CompactJob("tiny", ids, spec, follow_ups=((5, 6, 7),))
    ref = run_compaction(model, None, "tiny", job).prefix
    res = run_compaction(model.to("cuda"), None, "tiny", job)
    prefix = pickle.loads(pickle.dumps(res.prefix))  # what crosses the Ray boundary
    prefix.validate(expected_fingerprint="tiny", num_layers=2, num_kv_heads=2, head_dim=16)
    devices = {
        t.device.type
        for layer in prefix.layers
        for t in (layer.keys, layer.values, layer.beta, layer.indptr, layer.kept_indices)
        if t is not None
    }
    assert devices == {"cpu"}
    assert prefix.kept_per_head() == ref.kept_per_head()
    header, payload, digest = encode_prefix(res.prefix)
    asm = Assembler()
    trailer = pb.Trailer(sha256=digest, payload_bytes=len(payload))
    for msg in EncodedPrefix(header, payload, digest).messages(1 << 12, trailer):
        asm.add(msg)
    back = asm.result(expected_fingerprint="tiny")
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(prefix.layers, back.layers))
    # decode quality after the prefix (CPU model) within 1e-3 of the CPU-fitted prefix's
    model = model.to("cpu")
    full = hf.PrefixState.full(hf.prefill(model, list(ids))).forward(model, [11, 12, 13])

    def err(p: Any) -> float:
        got = hf.PrefixState.from_compacted(p).forward(model, [11, 12, 13])
        return float((got - full).abs().max())

    assert abs(err(prefix) - err(ref)) <= 1e-3, (err(prefix), err(ref))
