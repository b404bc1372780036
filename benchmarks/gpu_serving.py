"""A real SGLang server with the plugin on a GPU machine: the issue's GPU done-when figures.

    python -m benchmarks.gpu_serving make-model --out DIR [--tokenizer DIR] [--tiny --device cpu]
    python -m benchmarks.gpu_serving identity --state S      # SmolLM2: stock vs keep-only ratio 1
    python -m benchmarks.gpu_serving stock8b --model DIR --state S   # 8B-shaped, stock
    python -m benchmarks.gpu_serving plugin8b --model DIR --state S  # 8B-shaped, plugin
    python -m benchmarks.gpu_serving report --state S --out DIR      # gpu_serving.json + .png

Run by scripts/gpu_serving.sh (which sets up SGLang, FlashInfer and the check-only sgl_kernel
stand-in on the machine). Every server gets `--attention-backend flashinfer` and keeps CUDA
graphs on; what SGLang reports (`/server_info`, and `cuda graph:` on each decode log line) is
recorded. Phases (each writes S/<phase>.json, so they can run in separate calls):

- identity: SmolLM2-135M (bf16), a stock server and a plugin server (`keep-only` at ratio 1:
  every key kept, beta 0; its selection am-highest's top scores) on one `compactor serve
  --device cuda`. The plugin server is asked
  the needle document's questions until its prefix is installed; then both answer the seen
  and unseen questions greedily: identity_outputs_equal = every answer's tokens equal.
- stock8b / plugin8b (the random 8B-shaped checkpoint of `make-model`, one server at a time):
  1. idle decode: 64 distinct random 256-token prompts at once, 256 tokens each (ignore_eos),
     twice (the second burst, other prompts, is the figure); decode tokens/s = median of the
     scheduler's `gen throughput` over full-batch lines. The plugin server runs it before
     anything is compacted.
  2. /flush_cache, then the 32k-token shared prefix: two warm-up requests (prefix + its own
     32-token question, 1 token out); the plugin sends the prefix to the service (ratio 0.1,
     am-highest in 1024-token chunks) and installs it. KV slots held (pool - free, SGLang's
     own counters) once idle: the prefix's slots plus the two short tails, on both servers.
  3. 64 requests at once (prefix + question i, 128 tokens out, ignore_eos): decode step =
     median over full-batch log lines of 64 / gen throughput.

Ratios: idle_plugin_throughput_ratio = plugin / stock tokens/s; prefix_slots_ratio = stock /
plugin slots held; decode_step_ratio = plugin / stock step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_serving_lib import (  # noqa: E402
    GpuServingResult,
    LlamaShape,
    decode_lines,
    make_model,
    plot_result,
    step_time_s,
)


@dataclass(frozen=True)
class Workload:
    """The phases' sizes and device (GPU: the issue's; `--cpu-smoke`: the same code path on
    a CPU SGLang server, tiny, to check the script's plumbing without a GPU)."""

    device: str = "cuda"
    batch: int = 64
    prefix_tokens: int = 32768
    question_tokens: int = 32
    idle_prompt: int = 256
    idle_out: int = 256
    prefix_out: int = 128


GPU = Workload()
CPU_SMOKE = Workload("cpu", batch=4, prefix_tokens=1024, idle_prompt=64, idle_out=24,
                     prefix_out=24)  # fmt: skip
TINY = LlamaShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                  max_positions=2048)  # fmt: skip


def server_args(a: argparse.Namespace) -> list[str]:
    """Flags every server gets (stock and plugin alike)."""
    w: Workload = a.w
    common = ["--enable-metrics", "--decode-log-interval", "1",
              "--max-running-requests", str(w.batch)]  # fmt: skip
    if w.device == "cpu":
        return ["--attention-backend", "torch_native", *common]
    return [
        "--attention-backend", "flashinfer", *common,
        "--mem-fraction-static", str(a.mem_fraction),
        "--cuda-graph-max-bs", str(w.batch),
    ]  # fmt: skip


