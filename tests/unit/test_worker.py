"""The worker hands the registered method itself to the pipeline, cancellation as a hook.

(It used to wrap the method for cancellation, which hid `needs_context` and KVCompose's
layer planner: through the service GVote / CompressKV ran without their layer context.)
"""

from __future__ import annotations

from typing import Any

import pytest

import compactor.pipeline as pipeline
from compactor.methods.context import LayerBudgetPlanner, wants_context
from compactor.workers.errors import Cancelled
from compactor.workers.job import CompactJob
from compactor.workers.worker import _cancellation_point, run_compaction


class _Seen(Exception):
    pass


@pytest.mark.parametrize(
    ("method", "check"),
    [("gvote", wants_context), ("kvcompose", lambda m: isinstance(m, LayerBudgetPlanner))],
)
def test_pipeline_gets_the_method_itself(monkeypatch: Any, method: str, check: Any) -> None:
    seen: dict[str, Any] = {}

    def fake(model: Any, tok: Any, ids: Any, meth: Any, **kw: Any) -> Any:
        seen.update(method=meth, **kw)
        raise _Seen

    monkeypatch.setattr(pipeline, "compact_prefix", fake)
    monkeypatch.setattr(pipeline, "head_budget_curves", lambda *a, **k: (None, "uniform"))
    with pytest.raises(_Seen):
        run_compaction(None, None, "fp", CompactJob("fp", tuple(range(64)), method, ratio=0.1))
    assert check(seen["method"])
    assert callable(seen["before_layer"])


def test_cancellation_point_raises_once_asked_to_stop() -> None:
    stop = [False]
    hook = _cancellation_point(lambda: stop[0], layer_delay_s=0.0)
    hook(0)  # runs on
    stop[0] = True
    with pytest.raises(Cancelled, match="before layer 3"):
        hook(3)


def test_query_options_cross_the_wire_and_reach_the_pipeline(monkeypatch: Any) -> None:
    from compactor.service.convert import job_from_request, request_from_job
    from compactor.workers.errors import InvalidRequest

    job = CompactJob(
        "fp", tuple(range(64)), "am-highest", ratio=0.1, query_sources=("follow-up",),
        follow_ups=((5, 6),), on_policy=True, follow_up_answer_tokens=12,
    )  # fmt: skip
    back = job_from_request(request_from_job(job), auto_ratio=0.1)
    assert (back.on_policy, back.follow_up_answer_tokens) == (True, 12)
    assert back.key() == job.key() != CompactJob("fp", tuple(range(64)), "am-highest").key()
    # a job without the options keeps the cache key it had before they existed
    plain = CompactJob("fp", (1, 2), "am-highest")
    assert job_from_request(request_from_job(plain), 0.1).key() == plain.key()
    seen: dict[str, Any] = {}

    def fake(model: Any, tok: Any, ids: Any, meth: Any, **kw: Any) -> Any:
        seen.update(kw)
        raise _Seen

    monkeypatch.setattr(pipeline, "compact_prefix", fake)
    monkeypatch.setattr(pipeline, "head_budget_curves", lambda *a, **k: (None, "uniform"))
    with pytest.raises(_Seen):
        run_compaction(None, None, "fp", job)
    assert seen["on_policy"] is True
    assert seen["query_sources"].follow_up_answer_tokens == 12
    assert seen["query_sources"].sources == ("follow-up",)
    with pytest.raises(
        InvalidRequest, match=r"follow_up_answer_tokens must be in \[0, 256\], got 999"
    ):
        CompactJob("fp", (1, 2), "am-highest", follow_up_answer_tokens=999).validate(100)
