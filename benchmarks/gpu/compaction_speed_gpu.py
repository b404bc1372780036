"""Whole-model compaction at document scale on one GPU: a Llama-3-8B-shaped model, random weights.

    python -m benchmarks.gpu.compaction_speed_gpu            # on a CUDA machine (H100 / H200)
    python -m benchmarks.gpu.compaction_speed_gpu --smoke    # 2 small layers, T=256, on the CPU

Builds ``LlamaForCausalLM`` from a ``LlamaConfig`` with Llama-3-8B's shape (32 layers, 32
query / 8 KV heads, head dim 128, hidden 4096, MLP 14336, vocabulary 128256, bf16, SDPA
attention) and random weights, directly on the device (nothing is downloaded). Then:

1. ``--T`` (32k) tokens: whole-model ``compact_prefix`` with each of ``--methods``
   (am-highest, am-omp-fast) at ``--ratio`` 0.1, with the reference queries the SGLang
   plugin sends (``sglang_ext.config.PLUGIN_SPEC``: the ``follow-up`` source with 32 greedy
   answer tokens per follow-up): ``--follow-ups`` random follow-up questions of
   ``--follow-up-tokens`` tokens each, in the service's KV chunks (``--chunk-tokens``, default
   ``AUTO_CHUNK_TOKENS``; ``none`` for one chunk). Each stage is timed (prefill, queries, then per layer
   selection / beta / values, synchronized; see ``benchmarks/offline/compaction_speed.py``) with the
   peak GPU memory.
2. ``--big-T`` (128k) tokens with ``--big-methods`` (am-highest) and ``--big-follow-ups``
   follow-ups (the answer generation holds the prefix KV once for all follow-ups): does it
   complete within GPU memory (peak ``torch.cuda.max_memory_allocated``)?
3. One synthetic layer (``benchmarks/offline/methods_speed.py``) at ``--layer-T`` (16k) tokens with
   8 KV heads, n=4096, D=128: seconds per layer per method, with ``--exact-check``.

Before anything is timed, one untimed compaction per method at ``--warmup-T`` tokens (the
same code paths: CUDA context, cuBLAS / cuSOLVER handles, kernel selection), its seconds in
``meta.warmup_s``. The whole run keeps to ``--budget-s`` (480): a step that would start after
it is recorded as skipped (exit 1), so one call of a few minutes yields every record it could.

Writes ``benchmarks/results/compaction_speed_gpu.json`` (``--out``) with the command, git
commit, machine, device and date, again after each record. A step that fails (out of memory,
say) is recorded with its error and the next one runs. The steps can also run one at a time into the same file:
``--skip big,layer``, then ``--skip doc,layer --append``, then ``--skip doc,big --append``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options, script_parser
from benchmarks.offline.compaction_speed import (
    StageClock,
    add_chunk_tokens,
    earlier_runs,
    run_meta,
    timed_method,
)
from harness.provenance import provenance

LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
SMOKE = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}


def build_model(shape: dict[str, Any], max_positions: int, device: str, dtype: Any) -> Any:
    """LlamaForCausalLM of `shape`, random weights (transformers' init), built on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **shape,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def plugin_spec(method: str, ratio: float) -> Any:
    """The SGLang plugin's spec with `method` and `ratio` (the plugin's own object when
    importable; the same values otherwise)."""
    try:
        from sglang_ext.config import PLUGIN_SPEC
    except ImportError:  # the same knobs, spelled out
        from compactor.spec import CompactionSpec, QueryConfig

        PLUGIN_SPEC = CompactionSpec(
            method="kvzip",
            ratio=0.1,
            queries=QueryConfig(sources=("follow-up",), follow_up_answer_tokens=32),
        )
    return PLUGIN_SPEC.replace(method=method, ratio=ratio)


def compact_once(
    model: Any,
    T: int,
    method: str,
    ratio: float,
    follow_ups: int,
    follow_up_tokens: int,
    seed: int,
    chunk_tokens: int | None,
) -> dict[str, Any]:
    """One whole-model compaction of a random T-token prefix; its stages, memory, kept.

    The chunk size is the service's rule (``auto_chunk_size`` with `chunk_tokens`)."""
    import torch

    from compactor.pipeline import Hooks, compact_prefix
    from compactor.service.engine import auto_chunk_size

    cuda = next(model.parameters()).is_cuda
    sync = torch.cuda.synchronize if cuda else None
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (T,), generator=g).tolist()
    fus = [
        torch.randint(0, vocab, (follow_up_tokens,), generator=g).tolist()
        for _ in range(follow_ups)
    ]
    spec = plugin_spec(method, ratio).for_follow_ups(fus)
    spec = spec.replace(chunk_size=auto_chunk_size(spec, T, chunk_tokens))
    clock = StageClock()
    hooks = Hooks(
        progress=False,
        model_fingerprint="random-llama",
        method=timed_method(method, clock, sync),
    )
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    prefix, st = compact_prefix(model, None, ids, spec, follow_ups=fus, hooks=hooks)
    wall = time.perf_counter() - t0
    kept = [sum(layer.head_lengths()) for layer in prefix.layers]
    heads = prefix.num_kv_heads
    rec: dict[str, Any] = {
        "T": T,
        "method": method,
        "ratio": ratio,
        "follow_ups": follow_ups,
        "follow_up_tokens": follow_up_tokens,
        "chunk_size": spec.chunk_size,
        "spec": spec.to_dict(),
        "wall_s": {
            "prefill": st.prefill,
            "queries": st.queries,
            **clock.wall,
            "compaction": st.compaction,
        },
        "cpu_s": {
            "prefill": st.cpu_prefill,
            "queries": st.cpu_queries,
            **clock.cpu,
            "compaction": st.cpu_compaction,
        },
        "total_s": st.prefill + st.queries + st.compaction,
        "call_s": wall,
        "slowest_layer_s": max(st.per_layer),
        "kept_per_head_mean": sum(kept) / (len(kept) * heads),
        "budget_per_head": None if prefix.budget is None else prefix.budget.budget_per_head,
    }
    if cuda:
        rec["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec["model_memory_gib"] = base / 2**30
        rec["gpu_total_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return rec


def layer_speed(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/offline/methods_speed.py on one synthetic layer; its JSON."""
    out = Path(args.out) / "_methods_speed_gpu_layer.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.offline.methods_speed",
        "--device",
        args.device,
        "--H",
        str(args.layer_H),
        "--T",
        str(args.layer_T),
        "--n",
        str(args.layer_n),
        "--D",
        str(args.layer_D),
        "--ratio",
        str(args.ratio),
        "--layers",
        str(args.layers),
        "--repeats",
        "2",
        "--methods",
        *args.layer_methods.split(","),
        "--exact-check",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout, proc.stderr[-4000:], flush=True)
    if proc.returncode:
        raise RuntimeError(f"methods_speed.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    data = json.loads(out.read_text())
    out.unlink()
    return {"command": " ".join(cmd[1:]), **data}


def main() -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="2 small layers, T=256, on the CPU")
    add_options(ap, T=32768, methods="am-highest,am-omp-fast", ratio=0.1, follow_ups=4)
    add_options(ap, follow_up_tokens=64, big_T=131072, big_methods="am-highest", big_follow_ups=1)
    add_options(ap, layer_T=16384, layer_n=4096, layer_H=8, layer_D=128)
    add_options(ap, layer_methods="am-highest,am-omp-fast")
    add_chunk_tokens(ap)
    ap.add_argument("--warmup-T", type=int, default=2048, help="untimed warm-up prefix tokens")
    ap.add_argument(
        "--budget-s", type=float, default=480.0, help="no step starts after this many seconds"
    )
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: doc,big,layer")
    add_options(ap, out=ROOT / "benchmarks" / "results", json_name="compaction_speed_gpu.json")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the skipped steps' results of an existing JSON (one run per step)",
    )
    a = ap.parse_args()
    if a.smoke:
        a.device, a.T, a.big_T, a.follow_ups, a.follow_up_tokens = "cpu", 256, 512, 2, 16
        a.warmup_T = min(a.warmup_T, 128)
        a.layer_T, a.layer_n, a.layer_H, a.layer_D = 512, 256, 2, 32
        if a.json_name == "compaction_speed_gpu.json":
            a.json_name = "compaction_speed_gpu_smoke.json"

    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: use --smoke for the CPU check", file=sys.stderr)
        return 2
    torch.set_num_threads(1 if a.smoke else max(1, torch.get_num_threads()))
    shape = SMOKE if a.smoke else LLAMA3_8B
    a.layers = shape["num_hidden_layers"]
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    skip = set(filter(None, a.skip.split(",")))
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / a.json_name
    prov = provenance()
    result: dict[str, Any] = {
        "provenance": prov,
        "meta": {**run_meta(a.device, torch.get_num_threads(), prov), "model_shape": shape},
        "doc": [],
        "big": [],
        "layer": None,
    }
    if a.append and path.is_file():  # the steps skipped now keep their earlier results
        old = json.loads(path.read_text())
        for step in skip & {"doc", "big", "layer"}:
            result[step] = old.get(step, result[step])
        result["meta"]["earlier_runs"] = earlier_runs(old)

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    started = time.perf_counter()

    def attempt(step: str, fn: Any) -> Any:
        if time.perf_counter() - started > a.budget_s:
            return {"step": step, "skipped": f"not started: over --budget-s {a.budget_s:g}"}
        try:
            return fn()
        except Exception as exc:  # recorded, then the next step runs
            traceback.print_exc()
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
            return {"step": step, "error": f"{type(exc).__name__}: {exc}"[:2000]}

    model = None
    if not {"doc", "big"} <= skip:
        t0 = time.perf_counter()
        model = build_model(shape, max(a.T, a.big_T) + 1024, a.device, dtype)
        result["meta"]["model_build_s"] = time.perf_counter() - t0
        print(f"model built in {result['meta']['model_build_s']:.1f} s", flush=True)
        t0 = time.perf_counter()
        for name in sorted({*a.methods.split(","), *a.big_methods.split(",")}):
            compact_once(model, a.warmup_T, name, a.ratio, 1, 8, 0, a.chunk_tokens)
        result["meta"]["warmup_s"] = time.perf_counter() - t0
        result["meta"]["warmup_T"] = a.warmup_T
        print(f"warmed up in {result['meta']['warmup_s']:.1f} s", flush=True)
    for step, T, methods, fus in (
        ("doc", a.T, a.methods, a.follow_ups),
        ("big", a.big_T, a.big_methods, a.big_follow_ups),
    ):
        if step in skip:
            continue
        for name in methods.split(","):
            rec = attempt(
                step,
                lambda m=model, name=name, T=T, fus=fus: compact_once(
                    m,
                    T,
                    name,
                    a.ratio,
                    fus,
                    a.follow_up_tokens,
                    seed=T,
                    chunk_tokens=a.chunk_tokens,
                ),
            )
            rec.setdefault("method", name)
            rec.setdefault("T", T)
            result[step].append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "spec"}), flush=True)
            save()
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if "layer" not in skip:
        result["layer"] = attempt("layer", lambda: layer_speed(a))
        save()
    print(f"wrote {path}")
    records = [*result["doc"], *result["big"], result["layer"] or {}]
    return 1 if any("error" in r or "skipped" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
