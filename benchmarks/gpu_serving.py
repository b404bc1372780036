"""A real SGLang server with the plugin on a GPU machine: the GPU serving figures, one run.

    python -m benchmarks.gpu_serving run --state S --out DIR [--cpu-smoke]   # all three phases
    python -m benchmarks.gpu_serving report --state S --out DIR              # re-merge records
    python -m benchmarks.gpu_serving argv                                    # every server's flags

Run by scripts/gpu_serving.sh, which sets up SGLang, FlashInfer and the check-only sgl_kernel
stand-in on a machine without network. `run` makes two random-weight checkpoints (no
tokenizer: every server runs with `--skip-tokenizer-init`, ids in and ids out), then runs the
phases in order within `--budget-s`, writing each phase's record (S/<phase>.json) and the
merged gpu_serving.json + .png as each ends:

- identity: the SmolLM2-shaped model (bf16); a stock server (the plugin not loaded) and a
  plugin server whose fit is `keep-only` at ratio 1 (every key, beta 0), on one
  `compactor serve --device cuda`. The plugin server is asked two questions about a random
  document, then its prefix is installed. Random weights make greedy ties likely, so the
  figure compares log-probabilities: each question is sent with a fixed 16-token answer and
  SGLang scores those tokens (`input_token_logprobs`). The identity server must stay within
  `LOGPROB_TOL` of stock on every scored token, and move at most half as far as the same
  answers move, on average, when stock reads another document (the control: a random model
  depends little on its context, so the check must show the document still counts). Greedy
  16-token answers are recorded beside it.
- stock8b / plugin8b (the 8B-shaped checkpoint, one server at a time; stock = the plugin not
  loaded):
  1. idle decode: 64 distinct random 256-token prompts at once, 256 tokens each (ignore_eos),
     twice (the second burst is the figure); decode tokens/s = median of the scheduler's
     `gen throughput` over full-batch lines. The plugin server runs it before anything is
     compacted.
  2. /flush_cache, then the 32k-token shared prefix: two warm-up requests (prefix + its own
     32-token question, 1 token out); the plugin sends the prefix to the service (ratio 0.1,
     am-highest in 1024-token chunks) and installs it. KV slots held (pool - free, SGLang's
     own counters) once idle, on both servers.
  3. 64 requests at once (prefix + question i, 128 tokens out, ignore_eos): decode step =
     median over full-batch log lines of 64 / gen throughput.

Every GPU server gets `--attention-backend flashinfer` and decode CUDA graphs for the batch
sizes the run uses (`DECODE_GRAPH_BS`; other sizes pad up); prefill graphs are off
(`--disable-prefill-cuda-graph`: 58 captured sizes cost ~37 s a start and no figure reads
them). What SGLang reports (`/server_info`, `cuda graph:` on each decode line) is recorded.
Where torch is not the version SGLang's wheel was built for, the servers use SGLang's
pure-Python radix tree core (`tree_core_env`): the wheel's compiled core reads tensors of
another torch at the wrong offsets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_serving_lib import (  # noqa: E402
    LLAMA3_8B,
    SMOLLM2,
    GpuServingResult,
    LlamaShape,
    make_model,
    plot_result,
)
from benchmarks._gpu_serving_phases import (  # noqa: E402
    burst,
    flush_cache,
    generate_ids,
    random_ids,
    score_ids,
    server_facts,
)

PHASES = ("identity", "stock8b", "plugin8b")
DECODE_GRAPH_BS = (1, 2, 4, 8, 16, 32, 64)
LOGPROB_TOL = 0.05  # nats: identity vs stock, each scored token
CONTROL_FRACTION = 0.5  # identity's largest shift <= this x the control's mean shift


@dataclass(frozen=True)
class Workload:
    """The phases' sizes and device (GPU: the issue's; `--cpu-smoke`: the same code path on
    a CPU SGLang server with toy models, to check the run's plumbing without a GPU)."""

    device: str = "cuda"
    batch: int = 64
    prefix_tokens: int = 32768
    question_tokens: int = 32
    idle_prompt: int = 256
    idle_out: int = 256
    prefix_out: int = 128
    identity_doc: int = 2048
    identity_questions: int = 6
    answer_tokens: int = 16
    small: LlamaShape = SMOLLM2
    big: LlamaShape = LLAMA3_8B


