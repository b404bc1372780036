"""Two SGLang replicas share one `compactor serve`: one document is compacted once.

Each replica finds the shared document on its own, from different questions: replica A's
two questions part right after "Question:", replica B's one token later (both start with
"What"), so the branch points differ. The plugin cuts a path at a multiple of
`--compaction-align-tokens` below the branch, so both ask for the same prefix; the service
keys results by prefix, model and spec (the follow-up questions are hints, not part of the
key), so the second request joins the first compaction or hits its cached result. Then
each replica serves a new question from its compacted prefix.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from harness.launch import CompactorService, SGLangServer, start_all
from harness.pool import parse_metrics
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    prompt,
    questions,
    unseen_questions,
    wait_for_compactions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

QUESTIONS_A = [questions()[0], questions()[1]]  # "What is ...", "Who is ..."
QUESTIONS_B = [questions()[0], unseen_questions()[2]]  # "What is ...", "What colour ..."


def _service_metrics(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def test_two_replicas_share_one_compaction(plumbing_model: Path, tmp_path: Path) -> None:
    doc = document(sentences=40)  # ~700 tokens: a short compaction on 2 busy cores
    with contextlib.ExitStack() as stack:
        svc = CompactorService(
            plumbing_model, tmp_path / "compactor.log", in_process=True,
            extra_args=["--metrics-port", "0"],
        )  # fmt: skip
        start_all(stack, [svc])
        flags = [
            *compaction_args(
                svc.endpoint,
                0.1,
                "am-omp-fast",
                min_prefix_tokens=256,
                answer_tokens=QUICK_ANSWER_TOKENS,
            ),
            "--enable-metrics",
        ]
        servers = [
            SGLangServer(
                plumbing_model,
                log_path=tmp_path / f"replica{i}.log",
                max_total_tokens=4096,
                extra_args=flags,
            )
            for i in range(2)
        ]
        start_all(stack, servers)
        first: list[list[dict]] = []
        for srv, qs in zip(servers, (QUESTIONS_A, QUESTIONS_B)):
            first.append([srv.generate(prompt(doc, q), max_new_tokens=8) for q in qs])
        gauges = [wait_for_compactions(srv, 1, timeout_s=400) for srv in servers]
        service = _service_metrics(svc.metrics_port())
        later = [srv.generate(prompt(doc, unseen_questions()[0]), 8) for srv in servers]

    for g, srv in zip(gauges, servers):
        assert g["installed_total"] == 1 and g["fallbacks_total"] == 0, srv.log_tail()
    logical = [int(g["logical_tokens"]) for g in gauges]
    assert logical[0] == logical[1] > 256, logical  # the same prefix on both replicas
    assert logical[0] % 64 == 0, logical  # cut to --compaction-align-tokens
    # one compaction in the service; the other request joined it or hit its cached result
    assert service["compactor_compactions_total"] == 1, service
    shared = service.get("compactor_singleflight_joins_total", 0.0)
    shared += service.get("compactor_cache_hits_total", 0.0)
    assert shared == 1, service
    for out in later:  # a new question on each replica goes through its compacted prefix
        assert out["meta_info"]["cached_tokens"] >= logical[0], out["meta_info"]
        assert out["text"].strip(), out
    for answers in first:
        assert all(a["text"].strip() for a in answers)
