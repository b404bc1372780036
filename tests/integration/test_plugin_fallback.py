"""With the compaction endpoint unreachable, the plugin's server answers exactly as stock."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from harness.launch import SGLangServer, free_port, start_all
from harness.workload import ask_all, compaction_args, document, metric

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_unreachable_endpoint_gives_stock_outputs(prepared_model: Path, tmp_path: Path) -> None:
    doc = document(60)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    flags = compaction_args(dead, 0.1, min_hits=2, min_prefix_tokens=256, timeout_s=5)
    stock_srv = SGLangServer(
        prepared_model, log_path=tmp_path / "stock.log", max_total_tokens=4096, plugin=False
    )
    srv = SGLangServer(
        prepared_model,
        log_path=tmp_path / "plugin.log",
        max_total_tokens=4096,
        extra_args=[*flags, "--enable-metrics"],
    )
    with contextlib.ExitStack() as stack:
        start_all(stack, [stock_srv, srv])  # side by side: they start at once
        stock = ask_all(stock_srv, doc)
        outs = ask_all(srv, doc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and metric(srv, "sglang:compaction_fallbacks_total") < 1:
            time.sleep(1)
        assert metric(srv, "sglang:compaction_requested_total") >= 1
        assert metric(srv, "sglang:compaction_failures_total") >= 1
        assert metric(srv, "sglang:compaction_fallbacks_total") >= 1
        assert metric(srv, "sglang:compaction_installed_total") == 0
        again = ask_all(srv, doc)  # after the failure: still stock
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in stock]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in stock]
