"""Quality at equal memory: per-head budgets against uniform ones at the same physical slots.

Per document (``--docs`` needle documents, ``--prose-docs`` prose documents, ``--sentences``
each) and configuration, a real CPU SGLang server with the plugin (in-process compaction,
the plugin's default reference queries) is asked the six seen questions
(``harness.workload.questions()``: the sixth sends the shared document, with the questions as
follow-ups), the install is awaited, and the server's own gauges give the prefix's physical
slots and kept entries (``sglang:compaction_physical_tokens`` / ``..._kept_entries``). Then it
is asked the six unseen questions (asked only after the install). Configurations:

    gvote        GVote, which picks its own budget per head (nucleus ``--gvote-p``), run first
    uniform      am-highest, one budget for every layer and head
    auto         am-highest, per-head budgets from sensitivity curves
                 (``--compaction-head-budgets auto``; the curves are made first with
                 ``compactor sensitivity`` in a copy of the model directory)
    kv-compress  KV-Compress, budgets varying per layer and head under one total

The others run at ``--compaction-ratio`` = gvote's kept entries / (layers x KV heads x T) on
that document, so every configuration holds about the same physical memory; each row records
its own slots, read from its server, and ``physical_vs_gvote``. One stock server (the plugin
not loaded) answers the same unseen questions: its greedy ``--answer-tokens`` tokens are the
reference. Per row:

- unseen_agree: share of unseen questions whose greedy answer tokens equal stock's;
- unseen_logppl_gap: mean over the unseen questions and answer tokens of stock's log-prob of
  its own greedy answer (``output_token_logprobs``) minus the compacted server's, teacher
  forced (``input_ids`` = prompt + stock's answer, ``logprob_start_len`` = the prompt's
  length - 1: SGLang returns no log-prob at that first position; ``input_token_logprobs``);
  the stock server scoring its own answers this way gives the method's noise floor (the
  ``stock`` rows: prefill vs decode numerics, ~1e-3 nats);
- physical_slots, kept_entries, cells_per_slot, logical_tokens, ratio (the flag), seconds.

    python -m benchmarks.server.equal_memory --docs 1 --prose-docs 1 \\
        --json benchmarks/results/equal_memory.json --plot benchmarks/results/equal_memory.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import add_options
from harness.forced import teacher_forced
from harness.launch import SGLangServer, start_all
from harness.provenance import provenance
from harness.workload import (
    compaction_args,
    document,
    metric,
    prompt,
    prose_document,
    prose_unseen_questions,
    questions,
    unseen_questions,
)

__all__ = ["CONFIGS", "logppl_gap", "main", "matched_ratio", "summarize"]

CONFIGS = ("gvote", "uniform", "auto", "kv-compress")
RATIO_RANGE = (0.02, 0.9)
TIMEOUT_S = 900.0


def matched_ratio(kept_entries: float, cells: int, logical: float) -> tuple[float, bool]:
    """The per-head kept fraction that keeps `kept_entries` over `cells` (layers x KV heads)
    heads of a `logical`-token prefix, clamped to RATIO_RANGE; and whether it was clamped.
    ValueError for non-positive sizes."""
    if cells <= 0 or logical <= 0 or kept_entries <= 0:
        raise ValueError(f"need positive sizes, got kept={kept_entries} cells={cells} T={logical}")
    ratio = kept_entries / (cells * logical)
    lo, hi = RATIO_RANGE
    return min(max(ratio, lo), hi), not lo <= ratio <= hi


def logppl_gap(reference: Sequence[Sequence[float]], other: Sequence[Sequence[float]]) -> float:
    """Mean over every token of reference - other log-probs (nats per token), one list per
    question (the same answer tokens on both sides). ValueError on differing lengths."""
    diffs = []
    for ref, oth in zip(reference, other, strict=True):
        if len(ref) != len(oth):
            raise ValueError(f"answers of {len(ref)} and {len(oth)} tokens")
        diffs += [r - o for r, o in zip(ref, oth)]
    return sum(diffs) / len(diffs) if diffs else 0.0


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (config, kind): means over documents of the numeric fields."""
    keys = ("unseen_agree", "unseen_logppl_gap", "physical_slots", "kept_entries",
            "physical_vs_gvote", "ratio")  # fmt: skip
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["kind"]), []).append(r)
    out = []
    for (config, kind), rs in groups.items():
        s: dict[str, Any] = {"config": config, "kind": kind, "docs": len(rs)}
        for k in keys:
            vals = [r[k] for r in rs if r.get(k) is not None]
            s[k] = sum(vals) / len(vals) if vals else None
        out.append(s)
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=1, help="needle documents")
    p.add_argument("--prose-docs", type=int, default=1, help="prose documents")
    p.add_argument("--sentences", type=int, default=110, help="sentences per document")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, gvote first")
    p.add_argument("--gvote-p", type=float, default=0.95, help="GVote's nucleus mass")
    add_options(p, answer_tokens=16, json=Path("benchmarks/results/equal_memory.json"))
    add_options(p, plot=Path("benchmarks/results/equal_memory.png"))
    p.add_argument("--plot-only", action="store_true", help="redraw --plot from --json, no run")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    if configs[0] != "gvote" or not set(configs) <= set(CONFIGS):
        p.error(f"--configs must start with gvote and name only {CONFIGS}, got {args.configs}")
    return args


