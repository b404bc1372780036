"""Prefill/decode disaggregation end to end on CPU: sglang-router in front of a stock prefill
server (the plugin installed, no `--compaction-endpoint`: its CPU switch only) and a decode
server with the plugin against a real `compactor serve`, on shared-document workloads sent
through the router; the servers and the service serve `plumbing_model` (a random 2-layer Llama
with the embedded model's tokenizer: the figures below are the servers', not the answers').

One PD pair serves the module; each test asks about a document of its own (no two share a
radix path) and reads the servers' counters as they move during the test. From the servers'
own figures: decode compacts the document and holds it in >= 8x fewer slots than its logical
tokens; after the install every request matches the compacted prefix on decode and prefill
transfers only what follows it (prefill's `sglang:kv_transfer_total_mb`, calibrated on the
document's first request, which it sent whole); every request is answered. Decode's pool is
too small for the requests running at once: the ones SGLang retracts resume on their compacted
prefix. Last, nothing is lost when decode's compaction service is down (the full prefix
serves) or decode restarts (it compacts again). Needs `make pd-deps`."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.launch import CompactorService, SGLangServer, free_port, start_all
from harness.pd import PDRouter, pd_pair
from harness.pool import fetch_metrics
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    many_questions,
    metric,
    prompt,
    prompt_ids,
    questions,
    wait_for_compactions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
TIMEOUT_S = 400
RATIO = 0.05
RECONNECT_S = 30  # the client's reconnect backoff is capped at its retry policy's max_s (5 s)
SENT_MB = "sglang:kv_transfer_total_mb_sum"
# decode's pool holds one document's whole prompt (~710 tokens) once: the retraction test's
# six requests on the compacted prefix start at ~190 tokens together and need 6 x 240 more,
# over the pool by half, so SGLang retracts even when prefill hands them over a few steps apart
DECODE_POOL_TOKENS = 1000
SENTENCES = 40


@dataclass
class PD:
    service: CompactorService
    prefill: SGLangServer
    decode: SGLangServer
    router: PDRouter


@pytest.fixture(scope="module")
def pd(plumbing_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    """The module's PD pair behind the router; decode compacts through a real service."""
    logs = tmp_path_factory.mktemp("pd")
    service = CompactorService(
        plumbing_model, logs / "service.log", in_process=True, port=free_port()
    )
    decode_flags = [
        *compaction_args(service.endpoint, RATIO, "am-highest", min_hits=2, min_prefix_tokens=256,
                         timeout_s=TIMEOUT_S, answer_tokens=QUICK_ANSWER_TOKENS),
        "--compaction-query-sources", "follow-up", "--compaction-retry-backoff", "0",
        "--compaction-max-retries", "20",
        "--disaggregation-decode-retraction-backup", "cpu_tensor",
        "--num-reserved-decode-tokens", "1", "--max-running-requests", "8",
    ]  # fmt: skip
    prefill, decode, bootstrap = pd_pair(plumbing_model, logs, decode_args=decode_flags)
    decode.max_total_tokens = DECODE_POOL_TOKENS
    with contextlib.ExitStack() as stack:
        start_all(stack, [service, prefill, decode])
        router = PDRouter(prefill.url, bootstrap, decode.url, logs / "router.log")
        start_all(stack, [router])
        yield PD(service, prefill, decode, router)


def _sent_mb(prefill: SGLangServer) -> float:
    """Prefill's KV sent so far, MB (its histogram's sum; refreshed when a transfer ends)."""
    return metric(prefill, SENT_MB)


def _wait_sent(prefill: SGLangServer, before: float, timeout_s: float = 30.0) -> float:
    """Prefill's sent MB once it moved past `before` (the answer can arrive before prefill
    records its transfer)."""
    deadline = time.monotonic() + timeout_s
    while (now := _sent_mb(prefill)) <= before:
        assert time.monotonic() < deadline, f"prefill recorded no KV transfer: {prefill.log_tail()}"
        time.sleep(0.5)
    return now


def _first_request(pd: PD, doc: str, question: str) -> tuple[dict[str, Any], float]:
    """Asks a document's first question (decode holds none of it: prefill sends it whole):
    the answer, and prefill's MB per token from that transfer."""
    before = _sent_mb(pd.prefill)
    out = pd.router.generate(prompt(doc, question), max_new_tokens=8)
    n_prompt = len(prompt_ids(pd.decode, prompt(doc, question)))
    return out, (_wait_sent(pd.prefill, before) - before) / n_prompt


def _ended(decode: SGLangServer) -> tuple[int, int]:
    """Decode's (installed, fallbacks) so far."""
    m = fetch_metrics(decode.url)
    ended = (m.get(f"sglang:compaction_{n}_total", 0.0) for n in ("installed", "fallbacks"))
    installed, fallbacks = (int(x) for x in ended)
    return installed, fallbacks


