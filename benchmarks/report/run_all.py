"""`make bench`: run every benchmark that can run on this machine, one after another.

Each writes JSON (+ PNG where it plots) under benchmarks/results/. GPU-only benchmarks run
only when CUDA is available; the kvpress cross-check only when its venv exists
(scripts/setup_kvpress_venv.sh). Expect ~1 hour on a 2-core CPU machine; pass names to run a
subset: `python -m benchmarks.report.run_all cluster_sim methods_speed`.
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import ROOT

KVPRESS_VENV = ROOT / "third_party" / ".kvpress-venv"


def benchmarks() -> dict[str, list[str]]:
    """name -> argv (without the interpreter)."""
    return {
        "cluster_sim": ["-m", "benchmarks.offline.cluster_sim"],
        "methods_speed": [
            "-m",
            "benchmarks.offline.methods_speed",
            "--json",
            "benchmarks/results/methods_speed.json",
        ],
        "quality": ["-m", "benchmarks.offline.quality"],
        "agreement": ["-m", "benchmarks.server.agreement"],
        "next_question": ["-m", "benchmarks.server.next_question"],
        "service": ["-m", "benchmarks.offline.service", "--tokens", "1024", "--repeats", "1"],
        "serving": ["-m", "benchmarks.server.serving"],
        "plugin_overhead": ["-m", "benchmarks.server.plugin_overhead"],
        "kvpress_crosscheck": ["-m", "benchmarks.offline.kvpress_crosscheck"],
        "kernels": ["-m", "benchmarks.gpu.decode_attention"],
    }


def runnable(name: str) -> str | None:
    """None when `name` can run here, else the reason it is skipped."""
    if name == "kernels":
        import torch

        return None if torch.cuda.is_available() else "needs a CUDA device"
    if name == "kvpress_crosscheck" and not KVPRESS_VENV.exists():
        return f"needs {KVPRESS_VENV} (scripts/setup_kvpress_venv.sh)"
    return None


def main(argv: list[str]) -> int:
    table = benchmarks()
    unknown = [n for n in argv if n not in table]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {', '.join(table)}", file=sys.stderr)
        return 2
    failed = []
    for name in argv or list(table):
        reason = runnable(name)
        if reason:
            print(f"== {name}: skipped ({reason})", flush=True)
            continue
        print(f"== {name}: {' '.join(table[name])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, *table[name]], cwd=ROOT)
        print(f"== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
