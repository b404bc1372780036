"""The examples run as a user runs them (`python examples/<name>.py`) and say what they promise:
the compacted cache answers the question as the full one does; a running service compacts a
document, then answers the same request from its cache."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from harness.launch import CompactorService, free_port, start_all

ROOT = Path(__file__).resolve().parents[2]


def run(name: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_compact_document_answers_as_the_full_cache() -> None:
    lines = run("compact_document.py").splitlines()
    assert lines[0].startswith("document: ") and "(10% of the full cache), method kvzip" in lines[0]
    answers = dict(line.split(": ", 1) for line in lines[1:])
    assert set(answers) == {"     full", "compacted"}
    assert answers["compacted"] == answers["     full"] and "yellow" in answers["compacted"]


def test_ask_the_service_then_its_cache(tmp_path: Path) -> None:
    svc = CompactorService("smollm2-135m", tmp_path / "compactor.log", in_process=True,
                           port=free_port())  # fmt: skip
    with contextlib.ExitStack() as stack:
        start_all(stack, [svc])
        lines = run("ask_the_service.py", svc.endpoint).splitlines()
    assert lines[0].startswith(f"service at {svc.endpoint} serves smollm2-135m"), lines
    assert lines[1].startswith("first: ") and lines[1].endswith("from the cache: False")
    assert lines[2].startswith("again: ") and lines[2].endswith("from the cache: True")
    assert lines[1].split(",")[0] == lines[2].split(",")[0].replace("again", "first")
