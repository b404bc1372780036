"""Results tables in the documents, rendered from their result files (tests check they agree).

    python -m benchmarks.report.readme_tables            # every table, as the documents should show it
    python -m benchmarks.report.readme_tables serving    # one table
    python -m benchmarks.report.readme_tables --check    # exit 1 if a document's table differs
    python -m benchmarks.report.readme_tables --write    # re-render the marked tables in place
    python -m benchmarks.report.readme_tables --write docs/results.md   # ... of some documents only

A results table in one of `DOCUMENTS` (README.md, docs/*.md, sglang_ext/README.md) sits right
below a marker naming its renderer and its files:

    <!-- results: serving benchmarks/results/serving_3072.json -->
    | config | ... |

`tests/benchmarks/test_readme_results.py` re-renders every marked table and compares it with the
document (bold `**` ignored), checks that every renderer has a table, that markers appear only
in `DOCUMENTS`, and that each result file records its provenance (command, commit, machine,
date). Rounding: the renderers', to the digits the documents print.

Renderers register with `@table` (benchmarks/report/_tables_lib.py, re-exported here): the demo,
speed, GPU and suite-time tables below, the serving runs' in _tables_serving.py, the README's
headline in _tables_headline.py, the compaction-quality ones in _tables_quality.py, the
RULER-style suite's in _tables_ruler.py (its Attention Matching ones in _tables_ruler_am.py),
the cluster ones (PD, the cluster simulator) in _tables_cluster.py (all in benchmarks/report/).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks.gpu.serving.record import DECODE_STEP_BOUND, GpuServingResult

# the quality family registers its renderers on import
from benchmarks.report import (  # noqa: F401
    _tables_cluster,
    _tables_headline,
    _tables_quality,
    _tables_ruler,
    _tables_ruler_am,
    _tables_serving,
)
from benchmarks.report._tables_lib import TABLES, held, rec, seen_unseen, sig, table

# Every document that shows results (tables under a marker, or result files it names), relative
# to the repository root.
DOCUMENTS = (
    "README.md",
    "docs/results.md",
    "docs/gpu.md",
    "docs/benchmarks.md",
    "docs/cluster.md",
    "docs/testing.md",
    "sglang_ext/README.md",
)
MARKER = re.compile(r"<!-- results: (\S+)((?: \S+\.json)+) -->")


@table("demo", "demo.json")
def _demo(data: list[dict[str, Any]]) -> list[list[str]]:
    recs = data[0]["records"]
    base = recs[0]["kv_slots_held"]
    rows = [
        ["config", "KV slots held", "less KV", "after the run", "peak in the run",
         "needles, fitted / unseen questions", "needle retention, unseen",
         "per-token agreement, fitted / unseen", "agree16, fitted / unseen"],
    ]  # fmt: skip
    for r in recs:
        retention = r["needle_retention_unseen"]
        rows.append(
            [
                *held(r, base),
                str(r["kv_slots_held_after_run"]),
                str(r["run"]["peak_held"]),
                seen_unseen(r, "needle_accuracy"),
                "-" if retention is None else f"{retention:.2f}",
                seen_unseen(r, "token_agreement"),
                seen_unseen(r, "agreement"),
            ]
        )
    return rows


@table("suite_time", "suite_time.json")
def _suite_time(data: list[dict[str, Any]]) -> list[list[str]]:
    """One run of `make test`'s two streams: each pytest session and the tests in all; from a
    `.ci/run` log also the setup and lint, and the whole run."""
    r = data[0]
    names = ("stream 1: the server tests", "stream 2: the tests without a server",
             "stream 2: the short server tests")  # fmt: skip
    rows = [["part", "tests passed", "skipped", "minutes"]]
    for name, s in zip(names, r["sessions"], strict=True):
        rows.append([name, str(s["passed"]), str(s["skipped"]), f"{s['seconds'] / 60:.1f}"])
    rows.append(["the tests, both streams side by side", "-", "-", f"{r['total_s'] / 60:.1f}"])
    if r.get("ci_s") is not None:  # a .ci/run log: the venvs built and lint, then the tests
        rows.append(["setting up the venvs and lint", "-", "-", f"{r['setup_s'] / 60:.1f}"])
        rows.append(["`.ci/run` in all", "-", "-", f"{r['ci_s'] / 60:.1f}"])
    return rows


@table("compaction_speed", "compaction_speed.json")
def _compaction_speed(data: list[dict[str, Any]]) -> list[list[str]]:
    """Wall seconds per stage (and the process CPU seconds of the whole run) per T."""
    recs = data[0]["records"]
    a, b = "am-highest", "am-omp-fast"
    rows = [
        ["T", "chunks", "method", "prefill", "queries", "selection", "beta", "values", "total",
         "CPU s"]
    ]  # fmt: skip
    for T in sorted({r["T"] for r in recs}):
        x, y = rec(recs, T=T, method=a), rec(recs, T=T, method=b)

        def pair(k: str, d: int = 1, x: dict[str, Any] = x, y: dict[str, Any] = y) -> str:
            return f"{x['wall_s'][k]:.{d}f} / {y['wall_s'][k]:.{d}f}"

        size = x.get("chunk_size")
        chunks = f"{-(-T // size)} x {size}" if size else "1"
        rows.append(
            [str(T), chunks, f"{a} / {b}", f"{x['wall_s']['prefill']:.1f}",
             f"{x['wall_s']['queries']:.1f}",
             pair("selection", 2), pair("beta", 2), pair("values", 2),
             f"{x['total_s']:.1f} / {y['total_s']:.1f}",
             f"{x['cpu_total_s']:.1f} / {y['cpu_total_s']:.1f}"]
        )  # fmt: skip
    return rows


@table("compaction_speed_gpu", "compaction_speed_gpu.json")
def _compaction_speed_gpu(data: list[dict[str, Any]]) -> list[list[str]]:
    """The whole-model GPU run: wall seconds per stage, total and peak memory per record."""
    stages = ("prefill", "queries", "selection", "beta", "values")
    rows = [["T", "method", *stages, "total s", "peak GiB"]]
    for r in [*data[0]["doc"], *data[0]["big"]]:
        if "wall_s" not in r:  # an error or a step the budget skipped: the JSON says which
            continue
        rows.append(
            [str(r["T"]), r["method"], *(f"{r['wall_s'][k]:.2f}" for k in stages),
             f"{r['total_s']:.1f}", f"{r['peak_gpu_memory_gib']:.1f}"]
        )  # fmt: skip
    return rows


@table("gpu_serving", "gpu_serving.json")
def _gpu_serving(data: list[dict[str, Any]]) -> list[list[str]]:
    """The GPU serving run's figures against their bounds (`checks`); n/a: not measured."""
    r = data[0]
    figures = (
        ("attention backend SGLang runs", r["backend"], "flashinfer", "flashinfer"),
        ("decode CUDA graphs on", r["cuda_graphs"], "on", None),
        ("identity: keep-only at ratio 1 vs stock", r["identity_outputs_equal"], "equal",
         "identity_equal"),
        ("idle decode, plugin / stock", r["idle_plugin_throughput_ratio"], ">= 0.97",
         "idle_within_3pct"),
        ("32k prefix KV slots, stock / compacted", r["prefix_slots_ratio"], ">= 8",
         "prefix_slots_8x"),
        ("decode step at 64 requests, compacted / stock", r["decode_step_ratio"],
         f"<= {DECODE_STEP_BOUND}", "decode_step_0.35x"),
    )  # fmt: skip
    # the bounds as they stand now, on the figures as recorded
    fields = {k: v for k, v in r.items() if k in GpuServingResult.__dataclass_fields__}
    checks = GpuServingResult(**fields).checks()
    rows = [["figure", "measured", "bound", "met"]]
    for name, value, bound, check in figures:
        shown = "n/a" if value is None else (f"{value:.3g}" if isinstance(value, float) else
                                             str(value))  # fmt: skip
        met = checks.get(check) if check else value
        rows.append([name, shown, bound, "n/a" if met is None else ("yes" if met else "no")])
    ident = r["details"].get("identity", {})
    if "logprob_max_abs_diff" in ident:  # what the identity figure rests on
        tol = ident["logprob_tolerance"]
        ctrl = ident["control_mean_abs_diff"]
        scored = ident["scores"]["stock"]
        rows.insert(4, [
            f"identity: largest log-prob shift, {len(scored)} x {len(scored[0])} tokens (nats)",
            f"{ident['logprob_max_abs_diff']:.3g}",
            f"<= {tol['abs']:g} and <= {tol['of_control']:g} x control ({ctrl:.3g})", "",
        ])  # fmt: skip
        rows.insert(5, [
            "identity: scored requests served from the compacted prefix",
            f"{ident['compacted_rows_scored']:.0f} / {ident['scored_requests']}",
            "all", "",
        ])  # fmt: skip
    return rows


