"""End to end at SmolLM2's context limit: an ~8k-token document compacted by `compactor serve`.

A real `compactor serve` (in-process worker, its prefix limit the model's 8192 positions)
and a real CPU SGLang server with the plugin pointed at it. Two requests share a ~7.8k-token
document (440 sentences of harness.workload.document, under 8192 minus question and answer);
the second hit triggers the compaction (am-highest, ratio 0.1, the plugin's follow-up
queries), the plugin installs the result over scheduler iterations, and a third question is
served from the compacted prefix: the whole compacted path matches (cached tokens), and an
answer comes back. Budget: a few minutes (two 8k prefills, one in SGLang and one in the
service, plus the compaction).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from harness.launch import CompactorService, SGLangServer, start_all
from harness.workload import compacted_length, compaction_args, document, metric, prompt

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SENTENCES = 440  # ~7.8k tokens with a question: the longest document SmolLM2's 8192 take
QUESTIONS = ("What is the first room?", "Who wrote the report?", "How many rooms are there?")
CONTEXT = 8192


def test_8k_document_is_compacted_by_the_service_and_served(
    prepared_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    doc = document(SENTENCES)
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    n_prompt = max(len(tok(prompt(doc, q))["input_ids"]) for q in QUESTIONS)
    assert 7000 < n_prompt <= CONTEXT - 64, n_prompt  # near the limit, room for the answer
    with contextlib.ExitStack() as stack:
        service = CompactorService(prepared_model, tmp_path / "service.log", in_process=True)
        start_all(stack, [service])
        flags = compaction_args(
            service.endpoint, 0.1, "am-highest", min_hits=2, min_prefix_tokens=1024,
            timeout_s=400,
        )  # fmt: skip
        server = SGLangServer(
            prepared_model,
            tmp_path / "server.log",
            max_total_tokens=3 * CONTEXT,
            extra_args=[*flags, "--enable-metrics"],
        )
        start_all(stack, [server])
        first = server.generate(prompt(doc, QUESTIONS[0]), max_new_tokens=8)
        second = server.generate(prompt(doc, QUESTIONS[1]), max_new_tokens=8)
        T = second["meta_info"]["cached_tokens"]
        assert T > 7000, second["meta_info"]  # the shared document came from the radix cache
        assert first["text"] and second["text"]
        deadline = time.monotonic() + 300
        while (
            time.monotonic() < deadline and metric(server, "sglang:compaction_installed_total") < 1
        ):
            assert metric(server, "sglang:compaction_fallbacks_total") == 0, server.log_tail()
            time.sleep(2)
        assert metric(server, "sglang:compaction_installed_total") == 1, server.log_tail()
        logical = metric(server, "sglang:compaction_logical_tokens")
        physical = metric(server, "sglang:compaction_physical_tokens")
        # the compacted path stops short of the branch (margin, then alignment)
        assert logical == compacted_length(T) and physical > 0, (logical, physical, T)
        assert logical / physical >= 5, (logical, physical)  # slots held: T -> t_max
        third = server.generate(prompt(doc, QUESTIONS[2]), max_new_tokens=8)
        assert metric(server, "sglang:compaction_fallbacks_total") == 0
        service_log = Path(service.log_path).read_text(errors="replace")
    # served from the compacted prefix: the whole compacted path matched, an answer came back
    assert third["meta_info"]["cached_tokens"] >= logical, third["meta_info"]
    assert third["meta_info"]["completion_tokens"] >= 1 and third["text"], third
    assert f"T={int(logical)}" in service_log, service_log[-2000:]  # the service compacted it
    print(
        f"\nT={T} prompt tokens={n_prompt}: slots {int(logical)} -> {int(physical)} "
        f"({logical / physical:.1f}x); third answer {third['text']!r}"
    )
