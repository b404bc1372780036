"""The static decode cascade (`sglang_ext.attention.static_cascade`) against today's eager
cascade and the dense reference, on real CPU pools (Triton interpreted): padded batches,
mixed plain and compacted rows, two prefixes in one batch, a layout change between steps, a
smaller batch after a larger one."""

from __future__ import annotations

import pytest
import torch

from tests.sglang_ext._static import (
    dense_reference,
    eager_cascade,
    pool_with_prefixes,
    queries,
    static_cascade,
    step,
    write_rows,
)

TOL = dict(atol=2e-5, rtol=2e-5)


def check(runner, rows, prefixes, outs, q) -> None:  # type: ignore[no-untyped-def]
    for layer, out in enumerate(outs):
        want = dense_reference(runner, layer, q, rows, prefixes)
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(out, eager_cascade(runner, layer, q, rows, prefixes), **TOL)


def test_padded_mixed_batch_with_two_prefixes() -> None:
    runner, lay = pool_with_prefixes()
    requests = [(None, [10, 11, 12, 13]), ("A", [70, 71]), ("B", [72]), ("A", [73, 74, 75]),
                ("B", [76, 77])]  # fmt: skip
    rows = write_rows(runner, lay, requests)
    prefixes = [None if n is None else lay[n] for n, _ in requests]
    cascade = static_cascade(runner, max_bs=8)
    q = queries(len(rows), seed=1)
    check(runner, rows, prefixes, step(cascade, runner, 8, rows, prefixes, q), q)
    assert cascade.tables.built == 2  # one address table per layout


def test_layout_change_then_a_smaller_batch() -> None:
    runner, lay = pool_with_prefixes(seed=3)
    cascade = static_cascade(runner, max_bs=4)
    batches = [
        [("A", [70, 71]), ("A", [72]), (None, [10, 11]), ("B", [73])],  # bs 4, both prefixes
        [("B", [70, 71, 74]), ("A", [72]), (None, [10, 11, 12])],  # each request moved
        [("B", [75])],  # one request, in the same buffers
    ]
    for i, requests in enumerate(batches):
        rows = write_rows(runner, lay, requests)
        prefixes = [None if n is None else lay[n] for n, _ in requests]
        q = queries(len(rows), seed=10 + i)
        bs = 4 if i < 2 else 2
        check(runner, rows, prefixes, step(cascade, runner, bs, rows, prefixes, q), q)


def test_a_batch_without_compacted_rows_is_plain_attention() -> None:
    runner, lay = pool_with_prefixes()
    requests = [(None, [10, 11, 12]), (None, [20])]
    rows = write_rows(runner, lay, requests)
    q = queries(2, seed=4)
    cascade = static_cascade(runner, max_bs=2)
    check(runner, rows, [None, None], step(cascade, runner, 2, rows, [None, None], q), q)


def test_refuses_what_it_cannot_serve() -> None:
    runner, lay = pool_with_prefixes()
    cascade = static_cascade(runner, max_bs=2, max_groups=1)
    assert cascade.refusal([lay["A"], lay["B"]]) == "groups"
    assert cascade.refusal([lay["A"]] * 3) == "batch_size"
    assert cascade.refusal([lay["A"], None]) is None
    with pytest.raises(ValueError, match="groups"):
        cascade.prepare(2, [lay["A"], lay["B"]])
    with pytest.raises(ValueError, match="B <= bs"):
        cascade.prepare(1, [lay["A"], None])