@table("kernels", "kernels.json")
def _kernels(data: list[dict[str, Any]]) -> list[list[str]]:
    res = data[0]["results"]
    # flashinfer_beta: the FlashInfer β variant, since removed; files from before keep its column
    heads = {"triton_beta": "Triton + β", "triton_beta_ragged": "Triton + β, ragged per head",
             "flashinfer_stock": "FlashInfer stock (no β)",
             "flashinfer_beta": "FlashInfer + β variant (removed)"}  # fmt: skip
    kernels = [k for k in heads if any(r.get("kernel") == k for r in res)]
    shapes = ((1, 1024), (1, 131072), (8, 16384), (32, 65536), (32, 131072))
    rows = [["B x prefix slots", *(heads[k] for k in kernels)]]
    for b, n in shapes:
        cells = []
        for k in kernels:
            r = rec(res, kernel=k, batch=b, length=n)
            cells.append(f"{sig(r['ms'])} ms ({r['frac_of_copy_bw']:.2f})")
        rows.append([f"{b} x {n // 1024}k", *cells])
    return rows


@table(
    "methods_speed",
    "methods_speed_h100_T1024.json",
    "methods_speed_h100_T4096.json",
    "methods_speed_h100_T16384.json",
    "methods_speed_h100host_cpu_T1024.json",
)
def _methods_speed(data: list[dict[str, Any]]) -> list[list[str]]:
    *gpu, cpu = data
    methods = ("am-highest", "am-omp-fast", "am-omp")
    rows = [["T", *methods]]
    for d in gpu:
        cells = []
        for m in methods:
            try:
                cell = sig(rec(d["results"], method=m)["sec_per_layer"])
            except KeyError:
                cells.append("not run")
                continue
            if d["config"]["T"] == cpu["config"]["T"] and any(
                r["method"] == m for r in cpu["results"]
            ):
                c = sig(rec(cpu["results"], method=m)["sec_per_layer"])
                cell += f" (CPU, 1 thread: {c})" if m == methods[0] else f" (CPU: {c})"
            cells.append(cell)
        rows.append([str(d["config"]["T"]), *cells])
    return rows