def _wait_ended(decode: SGLangServer, since: tuple[int, int], n: int) -> dict[str, float]:
    """Decode's counters once `n` compactions ended after `since` (`_ended`'s), with the
    installs and fallbacks as moved since then."""
    ended = wait_for_compactions(decode, sum(since) + n, TIMEOUT_S, progress=False)
    installed, fallbacks = since
    return {**ended, "installed": ended["installed_total"] - installed,
            "fallbacks": ended["fallbacks_total"] - fallbacks}  # fmt: skip


def _log_since(server: SGLangServer, offset: int) -> str:
    return Path(server.log_path).read_bytes()[offset:].decode(errors="replace")


def _log_size(server: SGLangServer) -> int:
    return Path(server.log_path).stat().st_size


def test_decode_compacts_and_prefill_sends_only_the_suffix(pd: PD) -> None:
    doc, qs = document(SENTENCES, index=1), questions()
    since, decode_from = _ended(pd.decode), _log_size(pd.decode)
    first, mb_per_token = _first_request(pd, doc, qs[0])  # before any compaction: sent whole
    n_first = len(prompt_ids(pd.decode, prompt(doc, qs[0])))
    pd.router.generate(prompt(doc, qs[1]), max_new_tokens=4)  # the 2nd question: compaction
    ended = _wait_ended(pd.decode, since, 1)
    assert (ended["installed"], ended["fallbacks"]) == (1, 0), pd.decode.log_tail()
    logical, physical = ended["logical_tokens"], ended["physical_tokens"]
    tree_before = metric(pd.decode, "sglang:compaction_tree_slots")
    after = []
    for q in qs[2:5]:  # new questions, after the install
        before_mb = _sent_mb(pd.prefill)
        out = pd.router.generate(prompt(doc, q), max_new_tokens=8)
        n_prompt = len(prompt_ids(pd.decode, prompt(doc, q)))
        sent = (_wait_sent(pd.prefill, before_mb) - before_mb) / mb_per_token
        after.append((q, out, n_prompt, sent))
    tree_after = metric(pd.decode, "sglang:compaction_tree_slots")
    decode_log = _log_since(pd.decode, decode_from)
    prefill_log = Path(pd.prefill.log_path).read_text(errors="replace")
    print(f"\nPD: prefix {logical:.0f} logical tokens in {physical:.0f} decode slots (tree "
          f"{tree_before:.0f} slots at the install, {tree_after:.0f} at the end); the first "
          f"request sent {n_first} tokens ({mb_per_token * n_first:.2f} MB)")  # fmt: skip
    assert first["text"].strip(), first
    # decode holds the compacted prefix: >= 8x fewer slots than the tokens it stands for,
    # and its tree no longer holds the document whole beside it
    assert logical >= 256 and 0 < physical * 8 <= logical, (logical, physical)
    assert physical + tree_after < logical, (physical, tree_after, logical)
    assert "sglang_ext: installed compacted prefix" in decode_log
    assert "compacted requests are marked on the host" in decode_log  # served with beta
    assert "disagree with the rows' first slots" not in decode_log
    # prefill ran with the plugin's CPU switch, and never compacted
    assert "MooncakeKVSender.supports_host_tensor_indices True -> False" in prefill_log
    assert "installed compacted prefix" not in prefill_log
    for i, (q, out, n_prompt, sent) in enumerate(after):
        print(f"  {q!r}: {n_prompt} prompt tokens, prefill sent {sent:.1f}: {out['text']!r}")
        assert out["text"].strip() and out["meta_info"]["completion_tokens"] > 0, out
        # decode matched the whole compacted prefix (the first request after the install
        # exactly it, later ones also the document's tail the earlier ones left below it),
        # so prefill sent only what follows
        assert sent <= n_prompt - logical + 0.5, (q, sent, n_prompt, logical)
        if i == 0:
            assert abs(sent - (n_prompt - logical)) < 0.5, (q, sent, n_prompt, logical)
        assert sent < 0.5 * n_prompt, (q, sent, n_prompt)  # never the whole prompt


