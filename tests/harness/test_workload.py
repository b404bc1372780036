"""The shared-document workload: documents differ, needles are checkable per document."""

from __future__ import annotations

import pytest

from harness.forced import UNSCORED, Forced, logprob_gap, top1_share
from harness.workload import (
    NEEDLE_VALUES,
    document,
    many_questions,
    needle_correct,
    needles,
    prompt,
    prose_document,
    prose_unseen_questions,
    questions,
    unseen_questions,
)


def test_each_document_holds_its_own_needles() -> None:
    docs = [document(index=i) for i in range(len(NEEDLE_VALUES))]
    assert len({d[:40] for d in docs}) == len(docs)  # no two share a radix path from the start
    for i, doc in enumerate(docs):
        for j, answer in enumerate(NEEDLE_VALUES[i]):
            assert answer in doc
            for other in range(len(docs)):
                if other != i:
                    assert NEEDLE_VALUES[other][j] not in doc
        assert set(needles(i).values()) == set(NEEDLE_VALUES[i])


def test_needle_grading_is_per_document() -> None:
    q = "Who is the mayor of the town?"
    assert needle_correct(q, " The mayor is Margaret.", 0) is True
    assert needle_correct(q, " The mayor is Margaret.", 1) is False
    assert needle_correct(q, "Henrik", 1) is True
    assert needle_correct("When is the northern road closed?", "winter", 1) is None
    assert set(needles(0)) <= set(questions()) | set(unseen_questions())
    # the unseen questions ask for the same needles in other words
    assert needle_correct("What word opens the vault?", "It is otter.", 1) is True
    assert needle_correct("What word opens the vault?", "It is falcon.", 1) is False
    assert needle_correct("What colour was the ledger of the harbour town?", "blue", 0) is None
    assert prompt("D", q).startswith("D\nQuestion: ")


def test_unseen_questions_are_new_and_cover_each_needle() -> None:
    seen, unseen = questions(), unseen_questions()
    assert len(unseen) == len(seen) == 6 and not set(seen) & set(unseen)
    graded = [q for q in unseen if q in needles(0)]
    assert sorted(needles(0)[q] for q in graded) == sorted(NEEDLE_VALUES[0])


def test_unknown_document_index_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="document index 9"):
        document(index=9)


@pytest.mark.parametrize("prose", [False, True])
def test_many_questions_are_distinct_deterministic_and_never_unseen(prose: bool) -> None:
    pool = many_questions(40, prose=prose)
    assert len(pool) == len(set(pool)) == 40
    assert pool == many_questions(40, prose=prose)
    assert many_questions(8, prose=prose) == pool[:8]  # a smaller pool is a prefix
    assert not set(pool) & (set(unseen_questions()) | set(prose_unseen_questions()))
    if prose:  # no needle is asked of a document without needles
        assert not set(pool) & set(needles(0))
    else:
        assert pool[:6] == questions()
    assert many_questions(0, prose=prose) == []
    with pytest.raises(ValueError, match="-1"):
        many_questions(-1, prose=prose)


def test_prose_documents_have_no_needles_and_differ() -> None:
    docs = [prose_document(110, i) for i in range(3)]
    assert len({d[:200] for d in docs}) == 3
    assert all(d != document(110, 0) for d in docs)
    assert prose_document(110, 1) == docs[1]
    for d in docs:
        assert not any(v in d for vals in NEEDLE_VALUES for v in vals)
        assert "Day 109:" in d
    unseen = prose_unseen_questions()
    assert len(unseen) == 6 and not set(unseen) & set(needles(0))
    assert all(needle_correct(q, "falcon", 0) is None for q in unseen)
    with pytest.raises(ValueError, match="-2"):
        prose_document(10, -2)


def test_logprob_gap_and_top1_share_pair_the_answers_tokens() -> None:
    answers = [[5, 6, 7], [8, 9]]
    a = [Forced([-1.0, -2.0, -0.5], [5, 6, 1]), Forced([-0.1, -0.2], [8, 2])]
    b = [Forced([-1.5, -2.0, -1.0], [5, 6, 7]), Forced([-0.1, -0.7], [8, 9])]
    assert logprob_gap(a, b) == pytest.approx((0.5 + 0 + 0.5 + 0 + 0.5) / 5)
    assert logprob_gap(a, b, skip=1) == pytest.approx((0 + 0.5 + 0.5) / 3)
    assert top1_share(a, answers) == pytest.approx(3 / 5)
    assert top1_share(a, answers, skip=1) == pytest.approx(1 / 3)
    assert top1_share(b, answers) == 1.0
    with pytest.raises(ValueError):  # a different number of answers or tokens
        logprob_gap(a, b[:1])
    # a token one scoring could not reach counts in neither figure
    c = [Forced([-1.0, UNSCORED, -0.5], [5, -1, 1]), Forced([-0.1, -0.2], [8, 2])]
    assert logprob_gap(c, b) == pytest.approx((0.5 + 0.5 + 0 + 0.5) / 4)
    assert top1_share(c, answers) == pytest.approx(2 / 4)
