"""`make demo`: stock SGLang vs SGLang + `compactor serve` on a shared-document workload.

On the embedded SmolLM2-135M model and CPU:

1. prepare the checkpoint (a no-op when prepared) and start `compactor serve` (Ray workers);
2. start a real SGLang server for stock and for each compaction ratio (the compaction ones
   with `--compaction-endpoint` pointing at the service), all at once, then
   - warm-up, one server after the other: ask each document's questions once, in order
     (the documents enter the radix cache; on compaction servers the last question's hit
     sends the document to the service, with the questions as reference queries), then
     wait for the installs;
   - measured pass, one server at a time: every question of every document at once,
     streamed: accuracy on the needle questions, agreement with stock's greedy tokens,
     throughput, TTFT p50/p95, and the KV slots held by the shared documents (stock: their
     tokens; compaction: the plugin's physical-slot gauge plus the uncompacted margin);
3. print one table, write JSON + PNG, and stop every process (also on Ctrl-C or failure).

Every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.launch import CompactorService, SGLangServer, start_all
from harness.workload import (
    compaction_args,
    document,
    needle_correct,
    prompt,
    questions,
    stream_all,
    wait_for_compactions,
)

NEEDLE_COUNT = 3


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def warm_up(
    name: str, server: SGLangServer, docs: list[str], max_new_tokens: int
) -> dict[str, float]:
    """Ask each document's questions once, in order (uncompacted: no install happens before
    the last one). Returns the seconds it took and the shared-prefix tokens: what the last
    question of each document found cached, summed."""
    t0 = time.perf_counter()
    shared = 0
    for d, doc in enumerate(docs):
        for q in questions():
            out = server.generate(prompt(doc, q), max_new_tokens=max_new_tokens)
        shared += int(out["meta_info"]["cached_tokens"])
        print(f"  [{name}] warm-up: document {d} asked {len(questions())} questions", flush=True)
    return {"warmup_s": time.perf_counter() - t0, "shared_prefix_tokens": float(shared)}


def measure(
    name: str,
    server: SGLangServer,
    docs: list[str],
    ratio: float | None,
    max_new_tokens: int,
    gauges: dict[str, float],
) -> dict[str, Any]:
    """The measured pass: every question of every document at once; returns a record."""
    qs = questions()
    prompts = [prompt(doc, q) for doc in docs for q in qs]
    results, wall = stream_all(server.url, prompts, max_new_tokens)
    print(f"  [{name}] measured pass: {len(prompts)} requests at once in {wall:.1f} s", flush=True)
    shared = gauges["shared_prefix_tokens"]
    held = shared  # stock: one slot per shared token (page size 1)
    if ratio is not None:  # compacted: the physical slots, plus what stays uncompacted (margin)
        held = gauges["physical_tokens"] + max(0.0, shared - gauges["logical_tokens"])
    correct = [
        needle_correct(q, r.text, d)
        for d in range(len(docs))
        for q, r in zip(qs, results[d * len(qs) : (d + 1) * len(qs)])
    ]
    graded = [c for c in correct if c is not None]
    ttfts = [r.ttft_s for r in results]
    return {
        "config": name,
        "ratio": ratio,
        "documents": len(docs),
        "requests": len(results),
        "shared_prefix_tokens": shared,
        "kv_slots_held": held,
        "compactions_installed": gauges.get("installed_total"),
        "compaction_fallbacks": gauges.get("fallbacks_total"),
        "warmup_s": gauges["warmup_s"],
        "needle_accuracy": sum(graded) / len(graded),
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": sum(len(r.output_ids) for r in results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": _percentile(ttfts, 0.95),
        "answers": [{"text": r.text, "output_ids": r.output_ids} for r in results],
    }


def add_agreement(records: list[dict[str, Any]], tokens: int = 16) -> None:
    """Fraction of answers whose first `tokens` greedy tokens equal stock's."""
    stock = records[0]["answers"]
    for r in records:
        same = [
            a["output_ids"][:tokens] == s["output_ids"][:tokens]
            for a, s in zip(r["answers"], stock)
        ]
        r["agreement_with_stock"] = sum(same) / len(same)


def print_table(records: list[dict[str, Any]]) -> None:
    cols = [
        ("config", "{:<12}"),
        ("KV slots held", "{:>13.0f}"),
        ("less KV", "{:>7}"),
        ("needles", "{:>7.2f}"),
        ("agree16", "{:>7.2f}"),
        ("req/s", "{:>5.2f}"),
        ("tok/s", "{:>5.1f}"),
        ("TTFT p50", "{:>8.2f}"),
        ("TTFT p95", "{:>8.2f}"),
    ]
    print(" | ".join(f"{c:<12}" if i == 0 else c for i, (c, _) in enumerate(cols)))
    base = records[0]["kv_slots_held"]
    for r in records:
        vals = [
            r["config"],
            r["kv_slots_held"],
            f"{base / max(r['kv_slots_held'], 1):.1f}x",
            r["needle_accuracy"],
            r["agreement_with_stock"],
            r["requests_per_s"],
            r["output_tokens_per_s"],
            r["ttft_p50_s"],
            r["ttft_p95_s"],
        ]
        print(" | ".join(f.format(v) for (_, f), v in zip(cols, vals)))


