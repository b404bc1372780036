"""The worker hands the job's spec to the pipeline, cancellation as a hook; the spec crosses
the wire whole.

(The worker used to wrap the method for cancellation, which hid `needs_context` and
KVCompose's layer planner: through the service GVote / CompressKV ran without their layer
context. The pipeline now builds the registered method itself from the spec.)
"""

from __future__ import annotations

from typing import Any

import pytest

import compactor.pipeline as pipeline
from compactor.spec import CompactionSpec, QueryConfig
from compactor.workers.errors import Cancelled, InvalidRequest
from compactor.workers.job import CompactJob
from compactor.workers.worker import _cancellation_point, run_compaction


class _Seen(Exception):
    pass


def _capture(monkeypatch: Any) -> dict[str, Any]:
    """Replace compact_prefix by a fake that records its arguments and raises _Seen."""
    seen: dict[str, Any] = {}

    def fake(model: Any, tok: Any, ids: Any, spec: Any, follow_ups: Any, hooks: Any) -> Any:
        seen.update(ids=ids, spec=spec, follow_ups=follow_ups, hooks=hooks)
        raise _Seen

    monkeypatch.setattr(pipeline, "compact_prefix", fake)
    monkeypatch.setattr(pipeline, "head_budget_curves", lambda *a, **k: (None, "uniform"))
    return seen


@pytest.mark.parametrize("method", ["gvote", "kvcompose"])
def test_pipeline_gets_the_spec_and_the_hooks(monkeypatch: Any, method: str) -> None:
    seen = _capture(monkeypatch)
    spec = CompactionSpec(method=method, ratio=0.1)
    with pytest.raises(_Seen):
        run_compaction(None, None, "fp", CompactJob("fp", tuple(range(64)), spec))
    assert seen["spec"] is spec and seen["ids"] == list(range(64))
    hooks = seen["hooks"]
    assert hooks.method is None  # the pipeline builds the registered method itself
    assert callable(hooks.before_layer) and hooks.model_fingerprint == "fp"
    assert hooks.progress is False and seen["follow_ups"] is None


def test_cancellation_point_raises_once_asked_to_stop() -> None:
    stop = [False]
    hook = _cancellation_point(lambda: stop[0], layer_delay_s=0.0)
    hook(0)  # runs on
    stop[0] = True
    with pytest.raises(Cancelled, match="before layer 3"):
        hook(3)


def test_spec_crosses_the_wire_and_reaches_the_pipeline(monkeypatch: Any) -> None:
    from compactor.service.convert import job_from_request, request_from_job

    spec = CompactionSpec(
        method="am-highest", method_params={"value_ridge": 0.5}, ratio=0.1,
        queries=QueryConfig(sources=("follow-up",), follow_up_answer_tokens=12, seed=3),
        on_policy=True, keep_sink_tokens=2, chunk_size=40, head_budgets="auto",
    )  # fmt: skip
    job = CompactJob("fp", tuple(range(64)), spec, follow_ups=((5, 6),), request_id="r1")
    back = job_from_request(request_from_job(job), auto_ratio=0.3)
    assert back == job and back.key() == job.key()
    # every knob is part of the identity; the request id is not
    for change in ({"on_policy": False}, {"chunk_size": None}, {"queries": {"seed": 4}}):
        assert (
            CompactJob("fp", job.token_ids, spec.replace(**change), job.follow_ups).key()
            != job.key()
        )
    assert CompactJob("fp", job.token_ids, spec, job.follow_ups).key() == job.key()
    # follow-ups are hints, not identity: the same prefix and spec share one result
    assert CompactJob("fp", job.token_ids, spec).key() == job.key()
    assert CompactJob("fp", job.token_ids, spec, ((7, 8, 9),)).key() == job.key()
    assert CompactJob("fp", job.token_ids[:-1], spec, job.follow_ups).key() != job.key()
    assert CompactJob("fp2", job.token_ids, spec, job.follow_ups).key() != job.key()
    # tenants never share a result; no tenant keeps the keys as they were
    assert CompactJob("fp", job.token_ids, spec, tenant="cn:a").key() != job.key()
    assert CompactJob("fp", job.token_ids, spec, tenant="cn:a").key() != (
        CompactJob("fp", job.token_ids, spec, tenant="cn:b").key()
    )
    # budget auto (neither ratio nor tokens) is resolved to the server's auto ratio
    auto = CompactJob("fp", (1, 2), spec.with_budget())
    assert job_from_request(request_from_job(auto), auto_ratio=0.3).spec.ratio == 0.3
    seen = _capture(monkeypatch)
    with pytest.raises(_Seen):
        run_compaction(None, None, "fp", job)
    assert seen["spec"] == spec and seen["follow_ups"] == [[5, 6]]
    with pytest.raises(
        InvalidRequest,
        match=r"^queries.follow_up_answer_tokens = 999 is over this server's limit 256 ",
    ):
        bad = spec.replace(queries={"follow_up_answer_tokens": 999}, head_budgets="uniform")
        CompactJob("fp", (1, 2), bad, follow_ups=((5,),)).validate(100)


@pytest.mark.parametrize(
    ("spec_json", "match"),
    [
        ('{"method": "am-highest", "bogus": 1}', r"unknown spec key\(s\) \['bogus'\]"),
        ('{"queries": {"sorces": ["x"]}}', r"unknown spec key\(s\) \['queries.sorces'\]"),
        ('{"queries": {"sources": ["nope"]}}', "unknown query source 'nope'"),
        ('["not", "an", "object"]', "must be a JSON object"),
        ("{not json", "not valid JSON"),
        ("", "spec_json is required"),
    ],
)
def test_malformed_spec_json_is_invalid_request(spec_json: str, match: str) -> None:
    from compactor.service.convert import job_from_request
    from compactor.service.gen.compactor.v1 import compactor_pb2 as pb

    req = pb.CompactRequest(model_fingerprint="fp", token_ids=[1, 2, 3], spec_json=spec_json)
    with pytest.raises(InvalidRequest, match=match):
        job_from_request(req, auto_ratio=0.1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"method": "nosuch"}, "unknown method 'nosuch'; available: .*am-highest"),
        ({"ratio": 1.5}, r"ratio must be in \(0, 1\], got 1.5"),
        ({"ratio": "0.5"}, r"ratio must be in \(0, 1\], got '0.5'"),
        ({"tokens": 2.5, "ratio": None}, "tokens must be an int >= 1, got 2.5"),
        ({"keep_sink_tokens": -1}, "keep_sink_tokens must be >= 0"),
        ({"head_budgets": "/tmp/curves.json"}, "head_budgets must be one of"),
        (
            {"method_params": {"bogus": 1}},
            r"method_params.bogus is not a parameter a request may set",
        ),
    ],
)
def test_job_validate_names_the_field(change: dict[str, Any], match: str) -> None:
    spec = CompactionSpec(method="am-highest", ratio=0.1).replace(**change)
    with pytest.raises(InvalidRequest, match=match):
        CompactJob("fp", (1, 2, 3), spec).validate(100)
