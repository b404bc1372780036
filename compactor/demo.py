"""`make demo`: compact a real document with the embedded model and print live quality figures.

Until the serving demo lands (SGLang + `compactor serve`, see sglang_ext/README.md for the
two-terminal quick start), this is the main job end to end on CPU:

1. prepare the embedded SmolLM2-135M checkpoint (a no-op when already prepared);
2. build a ~1k-token needle-in-a-haystack document from the filler text shipped in the repo;
3. compact it with each method at each ratio (reference queries: repeat-prefill + self-study)
   and measure, on held-out future queries (the questions and the full model's own answers),
   attention output / mass errors, the log-perplexity gap, greedy agreement and needle accuracy;
4. print the table and the KV memory held per shared prefix, and write JSON + PNG.

Every number printed is measured in this run; nothing is cached or canned.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from compactor.cli import main as cli_main

DEFAULT_METHODS = "full,keep-only,am-highest,am-omp-fast"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compactor.demo", description=__doc__.split("\n")[0])
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated methods")
    p.add_argument("--ratios", default="0.1", help="comma-separated kept ratios")
    p.add_argument("--tokens", type=int, default=1000, help="document length in tokens")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    out_json, out_png = args.out / "demo.json", args.out / "demo.png"
    print("== 1/3 embedded model: compactor models prepare smollm2-135m", flush=True)
    if cli_main(["models", "prepare", "smollm2-135m"]) != 0:
        return 1
    print(
        f"== 2/3 compact a {args.tokens}-token document and evaluate ({args.methods})", flush=True
    )
    rc = cli_main(
        [
            "eval", "--model", "smollm2-135m", "--niah", "1", "--niah-tokens", str(args.tokens),
            "--methods", args.methods, "--ratios", args.ratios,
            "--json", str(out_json), "--plot", str(out_png),
        ]
    )  # fmt: skip
    if rc != 0:
        return rc
    print("== 3/3 KV memory held by the shared prefix (per layer and KV head, all layers)")
    records = json.loads(out_json.read_text())
    records = records["records"] if isinstance(records, dict) else records
    full = next((r for r in records if r["method"] == "full"), None)
    for r in records:
        if r["method"] == "full" or full is None:
            continue
        saved = full["kept_tokens"] / max(r["kept_tokens"], 1)
        print(
            f"  {r['method']:<12} ratio {r['ratio']:<5} keeps {r['kept_tokens']:>7.0f} of "
            f"{full['kept_tokens']:.0f} entries ({saved:.1f}x less), "
            f"logppl gap {r['logppl_gap']:+.3f}, needles {r.get('niah_accuracy', float('nan')):.2f}"
        )
    print(f"wrote {out_json} and {out_png} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
