"""compactor.eval.niah: deterministic needle cases."""

from __future__ import annotations

import pytest

from compactor.eval.niah import filler_text, make_niah, score_answer
from tests._tiny import real_model


@pytest.fixture(scope="module")
def tok(prepared_model):
    return real_model(prepared_model)[1]


def test_filler_shipped():
    assert len(filler_text()) > 25_000


@pytest.mark.parametrize("kind", ["single", "multi-key", "multi-value"])
def test_deterministic_and_within_length(tok, kind):
    a = make_niah(tok, 500, kind, seed=1)
    assert a == make_niah(tok, 500, kind, seed=1)
    assert a.prefix != make_niah(tok, 500, kind, seed=2).prefix
    n = len(tok(a.prefix, add_special_tokens=False)["input_ids"])
    assert 400 <= n <= 500
    for key, value in a.needles:
        assert f"The special magic number for {key} is {value}." in a.prefix
    for q in a.questions:
        assert set(q.answers) <= {v for _, v in a.needles}
    assert len(a.needles) == (1 if kind == "single" else 3)


def test_without_tokenizer_and_errors():
    c = make_niah(None, 300, "multi-key", seed=0, num_needles=2)
    assert len(c.needles) == 2 and len(c.questions) == 2
    with pytest.raises(ValueError, match="unknown NIAH kind 'x'"):
        make_niah(None, 300, "x")
    with pytest.raises(ValueError, match="num_tokens"):
        make_niah(None, 10)


def test_score_answer():
    assert score_answer("it is 12345.", ("12345",)) == 1.0
    assert score_answer("12 and 34", ("12", "56")) == 0.5
    assert score_answer("123456 and Sworn", ("12345", "worn", "sworn")) == 1 / 3
    with pytest.raises(ValueError):
        score_answer("x", ())
