"""Whole-model compaction speed per stage vs prefix length, on the real model (CPU by default).

    python -m benchmarks.offline.compaction_speed [--lengths 1024,2048,4096,8192] \
        [--methods am-highest,am-omp-fast,kvzip:refit=am] [--omp-max-T 8192] [--ratio 0.1] \
        [--device cpu] [--queries plugin|library] [--follow-ups 8] [--chunk-tokens N|none]

For each prefix length T (a needle document from the shipped filler): one
``compact_prefix`` per method with the spec a compaction gets in practice:

- ``--queries plugin`` (default): the SGLang plugin's spec (``sglang_ext.config.PLUGIN_SPEC``:
  the ``follow-up`` source, 32 greedy answer tokens per follow-up) with
  ``--follow-ups`` questions (``harness.workload.many_questions``; the plugin sends at most
  ``max_follow_ups`` = 8);
- ``--queries library``: the library default (``CompactionSpec()``: repeat-prefill), which
  re-reads the whole prefix once more (its cost grows like a second prefill).

The chunk size is the service's rule (``auto_chunk_size`` with ``--chunk-tokens``, default
the service's ``AUTO_CHUNK_TOKENS``): what ``compactor serve`` would compute for that prefix.
The prefill and the reference queries are shared through ``Hooks.reuse`` (timed on the first
method). The method runs inside the pipeline wrapped so that each layer's work is timed in
three stages (summed over all layers and KV heads, batched per layer):

- selection: the method's pick, with the reference pass it needs (mass, outputs, scores
  or the mass features);
- beta: the NNLS fit of beta for the kept keys;
- values: the least-squares value fit and packing.

``compaction`` is the pipeline's own stage (the three above + assembly), ``total_s`` =
prefill + queries + compaction. Wall seconds (perf_counter) and process CPU seconds
(process_time) are both recorded: on a shared machine CPU seconds show the cost without the
wait for a core. One torch thread (the service's worker setting). Writes
``benchmarks/results/compaction_speed.{json,png}`` with the command, git commit, machine,
device and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options
from harness.provenance import provenance

FIT_STAGES = ("selection", "beta", "values")
STAGES = ("prefill", "queries", *FIT_STAGES)


class StageClock:
    """Wall and CPU seconds per stage name, summed over :meth:`measure` blocks (mutated)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.queries_per_head = 0  # the most reference queries a layer's fit saw

    @contextmanager
    def measure(self, stage: str, sync: Any = None) -> Iterator[None]:
        """Time the block into `stage`; `sync()` (e.g. a CUDA synchronize) runs at both ends."""
        if sync is not None:
            sync()
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            if sync is not None:
                sync()
            self.wall[stage] = self.wall.get(stage, 0.0) + time.perf_counter() - t
            self.cpu[stage] = self.cpu.get(stage, 0.0) + time.process_time() - c


def timed_method(name: str, clock: StageClock, sync: Any = None, **params: Any) -> Any:
    """The registered AM method `name`, its ``compact`` timed stage by stage on `clock`
    (``SelectingMethod.compact_in_stages``), in a subclass built here so that the pipeline
    accepts it (``Hooks.method``)."""
    from compactor.methods import get_method

    base = type(get_method(name, **params))

    def compact(self: Any, x: Any) -> Any:
        clock.queries_per_head = max(clock.queries_per_head, int(x.queries.shape[1]))
        return self.compact_in_stages(x, lambda stage: clock.measure(stage, sync))

    timed: Any = dataclasses.dataclass(type(f"Timed{base.__name__}", (base,), {"compact": compact}))
    return timed(**params)


def add_chunk_tokens(ap: argparse.ArgumentParser) -> None:
    """--chunk-tokens: the service's auto-chunk limit the run applies (its default)."""
    from compactor.commands.serve import chunk_tokens_arg
    from compactor.spec import AUTO_CHUNK_TOKENS

    ap.add_argument(
        "--chunk-tokens",
        type=chunk_tokens_arg,
        default=AUTO_CHUNK_TOKENS,
        metavar="N|none",
        help="compact a longer prefix in KV chunks of N tokens, as `compactor serve "
        f"--auto-chunk-tokens` does (default {AUTO_CHUNK_TOKENS}; 'none': one chunk)",
    )


def run_meta(device: str, threads: int, prov: dict[str, Any]) -> dict[str, Any]:
    """The device and torch threads of this run; the command, commit, machine and date are
    in `prov` (``harness.provenance.provenance``), stored beside it."""
    import torch

    cuda = device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if cuda else prov["machine"]["cpu"]
    return {"device": device, "device_name": name, "threads": threads}


