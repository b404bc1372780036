"""Per-layer compaction speed of the registered methods on synthetic SmolLM2-like heads.

Shape legend: T prefix tokens, t kept, n reference queries, H_kv KV heads, D head dim.

    .venv/bin/python -m benchmarks.offline.methods_speed --T 1024 --n 2048 --ratio 0.1 \
        --methods am-omp-fast am-omp am-highest --json out.json [--device cuda]

Keys/queries are drawn with a few dominant directions plus noise so attention is peaked
(like real heads); single-threaded by default (one torch thread per worker, as the service runs them).
The layer is drawn on the CPU (the same data on every device) and moved to ``--device``,
where the fit runs; on CUDA the timer reads after a synchronize and the peak memory of each
method's fit is recorded. ``--exact-check`` also refits each selecting method's keys with the
exact NNLS (host syncs, many more rounds) and records both held-out errors, to show what the
fixed-work solver gives up (or not).
"""

from __future__ import annotations

import json
import math
import platform
import time
from typing import Any

# the repository first: this folder's kernels.py would shadow the `kernels` package
import torch

from benchmarks import add_options, script_parser
from compactor.head_budgets.uniform import head_budgets
from compactor.methods import SelectingMethod, get_method
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


def heldout_errors(
    layer: Any, q_eval: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> tuple[float, float]:
    """Mean over heads of the relative output error and of |mass ratio - 1| on q_eval."""
    out_err, mass_err = [], []
    for h in range(q_eval.shape[0]):
        k, v, b = layer.head(h)
        o, lse = attend(q_eval[h], k, v, b)
        out_err.append(float((o - ref_out[h]).norm() / ref_out[h].norm()))
        mass_err.append(float((lse - ref_lse[h]).exp().sub(1).abs().mean()))
    return sum(out_err) / len(out_err), sum(mass_err) / len(mass_err)


def exact_check(
    method: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_fit: torch.Tensor,
    budgets: list[int],
    q_eval: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
) -> dict[str, Any]:
    """The method's keys refitted with the fixed-work NNLS (as shipped) and the exact one:
    held-out errors and seconds of each refit."""
    from compactor.methods.refit import NNLS_ROUNDS, refit

    spec = method.refit_spec()
    if spec is None:
        return {}
    sel = method.select(keys, values, q_fit, budgets)
    out: dict[str, Any] = {}
    for label, rounds in (("fixed", NNLS_ROUNDS), ("exact", None)):
        _sync(keys.device)
        t0 = time.perf_counter()
        layer = refit(
            keys,
            values,
            q_fit,
            sel,
            beta_bounds=spec.beta_bounds,
            fit_beta=spec.fit_beta,
            fit_values=spec.fit_values,
            value_ridge=spec.value_ridge,
            nnls_rounds=rounds,
        )
        _sync(keys.device)
        dt = time.perf_counter() - t0
        oe, me = heldout_errors(layer, q_eval, ref_out, ref_lse)
        out[f"refit_{label}"] = {
            "seconds": dt,
            "heldout_rel_out_err": oe,
            "heldout_rel_mass_err": me,
        }
    return out


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU) so timers see all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main() -> None:
    ap = script_parser(__doc__)
    ap.add_argument(
        "--methods", nargs="+", default=["am-omp-fast", "am-omp", "am-highest", "keep-only"]
    )
    ap.add_argument("--H", type=int, default=3, help="KV heads per layer")
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--n", type=int, default=2048, help="reference queries per KV head")
    add_options(ap, D=64, ratio=0.1, repeats=3, threads=1)
    ap.add_argument("--layers", type=int, default=30, help="for the whole-model estimate")
    ap.add_argument("--device", default="cpu", help="torch device of the layer and the fit")
    ap.add_argument("--json", default="methods_speed.json")
    ap.add_argument(
        "--exact-check",
        action="store_true",
        help="also refit the selection with the exact NNLS and record both held-out errors",
    )
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
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base_mem = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(args.repeats):
            _sync(device)
            t0 = time.perf_counter()
            layer = method.compact_layer(keys, values, q_fit, budgets)
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = (
            (torch.cuda.max_memory_allocated(device) - base_mem) / 2**30
            if device.type == "cuda"
            else None
        )
        out_err, mass_err = heldout_errors(layer, q_eval, ref_out, ref_lse)
        best = min(times)
        extra: dict = {}
        if args.exact_check and isinstance(method, SelectingMethod):
            extra = exact_check(method, keys, values, q_fit, budgets, q_eval, ref_out, ref_lse)
        rows.append(
            {
                "method": name,
                "params": method.params(),
                "sec_per_layer": best,
                "sec_per_model": best * args.layers,
                "kept": layer.head_lengths(),
                "heldout_rel_out_err": out_err,
                "heldout_rel_mass_err": mass_err,
                "peak_fit_memory_gib": peak,
                **extra,
            }
        )
    print(
        f"H_kv={args.H} T={args.T} n={args.n} D={args.D} ratio={args.ratio} "
        f"threads={args.threads} device={device} ({_device_name(device)}) "
        f"(best of {args.repeats})"
    )
    print(
        f"{'method':<14}{'s/layer':>10}{'s/' + str(args.layers) + ' layers':>14}"
        f"{'out err':>10}{'mass err':>10}{'peak GiB':>10}  kept"
    )
    for r in rows:
        peak = r["peak_fit_memory_gib"]
        print(
            f"{r['method']:<14}{r['sec_per_layer']:>10.3f}{r['sec_per_model']:>14.2f}"
            f"{r['heldout_rel_out_err']:>10.3f}{r['heldout_rel_mass_err']:>10.3f}"
            f"{'-' if peak is None else f'{peak:.2f}':>10}  {r['kept']}"
        )
        for label in ("fixed", "exact"):
            x = r.get(f"refit_{label}")
            if x:
                print(
                    f"    refit with {label} NNLS: {x['seconds']:.3f} s, held-out out err "
                    f"{x['heldout_rel_out_err']:.4f}, mass err {x['heldout_rel_mass_err']:.4f}"
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
