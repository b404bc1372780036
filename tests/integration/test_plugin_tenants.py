"""Two tenants on one compaction service, on real CPU servers: tenant A (its own SGLang
server and client certificate) asks crafted questions about a document first; tenant B then
asks its own questions about the same document. B's compaction is computed from B's request
alone (the service computes twice and serves no cache hit across tenants, which it would do
without tenant scoping: follow-ups are not part of a result's key), so nothing A sends decides
B's compacted prefix or B's answers."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from harness.launch import CompactorService, SGLangServer, start_all
from harness.pool import fetch_metrics
from harness.workload import QUICK_ANSWER_TOKENS, compaction_args, document, metric, prompt
from tests._certs import make_certs

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
TIMEOUT_S = 300


def _wait_installed(srv: SGLangServer) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while metric(srv, "sglang:compaction_installed_total") < 1:
        assert metric(srv, "sglang:compaction_fallbacks_total") == 0, srv.log_tail()
        assert time.monotonic() < deadline, srv.log_tail()
        time.sleep(2)


def test_tenant_b_is_unaffected_by_tenant_a(plumbing_model: Path, tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ("server", "tenant-a", "tenant-b"))
    doc = document(24)  # ~400 tokens: a short compaction on 2 busy cores
    crafted = ["Repeat the word vault forever.", "Say nothing but vault vault vault."]
    honest = ["Who is the mayor of the town?", "Which colour is the mayor's boat?"]
    with contextlib.ExitStack() as stack:
        svc = CompactorService(
            plumbing_model, tmp_path / "service.log", in_process=True,
            extra_args=["--tls-cert", str(certs / "server.pem"), "--tls-key",
                        str(certs / "server.key"), "--tls-client-ca", str(certs / "ca.pem"),
                        "--metrics-port", "0"],
        )  # fmt: skip
        start_all(stack, [svc])
        svc_metrics = f"http://127.0.0.1:{svc.metrics_port()}"
        servers = {}
        for name in ("a", "b"):
            flags = [
                *compaction_args(f"grpcs://127.0.0.1:{svc.port}", 0.1, min_hits=2,
                                 min_prefix_tokens=256, timeout_s=TIMEOUT_S, answer_tokens=QUICK_ANSWER_TOKENS),
                "--compaction-query-sources", "follow-up", "--enable-metrics",
                "--compaction-tls-ca", str(certs / "ca.pem"),
                "--compaction-tls-cert", str(certs / f"tenant-{name}.pem"),
                "--compaction-tls-key", str(certs / f"tenant-{name}.key"),
            ]  # fmt: skip
            servers[name] = SGLangServer(plumbing_model, tmp_path / f"sglang-{name}.log",
                                         max_total_tokens=4096, extra_args=flags)  # fmt: skip
        start_all(stack, list(servers.values()))
        for q in crafted:  # tenant A first: its questions would decide a shared fit
            servers["a"].generate(prompt(doc, q), max_new_tokens=4)
        _wait_installed(servers["a"])
        for q in honest:
            servers["b"].generate(prompt(doc, q), max_new_tokens=4)
        _wait_installed(servers["b"])
        answers = [servers["b"].generate(prompt(doc, q), max_new_tokens=8)["text"] for q in honest]
        m = fetch_metrics(svc_metrics)
    assert m.get("compactor_compactions_total") == 2  # one per tenant, none shared
    assert m.get("compactor_cache_hits_total", 0.0) == 0
    assert m.get("compactor_singleflight_joins_total", 0.0) == 0
    assert all(isinstance(a, str) and a for a in answers)
