"""The plugin's attention work in one decode step over a compacted prefix, without a server.

    python -m benchmarks.gpu.cascade_step --out cascade_step.json          # CUDA
    TRITON_INTERPRET=1 python -m benchmarks.gpu.cascade_step --device cpu --layers 2 \\
        --batch 3 --prefix-tokens 64 --ratio 0.25 --tail 4 --heads 4 --kv-heads 2 \\
        --head-dim 16 --reps 1 --out /tmp/c.json                           # plumbing only

B requests share one compacted prefix (logical length T, `ratio` x T entries per layer and KV
head, packed into N slots as an install packs them, `sglang_ext.packing.PackedLayout`); each
row is [the N slots, T - N aliases, its own `tail` slots], as SGLang's `req_to_token` holds it.
Per decode step the `compaction` backend (`sglang_ext.adapter.wrapped_backend`) runs, for each
of L layers, the stages timed here:

    plan     plan_cascade: once per step (the prefix calls come from `PrefixPlans` after the
             first step; the tails are planned, and the rows' layout checked, every step)
    read     PackedLayout.read_ragged + stack_groups: the prefix's entries gathered per layer
    attend   run_cascade: the tails, the prefix (one call per node group) and the LSE merge
    kernel   the prefix's kernel call alone (what `attend` cannot go below for the prefix)

and the static cascade that SGLang captures in the compacted decode graph
(`sglang_ext.attention.static_cascade`, `sglang_ext.adapter.graph_variant`):

    static_prep    StaticCascade.prepare: the host plan and its one non-blocking upload
    static_eager   prepare + the in-graph part (the tails' gather, 3 launches a layer), eagerly
    static_replay  prepare + the in-graph part replayed from a CUDA graph (CUDA only)

`static_max_abs_diff` is the largest difference between the static and the eager cascade's
outputs over all layers (bf16: a few 1e-3 at most).

Each figure is milliseconds per decode step (all L layers), the median over `--reps` steps,
each step synchronised before and after (so host work and GPU work both count). The K/V
content is random: timings only. Writes JSON with provenance (`--out`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import add_options, script_parser
from harness.provenance import provenance
from sglang_ext.adapter.graph_variant import MAX_GROUPS, static_shape
from sglang_ext.attention.cascade import PrefixPlans, plan_cascade, run_cascade, stack_groups
from sglang_ext.attention.static_cascade import PrefixTables, StaticCascade
from sglang_ext.kv_store import ALIAS_SLOT
from sglang_ext.packing import PackedLayout, slots_needed

STAGES = ("plan", "read", "attend", "kernel")


def build(a: Any) -> dict[str, Any]:
    """The pool, beta, slot table and layout of the workload (module docstring)."""
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    per_head = max(1, round(a.ratio * a.prefix_tokens))
    counts = torch.full((a.layers, a.kv_heads), per_head, dtype=torch.int64)
    n_slots = slots_needed(counts)
    pool = 1 + n_slots + a.batch * a.tail  # slot 0 is ALIAS_SLOT
    order = (torch.randperm(pool - 1, generator=g) + 1).to(dev)
    layout = PackedLayout(counts, order[:n_slots], a.prefix_tokens)
    shape = (pool, a.kv_heads, a.head_dim)
    k = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(a.layers)]
    v = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(a.layers)]
    beta = torch.zeros(a.layers, pool, a.kv_heads, device=dev)
    beta[:, ALIAS_SLOT] = float("-inf")
    width = a.prefix_tokens + a.tail
    r2t = torch.zeros(a.batch, width, dtype=torch.int32, device=dev)
    tails = order[n_slots:].reshape(a.batch, a.tail)
    r2t[:, :n_slots] = layout.slots.to(torch.int32)
    r2t[:, a.prefix_tokens :] = tails.to(torch.int32)  # [N, T) stays ALIAS_SLOT
    q = torch.randn(a.batch, a.heads, a.head_dim, device=dev, dtype=dtype)
    return dict(k=k, v=v, beta=beta, r2t=r2t, layout=layout, q=q, n_slots=n_slots,
                per_head=per_head, pool=pool)  # fmt: skip


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall ms of `fn` over `reps` calls, each synchronised before and after."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: Triton compiles, the prefix plan is made and kept
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def measure(a: Any) -> dict[str, Any]:
    """Each stage's ms per decode step (all layers) and the whole step."""
    w = build(a)
    dev, layout, q = torch.device(a.device), w["layout"], w["q"]
    rows = torch.arange(a.batch)
    seq_lens = torch.full((a.batch,), a.prefix_tokens + a.tail)
    q_lens = torch.ones(a.batch, dtype=torch.int64)
    heads = dict(num_qo_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim)
    cache = PrefixPlans()
    bufs = (lambda j: w["k"][j], lambda j: w["v"][j], w["beta"])

    def plan() -> Any:
        return plan_cascade(w["r2t"], rows, seq_lens, q_lens, [layout] * a.batch,
                            cache=cache, **heads)  # fmt: skip

    def gather(i: int) -> Any:  # layer i's prefix entries, as the backend reads them
        return stack_groups([layout.read_ragged(i, *bufs, q.dtype)])

    the_plan = plan()
    kv = [gather(i) for i in range(a.layers)]
    idx = the_plan.prefix_tokens.to(dev)

    def read() -> None:
        for i in range(a.layers):
            gather(i)

    def attend() -> None:
        for i in range(a.layers):
            run_cascade(the_plan, q, w["k"][i], w["v"][i], w["beta"][i], i, kv[i])

    def kernel() -> None:
        for i in range(a.layers):
            the_plan.prefix[i].run(q.index_select(0, idx), *kv[i])

    def step() -> None:
        p = plan()
        for i in range(a.layers):
            run_cascade(p, q, w["k"][i], w["v"][i], w["beta"][i], i, gather(i))

    ms = {name: timed(fn, a.reps, dev) for name, fn in
          zip(STAGES, (plan, read, attend, kernel))}  # fmt: skip
    ms["step"] = timed(step, a.reps, dev)
    eager = [run_cascade(the_plan, q, w["k"][i], w["v"][i], w["beta"][i], i, kv[i])
             for i in range(a.layers)]  # fmt: skip
    static_ms, diff = measure_static(a, w, eager)
    return {"ms_per_step": {**ms, **static_ms}, "static_max_abs_diff": diff,
            "n_slots": w["n_slots"], "entries_per_head": w["per_head"], "pool_slots": w["pool"],
            "prefix_plans_made": cache.made}  # fmt: skip