def test_retracted_requests_resume_on_the_compacted_prefix(pd: PD) -> None:
    """Decode's pool is too small for the requests running at once: SGLang retracts some
    (their KV backed up to the host, `cpu_tensor`) and resumes them later; each resumes on its
    compacted prefix (the plugin's log) and answers token for token as it does when run alone
    afterwards; every request is answered in full."""
    doc, qs = document(SENTENCES, index=2), questions()
    since, decode_from = _ended(pd.decode), _log_size(pd.decode)
    n_new = 240
    for q in qs[:2]:
        pd.router.generate(prompt(doc, q), max_new_tokens=4)
    ended = _wait_ended(pd.decode, since, 1)
    assert (ended["installed"], ended["fallbacks"]) == (1, 0), pd.decode.log_tail()
    with ThreadPoolExecutor(len(qs)) as pool:
        outs = list(pool.map(
            lambda q: pd.router.generate(prompt(doc, q), max_new_tokens=n_new, ignore_eos=True),
            qs,
        ))  # fmt: skip
    decode_log = _log_since(pd.decode, decode_from)
    # a resumed request answers as it does alone (greedy): reading its prefix as plain
    # tokens changes the answer after the resume
    agree, retractions = [], 0
    for q, out in zip(qs, outs):
        if out["meta_info"].get("num_retractions"):
            retractions += out["meta_info"]["num_retractions"]
            alone = pd.router.generate(prompt(doc, q), max_new_tokens=n_new, ignore_eos=True)
            a, b = out["output_ids"], alone["output_ids"]
            agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    resumed = len(re.findall(r"resumed after retraction on its compacted prefix", decode_log))
    print(f"\nPD retraction: {len(agree)} request(s) retracted ({retractions} time(s)), "
          f"{resumed} resumed on their compacted prefix; first tokens as when run alone: "
          f"{agree} of {n_new}")  # fmt: skip
    assert agree, "no request was retracted: the pool was not tight enough"
    assert all(n == n_new for n in agree), agree
    assert resumed == retractions, (resumed, retractions)
    assert "disagree with the rows' first slots" not in decode_log
    for out in outs:
        assert out["meta_info"]["completion_tokens"] == n_new, out["meta_info"]


def test_service_outage_and_decode_restart_lose_no_request(pd: PD) -> None:
    """The service is down when a document's compaction is due: the requests are answered
    from the full prefix (one fallback); the service comes back and a question's retry
    installs the fit within RECONNECT_S (the first ones may still find decode's channel
    reconnecting). Then decode restarts on its address, empty: the router and prefill keep
    serving through it, it compacts the document again and prefill sends only the suffix
    again. (Last in the module: it leaves decode restarted.)"""
    doc, qs = document(SENTENCES, index=3), questions()
    since = _ended(pd.decode)
    first, mb_per_token = _first_request(pd, doc, qs[0])
    answered = [first]

    pd.service.stop()  # the outage: nothing listens at decode's endpoint
    answered.append(pd.router.generate(prompt(doc, qs[1]), max_new_tokens=8))  # due now
    outage = _wait_ended(pd.decode, since, 1)
    assert (outage["installed"], outage["fallbacks"]) == (0, 1), outage
    pd.service.restart()
    # each new question may send the document again; until decode's gRPC channel has
    # reconnected (within its 5 s backoff), such a retry fails fast and is one more fallback
    ended, deadline = 1, time.monotonic() + RECONNECT_S
    for n, q in enumerate([qs[2], *(q for q in many_questions(24) if q not in qs)]):
        answered.append(pd.router.generate(prompt(doc, q), max_new_tokens=8))  # a retry
        back = _wait_ended(pd.decode, since, ended + 1)
        ended = int(back["installed"] + back["fallbacks"])
        if back["installed"] or (n >= 2 and time.monotonic() > deadline):
            break
        time.sleep(2.0)
    assert back["installed"] == 1, pd.decode.log_tail()

    pd.decode.restart()  # same address: the router and prefill keep it
    for q in qs[3:5]:  # the new decode's own two hits of the document
        answered.append(pd.router.generate(prompt(doc, q), max_new_tokens=8))
    again = wait_for_compactions(pd.decode, 1, TIMEOUT_S, progress=False)
    assert again["installed_total"] == 1 and again["fallbacks_total"] == 0, pd.decode.log_tail()
    before_mb = _sent_mb(pd.prefill)
    answered.append(pd.router.generate(prompt(doc, qs[5]), max_new_tokens=8))
    n_prompt = len(prompt_ids(pd.decode, prompt(doc, qs[5])))
    sent = (_wait_sent(pd.prefill, before_mb) - before_mb) / mb_per_token
    logical = again["logical_tokens"]
    print(f"\nPD outage/restart: {len(answered)} requests answered; after the restart the "
          f"prefix is {logical:.0f} tokens in {again['physical_tokens']:.0f} slots and prefill "
          f"sent {sent:.1f} of {n_prompt} prompt tokens")  # fmt: skip
    for out in answered:
        assert out["text"].strip() and out["meta_info"]["completion_tokens"] > 0, out
    assert 0 < again["physical_tokens"] * 8 <= logical, again
    assert abs(sent - (n_prompt - logical)) < 0.5, (sent, n_prompt, logical)