def _stock(model: Path, docs: list[dict[str, Any]], args: argparse.Namespace, work: Path) -> None:
    """Stock answers, their log-probs and the prompts' token ids (mutates `docs`); the same
    server then scores its own answers teacher-forced (the `stock` rows)."""
    with SGLangServer(model, work / "stock.log", max_total_tokens=8192, plugin=False) as srv:
        for d in docs:
            d["stock"] = []
            for q in d["unseen"]:
                out = srv.post("/generate", {
                    "text": prompt(d["text"], q), "return_logprob": True, "logprob_start_len": 0,
                    "sampling_params": {"max_new_tokens": args.answer_tokens, "temperature": 0.0},
                })  # fmt: skip
                meta = out["meta_info"]
                d["stock"].append({
                    "prompt_ids": [int(x[1]) for x in meta["input_token_logprobs"]],
                    "answer": [int(x) for x in out["output_ids"]],
                    "logprobs": [float(x[0]) for x in meta["output_token_logprobs"]],
                })  # fmt: skip
            own = [
                teacher_forced(srv, s["prompt_ids"], s["answer"]).logprobs
                for q, s in zip(d["unseen"], d["stock"], strict=True)
            ]
            d["rows"] = [{
                "config": "stock", "kind": d["kind"], "doc": d["index"], "unseen_agree": None,
                "unseen_logppl_gap": logppl_gap([s["logprobs"] for s in d["stock"]], own),
            }]  # fmt: skip