def server_facts(srv: Any) -> dict[str, Any]:
    """What SGLang itself reports: its attention backends and whether CUDA graphs are on."""
    info = json.loads(urllib.request.urlopen(srv.url + "/server_info", timeout=30).read())
    found: dict[str, Any] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("attention_backend", "decode_attention_backend",
                         "prefill_attention_backend", "disable_cuda_graph"):  # fmt: skip
                    found.setdefault(k, v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(info)
    return found


def generate_ids(url: str, ids: list[int], max_new: int, ignore_eos: bool = True) -> dict[str, Any]:
    payload = {
        "input_ids": ids,
        "sampling_params": {
            "max_new_tokens": max_new,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
        },
    }
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=1200) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def burst(srv: Any, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Send every prompt at once; the scheduler log's full-batch decode lines give the speed."""
    offset = Path(srv.log_path).stat().st_size
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(lambda p: generate_ids(srv.url, p, max_new), prompts))
    wall = time.perf_counter() - t0
    with open(srv.log_path, "rb") as f:
        f.seek(offset)
        lines = decode_lines(f.read().decode(errors="replace"))
    full = [x for x in lines if x.running == len(prompts)]
    step = step_time_s(lines, len(prompts))
    return {
        "wall_s": wall,
        "output_tokens": sum(len(o.get("output_ids", [])) for o in outs),
        "full_batch_lines": len(full),
        "decode_tokens_per_s": None if step is None else len(prompts) / step,
        "decode_step_s": step,
        "cuda_graph_lines": sum(x.cuda_graph for x in full),
    }


def flush_cache(url: str) -> None:
    """Empty the radix cache (SGLang answers plain text; 400 while requests are running)."""
    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/flush_cache answered {resp.status}: {resp.read()[:200]!r}")