TINY = LlamaShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                  max_positions=4096, vocab=512)  # fmt: skip
GPU = Workload()
CPU_SMOKE = Workload("cpu", batch=4, prefix_tokens=1024, idle_prompt=64, idle_out=24,
                     prefix_out=24, identity_doc=512, identity_questions=3, answer_tokens=8,
                     small=TINY, big=TINY)  # fmt: skip


def tree_core_env(torch_version: str | None = None) -> dict[str, str]:
    """Environment for SGLang servers with `torch_version` (default: the installed torch): the
    pure-Python radix tree core where it is not the torch SGLang's wheel pins (and its compiled
    core was built against); nothing otherwise."""
    import re
    from importlib.metadata import requires

    if torch_version is None:
        import torch

        torch_version = str(torch.__version__)
    pins = [r for r in requires("sglang") or [] if re.match(r"torch\s*==", r)]
    pinned = pins[0].split("==", 1)[1].split(";")[0].strip() if pins else None
    if pinned is None or torch_version.split("+", 1)[0] == pinned:
        return {}
    return {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}


def server_args(a: argparse.Namespace) -> list[str]:
    """Flags every server gets (stock and plugin alike)."""
    w: Workload = a.w
    common = ["--skip-tokenizer-init", "--enable-metrics", "--decode-log-interval", "1",
              "--max-running-requests", str(w.batch)]  # fmt: skip
    if w.device == "cpu":
        return ["--attention-backend", "torch_native", *common]
    return [
        "--attention-backend", "flashinfer", *common,
        "--mem-fraction-static", str(a.mem_fraction),
        "--cuda-graph-bs-decode", *map(str, DECODE_GRAPH_BS),
        "--disable-prefill-cuda-graph",
    ]  # fmt: skip


def servers(a: argparse.Namespace, phase: str, endpoint: str, model: Path) -> dict[str, Any]:
    """The SGLang servers of `phase` (not started), by name: what the phase runs, and what
    `argv` prints for the preflight to parse."""
    from harness.launch import SGLangServer
    from harness.workload import compaction_args

    w: Workload = a.w
    env = tree_core_env()
    logs = a.state / "logs"
    if phase == "identity":
        ident = [*compaction_args(endpoint, a.identity_ratio, "keep-only", min_hits=2,
                                  timeout_s=a.compaction_timeout),
                 "--compaction-param", 'inner="am-highest"']  # fmt: skip
        return {
            name: SGLangServer(
                model,
                logs / f"sglang-identity-{name}.log",
                device=w.device,
                max_total_tokens=4 * w.identity_doc,
                extra_args=server_args(a) + extra,
                startup_timeout=540,
                plugin=bool(extra),
                env=env,
            )
            for name, extra in (("stock", []), ("identity", ident))
        }
    plugin = phase == "plugin8b"
    extra = server_args(a)
    if plugin:
        extra += compaction_args(endpoint, a.ratio, a.method, min_hits=2,
                                 timeout_s=a.compaction_timeout)  # fmt: skip
        extra += ["--compaction-chunk-size", str(a.chunk_size)]
    return {
        phase: SGLangServer(model, logs / f"sglang-{phase}.log", device=w.device,
                            max_total_tokens=a.max_total_tokens or w.prefix_tokens + 20000,
                            extra_args=extra, startup_timeout=600, plugin=plugin, env=env)
    }  # fmt: skip


def _service(a: argparse.Namespace, stack: contextlib.ExitStack, model: Path, name: str) -> Any:
    from harness.launch import CompactorService, start_all

    svc = CompactorService(model, a.state / "logs" / f"compactor-{name}.log", in_process=True,
                           extra_args=["--device", a.w.device], startup_timeout=600)  # fmt: skip
    start_all(stack, [svc])
    return svc