def earlier_runs(old: dict[str, Any]) -> list[dict[str, Any]]:
    """`old` result file's runs, for a run appended to it: its earlier runs, then its own
    meta with its provenance."""
    meta = old.get("meta", {})
    return [*meta.get("earlier_runs", []), {**meta, "provenance": old.get("provenance")}]


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Stacked wall seconds per T (top) and CPU seconds of each stage vs T, log-log (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in records})
    fig, axes = plt.subplots(2, len(methods), figsize=(5 * len(methods), 7), squeeze=False)
    for col, m in enumerate(methods):
        rows = sorted((r for r in records if r["method"] == m), key=lambda r: r["T"])
        ax = axes[0][col]
        xs = [str(r["T"]) for r in rows]
        bottom = [0.0] * len(rows)
        for st in STAGES:
            ys = [r["wall_s"][st] for r in rows]
            ax.bar(xs, ys, bottom=bottom, label=st)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_title(f"{m}: wall s per compaction (all layers)", fontsize=9)
        ax.set_xlabel("prefix tokens T")
        ax = axes[1][col]
        for st in (*STAGES, "compaction"):
            ax.plot([r["T"] for r in rows], [r["cpu_s"][st] for r in rows], "o-", label=st)
        Ts = [r["T"] for r in rows]
        if Ts:
            ref = rows[0]["cpu_s"]["compaction"]
            ax.plot(Ts, [ref * T / Ts[0] for T in Ts], "k:", label="linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{m}: process CPU s per stage", fontsize=9)
        ax.set_xlabel("prefix tokens T")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap, model="smollm2-135m", lengths="1024,2048,4096,8192")
    add_options(ap, methods="am-highest,am-omp-fast")
    ap.add_argument(
        "--omp-max-T", type=int, default=1 << 30, help="run OMP methods only up to this T"
    )
    add_options(ap, ratio=0.1, device="cpu", threads=1)
    ap.add_argument(
        "--queries",
        choices=("plugin", "library"),
        default="plugin",
        help="the plugin's spec with follow-ups (default) or the library default spec",
    )
    ap.add_argument("--follow-ups", type=int, default=8, help="with --queries plugin")
    add_chunk_tokens(ap)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the other (T, method) records of an existing JSON (one run per length)",
    )
    a = ap.parse_args()

    import torch

    from compactor import hf
    from compactor.eval.niah import make_niah
    from compactor.eval.runner import method_spec
    from compactor.models import resolve_model
    from compactor.pipeline import Hooks, compact_prefix
    from compactor.service.engine import auto_chunk_size
    from compactor.spec import CompactionSpec
    from harness.workload import many_questions
    from sglang_ext.config import PLUGIN_SPEC

    limit = a.chunk_tokens
    base = PLUGIN_SPEC if a.queries == "plugin" else CompactionSpec()
    torch.set_num_threads(a.threads)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else None
    model, tok = hf.load_model(resolve_model(a.model))
    if a.device != "cpu":
        model = model.to(a.device)
    fus = None
    if a.queries == "plugin":
        fus = [
            tok(" " + q, add_special_tokens=False).input_ids for q in many_questions(a.follow_ups)
        ]
    prov = provenance()
    meta = {
        **run_meta(a.device, a.threads, prov),
        "model": a.model,
        "ratio": a.ratio,
        "queries": a.queries,
        "query_sources": list(base.queries.sources),
        "follow_ups": len(fus or ()),
        "auto_chunk_tokens": limit,
    }
    records: list[dict[str, Any]] = []
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "compaction_speed.json"
    kept: list[dict[str, Any]] = []
    if a.append and path.is_file():
        old = json.loads(path.read_text())
        kept = old.get("records", [])
        meta["earlier_runs"] = earlier_runs(old)
    for T in [int(x) for x in a.lengths.split(",")]:
        ids = tok(make_niah(tok, T, seed=T).prefix, add_special_tokens=False).input_ids
        reuse: dict[Any, Any] = {}
        first = None
        for name in a.methods.split(","):
            if "omp" in name and a.omp_max_T < T:
                continue
            clock = StageClock()
            spec = method_spec(base, name, a.ratio).for_follow_ups(fus or ())
            spec = spec.replace(chunk_size=auto_chunk_size(spec, len(ids), limit))
            timed = timed_method(spec.method, clock, sync, **spec.method_params)
            hooks = Hooks(progress=False, reuse=reuse, method=timed)
            _, st = compact_prefix(model, tok, ids, spec, follow_ups=fus, hooks=hooks)
            first = first or st
            wall = {"prefill": first.prefill, "queries": first.queries, **clock.wall}
            cpu = {"prefill": first.cpu_prefill, "queries": first.cpu_queries, **clock.cpu}
            wall["compaction"], cpu["compaction"] = st.compaction, st.cpu_compaction
            for d in (wall, cpu):
                for s in FIT_STAGES:
                    d.setdefault(s, 0.0)
            rec = {
                "T": len(ids),
                "method": name,
                "n_queries_per_head": clock.queries_per_head,
                "chunk_size": spec.chunk_size,
                "wall_s": wall,
                "cpu_s": cpu,
                "total_s": wall["prefill"] + wall["queries"] + wall["compaction"],
                "cpu_total_s": cpu["prefill"] + cpu["queries"] + cpu["compaction"],
                "slowest_layer_s": max(st.per_layer),
            }
            records.append(rec)
            kept = [r for r in kept if (r["T"], r["method"]) != (rec["T"], name)]
            print(
                f"T={rec['T']:>5} {name:<12} "
                + "  ".join(f"{s} {wall[s]:6.2f}/{cpu[s]:6.2f}" for s in (*STAGES, "compaction"))
                + f"  total {rec['total_s']:6.2f}/{rec['cpu_total_s']:6.2f} s (wall/CPU)",
                flush=True,
            )
            every = sorted(kept + records, key=lambda r: (r["method"], r["T"]))
            out = {"provenance": prov, "meta": meta, "stages": list(STAGES), "records": every}
            path.write_text(json.dumps(out, indent=1))
    plot(sorted(kept + records, key=lambda r: (r["method"], r["T"])), path.with_suffix(".png"))
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
