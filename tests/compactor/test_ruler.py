"""compactor.eval.ruler (RULER-style tasks) and compactor.eval.paired (paired scoring)."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from compactor.eval.niah import haystack_text
from compactor.eval.paired import bootstrap_interval, mcnemar_p, paired_summary
from compactor.eval.ruler import HAYSTACK_TASKS, RULER_TASKS, make_ruler
from tests._tiny import real_model


@pytest.fixture(scope="module")
def tok(prepared_model):
    return real_model(prepared_model)[1]


@pytest.mark.parametrize("task", RULER_TASKS)
def test_tasks_are_deterministic_within_length_and_answerable(tok, task):
    a = make_ruler(tok, task, 800, seed=3)
    assert a == make_ruler(tok, task, 800, seed=3)
    assert a.prefix != make_ruler(tok, task, 800, seed=4).prefix
    n = len(tok(a.prefix, add_special_tokens=False)["input_ids"])
    assert 600 <= n <= 800
    for q in a.questions:  # every expected answer stands in the context
        assert q.answers and all(re.search(rf"\b{re.escape(x)}\b", a.prefix) for x in q.answers)
        assert q.text.startswith("\n\nQuestion: ")


def test_list_tasks_ask_for_what_the_context_counts(tok):
    cwe = make_ruler(tok, "cwe", 1000, seed=0)
    words = Counter(re.findall(r"^\d+\. (\w+)$", cwe.prefix, flags=re.M))
    top = set(cwe.questions[0].answers)
    assert len(top) == 5 and min(words[w] for w in top) > max(
        c for w, c in words.items() if w not in top
    )
    vt = make_ruler(tok, "vt", 1000, seed=0)
    chain = vt.questions[0].answers
    assert len(chain) == 4 and all(f"VAR {b} = VAR {a}." in vt.prefix
                                   for a, b in itertools.pairwise(chain))  # fmt: skip
    mq = make_ruler(tok, "niah_multiquery", 1000, seed=0)
    assert len(mq.questions[0].answers) == 2 and " and " in mq.questions[0].text


@pytest.mark.parametrize("task", HAYSTACK_TASKS)
def test_the_essays_haystack_is_real_prose_and_its_own_case(tok, task):
    a = make_ruler(tok, task, 800, seed=3, haystack="essays")
    assert a == make_ruler(tok, task, 800, seed=3, haystack="essays")
    filler = make_ruler(tok, task, 800, seed=3)
    assert a.prefix != filler.prefix and a.questions[0].answers != filler.questions[0].answers
    n = len(tok(a.prefix, add_special_tokens=False)["input_ids"])
    assert 600 <= n <= 800
    for q in a.questions:
        assert all(re.search(rf"\b{re.escape(x)}\b", a.prefix) for x in q.answers)
    # the prose between the needles is the essays' (whole sentences of them), not the filler
    prose = [s for s in re.split(r"(?<=[.!?])\s+", a.prefix.split("\n", 3)[-1])
             if "magic number" not in s and "VAR " not in s and len(s) > 40]  # fmt: skip
    assert prose and sum(s in haystack_text("essays") for s in prose) >= 0.8 * len(prose)
    assert not any(s in haystack_text("filler") for s in prose)


def test_the_essays_are_cleaned_paragraphs():
    text = haystack_text("essays")
    paras = text.split("\n\n")
    assert len(paras) == 49 and all("\n" not in p for p in paras)
    assert not re.search(r"[a-z][.!?][A-Z]", text)  # no lost sentence break left
    assert not any(re.match(r"[A-Z][a-z]+ \d{4}", p) for p in paras)  # no leading date


def test_bad_haystack():
    with pytest.raises(ValueError, match="unknown haystack 'web'"):
        make_ruler(None, "niah_single", 1000, haystack="web")
    with pytest.raises(ValueError, match="task 'cwe' has no haystack"):
        make_ruler(None, "cwe", 1000, haystack="essays")
    with pytest.raises(ValueError, match="unknown haystack 'web'"):
        haystack_text("web")


def test_bad_task_and_length():
    with pytest.raises(ValueError, match="unknown RULER task 'x'"):
        make_ruler(None, "x", 1000)
    with pytest.raises(ValueError, match="num_tokens must be >= 256"):
        make_ruler(None, "vt", 100)


def test_mcnemar_exact_p():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 3) == 1.0
    with pytest.raises(ValueError):
        mcnemar_p(-1, 2)


def test_paired_summary_counts_and_retention():
    stock = [True, True, True, False, True, False]
    ours = [True, False, True, True, True, False]
    s = paired_summary(stock, ours, [0.9] * 6, [0.1] * 6)
    assert s["mcnemar"] == {"both": 3, "stock_only": 1, "ours_only": 1, "neither": 1,
                            "p": 1.0}  # fmt: skip
    assert s["retention"] == 0.75 and s["accuracy"] == pytest.approx(4 / 6)
    lo, hi = s["retention_ci"]
    assert 0 <= lo <= 0.75 <= hi <= 1
    assert s["token_agreement_ci"] == (pytest.approx(0.9), pytest.approx(0.9))
    assert paired_summary([False], [True])["retention"] is None  # stock never right
    with pytest.raises(ValueError, match="2 stock items, 1 ours"):
        paired_summary([True, True], [True])


def test_bootstrap_interval_brackets_the_mean():
    vals = [float(i % 2) for i in range(100)]
    lo, hi = bootstrap_interval(vals)
    assert lo < 0.5 < hi and hi - lo < 0.25
    assert bootstrap_interval([]) is None


def test_retention_difference_is_paired():
    """Two methods that differ on 6 of stock's 30 right answers, always the same way: the
    paired interval of the difference stays above zero, where each retention's own interval
    is wide; the same outcomes give a difference of exactly zero."""
    from compactor.eval.paired import retention_difference

    stock = [True] * 30 + [False] * 5
    a = [True] * 24 + [False] * 6 + [False] * 5
    b = [True] * 18 + [False] * 12 + [True] * 5
    diff, (lo, hi) = retention_difference(stock, a, b)
    assert diff == pytest.approx(0.2) and 0 < lo < 0.2 < hi <= 0.4
    assert retention_difference(stock, a, a) == (0.0, (0.0, 0.0))
    assert retention_difference([False], [True], [True]) == (None, None)
    with pytest.raises(ValueError, match="3 stock items, 3 and 2"):
        retention_difference([True] * 3, [True] * 3, [True] * 2)
