"""What one run of the suite took: read from `scripts/run_tests.sh`'s output (`make test`), or
from `.ci/run`'s, which also says what setting up the venvs and lint took.

    d=$(mktemp -d); git clone -q . "$d" && cd "$d" && .ci/run > ../ci.log 2>&1
    python -m benchmarks.report.suite_time --log ../ci.log --json benchmarks/results/suite_time.json

Run it in the clone that ran the suite (its provenance names that commit). Records the tests'
seconds (the script's `run_tests: ... s in all` line), each pytest session's summary (passed,
skipped, seconds), the 15 slowest tests of both streams, each stream's exit, and from a
`.ci/run` log the whole run's seconds and its setup and lint part (`ci_s`, `setup_s`; None
from a `make test` log).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks import add_options, script_parser
from harness.provenance import provenance

_SESSION = re.compile(r"^(\d+) passed(?:, (\d+) skipped)?.* in ([0-9.]+)s", re.M)
_SLOW = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)", re.M)
_TOTAL = re.compile(r"^run_tests: (\d+) s in all", re.M)
_CI = re.compile(r"^ci: (\d+) s in all \(setup and lint (\d+) s\)", re.M)
_EXITS = re.compile(r"^run_tests: stream 1 \(server tests\) exit (\d+), stream 2 exit (\d+)", re.M)


def read_log(text: str) -> dict[str, Any]:
    """The figures of one run_tests.sh output. ValueError when its summary lines are missing
    (the run was cut short)."""
    total, exits = _TOTAL.search(text), _EXITS.search(text)
    if total is None or exits is None:
        raise ValueError("no run_tests summary in the log: was the run cut short?")
    sessions = [{"passed": int(p), "skipped": int(s or 0), "seconds": float(t)}
                for p, s, t in _SESSION.findall(text)]  # fmt: skip
    # (the script's own list repeats the sessions' lines: each test once)
    slow = sorted({(float(s), f"{w} {t}") for s, w, t in _SLOW.findall(text)}, reverse=True)
    ci = _CI.search(text)
    return {
        "ci_s": None if ci is None else int(ci.group(1)),
        "setup_s": None if ci is None else int(ci.group(2)),
        "total_s": int(total.group(1)),
        "stream_exits": [int(exits.group(1)), int(exits.group(2))],
        "sessions": sessions,
        "slowest": [{"seconds": s, "test": t} for s, t in slow[:15]],
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--log", type=Path, required=True, help="run_tests.sh's output")
    add_options(p, json=Path("benchmarks/results/suite_time.json"))
    a = p.parse_args(argv)
    res = {**read_log(a.log.read_text(errors="replace")), "provenance": provenance(argv)}
    a.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{res['total_s']} s in all ({res['total_s'] / 60:.1f} min); exits {res['stream_exits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