def render(name: str, root: Path = ROOT) -> tuple[tuple[str, ...], list[str]]:
    """The table `name` as markdown lines (header, separator, rows) and its files."""
    files, fn = TABLES[name]
    rows = fn([json.loads((root / f).read_text()) for f in files])
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + " --- |" * len(rows[0]))
    return files, lines


def marked_tables(text: str) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(renderer name, files, table lines) for every marker in a document's text."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = MARKER.search(line)
        if m is None:
            continue
        body = []
        for row in lines[i + 1 :]:
            if not row.startswith("|"):
                break
            body.append(row)
        out.append((m.group(1), tuple(m.group(2).split()), body))
    return out


def normalize(line: str) -> str:
    return re.sub(r"\s+", " ", line.replace("**", "")).strip()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _keep(new: str, old: str) -> str:
    """`new`, with the emphasis of `old`'s words where their text is unchanged."""
    if normalize(new) == normalize(old):
        return old
    a, b = new.split(" "), old.split(" ")
    if len(a) != len(b):
        return new
    return " ".join(o if normalize(o) == normalize(n) else n for n, o in zip(a, b))


def update(text: str, root: Path = ROOT) -> str:
    """`text` with every marked table re-rendered; a cell whose text is unchanged keeps its
    emphasis (`**`)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.search(lines[i])
        i += 1
        if m is None:
            continue
        old = []
        while i < len(lines) and lines[i].startswith("|"):
            old.append(lines[i])
            i += 1
        _, new = render(m.group(1), root)
        for j, row in enumerate(new):
            prev = _cells(old[j]) if j < len(old) else []
            cells = [_keep(c, prev[k] if k < len(prev) else "") for k, c in enumerate(_cells(row))]
            out.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def check(docs: tuple[str, ...] = DOCUMENTS, root: Path = ROOT) -> list[str]:
    """What is wrong with the marked tables of `docs`: a table that differs from what its
    renderer prints, a marker naming other files or an unknown renderer, and (when every
    document is checked) a renderer without a table. Empty when all agree."""
    problems, seen = [], set()
    for doc in docs:
        path = root / doc
        if not path.exists():
            problems.append(f"{doc}: missing")
            continue
        for name, files, lines in marked_tables(path.read_text()):
            seen.add(name)
            if name not in TABLES:
                problems.append(f"{doc}: unknown table {name!r}")
                continue
            want_files, want = render(name, root)
            if files != want_files:
                problems.append(f"{doc}: the {name} marker names {files}, not {want_files}")
            elif [normalize(x) for x in lines] != [normalize(x) for x in want]:
                problems.append(f"{doc}: the {name} table differs from its files")
    if set(docs) == set(DOCUMENTS):
        problems += [f"table {n!r} is in no document" for n in sorted(set(TABLES) - seen)]
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv[:1] == ["--write"]:  # re-render the tables of the documents given (in place)
        for doc in argv[1:] or DOCUMENTS:
            path = ROOT / doc if not Path(doc).is_absolute() else Path(doc)
            path.write_text(update(path.read_text()))
            print(f"updated {doc}")
        return 0
    if argv[:1] == ["--check"]:  # exit 1 when a document's table differs from its files
        problems = check(tuple(argv[1:]) or DOCUMENTS)
        for line in problems:
            print(line, file=sys.stderr)
        if not problems:
            print(f"every marked table agrees with its files ({', '.join(argv[1:] or DOCUMENTS)})")
        return 1 if problems else 0
    unknown = [name for name in argv if name not in TABLES]
    if unknown:
        raise SystemExit(f"unknown table {', '.join(unknown)}; the tables: {', '.join(TABLES)}")
    for name in argv or list(TABLES):
        files, lines = render(name)
        print(f"<!-- results: {name} {' '.join(files)} -->")
        print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
