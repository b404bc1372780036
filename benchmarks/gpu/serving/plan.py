"""The device plan of a GPU run, checked before any GPU time is spent.

    bash scripts/gpu_serving.sh plan        # = python -m benchmarks.gpu.serving.plan [--phases ...]

A device session has `SESSION_S` seconds of machine time in all (the machine's start, each
command, the transfers and the idle wait after the last call count), and one command may run
`COMMAND_LIMIT_S` at most (9 of its 10 minutes: a command killed at the limit loses its logs).
The plan lists each call: what travels (the working tree and the carried wheelhouse, MiB),
what runs, and each step's seconds as recorded by past runs
(`benchmarks/results/gpu_runs/timings.json`, each figure with its source). It exits non-zero
when a command is over its limit or the whole does not fit the session with `MARGIN_S` to
spare. It needs nothing staged and no GPU.

`benchmarks.gpu.serving.run` reads the same figures: a phase starts only while the time left
covers its recorded need (`need_s`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT

TIMINGS = ROOT / "benchmarks" / "results" / "gpu_runs" / "timings.json"
WHEELHOUSE = ".whl/gpu_serving"  # scripts/gpu_serving.sh pack writes it; git ignores it
SESSION_S = 900.0  # device time a session has, machine start included
COMMAND_LIMIT_S = 540.0  # one command's limit, with a minute to spare under the device's 10
MARGIN_S = 120.0  # what the whole plan leaves unspent
TREE_LIMIT_MIB = 64.0  # the working tree plus carried paths, per call
PHASES = ("identity", "stock8b", "plugin8b")

__all__ = [
    "COMMAND_LIMIT_S",
    "PHASES",
    "Call",
    "Step",
    "check",
    "load_timings",
    "need_s",
    "plan_calls",
    "tree_mib",
]


@dataclass(frozen=True)
class Step:
    """One part of a call's command: its recorded seconds; `beside` steps run alongside the
    others and are off the critical path (their time is not added)."""

    name: str
    seconds: float
    beside: bool = False


@dataclass(frozen=True)
class Call:
    """One `run` on the device machine: carried paths, the command, its steps."""

    name: str
    carry: tuple[str, ...]
    command: str
    steps: tuple[Step, ...]

    @property
    def command_s(self) -> float:
        """The command's estimated seconds (the steps on its critical path)."""
        return sum(s.seconds for s in self.steps if not s.beside)


def load_timings(path: Path = TIMINGS) -> dict[str, float]:
    """Step name -> recorded seconds (KeyError naming a step without `s`)."""
    steps = json.loads(path.read_text())["steps"]
    return {name: float(rec["s"]) for name, rec in steps.items()}