def bar_panels(
    records: list[dict[str, Any]], panels: list[tuple[str, str]], path: Path, title: str
) -> None:
    """One bar chart per (record key, panel title), configs on x, stock grey; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in records]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, [r[key] for r in records], color=["0.5"] + ["C0"] * (len(records) - 1))
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    panels = [
        ("kv_slots_held", "KV slots held by shared docs"),
        ("needle_accuracy", "needle accuracy"),
        ("requests_per_s", "requests / s"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p95_s", "TTFT p95 (s)"),
    ]
    title = "stock SGLang vs compacted shared prefixes (SmolLM2-135M, CPU)"
    bar_panels(records, panels, path, title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="known model name")
    p.add_argument("--docs", type=int, default=2, help="shared documents (up to 4)")
    p.add_argument("--sentences", type=int, default=60, help="sentences per document (~17 tokens)")
    p.add_argument("--ratios", default="0.1,0.2", help="comma-separated compaction ratios")
    p.add_argument("--method", default="am-highest", help="compaction method")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool size per server")
    p.add_argument("--workers", type=int, default=1, help="compactor workers (Ray actors)")
    p.add_argument("--in-process", action="store_true", help="compactor workers as threads, no Ray")
    p.add_argument("--compaction-timeout", type=float, default=400.0, help="seconds per server")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    args = p.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",") if r]
    if not 1 <= args.docs <= 4:
        raise SystemExit(f"--docs must be in [1, 4], got {args.docs}")
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so every server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from compactor.models import prepare_model

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="compaction-demo-"))
    print(f"== 1/3 embedded model {args.model} (logs under {logs})", flush=True)
    model = prepare_model(args.model)
    docs = [document(args.sentences, index=i) for i in range(args.docs)]
    n_q = len(questions())
    print(
        f"== 2/3 workload: {args.docs} documents x {n_q} questions ({NEEDLE_COUNT} needles each), "
        f"stock vs ratios {ratios} ({args.method})",
        flush=True,
    )
    configs = [("stock", None), *((f"ratio {r}", r) for r in ratios)]
    with contextlib.ExitStack() as stack:
        svc = stack.enter_context(
            CompactorService(
                args.model, logs / "compactor.log", workers=args.workers, in_process=args.in_process
            )
        )
        print(f"  compactor serve on {svc.endpoint} (pid {svc.pid})", flush=True)
        servers = []
        for name, ratio in configs:
            extra = ["--enable-metrics", "--sleep-on-idle"]  # idle servers must not spin
            if ratio is not None:
                extra += compaction_args(
                    svc.endpoint,
                    ratio,
                    args.method,
                    min_hits=n_q,
                    timeout_s=args.compaction_timeout,
                )
            log = logs / f"sglang-{name.replace(' ', '-')}.log"
            servers.append(
                SGLangServer(model, log, max_total_tokens=args.max_total_tokens, extra_args=extra)
            )
        start_all(stack, servers)
        for (name, _), srv in zip(configs, servers):
            print(f"  [{name}] SGLang up on {srv.url}", flush=True)
        # one server busy at a time (each binds its threads to every core); compactions run
        # in the service while the next server warms up
        warm = [
            warm_up(name, srv, docs, args.max_new_tokens)
            for (name, _), srv in zip(configs, servers)
        ]
        for (name, ratio), srv, gauges in zip(configs, servers, warm):
            if ratio is not None:
                gauges |= wait_for_compactions(
                    srv, len(docs), args.compaction_timeout, progress=False
                )
                print(
                    f"  [{name}] compactions installed {gauges['installed_total']:.0f}/"
                    f"{len(docs)}, fallbacks {gauges['fallbacks_total']:.0f}",
                    flush=True,
                )
        records = [
            measure(name, srv, docs, ratio, args.max_new_tokens, gauges)
            for (name, ratio), srv, gauges in zip(configs, servers, warm)
        ]
    add_agreement(records)
    print(f"== 3/3 results ({time.perf_counter() - t0:.0f} s, every process stopped)")
    print_table(records)
    out_json, out_png = args.out / "demo.json", args.out / "demo.png"
    out_json.write_text(
        json.dumps({"records": records, "args": vars(args) | {"out": str(args.out)}}, indent=1)
    )
    plot(records, out_png)
    print(f"wrote {out_json} and {out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