def _compacted(model: Path, d: dict[str, Any], config: str, ratio: float, args: argparse.Namespace,
               work: Path) -> dict[str, Any]:  # fmt: skip
    """One configuration's row for document `d` on its own server."""
    method = {"uniform": "am-highest", "auto": "am-highest"}.get(config, config)
    flags = compaction_args("inproc://", ratio, method, min_hits=len(questions()),
                            min_prefix_tokens=256, timeout_s=TIMEOUT_S)  # fmt: skip
    flags += ["--enable-metrics"]
    if config == "auto":
        flags += ["--compaction-head-budgets", "auto"]
    if config == "gvote":
        flags += ["--compaction-param", f"p={args.gvote_p}"]
    t0 = time.monotonic()
    log = work / f"{config}-{d['kind']}{d['index']}.log"
    with contextlib.ExitStack() as stack:
        srv = SGLangServer(model, log, max_total_tokens=8192, extra_args=flags)
        start_all(stack, [srv])
        for q in questions():
            srv.generate(prompt(d["text"], q), max_new_tokens=4)
        deadline = time.monotonic() + TIMEOUT_S
        while metric(srv, "sglang:compaction_installed_total") < 1:
            if metric(srv, "sglang:compaction_fallbacks_total") > 0 or time.monotonic() > deadline:
                raise RuntimeError(f"{config}: no install\n{srv.log_tail()}")
            time.sleep(2)
        row: dict[str, Any] = {
            "config": config, "kind": d["kind"], "doc": d["index"], "ratio": ratio,
            "physical_slots": int(metric(srv, "sglang:compaction_physical_tokens")),
            "kept_entries": int(metric(srv, "sglang:compaction_kept_entries")),
            "logical_tokens": int(metric(srv, "sglang:compaction_logical_tokens")),
        }  # fmt: skip
        agree, scored = 0, []
        for q, s in zip(d["unseen"], d["stock"]):
            out = srv.generate(prompt(d["text"], q), max_new_tokens=args.answer_tokens)
            if out["meta_info"]["cached_tokens"] < row["logical_tokens"]:
                raise RuntimeError(f"{config}: {q!r} did not read the compacted prefix")
            agree += [int(x) for x in out["output_ids"]] == s["answer"]
            scored.append(teacher_forced(srv, s["prompt_ids"], s["answer"]).logprobs)
    row["unseen_agree"] = agree / len(d["unseen"])
    row["unseen_logppl_gap"] = logppl_gap([s["logprobs"] for s in d["stock"]], scored)
    row["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(row), flush=True)
    return row


def _model_with_curves(work: Path) -> tuple[Path, str]:
    """A copy of the embedded model's directory (files linked) with am-highest's curves."""
    from compactor.models import prepare_model

    model = work / "model"
    model.mkdir()
    for f in prepare_model("smollm2-135m").iterdir():
        (model / f.name).symlink_to(f)
    cmd = [sys.executable, "-m", "compactor", "sensitivity", "--model", str(model), "--method",
           "am-highest", "--fractions", "0.02,0.05,0.1,0.2,0.3,0.5,0.9", "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=1800)
    return model, " ".join(["compactor", *cmd[3:5], "MODEL", *cmd[6:]])


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.plot_only:
        _plot(json.loads(args.json.read_text()), args.plot)
        return 0
    configs = args.configs.split(",")
    docs: list[dict[str, Any]] = [
        {"kind": "needle", "index": i, "text": document(args.sentences, i),
         "unseen": unseen_questions()} for i in range(args.docs)
    ] + [
        {"kind": "prose", "index": i, "text": prose_document(args.sentences, i),
         "unseen": prose_unseen_questions()} for i in range(args.prose_docs)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="equal-memory-") as tmp:
        work = Path(tmp)
        model, curves_cmd = _model_with_curves(work)
        cfg = json.loads((model / "config.json").read_text())
        cells = int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"])
        _stock(model, docs, args, work)
        for d in docs:
            g = _compacted(model, d, "gvote", 0.1, args, work)
            ratio, clamped = matched_ratio(g["kept_entries"], cells, g["logical_tokens"])
            rows = [g] + [_compacted(model, d, c, ratio, args, work) for c in configs[1:]]
            for r in rows:
                r["cells_per_slot"] = cells
                r["physical_vs_gvote"] = r["physical_slots"] / g["physical_slots"]
                r["ratio_clamped"] = clamped if r["config"] != "gvote" else None
            d["rows"] += rows
    rows = [r for d in docs for r in d["rows"]]
    result = {
        "provenance": provenance(argv, module="benchmarks.server.equal_memory"),
        "meta": {"model": "smollm2-135m", "docs": args.docs, "prose_docs": args.prose_docs,
                 "sentences": args.sentences, "configs": configs, "gvote_p": args.gvote_p,
                 "answer_tokens": args.answer_tokens, "sensitivity": curves_cmd},
        "rows": rows,
        "summary": summarize(rows),
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, args.plot)
    print(json.dumps(result["summary"], indent=1))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    """Two panels per document kind: log-ppl gap and agreement per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [s for s in result["summary"] if s["config"] != "stock"]
    kinds = sorted({s["kind"] for s in summary})
    configs = list(dict.fromkeys(s["config"] for s in summary))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(kinds), 1)
    for j, kind in enumerate(kinds):
        rows = [s for s in summary if s["kind"] == kind]
        xs = [configs.index(r["config"]) + j * width for r in rows]
        for ax, key in zip(axes, ("unseen_logppl_gap", "unseen_agree")):
            ax.bar(xs, [r[key] for r in rows], width, label=kind)
    labels = []
    for c in configs:
        slots = " / ".join(f"{s['physical_slots']:.0f}" for s in summary if s["config"] == c)
        labels.append(f"{c}\n{slots} slots")
    for ax in axes:
        ax.set_xticks([i + width * (len(kinds) - 1) / 2 for i in range(len(configs))])
        ax.set_xticklabels(labels)
    axes[0].set_ylabel("unseen log-ppl gap vs stock (nats/token)")
    axes[1].set_ylabel("unseen answers equal to stock's")
    axes[1].legend()
    fig.suptitle(f"equal physical memory (slots read from each server: {' / '.join(kinds)})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
