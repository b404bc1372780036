"""Quality of chunked compaction vs one chunk: what the service's auto-chunk rule costs.

    python -m benchmarks.offline.chunk_quality [--cases 4096:none,4096:2048,8192:none,8192:4096] \
        [--niah 2] [--runs DIR] [--reuse]

Each case ``T:C`` runs ``compactor eval`` on ``--niah`` needle documents of T tokens with
am-highest at ratio 0.1 (the library's default reference queries, repeat-prefill +
self-study) and ``--chunk-size C`` (``none``: one chunk), beside the uncompacted model. The
per-case eval JSONs go to ``--runs``; with ``--reuse`` a JSON already there from the same
command is read instead of run again (its file date is recorded as the run's date).
Writes ``benchmarks/results/chunk_quality.json``: per case the attention errors, the logppl
gap, 16-token agreement and needle accuracy, and per T the change against one chunk.
``compactor.spec.AUTO_CHUNK_TOKENS`` cites this file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options
from harness.provenance import provenance

METRICS = ("output_rel_err", "mass_rel_err", "logppl_gap", "agreement", "niah_accuracy")


def eval_command(T: int, chunk: int | None, niah: int, out: Path) -> list[str]:
    """The `compactor eval` command line of one case."""
    cmd = [
        sys.executable, "-m", "compactor", "eval", "--model", "smollm2-135m",
        "--niah", str(niah), "--niah-tokens", str(T), "--methods", "full,am-highest",
        "--ratios", "0.1", "--json", str(out), "--no-progress",
    ]  # fmt: skip
    return cmd if chunk is None else [*cmd, "--chunk-size", str(chunk)]


def parse_cases(text: str) -> list[tuple[int, int | None]]:
    """'4096:none,8192:4096' -> [(4096, None), (8192, 4096)]; ValueError names a bad case."""
    cases = []
    for part in text.split(","):
        T, _, chunk = part.partition(":")
        try:
            cases.append((int(T), None if chunk in ("", "none") else int(chunk)))
        except ValueError:
            raise ValueError(f"bad case {part!r}: expected T:CHUNK or T:none") from None
    return cases


def run_case(T: int, chunk: int | None, niah: int, runs: Path, reuse: bool) -> dict[str, Any]:
    path = runs / f"eval{T // 1024}k_{chunk or 'none'}.json"
    cmd = eval_command(T, chunk, niah, path)
    reused = reuse and path.is_file()
    if not reused:
        print("running:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    data = json.loads(path.read_text())
    (rec,) = [r for r in data["records"] if r["method"] == "am-highest"]
    mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
    return {
        "T": T,
        "chunk_size": chunk,
        "command": " ".join(["python", *cmd[1:]]),
        "reused_run": reused,
        "run_finished": mtime.isoformat(timespec="seconds"),
        "cases": data["meta"]["cases"],
        "seconds": rec["seconds"],
        **{k: rec[k] for k in METRICS},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap, cases="4096:none,4096:1024,4096:2048,8192:none,8192:4096", niah=2)
    add_options(ap, runs=Path("/tmp/chunk_quality_runs"))
    ap.add_argument("--reuse", action="store_true", help="read eval JSONs already in --runs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    try:
        cases = parse_cases(a.cases)
    except ValueError as exc:
        ap.error(str(exc))
    a.runs.mkdir(parents=True, exist_ok=True)
    records = [run_case(T, c, a.niah, a.runs, a.reuse) for T, c in cases]
    for r in records:
        one = next((x for x in records if x["T"] == r["T"] and x["chunk_size"] is None), None)
        if one is not None and one is not r:
            r["vs_one_chunk"] = {k: r[k] - one[k] for k in METRICS}
            r["output_rel_err_ratio"] = r["output_rel_err"] / one["output_rel_err"]
        print(
            f"T={r['T']:>5} chunk={r['chunk_size'] or 'none':>5}  "
            + "  ".join(f"{k} {r[k]:.3f}" for k in METRICS),
            flush=True,
        )
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "chunk_quality.json"
    path.write_text(json.dumps({"provenance": provenance(), "records": records}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
