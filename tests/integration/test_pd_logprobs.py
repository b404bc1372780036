"""PD's mixed numerics, measured: with the plugin on a PD decode server, the suffix's KV comes
from prefill (computed over the full prefix) while decode reads the compacted one. Stock's
greedy answers are scored teacher-forced on four deployments of the same model and fit:

- a single stock server and a single plugin server (`harness.workload.teacher_forced`);
- a PD pair without the plugin on decode and one with it (`harness.pd.pd_teacher_forced`:
  decode scores every answer token after the first, which prefill makes in serving too).

Each plugin server compacts the same document after the same two questions (same method,
ratio, query source and follow-ups), and both stock deployments score the same answers. Over
the tokens decode scores, PD with the plugin is off from PD without it by no more than the
single plugin server is off from the single stock one (mean |log-prob gap|). The measurement
is checked first: PD without the plugin matches the single stock server, and each plugin
deployment read its compacted prefix for every scored request (its compacted-rows counter).
Needs `make pd-deps`."""

from __future__ import annotations

import contextlib
import itertools
import math
from pathlib import Path

import pytest

from harness.forced import Forced, logprob_gap, teacher_forced, top1_share
from harness.launch import SGLangServer, start_all
from harness.pd import PDRouter, pd_pair, pd_teacher_forced
from harness.workload import (
    compaction_args,
    document,
    metric,
    prompt,
    prompt_ids,
    questions,
    wait_for_compactions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
TIMEOUT_S = 400
RATIO = 0.05
ANSWER_TOKENS = 12
ROWS = "sglang:compaction_compacted_rows_total"
NOISE = 0.02  # mean |log-prob gap| allowed between two stock deployments (numerics only)
TRANSFER_TIMEOUT_S = 90  # a request's KV transfer here takes under 10 s; a stuck one is resent


def test_pd_answers_stay_as_close_to_stock_as_a_single_plugin_servers(
    prepared_model: Path, tmp_path: Path
) -> None:
    doc, qs = document(40), questions()
    warm, scored = qs[:2], qs[2:4]
    plugin_flags = [
        *compaction_args("inproc://", RATIO, "am-highest", min_hits=2, min_prefix_tokens=256,
                         timeout_s=TIMEOUT_S),
        "--compaction-query-sources", "follow-up",
    ]  # fmt: skip
    forced: dict[str, list[Forced]] = {}
    rows: dict[str, float] = {}
    single = {
        "stock": SGLangServer(prepared_model, tmp_path / "stock.log", plugin=False),
        "plugin": SGLangServer(prepared_model, tmp_path / "plugin.log",
                               extra_args=[*plugin_flags, "--enable-metrics"]),
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        start_all(stack, list(single.values()))
        for srv in single.values():
            for q in warm:
                srv.generate(prompt(doc, q), max_new_tokens=4)
        ended = wait_for_compactions(single["plugin"], 1, TIMEOUT_S, progress=False)
        assert ended["installed_total"] == 1, single["plugin"].log_tail()
        pids = [prompt_ids(single["stock"], prompt(doc, q)) for q in scored]
        answers = [
            single["stock"].post("/generate", {"input_ids": pid, "sampling_params": {
                "max_new_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True,
            }})["output_ids"] for pid in pids
        ]  # fmt: skip
        before = metric(single["plugin"], ROWS)
        for name, srv in single.items():
            forced[f"single {name}"] = [teacher_forced(srv, p, a) for p, a in zip(pids, answers)]
        rows["single plugin"] = metric(single["plugin"], ROWS) - before

    for name in ("stock", "plugin"):
        decode_args = ["--disaggregation-decode-retraction-backup", "none"]
        if name == "plugin":
            decode_args += plugin_flags
        prefill, decode, bootstrap = pd_pair(prepared_model, tmp_path / name,
                                             decode_args=decode_args,
                                             transfer_timeout_s=TRANSFER_TIMEOUT_S)  # fmt: skip
        decode.plugin = name == "plugin"  # stock: the plugin not loaded on decode
        (tmp_path / name).mkdir()
        with contextlib.ExitStack() as stack:
            start_all(stack, [prefill, decode])
            router = PDRouter(prefill.url, bootstrap, decode.url, tmp_path / name / "router.log")
            start_all(stack, [router])
            for q in warm:
                router.generate(prompt(doc, q), max_new_tokens=4)
            if name == "plugin":
                ended = wait_for_compactions(decode, 1, TIMEOUT_S, progress=False)
                assert ended["installed_total"] == 1, decode.log_tail()
            before = metric(decode, ROWS)
            forced[f"PD {name}"] = [pd_teacher_forced(router, p, a) for p, a in zip(pids, answers)]
            rows[f"PD {name}"] = metric(decode, ROWS) - before

    noise = logprob_gap(forced["PD stock"], forced["single stock"], skip=1)
    single_gap = logprob_gap(forced["single plugin"], forced["single stock"], skip=1)
    pd_gap = logprob_gap(forced["PD plugin"], forced["PD stock"], skip=1)
    print(f"\nmean |log-prob gap| over {len(scored)} x {ANSWER_TOKENS - 1} tokens: PD stock vs "
          f"single stock {noise:.4f}; single plugin vs stock {single_gap:.4f}; PD plugin vs PD "
          f"stock {pd_gap:.4f}; compacted rows {rows}")  # fmt: skip
    for name, f in forced.items():
        unscored = sum(math.isnan(x) for x in itertools.chain(*(x.logprobs for x in f)))
        print(f"  {name:13} top-1 = stock's answer: {top1_share(f, answers, skip=1):.2f} "
              f"({unscored} token(s) prefill's greedy did not reach)")  # fmt: skip
    # the measurement: PD scores as a single server does, and the plugin's deployments read
    # their compacted prefixes for every scored request
    assert noise < NOISE, noise
    assert top1_share(forced["PD stock"], answers, skip=1) == 1.0
    assert rows["single plugin"] >= len(scored), rows
    assert rows["PD plugin"] >= len(scored) * (ANSWER_TOKENS - 1), rows
    assert rows["PD stock"] == 0, rows
    # the claim: PD with the plugin is no further from PD without it than a single plugin
    # server is from a single stock one (PD's suffix KV is computed over the full prefix)
    assert pd_gap <= single_gap + NOISE, (pd_gap, single_gap)
