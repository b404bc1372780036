"""Cancellation reaches the stages before the layer loop: the token loop of self-study and
follow-up answer generation and the per-continuation query collection.

(The worker used to check `should_stop` only before each layer, so a cancelled compaction
first generated every token and collected every query.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from compactor.spec import CompactionSpec, QueryConfig
from compactor.workers.errors import Cancelled
from compactor.workers.job import CompactJob
from compactor.workers.worker import run_compaction
from tests._tiny import random_ids

FP = "tiny-fp"


class _Tokenizer:
    """Enough of a tokenizer for self-study prompts on the tiny model (vocab 128, no EOS)."""

    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 128 for c in text[:12]]}


@pytest.fixture
def forwards(tiny: Any) -> Iterator[list[int]]:
    """[n]: the tiny model's forward calls so far (prefill, prompts, decoded tokens, ...)."""
    calls = [0]

    def hook(*_a: Any) -> None:
        calls[0] += 1

    handle = tiny.model.register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def _spec(**queries: Any) -> CompactionSpec:
    return CompactionSpec(method="am-highest", ratio=0.25, queries=QueryConfig(**queries))


@pytest.mark.parametrize(
    ("queries", "follow_ups", "stage"),
    [
        (
            {"sources": ("follow-up",), "follow_up_answer_tokens": 200},
            ((1, 2, 3), (4, 5)),
            "follow-up answer generation",
        ),
        (
            {"sources": ("self-study",), "self_study_tokens": 200, "self_study_prompts": ("a",)},
            (),
            "self-study generation",
        ),
        (
            {"sources": ("follow-up",), "follow_up_answer_tokens": 0},
            tuple((i + 1, i + 2) for i in range(40)),
            "query collection",
        ),
    ],
)
def test_cancel_stops_within_one_step_before_any_layer(
    tiny: Any,
    forwards: list[int],
    monkeypatch: pytest.MonkeyPatch,
    queries: dict[str, Any],
    follow_ups: Any,
    stage: str,
) -> None:
    """Stop is asked after 4 forward calls (prefill + 3): the compaction raises Cancelled in
    that stage at its next check, i.e. after at most one more forward call (not after the
    200 tokens / 40 continuations and before layer 0)."""
    layers: list[int] = []
    job = CompactJob(FP, tuple(random_ids(32, seed=3)), _spec(**queries), follow_ups=follow_ups)

    def should_stop() -> bool:
        return forwards[0] >= 4

    import compactor.pipeline.compact as pipeline  # where compact_prefix finds its stages

    real = pipeline.compact_layers

    def spy(*args: Any, **kwargs: Any) -> Any:
        layers.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "compact_layers", spy)
    with pytest.raises(Cancelled, match=f"during {stage}"):
        run_compaction(tiny, _Tokenizer(), FP, job, should_stop=should_stop)
    assert forwards[0] <= 5, forwards[0]
    assert layers == []  # the layer loop never started


def test_not_cancelled_runs_to_the_end(tiny: Any, forwards: list[int]) -> None:
    spec = _spec(sources=("follow-up",), follow_up_answer_tokens=8)
    job = CompactJob(FP, tuple(random_ids(32, seed=3)), spec, follow_ups=((1, 2),))
    res = run_compaction(tiny, None, FP, job, should_stop=lambda: False)
    assert res.prefix.logical_length == 32 and forwards[0] > 8
