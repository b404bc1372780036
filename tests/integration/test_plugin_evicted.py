"""Compaction where it matters most, on a real CPU SGLang server: the pool is too small for the
workload, and the original prefix is evicted while its compaction is in flight. The result is
installed all the same, later requests read it, and they answer as they do from the same
result installed with its original still cached.

The service is a real `compactor serve` behind `harness.hostile.HostileProxy` in mode `slow`
(the real result, held back `STALL_S`): while it waits, requests on other documents fill the
small pool and push the original out (SGLang's LRU eviction). Then the server's cache is
flushed and the same document asked again: its compaction comes back at once from the
service's result cache (the same tokens, follow-ups and spec: the same result), this time
with the original cached. Same greedy answers both times, and the counters say which was
which (`installed_evicted`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.hostile import HostileProxy
from harness.launch import CompactorService, SGLangServer, free_port, start_all
from harness.pool import labelled
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    metric,
    prompt,
    questions,
)

pytestmark = [pytest.mark.sglang]

STALL_S = 15.0  # how long the proxy holds the result back while the pool fills
TIMEOUT_S = 60.0  # --compaction-timeout: longer than the stall
POOL_TOKENS = 1600  # a document with one question is ~470 tokens: the pool holds three
DOC = document(24, 0)
ASKED, LATER = questions()[:2], questions()[2]
PRESSURE = [f"Pressure document {i}. " + document(24, 1 + i % 3) for i in range(6)]


def _ask(srv: SGLangServer, doc: str, question: str) -> list[int]:
    params = {"max_new_tokens": 12, "temperature": 0.0}
    out = srv.post("/generate", {"text": prompt(doc, question), "sampling_params": params}, 120.0)
    return list(out["output_ids"])


def _count(srv: SGLangServer, name: str) -> int:
    return int(metric(srv, f"sglang:compaction_{name}_total"))


def _wait_installed(srv: SGLangServer, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S + 60
    while _count(srv, "installed") + _count(srv, "fallbacks") < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no compaction ended; log tail:\n{srv.log_tail()}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def rig(plumbing_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """The plugin's server (a pool of POOL_TOKENS) against the proxy before a real service."""
    logs = tmp_path_factory.mktemp("evicted")
    svc = CompactorService(
        plumbing_model, logs / "compactor.log", in_process=True, port=free_port()
    )
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(HostileProxy(svc.endpoint, stall_s=STALL_S))
        flags = compaction_args(proxy.address, 0.1, min_hits=2, min_prefix_tokens=256,
                                timeout_s=TIMEOUT_S, answer_tokens=QUICK_ANSWER_TOKENS)  # fmt: skip
        srv = SGLangServer(plumbing_model, log_path=logs / "plugin.log",
                           max_total_tokens=POOL_TOKENS,
                           extra_args=[*flags, "--enable-metrics"])  # fmt: skip
        start_all(stack, [svc, srv])
        yield srv, proxy


def test_a_result_whose_original_was_evicted_is_installed_and_read(rig: tuple) -> None:
    srv, proxy = rig
    proxy.expect("slow")
    for q in ASKED:  # the second question's insert sends the document to compact
        _ask(srv, DOC, q)
    deadline = time.monotonic() + 30
    while _count(srv, "requested") < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _count(srv, "requested") == 1, srv.log_tail()
    for doc in PRESSURE:  # while the result is held back: the small pool evicts the original
        _ask(srv, doc, ASKED[0])
    assert _count(srv, "installed") == 0, "the result arrived before the pool filled"
    _wait_installed(srv, 1)
    assert (_count(srv, "installed"), _count(srv, "installed_evicted")) == (1, 1), srv.log_tail()
    rows = _count(srv, "compacted_rows")
    evicted_answer = _ask(srv, DOC, LATER)
    assert _count(srv, "compacted_rows") > rows  # read from the compacted prefix

    # the same result, installed with its original cached: from the service's cache
    srv.flush_cache()
    for q in ASKED:
        _ask(srv, DOC, q)
    _wait_installed(srv, 2)
    assert (_count(srv, "installed"), _count(srv, "installed_evicted")) == (2, 1), srv.log_tail()
    rows = _count(srv, "compacted_rows")
    assert _ask(srv, DOC, LATER) == evicted_answer
    assert _count(srv, "compacted_rows") > rows
    assert labelled(srv.url, "sglang:compaction_results_rejected_total", "reason") == {}
    assert [c.mode for c in proxy.calls] == ["slow", "honest"]
