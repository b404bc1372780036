"""What the plugin costs a server that compacts nothing: decode throughput of stock SGLang
(the plugin not loaded), the plugin loaded without --compaction-endpoint (off), and the plugin
on but idle (an endpoint, nothing compacted yet).

    python -m benchmarks.server.plugin_overhead [--rounds 3] [--batch 8] [--tokens 64]

The three servers (the embedded SmolLM2-135M, CPU, `--sleep-on-idle`) run side by side and
take turns: each round sends every server the same burst of `batch` random-id prompts
(`tokens` new tokens each, ignore_eos), one server at a time; a server's figure is the median
over rounds of the scheduler's `gen throughput` on full-batch decode lines (its own log).
Writes benchmarks/results/plugin_overhead.json (figures relative to stock, with provenance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options
from benchmarks.gpu.serving.phases import burst, random_ids

CONFIGS = ("stock", "off", "idle")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap, rounds=3, batch=8)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    add_options(ap, out=ROOT / "benchmarks" / "results", logs=Path("/tmp/plugin_overhead"))
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.batch < 1 or a.tokens < 8:
        ap.error("--rounds and --batch must be >= 1, --tokens >= 8")

    from compactor.models import prepare_model
    from harness.launch import SGLangServer, free_port, start_all
    from harness.provenance import provenance
    from harness.workload import compaction_args

    model = prepare_model("smollm2-135m")
    a.logs.mkdir(parents=True, exist_ok=True)
    common = ["--enable-metrics", "--decode-log-interval", "1",
              "--max-running-requests", str(a.batch)]  # fmt: skip
    # idle: a service address nothing listens on, and a trigger no burst reaches
    idle = compaction_args(f"127.0.0.1:{free_port()}", 0.1, min_hits=10_000)
    flags = {"stock": (False, []), "off": (True, []), "idle": (True, idle)}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    with contextlib.ExitStack() as stack:
        servers = {
            c: SGLangServer(model, a.logs / f"sglang-{c}.log", max_total_tokens=8192,
                            extra_args=common + flags[c][1], plugin=flags[c][0])
            for c in CONFIGS
        }  # fmt: skip
        start_all(stack, list(servers.values()))
        for r in range(a.rounds + 1):  # round 0 warms every server up and is not counted
            for i, c in enumerate(CONFIGS):
                prompts = [random_ids(a.prompt, 1000 * r + 10 * i + j, 49152) for j in
                           range(a.batch)]  # fmt: skip
                rec = burst(servers[c], prompts, a.tokens)
                if r:
                    runs[c].append(rec)
                print(f"round {r} {c}: {rec['decode_tokens_per_s']} tok/s", flush=True)
    tps = {
        c: statistics.median(x["decode_tokens_per_s"] for x in runs[c] if x["decode_tokens_per_s"])
        for c in CONFIGS
    }
    result = {
        "decode_tokens_per_s": tps,
        "relative_to_stock": {c: tps[c] / tps["stock"] for c in CONFIGS},
        "rounds": runs,
        "settings": vars(a) | {"out": str(a.out), "logs": str(a.logs), "model": str(model)},
        "provenance": provenance(module="benchmarks.server.plugin_overhead"),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "plugin_overhead.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result["relative_to_stock"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
