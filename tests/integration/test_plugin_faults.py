"""Fault suite: whatever the compaction service does, every request is answered, nothing hangs,
and the answers equal the stock server's.

A real CPU SGLang server with the plugin (serving `plumbing_model`, a random 2-layer Llama with
the embedded model's tokenizer; so does the stock server) asks a `harness.hostile.HostileProxy`
(loopback, a port the OS picks) which forwards to a real `compactor serve` and then misbehaves,
one mode per document (`--compaction-max-retries 0`: each document asks once; a mode's document
is its own, so no case sees another's prefix). Per case: two questions (the second one's insert
triggers the compaction, `--compaction-min-hits 2`), a bounded wait until the compaction ended,
the same two questions again; all four answers must equal a stock server's for that document,
and the plugin's counters must have moved by exactly:

- requested +1, fallbacks +1, installed 0, and
- `failures` +1 when the service gave no answer (a timeout, a killed service, nothing
  listening at the endpoint), or
- `invalid` +1 when it answered and the answer failed a check: undecodable bytes, a stream
  ending before its trailer, one over the size limit (cut off while it arrives), or a
  complete, checksummed result with wrong content (random payload, wrong shapes, NaN,
  huge magnitudes, another model's fingerprint, another prefix's hash).

The `honest` control goes through the same proxy untampered and must install, so the
fault cases fail because of their fault. `kill` SIGKILLs the real service; `unreachable`
then stops the proxy too, so nothing listens at the plugin's endpoint, and runs last.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.hostile import HostileProxy
from harness.launch import CompactorService, SGLangServer, free_port, start_all
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    metric,
    prompt,
    questions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TIMEOUT_S = 30.0  # --compaction-timeout; a compaction of the plumbing model takes ~2 s here
QUESTIONS = questions()[:2]
COUNTERS = ("requested", "installed", "failures", "invalid", "fallbacks")

CASES = [  # (mode, the counter that must move); run in this order, `kill` and `unreachable` last
    pytest.param("honest", "installed", id="honest"),
    pytest.param("garbage", "invalid", id="garbage"),
    pytest.param("truncated", "invalid", id="truncated"),
    pytest.param("random", "invalid", id="random"),
    pytest.param("shape", "invalid", id="shape"),
    pytest.param("nan", "invalid", id="nan"),
    pytest.param("huge", "invalid", id="huge"),
    pytest.param("fingerprint", "invalid", id="fingerprint"),
    pytest.param("prefix_hash", "invalid", id="prefix_hash"),
    pytest.param("oversize", "invalid", id="oversize"),
    pytest.param("slow", "failures", id="slow"),
    pytest.param("kill", "failures", id="kill"),
    pytest.param("unreachable", "failures", id="unreachable"),
]
MODES: list[str] = [str(p.values[0]) for p in CASES]
UNREACHABLE = "unreachable"  # not a proxy mode: the proxy is stopped


def _doc(mode: str) -> str:
    """The case's own document (~440 tokens; its first line differs from every other's)."""
    i = MODES.index(mode)
    return f"Fault case {i}: {mode}. " + document(24, i % 4)


def _ask(srv: SGLangServer, doc: str) -> list[list[int]]:
    """Greedy output ids of QUESTIONS, in order (each request bounded by 120 s)."""
    outs = []
    for q in QUESTIONS:
        params = {"max_new_tokens": 12, "temperature": 0.0}
        out = srv.post("/generate", {"text": prompt(doc, q), "sampling_params": params}, 120.0)
        outs.append(list(out["output_ids"]))
    return outs


def _counters(srv: SGLangServer) -> dict[str, int]:
    return {n: int(metric(srv, f"sglang:compaction_{n}_total")) for n in COUNTERS}


@pytest.fixture(scope="module")
def stock(
    plumbing_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """Stock SGLang's output ids per mode's document, asked twice: the first pass, and the
    second with every prompt already in the radix cache (a fully cached prompt takes another
    numeric path: a greedy token can differ from the first pass, on stock too). Its server
    stops before the rig starts (the test asks for `stock` first)."""
    log = tmp_path_factory.mktemp("stock") / "stock.log"
    with SGLangServer(plumbing_model, log_path=log, max_total_tokens=8192, plugin=False) as srv:
        return {mode: (_ask(srv, _doc(mode)), _ask(srv, _doc(mode))) for mode in MODES}


@dataclass
class Rig:
    server: SGLangServer
    proxy: HostileProxy


@pytest.fixture(scope="module")
def rig(plumbing_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The plugin's server against the hostile proxy in front of a real compactor."""
    logs = tmp_path_factory.mktemp("faults")
    svc = CompactorService(
        plumbing_model, logs / "compactor.log", in_process=True, port=free_port()
    )

    def kill_service() -> None:
        if svc.pid is not None:
            os.killpg(svc.pid, signal.SIGKILL)  # its own session: the group is the service

    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(HostileProxy(svc.endpoint, kill_service, 3 * TIMEOUT_S))
        flags = compaction_args(
            proxy.address,
            0.1,
            min_hits=2,
            min_prefix_tokens=256,
            timeout_s=TIMEOUT_S,
            answer_tokens=QUICK_ANSWER_TOKENS,
        )
        srv = SGLangServer(
            plumbing_model,
            log_path=logs / "plugin.log",
            max_total_tokens=8192,
            extra_args=[*flags, "--compaction-max-retries", "0", "--enable-metrics"],
        )
        start_all(stack, [svc, srv])
        yield Rig(srv, proxy)


@pytest.mark.parametrize(("mode", "counter"), CASES)
def test_fault_gives_stock_answers(
    mode: str, counter: str, stock: dict[str, tuple[list[list[int]], list[list[int]]]], rig: Rig
) -> None:
    srv, proxy = rig.server, rig.proxy
    doc = _doc(mode)
    before = _counters(srv)
    seen = len(proxy.calls)
    if mode == UNREACHABLE:
        proxy.stop()  # its port closes: the plugin's calls are refused
    else:
        proxy.expect(mode)
    t0 = time.monotonic()
    first = _ask(srv, doc)
    deadline = time.monotonic() + TIMEOUT_S + 60
    while time.monotonic() < deadline:
        now = _counters(srv)
        if now["installed"] + now["fallbacks"] > before["installed"] + before["fallbacks"]:
            break
        time.sleep(0.5)
    ended_s = time.monotonic() - t0
    again = _ask(srv, doc)
    delta = {n: v - before[n] for n, v in _counters(srv).items()}
    calls = proxy.calls[seen:]
    print(f"\n{mode}: compaction ended after {ended_s:.1f} s, counters moved {delta}")

    asked = set() if mode == UNREACHABLE else {mode}
    assert {c.mode for c in calls} == asked and len({c.request_id for c in calls}) == len(asked), (
        calls,
        srv.log_tail(),
    )
    expected = dict.fromkeys(COUNTERS, 0) | {"requested": 1, counter: 1}
    if mode != "honest":
        expected["fallbacks"] = 1
        assert first == stock[mode][0], "answers while the faulty compaction was in flight"
        assert again == stock[mode][1], "answers after the faulty compaction (cached prompts)"
    assert delta == expected, srv.log_tail()
