"""Per-layer compaction speed of the registered methods on synthetic SmolLM2-like heads.

Shape legend: T prefix tokens, t kept, n reference queries, H_kv KV heads, D head dim.

    .venv/bin/python benchmarks/methods_speed.py --T 1024 --n 2048 --ratio 0.1 \
        --methods am-omp-fast am-omp am-highest --json out.json [--device cuda]

Keys/queries are drawn with a few dominant directions plus noise so attention is peaked
(like real heads); single-threaded by default (one torch thread per worker, see DESIGN.md).
The layer is drawn on the CPU (the same data on every device) and moved to ``--device``,
where the fit runs; on CUDA the timer reads after a synchronize.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

from compactor.budgets import head_budgets
from compactor.methods import get_method
from compactor.solvers import attend


def synthetic_layer(H: int, T: int, n: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    """keys/values [H, T, D], fit queries [H, n, D], held-out queries [H, n, D]."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(H, 8, D, generator=g) * 2.0
    assign = torch.randint(0, 8, (H, T), generator=g)
    keys = torch.gather(centers, 1, assign.unsqueeze(-1).expand(-1, -1, D))
    keys = keys + torch.randn(H, T, D, generator=g)
    values = torch.randn(H, T, D, generator=g)

    def q(m: int) -> torch.Tensor:
        a = torch.randint(0, 8, (H, m), generator=g)
        return torch.gather(centers, 1, a.unsqueeze(-1).expand(-1, -1, D)) + torch.randn(
            H, m, D, generator=g
        )

    return keys, values, q(n), q(n)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU) so timers see all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--methods", nargs="+", default=["am-omp-fast", "am-omp", "am-highest", "keep-only"]
    )
    ap.add_argument("--H", type=int, default=3, help="KV heads per layer")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--n", type=int, default=2048, help="reference queries per KV head")
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30, help="for the whole-model estimate")
    ap.add_argument("--device", default="cpu", help="torch device of the layer and the fit")
    ap.add_argument("--json", default="methods_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    layer_data = synthetic_layer(args.H, args.T, args.n, args.D, seed=0)
    keys, values, q_fit, q_eval = (x.to(device) for x in layer_data)
    budgets = head_budgets(args.T, args.H, ratio=args.ratio)
    ref_out, ref_lse = attend(q_eval, keys, values)
    rows = []
    for name in args.methods:
        method = get_method(name)
        method.compact_layer(keys, values, q_fit, budgets)  # warm-up
        times = []
        for _ in range(args.repeats):
            _sync(device)
            t0 = time.perf_counter()
            layer = method.compact_layer(keys, values, q_fit, budgets)
            _sync(device)
            times.append(time.perf_counter() - t0)
        out_err, mass_err = [], []
        for h in range(args.H):
            k, v, b = layer.head(h)
            o, lse = attend(q_eval[h], k, v, b)
            out_err.append(float((o - ref_out[h]).norm() / ref_out[h].norm()))
            mass_err.append(float((lse - ref_lse[h]).exp().sub(1).abs().mean()))
        best = min(times)
        rows.append(
            {
                "method": name,
                "params": method.params(),
                "sec_per_layer": best,
                "sec_per_model": best * args.layers,
                "kept": layer.head_lengths(),
                "heldout_rel_out_err": sum(out_err) / len(out_err),
                "heldout_rel_mass_err": sum(mass_err) / len(mass_err),
            }
        )
    print(
        f"H_kv={args.H} T={args.T} n={args.n} D={args.D} ratio={args.ratio} "
        f"threads={args.threads} device={device} ({_device_name(device)}) "
        f"(best of {args.repeats})"
    )
    print(
        f"{'method':<14}{'s/layer':>10}{'s/' + str(args.layers) + ' layers':>14}"
        f"{'out err':>10}{'mass err':>10}  kept"
    )
    for r in rows:
        print(
            f"{r['method']:<14}{r['sec_per_layer']:>10.3f}{r['sec_per_model']:>14.2f}"
            f"{r['heldout_rel_out_err']:>10.3f}{r['heldout_rel_mass_err']:>10.3f}  {r['kept']}"
        )
    meta = {k: v for k, v in vars(args).items() if k != "json"}
    meta["torch"] = torch.__version__
    meta["machine"] = platform.machine()
    meta["device_name"] = _device_name(device)
    meta["budgets"] = budgets
    with open(args.json, "w") as f:
        json.dump({"config": meta, "results": rows}, f, indent=2)
    print(f"wrote {args.json}")
    if not all(math.isfinite(r["heldout_rel_out_err"]) for r in rows):
        raise SystemExit("non-finite error")


if __name__ == "__main__":
    main()
