"""The shared-document workload: documents differ, needles are checkable per document."""

from __future__ import annotations

import pytest

from harness.workload import NEEDLE_VALUES, document, needle_correct, needles, prompt, questions


def test_each_document_holds_its_own_needles() -> None:
    docs = [document(index=i) for i in range(len(NEEDLE_VALUES))]
    assert len({d[:40] for d in docs}) == len(docs)  # no two share a radix path from the start
    for i, doc in enumerate(docs):
        for j, answer in enumerate(needles(i).values()):
            assert answer in doc
            for other in range(len(docs)):
                if other != i:
                    assert NEEDLE_VALUES[other][j] not in doc


def test_needle_grading_is_per_document() -> None:
    q = "Who is the mayor of the town?"
    assert needle_correct(q, " The mayor is Margaret.", 0) is True
    assert needle_correct(q, " The mayor is Margaret.", 1) is False
    assert needle_correct(q, "Henrik", 1) is True
    assert needle_correct("When is the northern road closed?", "winter", 1) is None
    assert set(needles(0)) <= set(questions())
    assert prompt("D", q).startswith("D\nQuestion: ")


def test_unknown_document_index_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="document index 9"):
        document(index=9)
