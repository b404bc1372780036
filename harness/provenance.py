"""Provenance of a result file: the command, the code's commit, the machine and the date.

Every script that writes a result under `benchmarks/results/` stores `provenance()` in it
(key `provenance`), so a README figure can be traced to the run that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "provenance"]

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: list[str] | None = None, module: str | None = None) -> dict[str, Any]:
    """What produced a result: a JSON-ready dict.

    Args:
        argv: the script's arguments (default `sys.argv[1:]`).
        module: run as `python -m module` (default: the module `python -m` ran, else
            `python <script path>`).
    Returns keys: command, commit, dirty (uncommitted changes to tracked files outside
    benchmarks/results), machine (platform, CPU model, CPU count, usable CPUs), load_avg (1, 5
    and 15 min: other jobs on a shared machine slow timings), python, torch, date (UTC).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module is None and main_spec is not None and main_spec.name != "__main__":
        module = main_spec.name  # run as `python -m ...`
    if module is not None:
        head = ["python", "-m", module]
    else:
        script = Path(sys.argv[0]).resolve()
        try:
            head = ["python", str(script.relative_to(ROOT))]
        except ValueError:
            head = ["python", str(script)]
    # results being rewritten do not make the code dirty
    status = _git(
        "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"
    )
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "command": shlex.join([*head, *args]),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else None,
        },
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch_version,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
