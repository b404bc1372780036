"""spec.target_error: the ratio chosen by held-out attention-output error (compactor.pipeline.target).

The spec knob (validation naming the value, candidates under the ratio ceiling, wire JSON,
flags), the hold-out split, and real SmolLM2 compactions: a loose target picks a smaller
ratio than a tight one, the met estimate is <= the target, the choice is in the metadata.
"""

from __future__ import annotations

import argparse
import json

import pytest

from compactor.pipeline import Hooks, compact_prefix
from compactor.pipeline.target import split_held_out
from compactor.query_capture import Continuation, QueryPlan
from compactor.spec import TARGET_ERROR_RATIOS, CompactionSpec, QueryConfig, SpecError
from compactor.spec.cli_args import UsageError, add_spec_args, spec_from_args
from compactor.types import CompactedPrefix
from compactor.workers.errors import InvalidRequest
from compactor.workers.job import CompactJob
from tests._tiny import real_model

DOC = (
    "The mill at Harrow Bend was built in 1847 by Elias Crane, who dammed the river twice. "
    "It ground wheat for forty years, then burned in 1889; the town rebuilt it in stone in "
    "1891. Today the mill is a museum with a working wheel, open from April to October. "
) * 2
QUESTIONS = (
    "\nWho built the mill?",
    "\nWhen did it burn?",
    "\nWhat is it today?",
    "\nWhen is it open?",
    "\nWhat did it grind?",
)
QUIET = Hooks(progress=False)


# ---- the spec knob ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"target_error": 0}, "target_error must be a number > 0, got 0"),
        ({"target_error": -0.5}, r"got -0\.5"),
        ({"target_error": float("nan")}, "got nan"),
        ({"target_error": "0.1"}, "got '0.1'"),
        ({"target_error": True}, "got True"),
        ({"target_error": 0.1, "tokens": 32}, r"target_error \(0\.1\).*no tokens \(32\)"),
    ],
)
def test_bad_values_raise_naming_the_value(change: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match) as info:
        CompactionSpec(**change).validate()
    assert info.value.field == "target_error"


def test_ratio_is_the_ceiling_and_the_spec_is_not_auto() -> None:
    spec = CompactionSpec(target_error=0.1)
    assert not spec.is_auto and spec.resolve_auto(0.5) == spec  # the service leaves it alone
    assert spec.candidate_ratios() == TARGET_ERROR_RATIOS == (0.05, 0.1, 0.2, 0.3)
    assert spec.with_budget(ratio=0.15).candidate_ratios() == (0.05, 0.1, 0.15)
    assert spec.with_budget(ratio=0.1).candidate_ratios() == (0.05, 0.1)
    assert spec.with_budget(ratio=0.5).candidate_ratios() == (0.05, 0.1, 0.2, 0.3, 0.5)
    with pytest.raises(SpecError, match="needs target_error"):
        CompactionSpec(ratio=0.1).candidate_ratios()
    with pytest.raises(ValueError, match="give exactly one of ratio and tokens"):
        spec.budget_per_head(100, 4)  # chosen by compact_prefix, not here


def test_wire_json_key_and_flags() -> None:
    plain = CompactionSpec(ratio=0.1)
    assert "target_error" not in plain.to_dict()  # unset: the JSON and key of before
    spec = plain.replace(target_error=0.2)
    assert spec.to_dict()["target_error"] == 0.2
    assert CompactionSpec.from_dict(spec.to_dict()) == spec and spec.key() != plain.key()
    p = argparse.ArgumentParser()
    add_spec_args(p, prefix="compaction-", defaults=plain)
    got = spec_from_args(p.parse_args(["--compaction-target-error", "0.2"]), "compaction-")
    assert got == spec
    with pytest.raises(UsageError, match=r"got -1\.0") as info:
        spec_from_args(p.parse_args(["--compaction-target-error", "-1"]), "compaction-")
    assert info.value.flag == "--compaction-target-error"
    # the service accepts a target_error job without ratio (it is not budget "auto")
    from compactor.service.convert import job_from_request, request_from_job

    job = CompactJob("fp", (1, 2, 3), CompactionSpec(target_error=0.2))
    job.validate(100)
    back = job_from_request(request_from_job(job), auto_ratio=0.3)
    assert back == job and back.spec.ratio is None  # not resolved to the auto ratio
    with pytest.raises(InvalidRequest, match="or a target_error"):
        CompactJob("fp", (1, 2, 3), CompactionSpec()).validate(100)


