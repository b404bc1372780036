"""End to end past one chunk: a ~4.6k-token document compacted by `compactor serve`.

A real `compactor serve` (in-process worker) and a real CPU SGLang server with the plugin
pointed at it. Two requests share a ~4.6k-token document (260 sentences of
harness.workload.document): longer than SGLang's 4096-token prefill chunk and the service's
4096-token compaction chunk, so both take the chunked path. The second hit triggers the
compaction (am-highest, ratio 0.1, the plugin's follow-up queries), the plugin installs the
result, and a third question is served from the compacted prefix: the whole compacted path
matches (cached tokens), and an answer comes back. Budget: about two minutes.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from harness.launch import CompactorService, SGLangServer, start_all
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compacted_length,
    compaction_args,
    document,
    metric,
    prompt,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SENTENCES = 260  # ~4.6k tokens with a question: over one 4096-token chunk
QUESTIONS = ("What is the first room?", "Who wrote the report?", "How many rooms are there?")
CONTEXT = 8192  # the plumbing model's positions (SmolLM2's)
CHUNK = 4096  # SGLang's --chunked-prefill-size here, and the service's compaction chunk


def test_long_document_is_compacted_by_the_service_and_served(
    plumbing_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    doc = document(SENTENCES)
    tok = AutoTokenizer.from_pretrained(str(plumbing_model))
    n_prompt = max(len(tok(prompt(doc, q))["input_ids"]) for q in QUESTIONS)
    assert CHUNK < n_prompt <= CONTEXT - 64, n_prompt  # over a chunk, room for the answer
    with contextlib.ExitStack() as stack:
        service = CompactorService(plumbing_model, tmp_path / "service.log", in_process=True)
        start_all(stack, [service])
        flags = compaction_args(
            service.endpoint, 0.1, "am-highest", min_hits=2, min_prefix_tokens=1024,
            timeout_s=400, answer_tokens=QUICK_ANSWER_TOKENS,
        )  # fmt: skip
        server = SGLangServer(
            plumbing_model,
            tmp_path / "server.log",
            max_total_tokens=3 * CONTEXT,
            extra_args=[*flags, "--enable-metrics"],
        )
        start_all(stack, [server])
        first = server.generate(prompt(doc, QUESTIONS[0]), max_new_tokens=8)
        second = server.generate(prompt(doc, QUESTIONS[1]), max_new_tokens=8)
        T = second["meta_info"]["cached_tokens"]
        assert T > CHUNK, second["meta_info"]  # the shared document came from the radix cache
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
