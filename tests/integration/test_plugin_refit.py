"""End to end: a compacted document is refit once more questions were asked, swapped in while
requests run on it, and every request is answered.

A real CPU SGLang server with the plugin against a real `compactor serve` (gRPC on loopback,
in-process workers, its result cache on): `--compaction-refit-at 4`. Two questions install the
first fit of a ~550-token document; two more distinct questions make four, and the plugin
asks for refit 1 with all four as follow-ups. While the refit is computed and installed, two
client threads keep streaming new questions on the document. The server's metrics then show
two installs of the same document (one a refit), the service computed two results (the refit
is not answered from its cache: `fit_round` is part of the key), and every request that ran
across the swap got its answer.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness.launch import CompactorService, SGLangServer, start_all
from harness.pool import parse_metrics
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    Timed,
    compaction_args,
    document,
    metric,
    prompt,
    questions,
    stream_generate,
    unseen_questions,
    wait_for_compactions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _service_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def test_refit_replaces_the_fit_while_requests_run(prepared_model: Path, tmp_path: Path) -> None:
    doc = document(sentences=32)
    seen, later = questions(), unseen_questions()
    with contextlib.ExitStack() as stack:
        svc = CompactorService(
            prepared_model, tmp_path / "compactor.log", in_process=True,
            extra_args=["--metrics-port", "0"],
        )  # fmt: skip
        start_all(stack, [svc])
        flags = [
            *compaction_args(svc.endpoint, 0.1, min_prefix_tokens=256, refit_at=(4,),
                            answer_tokens=QUICK_ANSWER_TOKENS),
            "--enable-metrics",
        ]  # fmt: skip
        srv = SGLangServer(
            prepared_model, log_path=tmp_path / "server.log", max_total_tokens=8192,
            extra_args=flags,
        )  # fmt: skip
        start_all(stack, [srv])
        first = [srv.generate(prompt(doc, q), max_new_tokens=8) for q in seen[:2]]
        wait_for_compactions(srv, 1, timeout_s=400)
        assert metric(srv, "sglang:compaction_refits_total") == 0

        # requests keep running on the document while the refit is asked for and swapped in
        results: list[Timed] = []
        spans: list[tuple[float, float]] = []  # (start, end) of each request, monotonic
        errors: list[BaseException] = []
        stop = threading.Event()

        def ask_on(offset: int) -> None:
            i = offset
            while not stop.is_set():
                q = later[i % len(later)]
                start = time.monotonic()
                try:
                    results.append(stream_generate(srv.url, prompt(doc, q), 24, timeout=300))
                    spans.append((start, time.monotonic()))
                except BaseException as e:  # reported below
                    errors.append(e)
                i += 2

        threads = [threading.Thread(target=ask_on, args=(k,), daemon=True) for k in (0, 1)]
        for t in threads:
            t.start()
        more = [srv.generate(prompt(doc, q), max_new_tokens=8) for q in seen[2:4]]
        deadline = time.monotonic() + 400
        before_swap = time.monotonic()  # the last moment the first fit was seen installed
        while metric(srv, "sglang:compaction_installed_total") < 2:
            assert time.monotonic() < deadline, srv.log_tail()
            before_swap = time.monotonic()
            time.sleep(0.2)
        after_swap = time.monotonic()
        served_before = len(results)
        time.sleep(3.0)  # a few more requests on the refit
        stop.set()
        for t in threads:
            t.join(timeout=300)
        installed = metric(srv, "sglang:compaction_installed_total")
        refits = metric(srv, "sglang:compaction_refits_total")
        fallbacks = metric(srv, "sglang:compaction_fallbacks_total")
        service = _service_metrics(svc.metrics_port())
        log = Path(srv.log_path).read_text(errors="replace")

    print(
        f"\n{len(results)} requests across the refit ({served_before} before its install "
        f"was seen), service computed {service.get('compactor_compactions_total')}"
    )
    assert not errors, errors
    assert installed == 2 and refits == 1 and fallbacks == 0, log
    requested = re.findall(r"compaction requested T=(\d+) hash=(\w+) follow_ups=(\d+)(.*)", log)
    assert len(requested) == 2, requested
    (t0, h0, n0, _), (t1, h1, n1, tail1) = requested
    assert (t0, h0) == (t1, h1) and int(n0) == 2 and int(n1) == 4 and "refit 1" in tail1
    assert len(re.findall(r"installed compacted prefix hash=" + h0, log)) == 2
    assert "refit=1" in log
    # requests on the old fit and on the refit were told apart on the host, as the rows say
    assert "compacted requests are marked on the host" in log
    assert "disagree with the rows' first slots" not in log
    assert service["compactor_compactions_total"] == 2, service  # not the cached first fit
    assert served_before >= 1 and len(results) > served_before
    # some request was running when the refit was swapped in, and was answered
    assert any(s < before_swap and e > after_swap for s, e in spans), (spans, before_swap)
    assert all(r.output_ids and r.text.strip() for r in results), results
    assert all(a["text"].strip() for a in [*first, *more])