def need_s(phase: str, timings: dict[str, float] | None = None) -> float:
    """The recorded seconds phase `phase` needs once its servers are up."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; choose from {list(PHASES)}")
    return (load_timings() if timings is None else timings)[phase]


def plan_calls(timings: dict[str, float], phases: tuple[str, ...] = PHASES) -> list[Call]:
    """The calls of a GPU run, sent one after another while the machine is held:

    1. serve: install the wheelhouse, start the servers of `phases` together (one FlashInfer
       JIT: every model has head_dim 128), run the phases in order; the GPU tests run beside
       the servers' start;
    2. compaction: the compaction speed benchmark, then the plugin's attention work in one
       compacted decode step (`benchmarks.gpu.cascade_step`; no wheelhouse: torch, Triton and
       transformers are the machine's own).
    """
    serve = [Step("install", timings["install"]), Step("models", timings["models"]),
             Step("gpu_tests", timings["gpu_tests"], beside=True)]  # fmt: skip
    if phases:
        serve += [Step("server_start", timings["server_start"]),
                  Step("flashinfer_jit", timings["flashinfer_jit"])]  # fmt: skip
        serve += [Step(p, timings[p]) for p in phases]
        serve += [Step("run_overhead", timings["run_overhead"])]  # imports, shutdown, archive
    flag = "" if phases == PHASES else f" PHASES={','.join(phases)}"
    return [
        Call("serve", (WHEELHOUSE,), f"OUT=$OUT{flag} bash scripts/gpu_serving.sh",
             tuple(serve)),
        Call("compaction", (), "OUT=$OUT bash scripts/gpu_serving.sh compaction",
             (Step("compaction_speed", timings["compaction_speed"]),
              Step("cascade_step", timings["cascade_step"]))),
    ]  # fmt: skip


def tree_mib(carry: tuple[str, ...], recorded_wheelhouse_mib: float) -> float:
    """MiB that travel with a call: git's tracked and untracked-not-ignored files, and each
    carried path (the recorded wheelhouse size when it is not staged here)."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout  # fmt: skip
    files = [ROOT / f for f in out.decode().split("\0") if f]
    total = sum(f.stat().st_size for f in files if f.is_file())
    for path in carry:
        here = ROOT / path
        staged = [f for f in here.rglob("*") if f.is_file()] if here.is_dir() else []
        total += sum(f.stat().st_size for f in staged) or int(recorded_wheelhouse_mib * 2**20)
    return total / 2**20


def check(calls: list[Call], timings: dict[str, float], mib: list[float]) -> list[str]:
    """Problems with the plan (none: it fits). `mib[i]` travels with call i."""
    problems = []
    for call, size in zip(calls, mib):
        if call.command_s > COMMAND_LIMIT_S:
            problems.append(f"call {call.name}: its command needs {call.command_s:.0f} s, over "
                            f"the {COMMAND_LIMIT_S:.0f} s a command may run")  # fmt: skip
        if size > TREE_LIMIT_MIB:
            problems.append(f"call {call.name}: {size:.1f} MiB travel, over {TREE_LIMIT_MIB:g}")
    total = session_s(calls, timings, mib)
    if total > SESSION_S - MARGIN_S:
        problems.append(f"the plan needs {total:.0f} s of device time; a session has "
                        f"{SESSION_S:.0f} s and the plan keeps {MARGIN_S:.0f} s spare")  # fmt: skip
    return problems


def session_s(calls: list[Call], timings: dict[str, float], mib: list[float]) -> float:
    """Device time of the whole plan: one machine start (each call is sent while the machine
    is still held: a gap each), each call's transfer and command, the idle wait after the
    last."""
    transfer = sum(m * timings["transfer_per_mib"] for m in mib)
    commands = sum(c.command_s for c in calls) + timings["call_gap"] * (len(calls) - 1)
    return timings["machine_start"] + transfer + commands + timings["idle_release"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="the serving phases the call runs (comma-separated; empty: none)")  # fmt: skip
    ap.add_argument("--timings", type=Path, default=TIMINGS)
    a = ap.parse_args(argv)
    phases = tuple(p for p in a.phases.split(",") if p)
    if unknown := set(phases) - set(PHASES):
        ap.error(f"--phases: unknown {sorted(unknown)}; choose from {list(PHASES)}")
    timings = load_timings(a.timings)
    wheelhouse = json.loads(a.timings.read_text())["sizes"]["wheelhouse_mib"]["mib"]
    calls = plan_calls(timings, phases)
    mib = [tree_mib(c.carry, wheelhouse) for c in calls]
    shown = a.timings.relative_to(ROOT) if a.timings.is_relative_to(ROOT) else a.timings
    print(f"device plan (recorded timings: {shown})")
    print(f"  machine start                         {timings['machine_start']:6.0f} s")
    for call, size in zip(calls, mib):
        carried = ", ".join(call.carry) or "nothing"
        print(f"  call {call.name}: carry {carried}; {size:.1f} MiB travel "
              f"({size * timings['transfer_per_mib']:.0f} s)")  # fmt: skip
        print(f"    run: {call.command}")
        for step in call.steps:
            note = "  (beside the others)" if step.beside else ""
            print(f"    {step.name:34s}{step.seconds:6.0f} s{note}")
        print(f"    command                           {call.command_s:6.0f} s "
              f"(limit {COMMAND_LIMIT_S:.0f})")  # fmt: skip
    gaps = timings["call_gap"] * (len(calls) - 1)
    print(f"  gaps between calls (machine held)     {gaps:6.0f} s")
    print(f"  idle wait after the last call         {timings['idle_release']:6.0f} s")
    total = session_s(calls, timings, mib)
    print(f"  device time                           {total:6.0f} s of {SESSION_S:.0f} "
          f"(keep {MARGIN_S:.0f} spare)")  # fmt: skip
    problems = check(calls, timings, mib)
    for p in problems:
        print(f"DOES NOT FIT: {p}")
    print("plan: fits" if not problems else "plan: does not fit")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
