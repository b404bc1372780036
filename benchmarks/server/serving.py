"""Serving: stock SGLang vs compacted shared prefixes under SGLang's own load generator.

    python -m benchmarks.server.serving [--max-total-tokens 3072] [--ratios 0.1,0.2] [--groups 4]

Workload: `python -m sglang.bench_serving --dataset-name generated-shared-prefix` (groups
of prompts sharing a long random system prompt, all sent at once). For stock and for each
ratio, a real SGLang server with the same `--max-total-tokens` (the compaction ones pointed
at one `compactor serve` with Ray workers):

1. warm-up, one server after the other: two prompts of each group, in order (each system
   prompt enters the radix cache; on compaction servers the second request's branch sends
   it to the service, with both questions as reference queries); the pool is read right
   after (compaction servers: before the installs), then again once the installs landed;
2. measured run, one server at a time: bench_serving over the whole dataset (its generator
   caches the prompts by seed, so every server gets the same ones), the pool sampled every
   second; the pool is read once more after it;
3. figures, all read from the servers (`harness.pool`): KV slots held (pool - free) after
   warm-up and installs, at the peak of the run and after it; the most requests running /
   queued at once (the scheduler's `#running-req` log and SGLang's /metrics); request
   throughput, output tokens/s, TTFT p50/p95 (bench_serving); and agreement of each
   answer's first 16 greedy tokens with stock's, on the warm-up prompts (the compaction's
   follow-ups) and on the prompts it never saw.

With `--cold` there is no warm-up: each server meets the workload with an empty cache,
so compactions are asked, computed and installed during the measured run, while the small
pool churns (an original prefix may be evicted before its result arrives: the plugin
installs it all the same). Each record then also holds the plugin's counters after the run:
compactions requested and installed (onto an evicted original: `installed_evicted`), and the
results not installed, by reason. Writes serving_cold_<max-total-tokens>.json.

Writes benchmarks/results/serving_<max-total-tokens>.json (with the command, commit,
machine and date) and .png. Random-token prompts measure memory and scheduling; agreement
on them says whether the compacted server computes what stock computes, not answer quality.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options

_RUNNING = re.compile(r"#running-req: (\d+)")


def gsp_args(a: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(a.groups),
        "--gsp-prompts-per-group", str(a.prompts_per_group),
        "--gsp-system-prompt-len", str(a.system_prompt_len),
        "--gsp-question-len", str(a.question_len),
        "--gsp-output-len", str(a.output_len),
        "--seed", str(a.seed),
    ]  # fmt: skip


def dataset(a: argparse.Namespace, model: Path) -> list[Any]:
    """The prompts bench_serving will send (generated once, cached on disk by SGLang)."""
    import random

    import numpy as np
    from sglang.benchmark.datasets.generated_shared_prefix import (
        sample_generated_shared_prefix_requests,
    )
    from transformers import AutoTokenizer

    # bench_serving seeds both generators with --seed before generating
    random.seed(a.seed)
    np.random.seed(a.seed)
    return sample_generated_shared_prefix_requests(
        num_groups=a.groups,
        prompts_per_group=a.prompts_per_group,
        system_prompt_len=a.system_prompt_len,
        question_len=a.question_len,
        output_len=a.output_len,
        range_ratio=1.0,
        tokenizer=AutoTokenizer.from_pretrained(str(model)),
        seed=a.seed,
    )


def warmup_prompts(rows: list[Any], per_group: int = 2) -> list[list[str]]:
    """`per_group` prompts of each group (grouped by their system prompt's first characters)."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        groups.setdefault(row.prompt[:200], []).append(row.prompt)
    return [ps[:per_group] for ps in groups.values()]


def server_for(
    name: str,
    a: argparse.Namespace,
    model: Path,
    logs: Path,
    endpoint: str | None,
    ratio: float | None,
) -> Any:
    from harness.launch import SGLangServer
    from harness.workload import compaction_args

    extra = ["--enable-metrics", "--decode-log-interval", "1"]
    if ratio is not None:
        assert endpoint is not None
        extra += compaction_args(
            endpoint, ratio, a.method, min_hits=2, timeout_s=a.compaction_timeout
        )
    log = logs / f"sglang-{name.replace(' ', '-')}.log"
    return SGLangServer(
        model, log, max_total_tokens=a.max_total_tokens, extra_args=extra, plugin=ratio is not None
    )


def warm_up(name: str, srv: Any, rows: list[Any]) -> float:
    """Two prompts per group, in order. Returns `time.monotonic()` at the end."""
    t0 = time.perf_counter()
    for prompts in warmup_prompts(rows):
        for p in prompts:
            srv.generate(p, max_new_tokens=1)
    print(f"  [{name}] warm-up done in {time.perf_counter() - t0:.0f} s", flush=True)
    return time.monotonic()


def before_install(srv: Any, idle_since: float) -> Any:
    """The pool right after warm-up, if no compaction has landed yet (else None)."""
    from harness.pool import read_pool
    from harness.workload import metric

    reading = read_pool(srv.url, idle_since=idle_since)
    return reading if metric(srv, "sglang:compaction_installed_total") == 0 else None


def measure(
    name: str,
    srv: Any,
    a: argparse.Namespace,
    model: Path,
    logs: Path,
    ratio: float | None,
) -> dict[str, Any]:
    """bench_serving against one server, the pool sampled meanwhile; the scheduler's log
    gives the most running requests."""
    from harness.pool import PoolSampler, pool_size

    log_offset = Path(srv.log_path).stat().st_size
    out_file = logs / f"bench-{name.replace(' ', '-')}.jsonl"
    cmd = [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", "sglang", "--base-url", srv.url,
        "--model", str(model), "--tokenizer", str(model),
        *gsp_args(a),
        "--request-rate", "inf", "--warmup-requests", "0", "--disable-tqdm",
        "--output-file", str(out_file), "--output-details",
    ]  # fmt: skip
    t1 = time.perf_counter()
    with PoolSampler(srv.url, pool=pool_size(srv.url)) as sampler:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    end = time.monotonic()
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_serving failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    with open(srv.log_path, "rb") as f:
        f.seek(log_offset)
        running = [int(m) for m in _RUNNING.findall(f.read().decode(errors="replace"))]
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    print(f"  [{name}] bench_serving done in {time.perf_counter() - t1:.0f} s", flush=True)
    return {
        "config": name,
        "ratio": ratio,
        "max_total_tokens": a.max_total_tokens,
        "max_running_requests": max(running, default=0),
        "run": sampler.as_dict(),
        "completed": result["completed"],
        "requests_per_s": result["request_throughput"],
        "output_tokens_per_s": result["output_throughput"],
        "ttft_p50_s": result["median_ttft_ms"] / 1e3,
        "ttft_p90_s": result["p90_ttft_ms"] / 1e3,
        "ttft_p95_s": result["p95_ttft_ms"] / 1e3,
        "e2e_p50_s": result["median_e2e_latency_ms"] / 1e3,
        "duration_s": result["duration"],
        "generated_texts": result["generated_texts"],
        "_end": end,
    }


def add_counters(record: dict[str, Any], srv: Any) -> None:
    """The plugin's compaction counters after a run (a cold one: they moved during it)."""
    from harness.pool import fetch_metrics, labelled

    got = fetch_metrics(srv.url)
    for name in ("requested", "installed", "installed_evicted", "fallbacks"):
        record[f"compactions_{name}"] = int(got.get(f"sglang:compaction_{name}_total", 0))
    rejected = labelled(srv.url, "sglang:compaction_results_rejected_total", "reason")
    record["results_rejected"] = {k: int(v) for k, v in rejected.items()}


def add_pool(record: dict[str, Any], readings: dict[str, Any]) -> None:
    """Store the server-read pool readings and the table's KV figures in `record`."""
    record["pool"] = {k: None if v is None else v.as_dict() for k, v in readings.items()}
    installed = readings["installed"]
    record["pool_slots"] = installed.pool
    record["kv_slots_held"] = installed.held  # what the measured run starts from
    record["kv_slots_compacted"] = installed.compacted
    record["kv_slots_held_after_run"] = readings["after"].held
    record["kv_slots_held_peak"] = record["run"]["peak_held"]


def add_agreement(
    records: list[dict[str, Any]], rows: list[Any], model: Path, tokens: int = 16
) -> None:
    """Share of answers whose first `tokens` tokens equal stock's, on the warm-up prompts
    (the compaction's follow-ups: "seen") and on the others ("unseen")."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    seen_prompts = {p for group in warmup_prompts(rows) for p in group}
    seen = [row.prompt in seen_prompts for row in rows]

    def head(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"][:tokens])

    stock = [head(t) for t in records[0]["generated_texts"]]
    for r in records:
        texts = r["generated_texts"]
        if len(texts) != len(rows):
            raise RuntimeError(f"{r['config']}: {len(texts)} answers for {len(rows)} prompts")
        same = [head(t) == s for t, s in zip(texts, stock)]
        for label, want in (("seen", True), ("unseen", False)):
            picked = [x for x, k in zip(same, seen) if k is want]
            r[f"agreement_{label}"] = sum(picked) / max(len(picked), 1)
            r[f"prompts_{label}"] = len(picked)


def print_table(records: list[dict[str, Any]]) -> None:
    base = records[0]
    head = (
        f"{'config':<10} {'KV held':>7} {'less KV':>7} {'peak':>5} {'after':>5} "
        f"{'max running':>11} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>8} {'TTFT p95':>8} "
        f"{'agree16 seen/unseen':>19}"
    )
    print(head)
    for r in records:
        agree = f"{r['agreement_seen']:.2f} / {r['agreement_unseen']:.2f}"
        print(
            f"{r['config']:<10} {r['kv_slots_held']:>7d} "
            f"{base['kv_slots_held'] / max(r['kv_slots_held'], 1):>6.1f}x "
            f"{r['kv_slots_held_peak']:>5d} {r['kv_slots_held_after_run']:>5d} "
            f"{r['max_running_requests']:>11d} {r['requests_per_s']:>6.3f} "
            f"{r['output_tokens_per_s']:>9.2f} {r['ttft_p50_s']:>8.2f} {r['ttft_p95_s']:>8.2f} "
            f"{agree:>19}"
        )
    print(
        f"KV held = slots in use in each server's {base['pool_slots']}-slot pool (pool - free, "
        "read from the server) after warm-up and installs; peak / after: during / after the run."
    )


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    from harness.demo import bar_panels

    panels = [
        ("kv_slots_held", "KV slots held after warm-up"),
        ("kv_slots_held_peak", "KV slots held, peak of the run"),
        ("max_running_requests", "max requests running at once"),
        ("requests_per_s", "requests / s"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    ]
    bar_panels(records, panels, path, title)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap, model="smollm2-135m", groups=4, prompts_per_group=8, system_prompt_len=1024)
    add_options(ap, question_len=32, output_len=32, seed=1, max_total_tokens=3072, ratios="0.1,0.2")
    add_options(ap, method="am-highest", workers=1)
    ap.add_argument("--in-process", action="store_true", help="compactor workers as threads")
    add_options(ap, compaction_timeout=600.0, out=ROOT / "benchmarks" / "results")
    ap.add_argument("--cold", action="store_true", help="no warm-up: compactions land mid-run")
    a = ap.parse_args()
    ratios = [float(r) for r in a.ratios.split(",") if r]

    import signal

    from compactor.models import prepare_model
    from harness.launch import CompactorService, start_all
    from harness.pool import read_pool
    from harness.provenance import provenance
    from harness.workload import wait_for_compactions

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    prov = provenance()  # the code that runs: recorded before anything else
    model = prepare_model(a.model)
    logs = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    rows = dataset(a, model)
    print(f"{len(rows)} prompts in {a.groups} groups; logs under {logs}", flush=True)
    configs = [("stock", None), *((f"ratio {r}", r) for r in ratios)]
    with contextlib.ExitStack() as stack:
        endpoint = None
        if ratios:
            svc = CompactorService(
                a.model, logs / "compactor.log", workers=a.workers, in_process=a.in_process
            )
            start_all(stack, [svc])
            endpoint = svc.endpoint
        servers = [server_for(name, a, model, logs, endpoint, r) for name, r in configs]
        start_all(stack, servers)
        readings: list[dict[str, Any]] = [{"before": read_pool(s.url)} for s in servers]
        if a.cold:  # each server meets the workload with an empty cache, one at a time
            records = []
            for (name, r), srv, rd in zip(configs, servers, readings):
                records.append(measure(name, srv, a, model, logs, r))
                rd["installed"] = rd["after"] = read_pool(
                    srv.url, idle_since=records[-1].pop("_end")
                )
                add_pool(records[-1], rd)
                if r is not None:
                    add_counters(records[-1], srv)
            return finish(a, records, rows, model, prov, t0, "serving_cold")
        # one server busy at a time (each binds its threads to every core); compactions run
        # in the service while the next server warms up
        ends = []
        for (name, r), srv, rd in zip(configs, servers, readings):
            ends.append(warm_up(name, srv, rows))
            if r is not None:
                rd["warm"] = before_install(srv, ends[-1])
        infos: list[dict[str, float]] = [{} for _ in configs]
        for (name, r), srv, rd, info, end in zip(configs, servers, readings, infos, ends):
            if r is not None:
                info |= wait_for_compactions(srv, a.groups, a.compaction_timeout, progress=False)
            rd["installed"] = installed = read_pool(srv.url, idle_since=end)
            rd.setdefault("warm", installed)
            warm = rd["warm"]
            print(
                f"  [{name}] compactions installed {info.get('installed_total', 0):.0f}, "
                f"fallbacks {info.get('fallbacks_total', 0):.0f}; KV slots held "
                f"{'?' if warm is None else warm.held} after warm-up, {installed.held} after "
                f"the installs ({installed.compacted} in compacted nodes), pool {installed.pool}",
                flush=True,
            )
        records = [
            measure(name, srv, a, model, logs, r) for (name, r), srv in zip(configs, servers)
        ]
        for rec, srv, rd, info in zip(records, servers, readings, infos):
            rd["after"] = read_pool(srv.url, idle_since=rec.pop("_end"))
            add_pool(rec, rd)
            rec["compactions_installed"] = info.get("installed_total")
            rec["compaction_fallbacks"] = info.get("fallbacks_total")
    return finish(a, records, rows, model, prov, t0, "serving")


def finish(a: argparse.Namespace, records: list[dict[str, Any]], rows: list[Any], model: Path,
           prov: dict[str, Any], t0: float, stem_name: str) -> int:  # fmt: skip
    """Agreement with stock, the table, the JSON and the plot."""
    add_agreement(records, rows, model)
    print(
        f"\n{a.groups} groups x {a.prompts_per_group} prompts, system prompt {a.system_prompt_len} tokens, "
        f"question {a.question_len}, output {a.output_len}, --max-total-tokens {a.max_total_tokens} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    print_table(records)
    for r in records:
        if "compactions_requested" in r:
            print(f"{r['config']}: compactions requested {r['compactions_requested']}, installed "
                  f"{r['compactions_installed']} ({r['compactions_installed_evicted']} onto an "
                  f"evicted original), rejected {r['results_rejected'] or 'none'}")  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{stem_name}_{a.max_total_tokens}"
    meta = {
        "provenance": prov,
        "total_s": time.perf_counter() - t0,
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    Path(f"{stem}.json").write_text(json.dumps({"records": records, **meta}, indent=1))
    plot(
        records,
        Path(f"{stem}.png"),
        f"generated-shared-prefix, --max-total-tokens {a.max_total_tokens} (SmolLM2-135M, CPU)",
    )
    print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