def random_ids(n: int, seed: int, vocab: int, low: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


def eight_b(a: argparse.Namespace, plugin: bool) -> dict[str, Any]:
    from harness.launch import CompactorService, SGLangServer, start_all
    from harness.pool import read_pool
    from harness.workload import compaction_args, wait_for_compactions

    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    name = "plugin8b" if plugin else "stock8b"
    logs = a.state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    w: Workload = a.w
    rec: dict[str, Any] = {"phase": name, "model": str(a.model), "workload": asdict(w)}
    with contextlib.ExitStack() as stack:
        extra = server_args(a)
        if plugin:
            svc = CompactorService(a.model, logs / "compactor-8b.log", in_process=True,
                                   extra_args=["--device", a.w.device], startup_timeout=600)  # fmt: skip
            start_all(stack, [svc])
            extra += compaction_args(svc.endpoint, a.ratio, a.method, min_hits=2,
                                     timeout_s=a.compaction_timeout)  # fmt: skip
            # am-highest on one 32k chunk takes minutes a layer on an H100 (README's GPU
            # table: 24.6 s at 16k); 1k chunks take ~0.05 s a layer
            extra += ["--compaction-chunk-size", str(a.chunk_size)]
        srv = SGLangServer(a.model, logs / f"sglang-{name}.log", device=w.device,
                           max_total_tokens=a.max_total_tokens, extra_args=extra,
                           startup_timeout=600)  # fmt: skip
        start_all(stack, [srv])
        facts = server_facts(srv)
        rec["server"] = facts
        # twice, other prompts each time: the first burst pays one-time costs (allocator
        # growth, lazily compiled kernels), the second is the figure
        for key, seed in (("idle_first", 1000), ("idle", 2000)):
            idle = [random_ids(w.idle_prompt, seed + i, vocab) for i in range(w.batch)]
            rec[key] = burst(srv, idle, w.idle_out)
        print(f"  [{name}] idle decode {rec['idle']['decode_tokens_per_s']} tok/s", flush=True)
        flush_cache(srv.url)
        prefix = random_ids(w.prefix_tokens, 7, vocab)
        prompts = [prefix + random_ids(w.question_tokens, 100 + i, vocab) for i in range(w.batch)]
        for p in prompts[:2]:
            generate_ids(srv.url, p, 1)
        end = time.monotonic()
        if plugin:
            rec["compaction"] = wait_for_compactions(srv, 1, a.compaction_timeout, progress=True)
            end = time.monotonic()
        rec["pool_after_warmup"] = read_pool(srv.url, idle_since=end).as_dict()
        rec["prefix"] = burst(srv, prompts, w.prefix_out)
        print(f"  [{name}] held {rec['pool_after_warmup']['held']} slots, decode step "
              f"{rec['prefix']['decode_step_s']} s", flush=True)  # fmt: skip
    rec["backends"] = [str(facts.get("attention_backend"))]
    rec["cuda_graphs"] = [not facts.get("disable_cuda_graph", False)] + [
        rec[k]["cuda_graph_lines"] == rec[k]["full_batch_lines"] > 0 for k in ("idle", "prefix")
    ]
    return rec


def identity(a: argparse.Namespace) -> dict[str, Any]:
    from compactor.models import prepare_model
    from harness.launch import CompactorService, SGLangServer, start_all
    from harness.workload import (
        compaction_args,
        document,
        prompt,
        questions,
        unseen_questions,
        wait_for_compactions,
    )

    model = prepare_model("smollm2-135m", dtype="bfloat16")
    logs = a.state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc = document()
    with contextlib.ExitStack() as stack:
        svc = CompactorService(model, logs / "compactor-smollm2.log", in_process=True,
                               extra_args=["--device", a.w.device])  # fmt: skip
        start_all(stack, [svc])
        servers = {}
        for name, extra in (
            ("stock", []),
            ("identity", [*compaction_args(svc.endpoint, a.identity_ratio, "keep-only", min_hits=2,
                                           timeout_s=a.compaction_timeout),
                          "--compaction-param", 'inner="am-highest"']),
        ):  # fmt: skip
            servers[name] = SGLangServer(model, logs / f"sglang-smollm2-{name}.log",
                                         device=a.w.device, max_total_tokens=16384,
                                         extra_args=server_args(a) + extra,
                                         startup_timeout=540)  # fmt: skip
            start_all(stack, [servers[name]])
        ident = servers["identity"]
        for q in questions()[:2]:
            ident.generate(prompt(doc, q), max_new_tokens=1)
        comp = wait_for_compactions(ident, 1, a.compaction_timeout, progress=True)
        asked = [*questions(), *unseen_questions()]
        answers = {
            name: [srv.generate(prompt(doc, q), max_new_tokens=32)["output_ids"] for q in asked]
            for name, srv in servers.items()
        }
        facts = {name: server_facts(srv) for name, srv in servers.items()}
    installed = comp.get("installed_total", 0) >= 1
    log_text = Path(servers["identity"].log_path).read_text(errors="replace")
    rejections = [ln for ln in log_text.splitlines() if "compaction result rejected" in ln]
    same = [x == y for x, y in zip(answers["stock"], answers["identity"])]
    # where each answer first leaves stock's (None: equal): bf16 rounding of the service's
    # KV vs SGLang's own shows as late divergences, a wrong install as early ones
    first_diff = [
        None
        if x == y
        else next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        for x, y in zip(answers["stock"], answers["identity"])
    ]
    return {
        "phase": "identity",
        "model": str(model),
        "compaction": comp,
        "questions": asked,
        "equal_per_question": same,
        "first_diff_per_question": first_diff,
        "answers": answers,
        # None (not measured) unless the identity fit was installed: a fallback serves the
        # uncompacted prefix, whose answers equal stock's trivially
        "identity_outputs_equal": all(same) if installed else None,
        "rejections": rejections,
        "server": facts,
        "backends": [str(f.get("attention_backend")) for f in facts.values()],
        "cuda_graphs": [not f.get("disable_cuda_graph", False) for f in facts.values()],
    }


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def report(a: argparse.Namespace) -> GpuServingResult:
    """Merge the phase records under `a.state` into gpu_serving.json + .png in `a.out`."""
    from benchmarks._meta import provenance

    parts = {p.stem: json.loads(p.read_text()) for p in sorted(a.state.glob("*.json"))}
    stock, plug = parts.get("stock8b"), parts.get("plugin8b")
    if stock and plug:
        s_idle, p_idle = stock["idle"]["decode_tokens_per_s"], plug["idle"]["decode_tokens_per_s"]
        s_held, p_held = stock["pool_after_warmup"]["held"], plug["pool_after_warmup"]["held"]
        s_step, p_step = stock["prefix"]["decode_step_s"], plug["prefix"]["decode_step_s"]
        plug["idle_plugin_throughput_ratio"] = p_idle / s_idle if s_idle and p_idle else None
        plug["prefix_slots_ratio"] = s_held / p_held if p_held else None
        plug["decode_step_ratio"] = p_step / s_step if s_step and p_step else None
    ordered = [parts[k] for k in ("identity", "stock8b", "plugin8b") if k in parts]
    res = GpuServingResult.merge(a.device or device_name(), ordered)
    res.provenance = provenance(module="benchmarks.gpu_serving")
    a.out.mkdir(parents=True, exist_ok=True)
    res.write(a.out / "gpu_serving.json")
    plot_result(res, a.out / "gpu_serving.png")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mm = sub.add_parser("make-model", help="random-weight Llama checkpoint (8B-shaped)")
    mm.add_argument("--out", type=Path, required=True)
    mm.add_argument("--tokenizer", type=Path, default=None,
                    help="directory with tokenizer files (default: prepared smollm2-135m)")  # fmt: skip
    mm.add_argument("--device", default="cuda")
    mm.add_argument("--dtype", default="bfloat16")
    mm.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (CPU smoke test)")
    for name in ("identity", "stock8b", "plugin8b", "report"):
        p = sub.add_parser(name)
        p.add_argument("--state", type=Path, required=True, help="phase records go here")
        p.add_argument("--model", type=Path, default=None)
        p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
        p.add_argument("--device", default=None, help="report: the machine's name")
        p.add_argument("--mem-fraction", type=float, default=0.88)
        p.add_argument("--max-total-tokens", type=int, default=GPU.prefix_tokens + 20000)
        p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, a CPU server")
        p.add_argument("--ratio", type=float, default=0.1)
        p.add_argument("--method", default="am-highest")
        p.add_argument("--compaction-timeout", type=float, default=600.0)
        p.add_argument("--chunk-size", type=int, default=1024, help="plugin8b's chunks")
        p.add_argument("--identity-ratio", type=float, default=1.0,
                       help="identity's keep-only ratio (1: every key)")  # fmt: skip
    a = ap.parse_args(argv)
    # `timeout` sends SIGTERM: exit through the ExitStacks so the servers' groups are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.cmd == "make-model":
        tok = a.tokenizer
        if tok is None:
            from compactor.models import prepare_model

            tok = prepare_model("smollm2-135m", dtype="bfloat16")
        shape = TINY if a.tiny else LlamaShape()
        print(json.dumps(make_model(a.out, tok, shape, device=a.device, dtype=a.dtype)))
        return 0
    if a.cmd == "report":
        res = report(a)
        print(
            json.dumps({k: v for k, v in vars(res).items() if k not in ("details", "provenance")})
        )
        print("checks:", res.checks())
        return 0
    a.state.mkdir(parents=True, exist_ok=True)
    a.w = CPU_SMOKE if a.cpu_smoke else GPU
    if a.cmd == "identity":
        rec = identity(a)
    else:
        if a.model is None:
            ap.error(f"{a.cmd} needs --model (the make-model directory)")
        rec = eight_b(a, plugin=a.cmd == "plugin8b")
    (a.state / f"{a.cmd}.json").write_text(json.dumps(rec, indent=1))
    print(f"wrote {a.state / (a.cmd + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
