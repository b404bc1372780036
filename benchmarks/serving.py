"""Serving: stock SGLang vs compacted shared prefixes under SGLang's own load generator.

    python benchmarks/serving.py [--max-total-tokens 3072] [--ratios 0.1,0.2] [--groups 4]

Workload: `python -m sglang.bench_serving --dataset-name generated-shared-prefix` (groups
of prompts sharing a long random system prompt, all sent at once). For stock and for each
ratio, a real SGLang server with the same `--max-total-tokens` (the compaction ones pointed
at one `compactor serve` with Ray workers):

1. warm-up, one server after the other: two prompts of each group, in order (each system
   prompt enters the radix cache; on compaction servers the second request's branch sends
   it to the service, with both questions as reference queries), then wait for the
   installs;
2. measured run, one server at a time: bench_serving over the whole dataset (its generator
   caches the prompts by seed, so every server gets the same ones);
3. figures: KV slots held by the shared prefixes after warm-up (stock: one slot per shared
   token, measured as cached tokens; compaction: the plugin's physical-slot gauge), the
   most requests the scheduler ran at once (its `#running-req` log, every decode step),
   request throughput, output tokens/s, TTFT p50/p95.

Writes benchmarks/results/serving_<max-total-tokens>.json and .png. Random-token prompts
measure memory and scheduling only; answer quality is the demo's and quality.py's job.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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

    extra = ["--enable-metrics", "--sleep-on-idle", "--decode-log-interval", "1"]
    if ratio is not None:
        assert endpoint is not None
        extra += compaction_args(
            endpoint, ratio, a.method, min_hits=2, timeout_s=a.compaction_timeout
        )
    log = logs / f"sglang-{name.replace(' ', '-')}.log"
    return SGLangServer(model, log, max_total_tokens=a.max_total_tokens, extra_args=extra)


def warm_up(name: str, srv: Any, ratio: float | None, rows: list[Any]) -> dict[str, float]:
    """Two prompts per group, in order. Returns the shared-prefix tokens cached."""
    t0 = time.perf_counter()
    shared = []
    for prompts in warmup_prompts(rows):
        outs = [srv.generate(p, max_new_tokens=1) for p in prompts]
        shared.append(int(outs[-1]["meta_info"]["cached_tokens"]))
    info = {"shared_prefix_tokens": float(sum(shared)), "groups": float(len(shared))}
    info["kv_slots_held"] = info["shared_prefix_tokens"]  # stock: one slot per shared token
    info["warmup_s"] = time.perf_counter() - t0
    print(f"  [{name}] warm-up done in {info['warmup_s']:.0f} s", flush=True)
    return info


def wait_installs(name: str, srv: Any, info: dict[str, float], timeout_s: float) -> None:
    """Wait for the server's compactions; held slots become the physical ones (mutates info)."""
    from harness.workload import wait_for_compactions

    info |= wait_for_compactions(srv, int(info["groups"]), timeout_s, progress=False)
    info["kv_slots_held"] = info["physical_tokens"] + max(
        0.0, info["shared_prefix_tokens"] - info["logical_tokens"]
    )
    print(
        f"  [{name}] compactions installed {info['installed_total']:.0f}, fallbacks "
        f"{info['fallbacks_total']:.0f}; shared-prefix KV slots {info['kv_slots_held']:.0f} "
        f"(stock {info['shared_prefix_tokens']:.0f})",
        flush=True,
    )


def measure(
    name: str,
    srv: Any,
    a: argparse.Namespace,
    model: Path,
    logs: Path,
    ratio: float | None,
    info: dict[str, float],
) -> dict[str, Any]:
    """bench_serving against one server; the scheduler's log gives the most running requests."""
    log_offset = Path(srv.log_path).stat().st_size
    out_file = logs / f"bench-{name.replace(' ', '-')}.jsonl"
    cmd = [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", "sglang", "--base-url", srv.url,
        "--model", str(model), "--tokenizer", str(model),
        *gsp_args(a),
        "--request-rate", "inf", "--warmup-requests", "0", "--disable-tqdm",
        "--output-file", str(out_file),
    ]  # fmt: skip
    t1 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
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
        "shared_prefix_tokens": info["shared_prefix_tokens"],
        "kv_slots_held": info["kv_slots_held"],
        "compactions_installed": info.get("installed_total"),
        "compaction_fallbacks": info.get("fallbacks_total"),
        "max_running_requests": max(running, default=0),
        "completed": result["completed"],
        "requests_per_s": result["request_throughput"],
        "output_tokens_per_s": result["output_throughput"],
        "ttft_p50_s": result["median_ttft_ms"] / 1e3,
        "ttft_p95_s": result["p95_ttft_ms"] / 1e3,
        "e2e_p50_s": result["median_e2e_latency_ms"] / 1e3,
        "duration_s": result["duration"],
        "warmup_s": info["warmup_s"],
    }


def print_table(records: list[dict[str, Any]]) -> None:
    base = records[0]
    head = f"{'config':<10} {'KV slots held':>13} {'less KV':>7} {'max running':>11} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>8} {'TTFT p95':>8}"
    print(head)
    for r in records:
        print(
            f"{r['config']:<10} {r['kv_slots_held']:>13.0f} "
            f"{base['kv_slots_held'] / max(r['kv_slots_held'], 1):>6.1f}x {r['max_running_requests']:>11d} "
            f"{r['requests_per_s']:>6.3f} {r['output_tokens_per_s']:>9.2f} {r['ttft_p50_s']:>8.2f} {r['ttft_p95_s']:>8.2f}"
        )


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    from harness.demo import bar_panels

    panels = [
        ("kv_slots_held", "KV slots held by shared prefixes"),
        ("max_running_requests", "max requests running at once"),
        ("requests_per_s", "requests / s"),
        ("output_tokens_per_s", "output tokens / s"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    ]
    bar_panels(records, panels, path, title)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-total-tokens", type=int, default=3072)
    ap.add_argument("--ratios", default="0.1,0.2")
    ap.add_argument("--method", default="am-highest")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--in-process", action="store_true", help="compactor workers as threads")
    ap.add_argument("--compaction-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    ratios = [float(r) for r in a.ratios.split(",") if r]

    import signal

    from compactor.models import prepare_model
    from harness.launch import CompactorService, start_all

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
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
        # one server busy at a time (each binds its threads to every core); compactions run
        # in the service while the next server warms up
        infos = [warm_up(name, srv, r, rows) for (name, r), srv in zip(configs, servers)]
        for (name, r), srv, info in zip(configs, servers, infos):
            if r is not None:
                wait_installs(name, srv, info, a.compaction_timeout)
        records = [
            measure(name, srv, a, model, logs, r, info)
            for (name, r), srv, info in zip(configs, servers, infos)
        ]
    print(
        f"\n{a.groups} groups x {a.prompts_per_group} prompts, system prompt {a.system_prompt_len} tokens, "
        f"question {a.question_len}, output {a.output_len}, --max-total-tokens {a.max_total_tokens} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    print_table(records)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"serving_{a.max_total_tokens}"
    Path(f"{stem}.json").write_text(
        json.dumps({"records": records, "args": {k: str(v) for k, v in vars(a).items()}}, indent=1)
    )
    plot(
        records,
        Path(f"{stem}.png"),
        f"generated-shared-prefix, --max-total-tokens {a.max_total_tokens} (SmolLM2-135M, CPU)",
    )
    print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
