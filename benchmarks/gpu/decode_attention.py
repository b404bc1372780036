"""Decode-attention latency over a (compacted) paged prefix, GPU only.

For each prefix length L (default 1k..128k) and batch size B it times one decode step
(``q [B, H_q, D]`` over B requests of L slots each, page size 1) for:

    flashinfer_stock   FlashInfer's stock BatchDecodeWithPagedKVCacheWrapper, no beta
    triton_beta        compaction_kernels.biased_attention.triton paged decode, with beta (the plugin's)
    triton_beta_ragged the same kernel over the same entries per request, split unevenly over
                       the KV heads (head h keeps a share proportional to h + 1) and stored
                       ragged head by head: what a packed compacted prefix with per-head
                       budgets hands the cascade (`PackedLayout.read_ragged`; the gather
                       itself is not timed here)

and reports achieved bytes/s (K + V + beta + slot indices read, output written) against the
device's measured device-to-device copy bandwidth. Writes JSON (``--out``) and a plot
(``--plot``). Missing pieces (no flashinfer installed) are recorded as skipped, not faked.
Result files written before the FlashInfer beta variant was removed (the committed
``results/kernels.json``) also hold ``flashinfer_beta`` rows; the plot draws them too.

    python -m benchmarks.gpu.decode_attention --out benchmarks/results/kernels.json \
        --plot benchmarks/results/kernels.png
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import add_options
from harness.provenance import provenance

DEFAULT_LENGTHS = [1024, 4096, 16384, 65536, 131072]
DEFAULT_BATCHES = [1, 8, 32]
KERNELS = ("triton_beta", "triton_beta_ragged", "flashinfer_stock")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("kernels_bench.json"), help="JSON path")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (optional)")
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    p.add_argument("--batches", type=int, nargs="+", default=DEFAULT_BATCHES)
    add_options(p, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--shuffle", action="store_true", help="scatter slots over the pool")
    p.add_argument("--max-gib", type=float, default=24.0, help="skip configs whose KV exceeds this")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions per point")
    p.add_argument(
        "--kernels",
        nargs="+",
        choices=KERNELS,
        default=list(KERNELS),
        help="which kernels to time (default: all that can be built here)",
    )
    return p.parse_args(argv)


def _time_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median CUDA-event time of ``fn`` in ms, after warm-up, with an L2 flush between."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Factories ``(pool, q) -> run`` for every kernel that can be built here."""
    from compaction_kernels.biased_attention import triton as tri

    def triton_beta(pool: dict[str, torch.Tensor], q: torch.Tensor) -> Callable[[], Any]:
        w = tri.BiasedPagedAttention()
        w.plan(
            pool["kv_indptr"],
            pool["kv_indices"],
            args.num_qo_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        return lambda: w.run(q, pool["k"], pool["v"], pool["beta"])

    def triton_beta_ragged(pool: dict[str, torch.Tensor], q: torch.Tensor) -> Callable[[], Any]:
        w = tri.BiasedPagedAttention()
        w.plan(pool["ragged_indptr"], None, args.num_qo_heads, args.num_kv_heads, args.head_dim)
        rows = pool["k"].shape[0] * args.num_kv_heads
        keys, values = pool["k"].reshape(rows, -1), pool["v"].reshape(rows, -1)
        return lambda: w.run(q, keys, values, pool["beta"].reshape(rows))

    out: dict[str, Any] = {"triton_beta": triton_beta, "triton_beta_ragged": triton_beta_ragged}
    if "flashinfer_stock" not in args.kernels:
        return out
    try:
        import flashinfer
    except ImportError as exc:  # recorded in the JSON, not silently dropped
        out["flashinfer_stock"] = f"skipped: {exc}"
        return out

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")

    def flashinfer_stock(pool: dict[str, torch.Tensor], q: torch.Tensor) -> Callable[[], Any]:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        ones = torch.ones(q.shape[0], dtype=torch.int32, device="cuda")
        w.plan(
            pool["kv_indptr"],
            pool["kv_indices"],
            ones,
            args.num_qo_heads,
            args.num_kv_heads,
            args.head_dim,
            1,
            q_data_type=q.dtype,
        )
        paged = (pool["k"].unsqueeze(1), pool["v"].unsqueeze(1))
        return lambda: w.run(q, paged, return_lse=True)

    out["flashinfer_stock"] = flashinfer_stock
    return out


def _pool(batch: int, length: int, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    slots = batch * length
    h, d = args.num_kv_heads, args.head_dim
    k = torch.randn(slots, h, d, device="cuda", dtype=dtype)
    v = torch.randn(slots, h, d, device="cuda", dtype=dtype)
    beta = torch.randn(slots, h, device="cuda") * 0.5
    beta[::7] = -math.inf  # some masked (padding) slots
    order = (
        torch.randperm(slots, device="cuda") if args.shuffle else torch.arange(slots, device="cuda")
    )
    return {
        "k": k,
        "v": v,
        "beta": beta,
        "kv_indices": order.to(torch.int32),
        "kv_indptr": torch.arange(0, slots + 1, length, dtype=torch.int32, device="cuda"),
        "ragged_indptr": ragged_indptr(batch, length, h).cuda(),
    }


def ragged_indptr(batch: int, length: int, heads: int) -> torch.Tensor:
    """[batch * heads + 1] int32: each request's length * heads entries split over its KV
    heads in proportion to h + 1 (the last head takes the rounding), head by head."""
    total, weights = length * heads, torch.arange(1, heads + 1, dtype=torch.float64)
    per = torch.floor(total * weights / weights.sum()).long()
    per[-1] += total - int(per.sum())
    out = torch.zeros(batch * heads + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(per.repeat(batch), 0)
    return out.to(torch.int32)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Time every (length, batch, kernel); returns the JSON-ready result dict."""
    dtype = getattr(torch, args.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    bandwidth = copy_bandwidth_gbs()
    factories = {k: f for k, f in _kernels(args).items() if k in args.kernels}
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        for length in args.lengths:
            kv_bytes = 2 * batch * length * args.num_kv_heads * args.head_dim * elem
            if kv_bytes > args.max_gib * (1 << 30):
                rows.append({"batch": batch, "length": length, "skipped": "over --max-gib"})
                continue
            pool = _pool(batch, length, args, dtype)
            q = torch.randn(batch, args.num_qo_heads, args.head_dim, device="cuda", dtype=dtype)
            extra = batch * length * 4 + batch * args.num_qo_heads * (args.head_dim * elem + 4)
            for name, factory in factories.items():
                row: dict[str, Any] = {"kernel": name, "batch": batch, "length": length}
                if isinstance(factory, str):
                    row["skipped"] = factory
                else:
                    ms = _time_ms(factory(pool, q), args.reps)
                    beta_bytes = batch * length * args.num_kv_heads * 4 if "beta" in name else 0
                    indices = batch * length * 4 if name.endswith("ragged") else 0  # none read
                    moved = kv_bytes + beta_bytes + extra - indices
                    row.update(ms=ms, bytes=moved, gbs=moved / (ms * 1e-3) / 1e9)
                    row["frac_of_copy_bw"] = row["gbs"] / bandwidth
                rows.append(row)
                print(json.dumps(row), flush=True)
            del pool, q
            torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_gbs": bandwidth,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": rows,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency and achieved bandwidth vs prefix length, one line per (kernel, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for r in result["results"]:
        if "ms" in r:
            series.setdefault((r["kernel"], r["batch"]), []).append(
                (r["length"], r["ms"], r["gbs"])
            )
    for (kernel, batch), pts in sorted(series.items()):
        pts.sort()
        xs = [p[0] for p in pts]
        style = {"triton_beta": "-o", "triton_beta_ragged": ":o", "flashinfer_stock": "--^"}.get(
            kernel, "-s"
        )
        ax_ms.plot(xs, [p[1] for p in pts], style, label=f"{kernel} B={batch}")
        ax_bw.plot(xs, [p[2] for p in pts], style, label=f"{kernel} B={batch}")
    ax_bw.axhline(result["copy_bandwidth_gbs"], color="k", lw=1, ls=":", label="copy bandwidth")
    for ax, ylabel in ((ax_ms, "decode latency (ms)"), (ax_bw, "achieved GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prefix slots per request")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.set_yscale("log")
    ax_bw.legend(fontsize=7)
    fig.suptitle(f"biased paged decode on {result['device']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu/decode_attention.py needs a CUDA device; none found.", file=sys.stderr
        )
        return 2
    result = {
        **run_benchmark(args),
        "provenance": provenance(argv, "benchmarks.gpu.decode_attention"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if args.plot is not None:
        plot(result, args.plot)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
