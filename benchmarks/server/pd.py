"""Prefill/decode disaggregation, stock vs the plugin on decode: the same shared-document
workload through sglang-router in front of a prefill and a decode server (CPU, the embedded
model, `harness.pd`).

    .venv/bin/python -m benchmarks.server.pd         # ~16 min on 2 cores; needs `make pd-deps`

Two configurations, one after the other, each a fresh pair behind a fresh router:

- `stock`: decode without the plugin (not loaded); prefill with the plugin installed and no
  `--compaction-endpoint`, for its CPU switch only (SGLang's Mooncake sender needs CUDA
  otherwise, see `sglang_ext.adapter.pd`);
- `plugin`: the same prefill; decode with the plugin against a real `compactor serve`
  (`--compaction-ratio`, the plugin's default method and queries).

Both decode servers keep their own radix cache (`--disaggregation-decode-enable-radix-cache`),
so both send prefill only what decode does not hold. Per configuration:

1. warm-up: each document's first two questions, one after the other (on `plugin` the second
   sends the document to the service); `plugin` then waits for every install;
2. the pool of decode, read from the server when idle (`harness.pool`: pool - free): the KV
   slots held for the documents;
3. measured pass: every document's other questions, all at once, streamed through the
   router: request throughput, TTFT p50 / p95, the decode step as the client sees it
   ((latency - TTFT) / (tokens - 1), mean), decode's pool sampled every second (peak slots
   held, most requests running), and the KV prefill sent (its `kv_transfer_total_mb`);
4. the mixed numerics (`plugin`: suffix KV from prefill over the full prefix, decode over the
   compacted one): `stock`'s answers of the measured pass scored teacher-forced through the
   pair (`harness.pd.pd_teacher_forced`), and on two single servers, stock and the plugin with
   the same fit (same service, spec and warm-up). Reported: the mean |log-prob gap| over the
   tokens decode scores (all but each answer's first), PD plugin vs PD stock beside single
   plugin vs single stock (and PD stock vs single stock, the measurement's floor), and the
   share of those tokens that are each deployment's top-1.

Writes `benchmarks/results/pd.json` (command, commit, machine, date inside).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, add_options, script_parser
from harness.forced import Forced, logprob_gap, teacher_forced, top1_share
from harness.launch import CompactorService, SGLangServer, start_all
from harness.pd import PDRouter, pd_pair, pd_teacher_forced
from harness.pool import PoolSampler, pool_size, read_pool
from harness.workload import (
    Timed,
    compaction_args,
    document,
    metric,
    percentile,
    prompt,
    prompt_ids,
    questions,
    stream_all,
    wait_for_compactions,
)
from sglang_ext.config import PLUGIN_SPEC

CONFIGS = ("stock", "plugin")
SENT_MB = "sglang:kv_transfer_total_mb_sum"
ROWS = "sglang:compaction_compacted_rows_total"
WARM_QUESTIONS = 2  # the plugin's trigger: a path shared by this many different questions


def timing_summary(results: list[Timed], wall_s: float) -> dict[str, float]:
    """Throughput, TTFT p50 / p95 and the mean decode step of one measured pass."""
    steps = [(r.latency_s - r.ttft_s) / (len(r.output_ids) - 1)
             for r in results if len(r.output_ids) > 1]  # fmt: skip
    ttft = [r.ttft_s for r in results]
    return {
        "requests": len(results),
        "wall_s": wall_s,
        "request_throughput": len(results) / wall_s,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "decode_step_s": statistics.mean(steps) if steps else float("nan"),
    }


@dataclass
class Scored:
    """A measured pass's prompts (token ids), the answers scored after them, and their
    teacher-forced scoring through the pair."""

    ids: list[list[int]]
    answers: list[list[int]]
    forced: list[Forced]


def _docs(args: Any) -> list[str]:
    return [document(args.sentences, index=i) for i in range(args.docs)]


def _plugin_args(args: Any, endpoint: str) -> list[str]:
    return compaction_args(endpoint, args.ratio, PLUGIN_SPEC.method, min_hits=WARM_QUESTIONS,
                           timeout_s=args.timeout)  # fmt: skip


def _warm_up(server: Any, docs: list[str]) -> None:
    """Each document's first questions, one after the other (the plugin's trigger)."""
    for doc in docs:
        for q in questions()[:WARM_QUESTIONS]:
            server.generate(prompt(doc, q), max_new_tokens=4)


def run_config(
    name: str, args: Any, model: Path, logs: Path, endpoint: str, scored: list[list[int]] | None
) -> tuple[dict[str, Any], Scored]:
    """One configuration's pair, router, warm-up, measured pass and scoring of `scored`
    (answers to the measured prompts; None: this pass's own answers)."""
    docs = _docs(args)
    qs = questions()
    decode_args: list[str] = ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if name == "plugin":
        decode_args += _plugin_args(args, endpoint)
    prefill, decode, bootstrap = pd_pair(
        model, logs / name, decode_args=decode_args, max_total_tokens=args.max_total_tokens
    )
    decode.plugin = name == "plugin"  # stock: the plugin not loaded on decode
    (logs / name).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        start_all(stack, [prefill, decode])
        router = PDRouter(prefill.url, bootstrap, decode.url, logs / name / "router.log")
        start_all(stack, [router])
        print(
            f"== {name}: warm-up ({args.docs} documents x {WARM_QUESTIONS} questions)", flush=True
        )
        _warm_up(router, docs)
        ended = time.monotonic()
        if name == "plugin":
            wait_for_compactions(decode, args.docs, args.timeout)
            ended = time.monotonic()
        pool = pool_size(decode.url)
        idle = read_pool(decode.url, pool, idle_since=ended)
        prompts = [prompt(doc, q) for doc in docs for q in qs[WARM_QUESTIONS:]]
        print(f"== {name}: measured pass ({len(prompts)} requests at once)", flush=True)
        sent_before = metric(prefill, SENT_MB)
        with PoolSampler(decode.url, pool) as sampler:
            results, wall = stream_all(router.url, prompts, args.max_new_tokens)
        time.sleep(2.0)  # prefill records a transfer when it ends
        sent = metric(prefill, SENT_MB) - sent_before
        plugin_gauges = {
            n: metric(decode, f"sglang:compaction_{n}")
            for n in ("installed_total", "fallbacks_total", "logical_tokens", "physical_tokens")
        } if name == "plugin" else None  # fmt: skip
        print(f"== {name}: scoring answers teacher-forced through the pair", flush=True)
        ids = [prompt_ids(decode, p) for p in prompts]
        answers = [r.output_ids for r in results] if scored is None else scored
        rows_before = metric(decode, ROWS)
        forced = [pd_teacher_forced(router, p, a) for p, a in zip(ids, answers, strict=True)]
        compacted_rows = metric(decode, ROWS) - rows_before
    row = {
        "config": name,
        "decode_pool": pool,
        "decode_idle": idle.as_dict(),
        "decode_busy": sampler.as_dict(),
        "prefill_sent_mb": sent,
        "plugin": plugin_gauges,
        **timing_summary(results, wall),
        "answers": [r.text for r in results],
        "scoring_compacted_rows": compacted_rows,
        "unscored_tokens": sum(math.isnan(x) for f in forced for x in f.logprobs),
    }
    return row, Scored(ids, answers, forced)


def run_single(
    args: Any, model: Path, logs: Path, endpoint: str, ids: list[list[int]],
    answers: list[list[int]],
) -> dict[str, list[Forced]]:  # fmt: skip
    """A single stock server and a single plugin server (the same fit: same service, spec and
    warm-up) score `answers` after `ids` teacher-forced."""
    servers = {
        "stock": SGLangServer(model, logs / "single-stock.log", plugin=False,
                              max_total_tokens=args.max_total_tokens),
        "plugin": SGLangServer(model, logs / "single-plugin.log",
                               max_total_tokens=args.max_total_tokens,
                               extra_args=[*_plugin_args(args, endpoint), "--enable-metrics"]),
    }  # fmt: skip
    print("== single servers: warm-up and scoring", flush=True)
    with contextlib.ExitStack() as stack:
        start_all(stack, list(servers.values()))
        for srv in servers.values():
            _warm_up(srv, _docs(args))
        wait_for_compactions(servers["plugin"], args.docs, args.timeout)
        return {
            name: [teacher_forced(srv, p, a) for p, a in zip(ids, answers, strict=True)]
            for name, srv in servers.items()
        }


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_options(
        p,
        model=("smollm2-135m", "known model name or checkpoint directory"),
        docs=(2, "shared documents"),
        sentences=(60, "sentences per document (~17 tokens each)"),
        ratio=(PLUGIN_SPEC.ratio, "the plugin's --compaction-ratio"),
        max_new_tokens=(32, "tokens generated per measured request"),
        max_total_tokens=(8192, "KV pool size of each server"),
        timeout=(400.0, "seconds to wait for the installs"),
        json=(str(RESULTS / "pd.json"), "where the results go"),
    )
    args = p.parse_args(argv)
    from compactor.models import prepare_model
    from harness.provenance import provenance

    prov = provenance(argv, module="benchmarks.server.pd")
    model = prepare_model(args.model)
    logs = Path(tempfile.mkdtemp(prefix="compaction-pd-"))
    print(f"logs under {logs}", flush=True)
    t0 = time.perf_counter()
    rows = []
    with contextlib.ExitStack() as stack:
        svc = stack.enter_context(CompactorService(args.model, logs / "compactor.log"))
        forced: dict[str, list[Forced]] = {}
        stock_answers: list[list[int]] | None = None  # scored on every deployment
        for name in CONFIGS:
            row, scored = run_config(name, args, model, logs, svc.endpoint, stock_answers)
            rows.append(row)
            forced[f"pd_{name}"], stock_answers = scored.forced, scored.answers
        answers = scored.answers
        single = run_single(args, model, logs, svc.endpoint, scored.ids, answers)
    forced.update({f"single_{n}": f for n, f in single.items()})
    stock, plugin = rows
    out = {
        "provenance": prov,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "plugin_spec": PLUGIN_SPEC.to_dict(),
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "decode_slots_ratio": stock["decode_idle"]["held"] / max(1, plugin["decode_idle"]["held"]),
        "logprobs": {
            "answers": len(answers),
            "scored_tokens": sum(len(a) - 1 for a in answers),
            "gap_pd_plugin_vs_pd_stock": logprob_gap(forced["pd_plugin"], forced["pd_stock"], 1),
            "gap_single_plugin_vs_single_stock": logprob_gap(
                forced["single_plugin"], forced["single_stock"], 1
            ),
            "gap_pd_stock_vs_single_stock": logprob_gap(
                forced["pd_stock"], forced["single_stock"], 1
            ),
            "top1": {n: top1_share(f, answers, 1) for n, f in forced.items()},
        },
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"{r['config']:7} decode slots held {r['decode_idle']['held']:5d}  "
              f"peak {r['decode_busy']['peak_held']:5d}  running <= {r['decode_busy']['max_running']}"
              f"  req/s {r['request_throughput']:.2f}  TTFT p50 {r['ttft_p50_s']:.2f} s  "
              f"step {r['decode_step_s'] * 1000:.0f} ms  prefill sent {r['prefill_sent_mb']:.1f} MB")  # fmt: skip
    lp = out["logprobs"]
    print(f"mean |log-prob gap| over {lp['scored_tokens']} tokens: PD plugin vs PD stock "
          f"{lp['gap_pd_plugin_vs_pd_stock']:.3f}, single plugin vs single stock "
          f"{lp['gap_single_plugin_vs_single_stock']:.3f} (PD stock vs single stock "
          f"{lp['gap_pd_stock_vs_single_stock']:.3f}); top-1 {lp['top1']}")  # fmt: skip
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
