"""CompactedPrefix / CompactedLayer: save/load round trip and every validation error."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from compactor.types import CompactedLayer, CompactedPrefix, prefix_hash

H, D, T = 3, 8, 20


def make_layer(lengths=(2, 3, 1), dtype=torch.bfloat16) -> CompactedLayer:
    n = sum(lengths)
    indptr = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    return CompactedLayer(
        keys=torch.randn(n, D).to(dtype),
        values=torch.randn(n, D).to(dtype),
        beta=torch.randn(n),
        indptr=indptr,
        kept_indices=torch.arange(n, dtype=torch.int64),
    )


def make_prefix(num_layers=2, **kw) -> CompactedPrefix:
    fields = dict(
        model_fingerprint="smollm2-abc",
        logical_length=T,
        prefix_hash=prefix_hash(range(T)),
        method="am-omp",
        params={"k": 1, "tau": 1},
        layers=[make_layer() for _ in range(num_layers)],
        head_dim=D,
        num_kv_heads=H,
        dtype=torch.bfloat16,
    )
    fields.update(kw)
    return CompactedPrefix(**fields)  # type: ignore[arg-type]


def with_layer(p: CompactedPrefix, **changes) -> CompactedPrefix:
    return dataclasses.replace(p, layers=[dataclasses.replace(p.layers[0], **changes)])


def test_round_trip(tmp_path):
    p = make_prefix()
    p.validate("smollm2-abc", num_layers=2, num_kv_heads=H, head_dim=D)
    path = tmp_path / "p.safetensors"
    p.save(path)
    q = CompactedPrefix.load(path)
    q.validate("smollm2-abc", num_layers=2, num_kv_heads=H, head_dim=D)
    assert q.metadata() == p.metadata()
    for a, b in zip(p.layers, q.layers):
        assert torch.equal(a.keys, b.keys) and a.keys.dtype == torch.bfloat16
        assert torch.equal(a.values, b.values)
        assert torch.equal(a.beta, b.beta) and b.beta.dtype == torch.float32
        assert torch.equal(a.indptr, b.indptr) and b.indptr.dtype == torch.int32
        assert b.kept_indices is not None and torch.equal(a.kept_indices, b.kept_indices)


def test_load_rejects_plain_safetensors(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not a compacted prefix"):
        CompactedPrefix.load(path)


def test_helpers():
    p = make_prefix()
    assert p.kept_tokens() == 2 * 6
    assert p.kept_per_head() == [[2, 3, 1], [2, 3, 1]]
    assert p.times_smaller() == pytest.approx(2 * H * T / 12)
    assert p.kept_fraction() == pytest.approx(12 / (2 * H * T))
    per_layer = 6 * D * 2 * 2 + 6 * 4 + 4 * 4 + 6 * 8
    assert p.nbytes() == 2 * per_layer
    k, _v, b = p.layers[0].head(1)
    assert k.shape == (3, D) and b.shape == (3,)


def test_prefix_hash():
    assert prefix_hash([1, 2, 3]) == prefix_hash((1, 2, 3))
    assert prefix_hash([1, 2, 3]) != prefix_hash([1, 2, 4])
    import hashlib

    assert prefix_hash([1]) == hashlib.sha256(b"\x01\x00\x00\x00").hexdigest()
    with pytest.raises(ValueError, match="int32"):
        prefix_hash([2**31])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda p: with_layer(p, keys=p.layers[0].keys[:, :4], values=p.layers[0].values[:, :4]),
            "head_dim",
        ),
        (lambda p: with_layer(p, values=p.layers[0].values[:3]), "values shape"),
        (
            lambda p: with_layer(
                p, keys=p.layers[0].keys.float(), values=p.layers[0].values.float()
            ),
            "dtype",
        ),
        (lambda p: with_layer(p, beta=p.layers[0].beta.double()), "beta dtype"),
        (lambda p: with_layer(p, beta=p.layers[0].beta[:2]), "beta must be"),
        (lambda p: with_layer(p, indptr=p.layers[0].indptr.long()), "indptr dtype"),
        (
            lambda p: with_layer(p, indptr=torch.tensor([1, 2, 5, 6], dtype=torch.int32)),
            "start at 0",
        ),
        (lambda p: with_layer(p, indptr=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), "monotone"),
        (
            lambda p: with_layer(p, indptr=torch.tensor([0, 2, 5, 5], dtype=torch.int32)),
            "indptr\\[-1\\]",
        ),
        (
            lambda p: with_layer(p, indptr=torch.tensor([0, 2, 6], dtype=torch.int32)),
            "num_kv_heads",
        ),
        (
            lambda p: with_layer(p, keys=p.layers[0].keys.clone().fill_(math.inf)),
            "keys contain non-finite",
        ),
        (
            lambda p: with_layer(p, values=p.layers[0].values.clone().fill_(math.nan)),
            "values contain non-finite",
        ),
        (lambda p: with_layer(p, beta=torch.full((6,), math.nan)), "NaN"),
        (lambda p: with_layer(p, beta=torch.full((6,), math.inf)), "\\+inf"),
        (
            lambda p: with_layer(p, kept_indices=torch.full((6,), T, dtype=torch.int64)),
            "kept_indices",
        ),
        (lambda p: dataclasses.replace(p, logical_length=2), "logical_length"),
        (lambda p: dataclasses.replace(p, params={"x": object()}), "JSON"),
        (lambda p: dataclasses.replace(p, layers=[]), "no layers|layers"),
    ],
)
def test_validation_errors(mutate, match):
    p = mutate(make_prefix(num_layers=1))
    with pytest.raises(ValueError, match=match):
        p.validate()


def test_validation_expectations():
    p = make_prefix()
    with pytest.raises(ValueError, match="another model"):
        p.validate("gemma-xyz")
    with pytest.raises(ValueError, match="num_layers"):
        p.validate(num_layers=30)
    with pytest.raises(ValueError, match="num_kv_heads"):
        p.validate(num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim"):
        p.validate(head_dim=64)


def test_minus_inf_beta_is_allowed():
    p = make_prefix(num_layers=1)
    with_layer(p, beta=torch.full((6,), -math.inf)).validate()


def test_padded_layout_masks_the_padding() -> None:
    layer = make_layer(lengths=(2, 3, 0), dtype=torch.float32)
    k, v, beta = layer.padded(4)
    assert k.shape == v.shape == (3, 4, layer.keys.shape[-1]) and beta.shape == (3, 4)
    for h, n in enumerate((2, 3, 0)):
        kh, vh, bh = layer.head(h)
        assert torch.equal(k[h, :n], kh) and torch.equal(v[h, :n], vh)
        assert torch.equal(beta[h, :n], bh) and bool(torch.isneginf(beta[h, n:]).all())
        assert not k[h, n:].any()
    with pytest.raises(ValueError, match="slots=2 < longest head"):
        layer.padded(2)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"ratio_chosen": "high"}, "ratio_chosen"), ({"budget_per_head": -1}, "budget_per_head"),
     ({"estimated_error": float("nan")}, "estimated_error"), ({"head_table": [[1, "x"]]},
     "head_table"), ({"search": [1, 2]}, "search"), ({"tokens_asked": True}, "tokens_asked")],
)  # fmt: skip
def test_a_budget_report_of_the_wrong_types_is_refused_when_read(
    change: dict[str, Any], field: str
) -> None:
    """A prefix's budget report is the sender's JSON: read back, a field of the wrong type is
    a ValueError naming it (a result carrying one is refused before anything is installed)."""
    from compactor.budget_report import BudgetReport

    good = BudgetReport(ratio_asked=0.1, tokens_asked=None, ratio_chosen=None, budget_per_head=3)
    assert BudgetReport.from_dict(good.as_dict()) == good and good.ratio_used == 0.1
    with pytest.raises(ValueError, match=field):
        BudgetReport.from_dict({**good.as_dict(), **change})
    with pytest.raises(ValueError, match="unknown fields"):
        BudgetReport.from_dict({**good.as_dict(), "chosen": 1})