def measure_static(
    a: Any, w: dict[str, Any], eager: list[torch.Tensor]
) -> tuple[dict[str, float | None], float]:
    """The static cascade's stages (module docstring) and its largest difference from the
    eager cascade's outputs `eager` (one [B, H_q, D] per layer)."""
    dev, q, r2t = torch.device(a.device), w["q"], w["r2t"]
    shape = static_shape(a.heads, a.kv_heads, a.head_dim, cuda=dev.type == "cuda")
    tables = PrefixTables(lambda j: w["k"][j], lambda j: w["v"][j], w["beta"])
    static = StaticCascade(shape, num_layers=a.layers, max_bs=a.batch, max_groups=MAX_GROUPS,
                           width=r2t.shape[1], tables=tables, device=dev)  # fmt: skip
    prefixes = [w["layout"]] * a.batch
    rows = torch.arange(a.batch, device=dev)
    seq_lens = torch.full((a.batch,), a.prefix_tokens + a.tail, device=dev)
    outs: list[torch.Tensor] = []

    def prep() -> None:
        static.prepare(a.batch, prefixes)

    def body() -> None:  # what the graph captures
        static.gather_tails(a.batch, r2t, rows, seq_lens)
        outs[:] = [static.attend(a.batch, i, q, (w["k"][i], w["v"][i], w["beta"][i]), None)
                   for i in range(a.layers)]  # fmt: skip

    ms: dict[str, float | None] = {"static_prep": timed(prep, a.reps, dev)}
    ms["static_eager"] = timed(lambda: (prep(), body()), a.reps, dev)
    diff = max(float((o.float() - e.float()).abs().max()) for o, e in zip(outs, eager))
    ms["static_replay"] = None
    if dev.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm-up off the capture stream, as SGLang's runner does
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            body()
        ms["static_replay"] = timed(lambda: (prep(), graph.replay()), a.reps, dev)
        graph.replay()
        torch.cuda.synchronize(dev)
        diff = max(diff, *(float((o.float() - e.float()).abs().max())
                           for o, e in zip(outs, eager)))  # fmt: skip
    return ms, diff


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_options(p, device="cuda", dtype="bfloat16", layers=32, batch=64, prefix_tokens=32704,
                ratio=0.1, tail=160, heads=32, kv_heads=8, head_dim=128, reps=20,
                out=Path("cascade_step.json"))  # fmt: skip
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("cascade_step: --device cuda but no CUDA device; use --device cpu with "
              "TRITON_INTERPRET=1 for the plumbing", file=sys.stderr)  # fmt: skip
        return 2
    res = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           **measure(a), "provenance": provenance(argv, "benchmarks.gpu.cascade_step")}  # fmt: skip
    if a.device == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["ms_per_step"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
