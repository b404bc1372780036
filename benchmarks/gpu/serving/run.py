"""A real SGLang server with the plugin on a GPU machine: the GPU serving figures, one run.

    python -m benchmarks.gpu.serving.run run --state S --out DIR [--phases a,b] [--cpu-smoke]
    python -m benchmarks.gpu.serving.run report --state S --out DIR    # re-merge the records
    python -m benchmarks.gpu.serving.run argv                          # every server's flags

Run by scripts/gpu_serving.sh, which sets up SGLang, FlashInfer and the check-only sgl_kernel
stand-in on a machine without network. `run` makes two random-weight checkpoints (no
tokenizer: every server runs with `--skip-tokenizer-init`, ids in and ids out), starts the
service and servers of every phase to run at once (one FlashInfer JIT: both models have
head_dim 128; the servers idle, using no GPU, until their phase), then runs the phases in
order, each only while what is left of `--budget-s` covers its recorded need
(`benchmarks.gpu.serving.plan.need_s`). Each phase's record (S/<phase>.json) and the merged
gpu_serving.json + .png are written as it ends; a phase whose record holds no error is not
run again (`--phases` picks phases; a warm machine keeps S). The phases
(`benchmarks.gpu.serving.phases`):

- identity: the identity model (`IDENTITY`, bf16); a stock server (the plugin not loaded) and
  a plugin server whose fit is `keep-only` at ratio 1 (every key, beta 0), on a
  `compactor serve --device cuda`. The plugin server is asked two questions about a random
  document, then its prefix is installed; each question is then scored with a fixed 16-token
  answer (`input_token_logprobs`) on both servers. Identity holds when every score is within
  `LOGPROB_TOL` of stock's, moves at most half as far as stock moves on another document
  (the control), and every scored request was served from the compacted prefix (the plugin's
  `compacted_rows` counter on /metrics moved by as many rows).
- stock8b / plugin8b (the 8B-shaped checkpoint; stock = the plugin not loaded):
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

Every GPU server gets `--attention-backend flashinfer`, decode CUDA graphs for the batch sizes
the run uses (`DECODE_GRAPH_BS`; other sizes pad up) and `--sleep-on-idle` (an idle scheduler
otherwise spins a core, and four of them would slow the JIT); prefill graphs are off
(`--disable-prefill-cuda-graph`: 58 captured sizes cost ~37 s a start and no figure reads
them). The backend is what SGLang builds (`served_backend`); `cuda_graphs` is read from the
idle bursts' decode lines (a batch on a compacted prefix runs eagerly, by design: its lines are
recorded beside). Where torch is not the version SGLang's wheel was built for, the servers use
SGLang's pure-Python radix tree core (`tree_core_env`): the wheel's compiled core reads tensors
of another torch at the wrong offsets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options
from benchmarks.gpu.serving.checkpoint import IDENTITY, LLAMA3_8B, LlamaShape, make_model
from benchmarks.gpu.serving.phases import (
    eight_b,
    eight_b_measure,
    eight_b_warm,
    identity,
)
from benchmarks.gpu.serving.plan import PHASES, load_timings
from benchmarks.gpu.serving.record import GpuServingResult, plot_result
from harness.pool import IDLE_REPUBLISH_S

DECODE_GRAPH_BS = (1, 2, 4, 8, 16, 32, 64)
MODEL_OF = {"identity": "small", "stock8b": "big", "plugin8b": "big"}


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
    small: LlamaShape = IDENTITY
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
        "--disable-prefill-cuda-graph", "--sleep-on-idle",
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
                startup_timeout=a.startup_timeout,
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
                            extra_args=extra, startup_timeout=a.startup_timeout,
                            plugin=plugin, env=env)
    }  # fmt: skip


def spawn_phase(
    a: argparse.Namespace, phase: str, model: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    """Spawn `phase`'s service (its plugin servers' endpoint) and servers without waiting;
    `stack` stops them. Returns them by name (the service as "service")."""
    from harness.launch import CompactorService

    procs: dict[str, Any] = {}
    if phase != "stock8b":
        svc = CompactorService(model, a.state / "logs" / f"compactor-{phase}.log",
                               in_process=True, extra_args=["--device", a.w.device],
                               startup_timeout=a.startup_timeout)  # fmt: skip
        stack.callback(svc.stop)
        svc.spawn()  # its port is picked here: the servers' endpoint
        procs["service"] = svc
    endpoint = procs["service"].endpoint if procs else "unused:0"
    for name, srv in servers(a, phase, endpoint, model).items():
        stack.callback(srv.stop)
        srv.spawn()
        procs[name] = srv
    return procs


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def report(a: argparse.Namespace) -> GpuServingResult:
    """Merge the phase records under `a.state` into gpu_serving.json + .png in `a.out`."""
    from harness.provenance import provenance

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
    res.provenance = provenance(module="benchmarks.gpu.serving.run")
    a.out.mkdir(parents=True, exist_ok=True)
    res.write(a.out / "gpu_serving.json")
    plot_result(res, a.out / "gpu_serving.png")
    return res


def model_path(a: argparse.Namespace, key: str) -> Path:
    """The random checkpoint `key` ("small" or "big") under the state folder, made once."""
    path = a.state / f"model-{key}"
    if not (path / "random_model.json").is_file():
        shape = a.w.small if key == "small" else a.w.big
        make_model(path, None, shape, device=a.w.device, dtype=a.dtype)
    return path


def done_before(state: Path, phase: str) -> bool:
    """Whether `phase` has a record without an error under `state` (a rerun skips it)."""
    path = state / f"{phase}.json"
    return path.is_file() and "error" not in json.loads(path.read_text())


def run(a: argparse.Namespace) -> int:
    """`a.phases` in order within `a.budget_s`, every service and server started at once
    (the small model's first, while the big one is written); each record and the merged
    report are written as each phase ends. Returns the number of phases that failed or did
    not run."""
    t0 = time.monotonic()
    (a.state / "logs").mkdir(parents=True, exist_ok=True)
    todo = [p for p in a.phases if not done_before(a.state, p)]
    for phase in a.phases:
        if phase not in todo:
            print(f"=== {phase}: recorded without error by an earlier run; not run again")
    if not todo:
        report(a)
        return 0
    needs = load_timings()
    bad = 0
    with contextlib.ExitStack() as stack:
        procs: dict[str, dict[str, Any] | BaseException] = {}
        for key in ("small", "big"):
            for phase in (p for p in todo if MODEL_OF[p] == key):
                try:
                    procs[phase] = spawn_phase(a, phase, model_path(a, key), stack)
                except Exception as exc:  # recorded as the phase's error below
                    procs[phase] = exc
        print(f"=== every server spawned ({time.monotonic() - t0:.0f} s into the run)", flush=True)
        later: tuple[Any, dict[str, Any], float, float, float] | None = None
        for phase in todo:
            left = a.budget_s - (time.monotonic() - t0)
            if left < needs[phase]:
                rec: dict[str, Any] = {"phase": phase, "error": (
                    f"not started: {left:.0f} s left of --budget-s, its recorded need is "
                    f"{needs[phase]:.0f} s")}  # fmt: skip
                bad += 1
                _write(a, rec, t0)
                continue
            print(f"=== {phase} ({time.monotonic() - t0:.0f} s into the run)", flush=True)
            start = time.monotonic()
            try:
                mine = procs[phase]
                if isinstance(mine, BaseException):
                    raise mine
                for proc in mine.values():
                    proc.wait_ready()
                ready = time.monotonic()
                if phase == "stock8b" and "plugin8b" in todo[todo.index(phase) :]:
                    # stock's idle pool figure is republished ~32 s after it went idle: its
                    # second half runs after plugin8b instead of waiting (both idle meanwhile)
                    part, idle_since = eight_b_warm(a, mine[phase], plugin=False)
                    later = (mine[phase], part, idle_since, start, ready)
                    continue
                rec = identity(a, mine) if phase == "identity" else eight_b(
                    a, mine, plugin=phase == "plugin8b")  # fmt: skip
                rec["waited_for_servers_s"] = ready - start
                rec["measured_s"] = time.monotonic() - ready
            except (Exception, SystemExit) as exc:  # a failed phase keeps the others' records
                bad += 1
                rec = _failed(phase, exc)
            _write(a, rec, t0)
        if later is not None:  # stock8b's second half, if what is left covers it
            srv, part, idle_since, start, ready = later
            wait = max(0.0, IDLE_REPUBLISH_S - (time.monotonic() - idle_since))
            left = a.budget_s - (time.monotonic() - t0)
            try:
                if left < wait + needs["stock8b"]:
                    raise TimeoutError(
                        f"second half not started: {left:.0f} s left of --budget-s, it needs "
                        f"{wait:.0f} s for SGLang's idle pool figure + {needs['stock8b']:.0f} s"
                    )
                rec = eight_b_measure(a, srv, part, idle_since)
                rec["waited_for_servers_s"] = ready - start
                rec["measured_s"] = time.monotonic() - ready  # plugin8b's time included
            except (Exception, SystemExit) as exc:
                bad += 1
                rec = {**part, **_failed("stock8b", exc)}  # the first half's readings kept
            _write(a, rec, t0)
    return bad


def _failed(phase: str, exc: BaseException) -> dict[str, Any]:
    """The record of a phase that raised; SIGTERM (the outer timeout) says so."""
    rec: dict[str, Any] = {"phase": phase, "error": f"{type(exc).__name__}: {exc}"[-4000:]}
    if isinstance(exc, SystemExit):
        rec["error"], rec["stopped"] = "stopped by SIGTERM (the outer timeout)", exc.code
    print(f"  [{phase}] failed: {rec['error'][-1500:]}", flush=True)
    return rec


def _write(a: argparse.Namespace, rec: dict[str, Any], t0: float) -> None:
    """Write a phase record and the merged report; then, if the outer timeout stopped the
    phase (`_failed`), exit (the ExitStack stops every server)."""
    rec["seconds"] = time.monotonic() - t0
    (a.state / f"{rec['phase']}.json").write_text(json.dumps(rec, indent=1))
    res = report(a)
    print(f"  [{rec['phase']}] done at {rec['seconds']:.0f} s; checks so far {res.checks()}")
    if "stopped" in rec:
        raise SystemExit(rec["stopped"])


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
        p.add_argument("--phases", default=",".join(PHASES),
                       help="run: these phases, in this order (comma-separated)")  # fmt: skip
        p.add_argument("--startup-timeout", type=float, default=600.0,
                       help="run: seconds a service or server may take to answer")  # fmt: skip
        add_options(p, dtype="bfloat16", mem_fraction=0.88)
        p.add_argument("--max-total-tokens", type=int, default=None)
        add_options(p, ratio=0.1, method="am-highest", compaction_timeout=300.0)
        p.add_argument("--chunk-size", type=int, default=1024, help="plugin8b's chunks")
        p.add_argument("--identity-ratio", type=float, default=1.0,
                       help="identity's keep-only ratio (1: every key)")  # fmt: skip
    a = ap.parse_args(argv)
    # `timeout` sends SIGTERM: exit through the ExitStacks so the servers' groups are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.w = CPU_SMOKE if a.cpu_smoke else GPU
    a.phases = [p for p in a.phases.split(",") if p]
    if unknown := set(a.phases) - set(PHASES):
        ap.error(f"--phases: unknown {sorted(unknown)}; choose from {list(PHASES)}")
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
