"""End to end: a real SGLang server compacts a shared document in-process and keeps answering.

One server with `--compaction-endpoint inproc://` and `--compaction-min-hits 6`: the six
questions are first answered uncompacted (no prefix has 6 hits until the sixth one is cached,
so these are the stock answers), the sixth hit triggers the compaction (am-omp, ratio 0.1), and
after the install the same questions are asked again over the compacted prefix.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.launch import SGLangServer
from harness.workload import (
    ask_all,
    compacted_length,
    compaction_args,
    document,
    metric,
    needle_correct,
    questions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_shared_document_is_compacted_and_answers_hold(
    prepared_model: Path, tmp_path: Path
) -> None:
    doc = document()
    args = [
        *compaction_args(
            "inproc://", 0.1, "am-omp", min_hits=len(questions()), min_prefix_tokens=512,
            timeout_s=400,
        ),
        "--compaction-query-sources", "follow-up", "--compaction-on-policy", "--enable-metrics",
    ]  # fmt: skip
    with SGLangServer(
        prepared_model, log_path=tmp_path / "server.log", max_total_tokens=4096, extra_args=args
    ) as srv:
        before = ask_all(srv, doc)
        T = before[-1]["meta_info"]["cached_tokens"]
        assert T > 1000, T  # the shared document came from the radix cache
        assert metric(srv, "sglang:compaction_requested_total") == 1
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and metric(srv, "sglang:compaction_installed_total") < 1:
            assert metric(srv, "sglang:compaction_fallbacks_total") == 0, srv.log_tail()
            time.sleep(2)
        assert metric(srv, "sglang:compaction_installed_total") == 1, srv.log_tail()
        logical = metric(srv, "sglang:compaction_logical_tokens")
        physical = metric(srv, "sglang:compaction_physical_tokens")
        # the compacted path stops short of the branch (margin, then alignment)
        assert logical == compacted_length(T) and physical > 0, (logical, T)
        assert logical / physical >= 5, (logical, physical)  # slots held: T -> t_max
        assert metric(srv, "sglang:compaction_bytes_saved") > 0
        # uniform budgets: every (layer, KV head) keeps t_max entries, no padding
        cfg = json.loads((prepared_model / "config.json").read_text())
        cells = cfg["num_hidden_layers"] * cfg["num_key_value_heads"]
        assert metric(srv, "sglang:compaction_kept_entries") == physical * cells
        after = ask_all(srv, doc)
        log = Path(srv.log_path).read_text(errors="replace")
    assert "sglang_ext: installed compacted prefix" in log
    # the backend decided on the host marks, and on CPU they agreed with every row's slots
    assert "compacted requests are marked on the host" in log  # the marking hook ran
    assert "disagree with the rows' first slots" not in log
    # the compacted prefix served every question (matched whole, logical length kept)
    for out in after:
        assert out["meta_info"]["cached_tokens"] >= logical, out["meta_info"]
    agree = reproduced = 0
    for q, b, a in zip(questions(), before, after):
        agree += b["output_ids"][:16] == a["output_ids"][:16]
        # stock's whole answer text (its stop token is not text), then maybe more
        reproduced += a["text"].startswith(b["text"].rstrip())
        if needle_correct(q, b["text"]):
            assert needle_correct(q, a["text"]), (q, b["text"], a["text"])
    print(
        f"\nslots held by the prefix: stock {int(logical)}, compacted {int(physical)} "
        f"({logical / physical:.1f}x); first-16-token agreement {agree}/{len(after)}, "
        f"stock answer reproduced {reproduced}/{len(after)}"
    )
    for q, b, a in zip(questions(), before, after):
        print(f"Q: {q}\n  stock:     {b['text']!r}\n  compacted: {a['text']!r}")
    # The needles above are the hard requirement; the rest is the issue's "first 16 greedy
    # tokens agree on most questions". Measured with am-omp fitted on-policy to the six
    # questions plus the model's own 32-token answers (the plugin's query defaults): strict
    # 16-token agreement 5/6, stock's answer text reproduced 5/6. The default am-highest gives
    # 3/6 and 5/6 here (its two misses go on where stock emitted its stop token); replayed
    # offline (benchmarks/server/agreement.py --docs 1 --held-out 0) the strict counts are the same.
    assert reproduced >= 4 and agree >= 4, (agree, reproduced)
