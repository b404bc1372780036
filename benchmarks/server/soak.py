"""Soak: many install / flush cycles of one compacted prefix on a real CPU SGLang server.

    python -m benchmarks.server.soak --cycles 300        # writes benchmarks/results/soak.json

Each cycle: two requests share a document and branch after it (the plugin's trigger), the
real `compactor serve` answers (from its result cache after the first cycle), the plugin
installs the compacted prefix, a third request is served from it, then `/flush_cache`
drops everything. After each cycle the script reads, from the server's own /metrics, the KV
pool's free slots, the slots the beta store marks compacted and the install counter, and
the scheduler process's RSS from /proc. Free slots and beta slots must come back to their
baseline exactly; RSS is reported as growth after the warm-up cycles and as a per-cycle slope.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import add_options
from harness.launch import CompactorService, SGLangServer, start_all
from harness.provenance import ROOT, provenance
from harness.workload import compaction_args, document, metric, prompt

__all__ = ["QUESTIONS", "run_soak", "scheduler_rss_bytes"]

RESULT = ROOT / "benchmarks" / "results" / "soak.json"
QUESTIONS = ("What is the first room?", "Who wrote the report?", "How many rooms are there?")


def scheduler_rss_bytes(server_pid: int) -> int | None:
    """RSS of the server's scheduler process (SGLang names it `sglang::scheduler...`)."""
    import psutil

    try:
        for child in psutil.Process(server_pid).children(recursive=True):
            name = " ".join([child.name(), *child.cmdline()])
            if "scheduler" in name:
                return int(child.memory_info().rss)
    except psutil.Error:
        return None
    return None


def _wait(server: SGLangServer, name: str, target: float, timeout_s: float) -> float:
    """Poll a /metrics series until it equals `target`; returns its last value."""
    deadline = time.monotonic() + timeout_s
    value = metric(server, name)
    while value != target and time.monotonic() < deadline:
        time.sleep(0.2)
        value = metric(server, name)
    return value


def run_soak(
    model: Path,
    workdir: Path,
    cycles: int,
    warmup: int = 3,
    sentences: int = 16,
    after: Callable[[SGLangServer, str], None] | None = None,
    method: str = "am-highest",
) -> dict[str, Any]:
    """Run the soak; returns per-cycle samples and the summary (see the module docstring).
    `after(server, doc)` runs on the live server once the cycles are done; `method` is the
    compaction method (gvote: budgets that differ per layer and head, packed)."""
    if cycles <= warmup:
        raise ValueError(f"cycles must be > warmup={warmup}, got {cycles}")
    doc = document(sentences)
    samples: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        service = CompactorService(model, workdir / "service.log", in_process=True)
        start_all(stack, [service])  # its port is known once it is up
        flags = compaction_args(service.endpoint, 0.1, method, min_hits=2, min_prefix_tokens=128)
        server = SGLangServer(
            model,
            workdir / "server.log",
            max_total_tokens=4096,
            extra_args=[*flags, "--enable-metrics"],
        )
        start_all(stack, [server])
        assert server.pid is not None
        t0 = time.monotonic()
        for i in range(cycles):
            for q in QUESTIONS[:2]:
                server.generate(prompt(doc, q), max_new_tokens=1)
            installed = _wait(server, "sglang:compaction_installed_total", i + 1, 120)
            if installed != i + 1:
                raise RuntimeError(f"cycle {i}: {installed} installs, expected {i + 1}")
            served = server.generate(prompt(doc, QUESTIONS[2]), max_new_tokens=1)
            held = int(metric(server, "sglang:compaction_physical_tokens"))
            server.flush_cache()
            pool = metric(server, "sglang:compaction_pool_slots")
            free = _wait(server, "sglang:compaction_free_slots", pool, 30)
            samples.append(
                {
                    "cycle": i,
                    "seconds": round(time.monotonic() - t0, 2),
                    "free_slots": int(free),
                    "pool_slots": int(pool),
                    "beta_slots": int(metric(server, "sglang:compaction_beta_slots")),
                    "physical_tokens": int(metric(server, "sglang:compaction_physical_tokens")),
                    "physical_tokens_before_flush": held,
                    "cached_tokens": int(served["meta_info"].get("cached_tokens", 0)),
                    "scheduler_rss_bytes": scheduler_rss_bytes(server.pid),
                }
            )
            if i % 25 == 0 or i == cycles - 1:
                s = samples[-1]
                print(
                    f"cycle {i + 1}/{cycles}: free {s['free_slots']}/{s['pool_slots']} "
                    f"beta_slots {s['beta_slots']} rss {(s['scheduler_rss_bytes'] or 0) >> 20} MiB",
                    flush=True,
                )
        if after is not None:
            after(server, doc)
        invalid = metric(server, "sglang:compaction_invalid_total")
        failures = metric(server, "sglang:compaction_failures_total")
    return {"samples": samples, "summary": summarize(samples, warmup, invalid, failures)}


def summarize(
    samples: list[dict[str, Any]], warmup: int, invalid: float, failures: float
) -> dict[str, Any]:
    """Baseline (after `warmup` cycles) vs the end, and the RSS slope per cycle."""
    base, end = samples[warmup - 1], samples[-1]
    rss = [(s["cycle"], s["scheduler_rss_bytes"]) for s in samples[warmup - 1 :]]
    slope = None
    if all(r is not None for _, r in rss) and len(rss) > 1:
        n = len(rss)
        mx = sum(c for c, _ in rss) / n
        my = sum(r for _, r in rss) / n
        var = sum((c - mx) ** 2 for c, _ in rss)
        slope = sum((c - mx) * (r - my) for c, r in rss) / var if var else 0.0
    b_rss, e_rss = base["scheduler_rss_bytes"], end["scheduler_rss_bytes"]
    return {
        "cycles": len(samples),
        "warmup_cycles": warmup,
        "installs_invalid": int(invalid),
        "installs_failed": int(failures),
        "compacted_prefix_held_every_cycle": all(
            s["physical_tokens_before_flush"] > 0 for s in samples
        ),
        "third_request_hit_the_prefix_every_cycle": all(s["cached_tokens"] > 0 for s in samples),
        "free_slots_always_back_to_pool": all(s["free_slots"] == s["pool_slots"] for s in samples),
        "beta_slots_max_after_flush": max(s["beta_slots"] for s in samples),
        "physical_tokens_max_after_flush": max(s["physical_tokens"] for s in samples),
        "scheduler_rss_baseline_mib": None if b_rss is None else round(b_rss / 2**20, 1),
        "scheduler_rss_end_mib": None if e_rss is None else round(e_rss / 2**20, 1),
        "scheduler_rss_growth_mib": (
            None if b_rss is None or e_rss is None else round((e_rss - b_rss) / 2**20, 2)
        ),
        "scheduler_rss_slope_kib_per_cycle": None if slope is None else round(slope / 1024, 2),
        "wall_seconds": end["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, cycles=300, warmup=3, out=RESULT)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the servers' logs here")
    ap.add_argument("--method", default="am-highest", help="compaction method")
    args = ap.parse_args(argv)
    from compactor.models import prepare_model

    model = prepare_model("smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run_soak(model, workdir, args.cycles, args.warmup, method=args.method)
    result["provenance"] = provenance(argv)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
