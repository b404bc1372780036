"""`make demo`: stock SGLang vs SGLang + `compactor serve` on a shared-document workload.

On the embedded SmolLM2-135M model and CPU:

1. prepare the checkpoint (a no-op when prepared) and start `compactor serve` (Ray workers);
2. start a real SGLang server for stock and for each compaction ratio (the compaction ones
   with `--compaction-endpoint` pointing at the service), all at once, then
   - warm-up, one server after the other: ask each document's six questions once, in order
     (the documents enter the radix cache; on compaction servers the last question's hit
     sends the document to the service, with the questions as reference queries), read
     the pool (on compaction servers only if no install has landed yet: with several
     documents the first is usually installed by then), then wait for the installs and read
     it again;
   - measured pass, one server at a time: the six questions of every document plus six
     questions the compaction never saw, all at once, streamed: needle accuracy and
     agreement with stock's greedy tokens on each set, throughput, TTFT p50/p95, and the
     pool sampled every second (peak slots held, most requests running / queued);
3. read every pool once more (after the run), print one table, write JSON + PNG, and stop
   every process (also on Ctrl-C or failure).

Every figure printed is measured in this run; KV slots are read from the servers
(`harness.pool`: pool size - free slots, as SGLang and the plugin report them).
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

from harness.forced import teacher_forced
from harness.launch import CompactorService, SGLangServer, start_all
from harness.pool import PoolReading, PoolSampler, pool_size, read_pool
from harness.workload import (
    compaction_args,
    document,
    metric,
    needle_correct,
    percentile,
    prompt,
    prompt_ids,
    questions,
    stream_all,
    unseen_questions,
    wait_for_compactions,
)
from sglang_ext.config import PLUGIN_SPEC

NEEDLE_COUNT = 3


def warm_up(name: str, server: SGLangServer, docs: list[str], max_new_tokens: int) -> float:
    """Ask each document's questions once, in order (uncompacted: no install happens before
    the last one). Returns `time.monotonic()` at the end."""
    for d, doc in enumerate(docs):
        for q in questions():
            server.generate(prompt(doc, q), max_new_tokens=max_new_tokens)
        print(f"  [{name}] warm-up: document {d} asked {len(questions())} questions", flush=True)
    return time.monotonic()


def measure(
    name: str, server: SGLangServer, docs: list[str], ratio: float | None, max_new_tokens: int
) -> dict[str, Any]:
    """The measured pass: every question (seen, then unseen) of every document at once."""
    asked = [(d, q, seen) for d in range(len(docs)) for q, seen in _question_set()]
    prompts = [prompt(docs[d], q) for d, q, _ in asked]
    with PoolSampler(server.url, pool=pool_size(server.url)) as sampler:
        results, wall = stream_all(server.url, prompts, max_new_tokens)
    end = time.monotonic()
    print(f"  [{name}] measured pass: {len(prompts)} requests at once in {wall:.1f} s", flush=True)
    ttfts = [r.ttft_s for r in results]
    return {
        "config": name,
        "ratio": ratio,
        "documents": len(docs),
        "requests": len(results),
        "run": sampler.as_dict(),
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": sum(len(r.output_ids) for r in results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "answers": [
            {
                "doc": d,
                "question": q,
                "seen": seen,
                "needle": needle_correct(q, r.text, d),
                "text": r.text,
                "output_ids": r.output_ids,
            }
            for (d, q, seen), r in zip(asked, results)
        ],
        "_end": end,
    }


def _question_set() -> list[tuple[str, bool]]:
    return [(q, True) for q in questions()] + [(q, False) for q in unseen_questions()]


def add_forced(records: list[dict[str, Any]], servers: list[SGLangServer], docs: list[str]) -> None:
    """Score stock's answers teacher-forced on every server (stock first: its own log-probs
    are the reference); each answer gets its per-token top-1 agreement and log-probs."""
    stock = records[0]["answers"]
    ids = [prompt_ids(servers[0], prompt(docs[a["doc"]], a["question"])) for a in stock]
    for r, srv in zip(records, servers, strict=True):
        for a, s, pid in zip(r["answers"], stock, ids, strict=True):
            forced = teacher_forced(srv, pid, s["output_ids"])
            a["forced_agree"] = forced.agreement(s["output_ids"])
            a["forced_logprobs"] = forced.logprobs


def add_quality(records: list[dict[str, Any]], tokens: int = 16) -> None:
    """Per config, on the questions the compaction fitted ("seen") and on those it never saw
    ("unseen"), against stock's answers to the same questions:

    - needle_accuracy; needle_retention: P(right | stock right), the headline;
    - token_agreement: share of stock's answer tokens that are this server's top-1 when it is
      fed stock's answer (teacher-forced: one early difference does not sink the rest);
      logprob_gap: mean nats by which this server finds stock's answer tokens less likely
      than stock does (when :func:`add_forced` ran);
    - agreement (agree16, secondary): the first `tokens` greedy tokens all equal stock's.
    """
    stock = records[0]["answers"]
    for r in records:
        for label, seen in (("seen", True), ("unseen", False)):
            pairs = [(a, s) for a, s in zip(r["answers"], stock) if a["seen"] is seen]
            graded = [(a["needle"], s["needle"]) for a, s in pairs if a["needle"] is not None]
            kept = [mine for mine, theirs in graded if theirs]
            same = [a["output_ids"][:tokens] == s["output_ids"][:tokens] for a, s in pairs]
            r[f"needle_accuracy_{label}"] = sum(m for m, _ in graded) / len(graded)
            r[f"needle_retention_{label}"] = sum(kept) / len(kept) if kept else None
            r[f"agreement_{label}"] = sum(same) / len(same)
            if all("forced_agree" in a for a, _ in pairs):
                agree = [x for a, _ in pairs for x in a["forced_agree"]]
                gaps = [
                    ref - mine
                    for a, s in pairs
                    for mine, ref in zip(a["forced_logprobs"], s["forced_logprobs"], strict=True)
                ]
                r[f"token_agreement_{label}"] = sum(agree) / max(len(agree), 1)
                r[f"logprob_gap_{label}"] = sum(gaps) / max(len(gaps), 1)


def add_pool(record: dict[str, Any], readings: dict[str, PoolReading | None]) -> None:
    """Store the server-read pool readings and the table's KV figures in `record`."""
    record["pool"] = {k: None if v is None else v.as_dict() for k, v in readings.items()}
    installed, after = readings["installed"], readings["after"]
    assert installed is not None and after is not None
    record["pool_slots"] = installed.pool
    record["kv_slots_held"] = installed.held  # what the measured pass starts from
    record["kv_slots_held_after_run"] = after.held
    record["kv_slots_compacted"] = installed.compacted


