"""How large compacted keys, values and beta get next to the original KV (the install's slack).

    python -m benchmarks.server.magnitudes        # writes benchmarks/results/magnitudes.json

Compacts one document of the embedded SmolLM2 with several methods and ratios and reports,
over all layers, max |K_compacted| / max |K_original| and the same for values (per layer, the
largest ratio), and the largest finite beta next to ln T. `sglang_ext.installer` refuses a
result beyond KEY_SLACK / VALUE_SLACK x the original prefix's max or beta > ln T + BETA_SLACK;
`tests/sglang_ext/test_install.py` checks those constants against this file's figures.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from benchmarks import add_options
from harness.provenance import ROOT, provenance

__all__ = ["measure"]

RESULT = ROOT / "benchmarks" / "results" / "magnitudes.json"
METHODS = ("am-omp-fast", "am-highest", "gvote", "snapkv")
RATIOS = (0.05, 0.1, 0.3)


def measure(tokens: int = 600) -> dict[str, Any]:
    """Rows of {method, ratio, T, key_ratio, value_ratio, beta_max, ln_T}."""
    import torch

    from compactor.hf import load_model
    from compactor.models import prepare_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.spec import CompactionSpec
    from harness.workload import document

    torch.set_num_threads(1)
    model, tok = load_model(prepare_model("smollm2-135m"))
    ids = tok(document(40))["input_ids"][:tokens]
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    original = [(layer.keys.abs().max(), layer.values.abs().max()) for layer in cache.layers]
    rows = []
    for method in METHODS:
        for ratio in RATIOS:
            spec = CompactionSpec(method=method, ratio=ratio)
            prefix, _ = compact_prefix(model, tok, ids, spec, hooks=Hooks(progress=False))
            k_ratio = v_ratio = 0.0
            beta_max = -math.inf
            for layer, (k_max, v_max) in zip(prefix.layers, original, strict=True):
                k_ratio = max(k_ratio, float(layer.keys.abs().max() / k_max))
                v_ratio = max(v_ratio, float(layer.values.abs().max() / v_max))
                finite = layer.beta[torch.isfinite(layer.beta)]
                if finite.numel():
                    beta_max = max(beta_max, float(finite.max()))
            rows.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "T": len(ids),
                    "key_ratio": round(k_ratio, 4),
                    "value_ratio": round(v_ratio, 4),
                    "beta_max": round(beta_max, 4),
                    "ln_T": round(math.log(len(ids)), 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return {
        "rows": rows,
        "max_key_ratio": max(r["key_ratio"] for r in rows),
        "max_value_ratio": max(r["value_ratio"] for r in rows),
        "max_beta_minus_ln_T": max(r["beta_max"] - r["ln_T"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, tokens=600, out=RESULT)
    args = ap.parse_args(argv)
    result = measure(args.tokens)
    result["provenance"] = provenance(argv)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