# ---- the hold-out split ----------------------------------------------------------------


def _plan(*sources: str) -> QueryPlan:
    return QueryPlan(
        QueryConfig(), [Continuation(s, [i + 1]) for i, s in enumerate(sources)], None, None
    )


def test_split_holds_out_every_fourth_follow_up_else_self_study() -> None:
    fit, held, src = split_held_out(_plan("repeat-prefill", *["follow-up"] * 8))
    assert src == "follow-up" and [c.tokens for c in held.continuations] == [[5], [9]]
    assert len(fit.continuations) == 7 and fit.continuations[0].source == "repeat-prefill"
    fit, held, src = split_held_out(_plan("follow-up", "follow-up"))
    assert [c.tokens for c in held.continuations] == [[2]] and len(fit.continuations) == 1
    fit, held, src = split_held_out(_plan("follow-up", *["self-study"] * 4))
    assert src == "self-study" and [c.tokens for c in held.continuations] == [[5]]
    assert len(fit.continuations) == 4
    with pytest.raises(ValueError, match=r"got \{'follow-up': 1, 'self-study': 0\}"):
        split_held_out(_plan("repeat-prefill", "follow-up"))


# ---- real SmolLM2 compactions ----------------------------------------------------------


@pytest.fixture(scope="module")
def chosen(prepared_model):
    """Prefixes compacted with a loose (0.5) and a tight (0.1) target on the same document."""
    model, tok = real_model(prepared_model)
    ids = tok(DOC)["input_ids"]
    fus = [tok(q)["input_ids"] for q in QUESTIONS]
    base = CompactionSpec(
        method="am-omp-fast",
        queries=QueryConfig(sources=("follow-up",), follow_up_answer_tokens=8),
        on_policy=True,
    )
    hooks = Hooks(progress=False, reuse={})  # one prefill and query plan for both
    out = {}
    for target in (0.5, 0.1):
        spec = base.replace(target_error=target)
        out[target] = compact_prefix(model, tok, ids, spec, fus, hooks)[0]
    return len(ids), out


def test_loose_target_picks_a_smaller_ratio_than_a_tight_one(chosen) -> None:
    T, out = chosen
    loose, tight = out[0.5].budget, out[0.1].budget
    assert loose.ratio_chosen < tight.ratio_chosen
    for b in (loose, tight):
        search = b.search
        assert b.ratio_chosen == search["chosen_ratio"] == b.ratio_used
        assert b.ratio_asked is None and b.ratio_chosen in TARGET_ERROR_RATIOS
        assert b.estimated_error == search["estimated_error"]
        assert search["held_out"] == 1 and search["held_out_source"] == "follow-up"
        assert b.budget_per_head == round(b.ratio_chosen * T)
        tried = [c["ratio"] for c in search["candidates"]]
        assert tried == sorted(tried) and tried[-1] == b.ratio_chosen
        # every candidate before the chosen one missed the target
        assert all(c["error"] > b.target_error for c in search["candidates"][:-1])
    # the refit keeps the chosen budget per head; the record travels with the prefix's
    # metadata (the service's Header.metadata_json)
    for prefix in out.values():
        t = prefix.budget.budget_per_head
        assert max(max(h) for h in prefix.kept_per_head()) <= t
        back = CompactedPrefix.from_parts(
            json.loads(json.dumps(prefix.metadata())), prefix.tensors()
        )
        assert back.budget == prefix.budget


def test_met_estimate_is_at_most_the_target(chosen) -> None:
    _, out = chosen
    for target, prefix in out.items():
        search = prefix.budget.search
        assert prefix.budget.target_error == search["target_error"] == target
        if search["met"]:
            assert 0 < search["estimated_error"] <= target
        else:  # none met it: the largest candidate
            assert prefix.budget.ratio_chosen == TARGET_ERROR_RATIOS[-1]
    assert out[0.5].budget.search["met"]


def test_too_few_continuations_to_hold_out(prepared_model) -> None:
    model, tok = real_model(prepared_model)
    ids = tok(DOC)["input_ids"]
    spec = CompactionSpec(
        method="am-omp-fast", queries=QueryConfig(sources=("follow-up",)), target_error=0.1
    )
    with pytest.raises(ValueError, match="needs >= 2 follow-ups"):
        compact_prefix(model, tok, ids, spec, [tok(QUESTIONS[0])["input_ids"]], QUIET)