def print_table(records: list[dict[str, Any]]) -> None:
    cols = [
        ("config", "{:<12}"),
        ("KV held", "{:>7d}"),
        ("less KV", "{:>7}"),
        ("after run", "{:>9d}"),
        ("peak", "{:>5d}"),
        ("needles seen/unseen", "{:>19}"),
        ("retention unseen", "{:>16}"),
        ("tok agree seen/unseen", "{:>21}"),
        ("agree16 seen/unseen", "{:>19}"),
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
            r["kv_slots_held_after_run"],
            r["run"]["peak_held"],
            f"{r['needle_accuracy_seen']:.2f} / {r['needle_accuracy_unseen']:.2f}",
            _fmt(r.get("needle_retention_unseen")),
            f"{_fmt(r.get('token_agreement_seen'))} / {_fmt(r.get('token_agreement_unseen'))}",
            f"{r['agreement_seen']:.2f} / {r['agreement_unseen']:.2f}",
            r["requests_per_s"],
            r["output_tokens_per_s"],
            r["ttft_p50_s"],
            r["ttft_p95_s"],
        ]
        print(" | ".join(f.format(v) for (_, f), v in zip(cols, vals)))
    pool = records[0]["pool_slots"]
    print(
        f"KV held = slots in use in each server's {pool}-slot pool (pool - free, read from the "
        "server) after warm-up and installs; after run / peak: after and during the measured "
        "pass. seen = the six questions the compaction fitted; unseen = six it never saw. "
        "retention = P(needle right | stock right); tok agree = share of stock's answer tokens "
        "that are the server's top-1, fed stock's answer; agree16 = first 16 tokens all equal."
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


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
        ("kv_slots_held", "KV slots held (read from server)"),
        ("needle_accuracy_unseen", "needles, unseen questions"),
        ("token_agreement_unseen", "per-token agreement, unseen"),
        ("requests_per_s", "requests / s"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    ]
    title = "stock SGLang vs compacted shared prefixes (SmolLM2-135M, CPU)"
    bar_panels(records, panels, path, title)


def _before_install(server: SGLangServer, idle_since: float) -> PoolReading | None:
    """The pool right after warm-up, if no compaction has landed yet (else None)."""
    reading = read_pool(server.url, idle_since=idle_since)
    return reading if metric(server, "sglang:compaction_installed_total") == 0 else None


def _provenance(argv: list[str] | None) -> dict[str, Any]:
    """`harness.provenance.provenance` when run from the repository (the demo's usual home)."""
    try:
        from harness.provenance import provenance
    except ImportError:
        return {"command": "python -m harness.demo " + " ".join(sys.argv[1:])}
    return provenance(sys.argv[1:] if argv is None else argv, module="harness.demo")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="known model name")
    p.add_argument("--docs", type=int, default=2, help="shared documents (up to 4)")
    p.add_argument("--sentences", type=int, default=60, help="sentences per document (~17 tokens)")
    p.add_argument("--ratios", default="0.1,0.2", help="comma-separated compaction ratios")
    p.add_argument(
        "--method", default=PLUGIN_SPEC.method, help="compaction method (default: the plugin's)"
    )
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
    prov = _provenance(argv)  # the code that runs: recorded before anything else
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="compaction-demo-"))
    print(f"== 1/3 embedded model {args.model} (logs under {logs})", flush=True)
    model = prepare_model(args.model)
    docs = [document(args.sentences, index=i) for i in range(args.docs)]
    n_q = len(questions())
    print(
        f"== 2/3 workload: {args.docs} documents x {n_q} questions ({NEEDLE_COUNT} needles each) "
        f"+ {len(unseen_questions())} unseen, stock vs ratios {ratios} ({args.method})",
        flush=True,
    )
    configs = [("stock", None), *((f"ratio {r}", r) for r in ratios)]
    readings: list[dict[str, PoolReading | None]] = [{} for _ in configs]
    infos: list[dict[str, float]] = [{} for _ in configs]
    with contextlib.ExitStack() as stack:
        svc = stack.enter_context(
            CompactorService(
                args.model, logs / "compactor.log", workers=args.workers, in_process=args.in_process
            )
        )
        print(f"  compactor serve on {svc.endpoint} (pid {svc.pid})", flush=True)
        servers = []
        for name, ratio in configs:
            # pool gauges published on every decode step (SGLangServer: no spinning when idle)
            extra = ["--enable-metrics", "--decode-log-interval", "1"]
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
                SGLangServer(
                    model,
                    log,
                    max_total_tokens=args.max_total_tokens,
                    extra_args=extra,
                    plugin=ratio is not None,  # stock: the plugin not loaded at all
                )
            )
        start_all(stack, servers)
        for (name, _), srv, rd in zip(configs, servers, readings):
            rd["before"] = before = read_pool(srv.url)
            print(f"  [{name}] SGLang up on {srv.url}, {before.pool}-slot pool", flush=True)
        # one server busy at a time (each binds its threads to every core); compactions run
        # in the service while the next server warms up
        ends = []
        for (name, ratio), srv, rd in zip(configs, servers, readings):
            ends.append(warm_up(name, srv, docs, args.max_new_tokens))
            if ratio is not None:
                rd["warm"] = _before_install(srv, ends[-1])
        for (name, ratio), srv, rd, info, end in zip(configs, servers, readings, infos, ends):
            if ratio is not None:
                info |= wait_for_compactions(srv, len(docs), args.compaction_timeout, False)
            rd["installed"] = installed = read_pool(srv.url, idle_since=end)
            if ratio is None:
                rd["warm"] = installed
                print(f"  [{name}] KV slots held after warm-up: {installed.held}", flush=True)
                continue
            warm = rd["warm"]  # None: a compaction landed before the pool could be read
            held_before = "" if warm is None else f"{warm.held} before the installs, "
            print(
                f"  [{name}] compactions installed {info['installed_total']:.0f}/{len(docs)}, "
                f"fallbacks {info['fallbacks_total']:.0f}; KV slots held {held_before}"
                f"{installed.held} after the installs ({installed.compacted} in compacted nodes)",
                flush=True,
            )
        records = [
            measure(name, srv, docs, ratio, args.max_new_tokens)
            for (name, ratio), srv in zip(configs, servers)
        ]
        for rec, srv, rd, info in zip(records, servers, readings, infos):
            rd["after"] = read_pool(srv.url, idle_since=rec.pop("_end"))
            add_pool(rec, rd)
            rec["compactions_installed"] = info.get("installed_total")
            rec["compaction_fallbacks"] = info.get("fallbacks_total")
        add_forced(records, servers, docs)
    add_quality(records)
    print(f"== 3/3 results ({time.perf_counter() - t0:.0f} s, every process stopped)")
    print_table(records)
    out_json, out_png = args.out / "demo.json", args.out / "demo.png"
    meta = {
        "provenance": prov,
        "total_s": time.perf_counter() - t0,
        "args": vars(args) | {"out": str(args.out)},
    }
    out_json.write_text(json.dumps({"records": records, **meta}, indent=1))
    plot(records, out_png)
    print(f"wrote {out_json} and {out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