def identity(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    from harness.launch import start_all
    from harness.workload import wait_for_compactions

    w: Workload = a.w
    vocab = w.small.vocab
    doc, other = random_ids(w.identity_doc, 1, vocab), random_ids(w.identity_doc, 2, vocab)
    qs = [random_ids(w.question_tokens, 10 + i, vocab) for i in range(w.identity_questions)]
    answers = [random_ids(w.answer_tokens, 50 + i, vocab) for i in range(len(qs))]
    with contextlib.ExitStack() as stack:
        svc = _service(a, stack, model, "identity")
        srv = servers(a, "identity", svc.endpoint, model)
        start_all(stack, list(srv.values()))
        for q in qs[:2]:
            generate_ids(srv["identity"].url, doc + q, 1)
        comp = wait_for_compactions(srv["identity"], 1, a.compaction_timeout, progress=True)
        scores = {
            name: [score_ids(s.url, doc + q, ans) for q, ans in zip(qs, answers)]
            for name, s in srv.items()
        }
        control = [score_ids(srv["stock"].url, other + q, ans) for q, ans in zip(qs, answers)]
        greedy = {
            name: [generate_ids(s.url, doc + q, w.answer_tokens)["output_ids"] for q in qs]
            for name, s in srv.items()
        }
        facts = {name: server_facts(s) for name, s in srv.items()}
    installed = comp.get("installed_total", 0) >= 1
    shift = [abs(x - y) for a_, b_ in zip(scores["stock"], scores["identity"])
             for x, y in zip(a_, b_)]  # fmt: skip
    ctrl = [abs(x - y) for a_, b_ in zip(scores["stock"], control) for x, y in zip(a_, b_)]
    max_shift, mean_ctrl = max(shift), sum(ctrl) / len(ctrl)
    within = max_shift <= LOGPROB_TOL and max_shift <= CONTROL_FRACTION * mean_ctrl
    log_text = Path(srv["identity"].log_path).read_text(errors="replace")
    return {
        "phase": "identity",
        "model": str(model),
        "compaction": comp,
        "logprob_max_abs_diff": max_shift,
        "control_mean_abs_diff": mean_ctrl,
        "logprob_tolerance": {"abs": LOGPROB_TOL, "of_control": CONTROL_FRACTION},
        "scores": scores,
        "greedy_equal_per_question": [x == y for x, y in zip(*greedy.values())],
        "greedy": greedy,
        # None (not measured) unless the identity fit was installed: a fallback serves the
        # uncompacted prefix, whose scores equal stock's trivially
        "identity_outputs_equal": within if installed else None,
        "rejections": [ln for ln in log_text.splitlines() if "compaction result rejected" in ln],
        "server": facts,
        "backends": [str(f.get("attention_backend")) for f in facts.values()],
        "cuda_graphs": [not f.get("disable_cuda_graph", False) for f in facts.values()],
    }


def eight_b(a: argparse.Namespace, model: Path, plugin: bool) -> dict[str, Any]:
    from harness.launch import start_all
    from harness.pool import read_pool
    from harness.workload import wait_for_compactions

    w: Workload = a.w
    vocab = w.big.vocab
    name = "plugin8b" if plugin else "stock8b"
    rec: dict[str, Any] = {"phase": name, "model": str(model), "workload": asdict(w)}
    with contextlib.ExitStack() as stack:
        endpoint = _service(a, stack, model, name).endpoint if plugin else "unused:0"
        srv = servers(a, name, endpoint, model)[name]
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


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def report(a: argparse.Namespace) -> GpuServingResult:
    """Merge the phase records under `a.state` into gpu_serving.json + .png in `a.out`."""
    from benchmarks._meta import provenance

    parts = {p.stem: json.loads(p.read_text()) for p in sorted(a.state.glob("*.json"))}
    stock, plug = parts.get("stock8b"), parts.get("plugin8b")
    if stock and plug and "error" not in stock and "error" not in plug:
        s_idle, p_idle = stock["idle"]["decode_tokens_per_s"], plug["idle"]["decode_tokens_per_s"]
        s_held, p_held = stock["pool_after_warmup"]["held"], plug["pool_after_warmup"]["held"]
        s_step, p_step = stock["prefix"]["decode_step_s"], plug["prefix"]["decode_step_s"]
        plug["idle_plugin_throughput_ratio"] = p_idle / s_idle if s_idle and p_idle else None
        plug["prefix_slots_ratio"] = s_held / p_held if p_held else None
        plug["decode_step_ratio"] = p_step / s_step if s_step and p_step else None
    ordered = [parts[k] for k in PHASES if k in parts]
    res = GpuServingResult.merge(a.device or device_name(), ordered)
    res.provenance = provenance(module="benchmarks.gpu_serving")
    a.out.mkdir(parents=True, exist_ok=True)
    res.write(a.out / "gpu_serving.json")
    plot_result(res, a.out / "gpu_serving.png")
    return res


def models(a: argparse.Namespace) -> dict[str, Path]:
    """The two random checkpoints under the state folder, made once."""
    out = {}
    for key, shape in (("small", a.w.small), ("big", a.w.big)):
        path = a.state / f"model-{key}"
        if not (path / "random_model.json").is_file():
            make_model(path, None, shape, device=a.w.device, dtype=a.dtype)
        out[key] = path
    return out


def run(a: argparse.Namespace) -> int:
    """Every phase in order within `a.budget_s`; each record and the merged report are
    written as each phase ends. Returns the number of phases that failed or did not run."""
    t0 = time.monotonic()
    (a.state / "logs").mkdir(parents=True, exist_ok=True)
    paths = models(a)
    bad = 0
    for phase in PHASES:
        left = a.budget_s - (time.monotonic() - t0)
        if left < a.min_phase_s:
            print(f"=== {phase}: not run, {left:.0f} s left of --budget-s", flush=True)
            bad += 1
            continue
        print(f"=== {phase} ({time.monotonic() - t0:.0f} s into the run)", flush=True)
        stopped: SystemExit | None = None
        try:
            if phase == "identity":
                rec = identity(a, paths["small"])
            else:
                rec = eight_b(a, paths["big"], plugin=phase == "plugin8b")
        except (Exception, SystemExit) as exc:  # a failed phase keeps the others' records
            bad += 1
            rec = {"phase": phase, "error": f"{type(exc).__name__}: {exc}"[-4000:]}
            if isinstance(exc, SystemExit):  # SIGTERM (the outer timeout): record, then stop
                stopped, rec["error"] = exc, "stopped by SIGTERM (the outer timeout)"
            print(f"  [{phase}] failed: {rec['error'][-1500:]}", flush=True)
        rec["seconds"] = time.monotonic() - t0
        (a.state / f"{phase}.json").write_text(json.dumps(rec, indent=1))
        res = report(a)
        print(f"  [{phase}] done at {rec['seconds']:.0f} s; checks so far {res.checks()}")
        if stopped is not None:
            raise stopped
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "report", "argv"):
        p = sub.add_parser(name)
        p.add_argument("--state", type=Path, default=Path("/tmp/gpu_serving/state"),
                       help="phase records, models and logs go here")  # fmt: skip
        p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
        p.add_argument("--device", default=None, help="report: the machine's name")
        p.add_argument("--cpu-smoke", action="store_true", help="toy models, a CPU server")
        p.add_argument("--budget-s", type=float, default=540.0, help="run: all phases within")
        p.add_argument("--min-phase-s", type=float, default=60.0,
                       help="run: a phase starts only with this much of the budget left")  # fmt: skip
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--mem-fraction", type=float, default=0.88)
        p.add_argument("--max-total-tokens", type=int, default=None)
        p.add_argument("--ratio", type=float, default=0.1)
        p.add_argument("--method", default="am-highest")
        p.add_argument("--compaction-timeout", type=float, default=300.0)
        p.add_argument("--chunk-size", type=int, default=1024, help="plugin8b's chunks")
        p.add_argument("--identity-ratio", type=float, default=1.0,
                       help="identity's keep-only ratio (1: every key)")  # fmt: skip
    a = ap.parse_args(argv)
    # `timeout` sends SIGTERM: exit through the ExitStacks so the servers' groups are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.w = CPU_SMOKE if a.cpu_smoke else GPU
    if a.cmd == "report":
        res = report(a)
        print(
            json.dumps({k: v for k, v in vars(res).items() if k not in ("details", "provenance")})
        )
        print("checks:", res.checks())
        return 0
    if a.cmd == "argv":  # every server's launch_server flags, for the preflight to parse
        model = Path("/nonexistent/model")
        flags = {name: {"plugin": s.plugin, "flags": s.command()[3:]} for phase in PHASES
                 for name, s in servers(a, phase, "127.0.0.1:1", model).items()}  # fmt: skip
        print(json.dumps(flags))
        return 0
    a.state.mkdir(parents=True, exist_ok=True)
    return 1 if run(a) else 0


if __name__ == "__main__":
    sys.exit(main())
