"""compactor.spec.limits.WorkLimits: every knob that scales a worker's work has a cap, checked
before any work is queued, with a message naming the field, its value and the flag."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from compactor.spec import CompactionSpec, QueryConfig
from compactor.spec.limits import WorkLimits
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob

SPEC = CompactionSpec(method="am-omp-fast", ratio=0.1, queries=QueryConfig(sources=("random",)))


def _job(spec: CompactionSpec = SPEC, follow_ups: tuple[tuple[int, ...], ...] = ()) -> CompactJob:
    return CompactJob("fp", tuple(range(2, 66)), spec, follow_ups=follow_ups)


@pytest.mark.parametrize(
    ("queries", "field", "flag"),
    [
        ({"random_count": 10**9}, "queries.random_count", "--max-random-queries"),
        ({"max_queries_per_head": 10**6}, "queries.max_queries_per_head", "--max-queries"),
        ({"self_study_tokens": 10**7}, "queries.self_study_tokens", "--max-self-study-tokens"),
        ({"self_study_prompts": ("p",) * 10_000}, "queries.self_study_prompts",
         "--max-self-study-prompts"),
        ({"follow_up_answer_tokens": 257}, "queries.follow_up_answer_tokens",
         "--max-follow-up-answer-tokens"),
    ],
)  # fmt: skip
def test_each_query_knob_is_capped(queries: dict[str, object], field: str, flag: str) -> None:
    spec = SPEC.replace(queries=replace(SPEC.queries, **queries))
    with pytest.raises(
        InvalidRequest, match=rf"^{field} = .* is over this server's limit .*{flag}"
    ):
        _job(spec).validate(4096)


def test_follow_ups_solver_rounds_and_chunks_are_capped() -> None:
    with pytest.raises(InvalidRequest, match=r"^follow_ups = 10000 is over .* 64"):
        _job(follow_ups=((5,),) * 10_000).validate(4096)
    with pytest.raises(InvalidRequest, match=r"^follow_ups \(longest\) = 5000 is over .* 4096"):
        _job(follow_ups=((5,) * 5000,)).validate(4096)
    with pytest.raises(
        InvalidRequest,
        match=r"^method_params.nnls_iters = 100000 is outside \[0, iterations = 64\]",
    ):
        _job(SPEC.replace(method_params={"nnls_iters": 100_000})).validate(4096)
    with pytest.raises(InvalidRequest, match=r"^chunk_size = 16 is under .* 256"):
        _job(SPEC.replace(chunk_size=16)).validate(4096)


def test_the_caps_are_the_servers_to_set() -> None:
    spec = SPEC.replace(queries=replace(SPEC.queries, random_count=20_000))
    with pytest.raises(InvalidRequest):
        _job(spec).validate(4096)
    _job(spec).validate(4096, limits=WorkLimits(max_random_queries=20_000))  # raised: accepted
    _job().validate(4096, limits=WorkLimits())  # the defaults accept ordinary specs


def test_flags_are_generated_from_the_fields() -> None:
    p = argparse.ArgumentParser()
    WorkLimits.add_cli_args(p)
    ns = p.parse_args(["--max-random-queries", "99", "--min-chunk-tokens", "512"])
    limits = WorkLimits.from_args(ns)
    assert limits.max_random_queries == 99 and limits.min_chunk_tokens == 512
    assert limits.as_dict()["max_follow_ups"] == WorkLimits().max_follow_ups
    with pytest.raises(ValueError, match=r"WorkLimits.max_follow_ups must be an int >= 1, got 0"):
        WorkLimits.from_args(p.parse_args(["--max-follow-ups", "0"]))
