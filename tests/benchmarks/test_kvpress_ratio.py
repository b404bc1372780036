"""Our ratio (the kept fraction) meets kvpress's compression_ratio (the fraction removed) in one
place, which also counts what kvpress keeps as kvpress counts it."""

from __future__ import annotations

import pytest

from benchmarks.offline._kvpress import compression_ratio, kvpress_kept


def test_the_one_conversion() -> None:
    assert compression_ratio(0.1) == pytest.approx(0.9) and compression_ratio(1.0) == 0.0
    assert kvpress_kept(200, 0.2) == int(200 * (1 - 0.8)) == 39  # kvpress's float arithmetic
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="kept fraction"):
            compression_ratio(bad)
