"""scripts/gpu_serving.sh's parts that run on a CPU: the check-only sgl_kernel stand-in's ops
against plain torch formulas, `make-model` with a toy shape, the result record and its JSON,
the scheduler-log parser, and the script's syntax. The GPU run itself never runs in CI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gpu.serving.checkpoint import make_model
from benchmarks.gpu.serving.record import GpuServingResult
from benchmarks.gpu.serving.schedlog import decode_lines, step_time_s

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "scripts" / "gpu_standin" / "sgl_kernel"


@pytest.fixture(scope="module")
def sk() -> ModuleType:
    """The GPU stand-in under another name (the CPU stand-in keeps `sgl_kernel`)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_standin_sgl_kernel", STANDIN / "__init__.py", submodule_search_locations=[str(STANDIN)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)).to(
        x.dtype
    )


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_standin_is_marked_check_only(sk: ModuleType) -> None:
    assert sk.__standin__ is True
    assert "CHECK-ONLY" in (sk.__doc__ or "")
    with pytest.raises(AttributeError, match="check-only GPU stand-in"):
        _ = sk.not_an_sgl_kernel_op  # no catch-all: only names SGLang imports exist
    for op in (sk.int8_scaled_mm, sk.moe_sum, sk.merge_state_v2, sk.quantization.ggml_dequantize,
               sk.kvcacheio.transfer_kv_per_layer):  # fmt: skip
        with pytest.raises(NotImplementedError, match="stand-in"):
            op()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_and_fused_add(sk: ModuleType, dtype: torch.dtype, gemma: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 48, generator=g).to(dtype)
    r = torch.randn(7, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    norm, fused = (
        (sk.gemma_rmsnorm, sk.gemma_fused_add_rmsnorm)
        if gemma
        else (sk.rmsnorm, sk.fused_add_rmsnorm)
    )
    off = 1.0 if gemma else 0.0
    _close(norm(x, w, 1e-6), _rms_ref(x, w, 1e-6, off))
    out = torch.full_like(x, float("nan"))
    assert norm(x, w, 1e-5, out=out) is out
    _close(out, _rms_ref(x, w, 1e-5, off))

    xi, ri = x.clone(), r.clone()
    assert fused(xi, ri, w, 1e-6) is None  # in place
    s = (x.double() + r.double()).to(dtype)
    _close(ri, s)
    _close(xi, _rms_ref(x.double() + r.double(), w, 1e-6, off).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_and_mul(sk: ModuleType, dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    a, b = x[..., :32].double(), x[..., 32:].double()
    refs = {
        sk.silu_and_mul: F.silu(a) * b,
        sk.gelu_and_mul: F.gelu(a) * b,
        sk.gelu_tanh_and_mul: F.gelu(a, approximate="tanh") * b,
    }
    for op, want in refs.items():
        _close(op(x), want.to(dtype))
        out = torch.empty(3, 5, 32, dtype=dtype)
        assert op(x, out) is out
        _close(out, want.to(dtype))
    with pytest.raises(ValueError, match="odd"):
        sk.silu_and_mul(torch.zeros(2, 5))


def test_top_k_renorm(sk: ModuleType) -> None:
    probs = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(3)), -1)
    ks = torch.tensor([1, 3, 0, 10])  # 0 and V keep everything
    got = sk.top_k_renorm_prob(probs, ks)
    for i, k in enumerate([1, 3, 10, 10]):
        want = torch.zeros(10)
        idx = probs[i].topk(k).indices
        want[idx] = probs[i][idx] / probs[i][idx].sum()
        torch.testing.assert_close(got[i], want)
    torch.testing.assert_close(
        sk.top_k_renorm_prob(probs, 3), sk.top_k_renorm_prob(probs, ks * 0 + 3)
    )


def test_top_p_renorm(sk: ModuleType) -> None:
    probs = torch.tensor([[0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25], [0.9, 0.05, 0.03, 0.02]])
    got = sk.top_p_renorm_prob(probs, torch.tensor([0.7, 0.5, 0.5]))
    # row 0: 0.5 then 0.3 (mass before 0.3 is 0.5 < 0.7), not the 0.1s (0.8 before them)
    torch.testing.assert_close(got[0], torch.tensor([0.625, 0.0, 0.375, 0.0]))
    assert int((got[1] > 0).sum()) == 2 and torch.isclose(got[1].sum(), torch.tensor(1.0))
    torch.testing.assert_close(got[2], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_weak_ref_tensor_aliases(sk: ModuleType) -> None:
    t = torch.arange(12.0).view(3, 4)[:, 1:]
    ref = sk.weak_ref_tensor(t)
    assert ref.data_ptr() == t.data_ptr() and ref.stride() == t.stride()
    t.add_(1)
    assert torch.equal(ref, t)


@pytest.mark.slow
def test_standin_satisfies_sglang_cuda_imports() -> None:
    """Import SGLang's CUDA-path modules as if on CUDA, with the stand-in first on the path:
    every module-level `from sgl_kernel import ...` must resolve."""
    code = f"""
import sys; sys.path.insert(0, {str(STANDIN.parent)!r})
import sglang.srt.utils.common as c, sglang.srt.utils as u
for m in (c, u):
    m.is_cuda = m.is_cuda_alike = lambda: True
import sgl_kernel; assert sgl_kernel.__standin__
import torch  # an H100 as SGLang's import-time checks see it
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.device_count = lambda: 1
torch.version.cuda = "13.0"
import sglang.srt.models.llama, sglang.srt.layers.sampler
import sglang.srt.layers.attention.flashinfer_backend, sglang.srt.model_executor.model_runner
import sglang.srt.layers.attention.triton_backend  # sgl_kernel.utils.is_arch_support_pdl
import sglang.srt.managers.scheduler, sglang.srt.mem_cache.memory_pool
import sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_make_model_tiny_on_cpu(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from benchmarks.gpu.serving.run import TINY
    from compactor.models import prepare_model

    tok_dir = prepare_model("smollm2-135m")
    out = tmp_path / "m"
    make_model(out, tok_dir, TINY, device="cpu")
    tok = AutoTokenizer.from_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok) and cfg["num_key_value_heads"] == 2
    assert cfg["dtype"] == "bfloat16" and not cfg["tie_word_embeddings"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"] and len(index["weight_map"]) == 2 * 9 + 3
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tok("The harbour town", return_tensors="pt")["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    w = model.model.layers[0].self_attn.q_proj.weight
    assert 0.01 < float(w.detach().std()) < 0.03  # N(0, 0.02)
    assert torch.equal(model.model.norm.weight, torch.ones(64))


def test_make_model_without_a_tokenizer(tmp_path: Path) -> None:
    """What the GPU run serves with --skip-tokenizer-init: the shape's vocabulary, no
    tokenizer file."""
    from transformers import LlamaForCausalLM

    from benchmarks.gpu.serving.run import TINY

    summary = make_model(tmp_path, None, TINY, device="cpu")
    assert (
        summary["vocab"]
        == TINY.vocab
        == json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    )
    assert not (tmp_path / "tokenizer.json").exists()
    model = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, TINY.vocab)


def test_decode_log_parsing() -> None:
    log = (
        "[2026-11-24 04:00:00] Decode batch, #running-req: 64, #token: 43008, token usage: 0.81, "
        "cuda graph: True, gen throughput (token/s): 640.00, #queue-req: 0,\n"
        "[2026-11-24 04:00:01] Decode batch, #running-req: 64, #token: 43072, token usage: 0.81, "
        "cuda graph: True, gen throughput (token/s): 800.00, #queue-req: 0,\n"
        "[2026-11-24 04:00:02] Decode batch, #running-req: 12, #token: 900, token usage: 0.01, "
        "cuda graph: False, gen throughput (token/s): 100.00, #queue-req: 0,\n"
    )
    lines = decode_lines(log)
    assert [(x.running, x.cuda_graph) for x in lines] == [(64, True), (64, True), (12, False)]
    assert step_time_s(lines, 64) == pytest.approx((0.1 + 0.08) / 2)
    assert step_time_s(lines, 32) is None


def _phase(name: str, **kw: Any) -> dict[str, Any]:
    return {"phase": name, "backends": ["flashinfer"], "cuda_graphs": [True], **kw}


def test_report_writes_the_issue_fields(tmp_path: Path) -> None:
    from benchmarks.gpu.serving.run import main

    state = tmp_path / "state"
    state.mkdir()
    runs = {
        "stock8b": ({"decode_tokens_per_s": 1000.0}, 32834, 0.100),
        "plugin8b": ({"decode_tokens_per_s": 985.0}, 3400, 0.015),
    }
    for name, (idle, held, step) in runs.items():
        rec = _phase(name, idle=idle, pool_after_warmup={"held": held},
                     prefix={"decode_step_s": step})  # fmt: skip
        (state / f"{name}.json").write_text(json.dumps(rec))
    (state / "identity.json").write_text(
        json.dumps(_phase("identity", identity_outputs_equal=True))
    )
    out = tmp_path / "out"
    assert (
        main(["report", "--state", str(state), "--out", str(out), "--device", "H100 (test)"]) == 0
    )
    res = json.loads((out / "gpu_serving.json").read_text())
    fields = ("device", "backend", "cuda_graphs", "idle_plugin_throughput_ratio",
              "identity_outputs_equal", "prefix_slots_ratio", "decode_step_ratio")  # fmt: skip
    assert all(k in res for k in fields)
    assert res["device"] == "H100 (test)" and res["backend"] == "flashinfer" and res["cuda_graphs"]
    assert res["idle_plugin_throughput_ratio"] == pytest.approx(0.985)
    assert res["prefix_slots_ratio"] == pytest.approx(32834 / 3400)
    assert res["decode_step_ratio"] == pytest.approx(0.15)
    assert res["identity_outputs_equal"] is True and all(res["checks"].values())
    assert res["provenance"]["commit"] and (out / "gpu_serving.png").stat().st_size > 0


def test_result_checks_fail_and_missing() -> None:
    res = GpuServingResult.merge(
        "x", [_phase("plugin8b", idle_plugin_throughput_ratio=0.9, decode_step_ratio=0.4)]
    )
    checks = res.checks()
    assert checks["idle_within_3pct"] is False and checks["decode_step_0.35x"] is False
    assert checks["prefix_slots_8x"] is None and checks["identity_equal"] is None
    mixed = GpuServingResult.merge("x", [_phase("a"), {**_phase("b"), "backends": ["triton"]}])
    assert mixed.backend == "flashinfer,triton" and mixed.checks()["flashinfer"] is False


def test_script_syntax() -> None:
    for script in ("gpu_serving.sh", "gpu_checks.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True)
        assert proc.returncode == 0, proc.stderr


def test_compactor_serve_device_flag() -> None:
    """The script's `compactor serve --in-process --device cuda` (workers on the GPU)."""
    from compactor.cli import build_parser
    from compactor.workers.pool import PoolConfig

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--in-process", "--device", "cuda"])
    assert args.device == "cuda"
    assert parser.parse_args(["serve", "--model", "m"]).device == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--device", "tpu"])
    assert PoolConfig(model_dir="m").device == "cpu"


def _no_servers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """`run` without models or servers: each phase's processes are none; returns the phases
    whose processes were spawned."""
    from benchmarks.gpu.serving import run as gs

    spawned: list[str] = []

    def spawn(a: Any, phase: str, model: Path, stack: Any) -> dict[str, Any]:
        spawned.append(phase)
        return {phase: SimpleNamespace(wait_ready=lambda: None)}  # ready at once

    monkeypatch.setattr(gs, "model_path", lambda a, key: tmp_path)
    monkeypatch.setattr(gs, "spawn_phase", spawn)
    monkeypatch.setattr(gs.signal, "signal", lambda *args: None)
    return spawned


def test_a_phase_stopped_by_sigterm_leaves_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outer `timeout` stops a phase with SIGTERM (SystemExit here): its record says so
    and the merged report is written before the run stops (a GPU run once lost both)."""
    from benchmarks.gpu.serving import run as gs

    def stopped(*args: Any) -> Any:
        raise SystemExit(143)

    _no_servers(monkeypatch, tmp_path)
    monkeypatch.setattr(gs, "identity", stopped)
    state, out = tmp_path / "state", tmp_path / "out"
    with pytest.raises(SystemExit):
        gs.main(["run", "--cpu-smoke", "--state", str(state), "--out", str(out)])
    assert "SIGTERM" in json.loads((state / "identity.json").read_text())["error"]
    assert not (state / "stock8b.json").exists()  # nothing ran after the stop
    assert json.loads((out / "gpu_serving.json").read_text())


def test_a_rerun_skips_phases_recorded_without_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumable phases: a second call runs only the phases whose record is missing or holds
    an error, and starts no server for the others."""
    from benchmarks.gpu.serving import run as gs

    spawned = _no_servers(monkeypatch, tmp_path)
    ran: list[str] = []
    tries = {"plugin8b": 0}

    def phase(name: str) -> Any:
        def run(a: Any, procs: dict[str, Any], **kw: Any) -> dict[str, Any]:
            ran.append(name if name == "identity" else ("plugin8b" if kw["plugin"] else "stock8b"))
            if ran[-1] == "plugin8b":
                tries["plugin8b"] += 1
                if tries["plugin8b"] == 1:
                    raise RuntimeError("the first try fails")
            readings = {"idle": {"decode_tokens_per_s": 1.0}, "prefix": {"decode_step_s": 1.0},
                        "pool_after_warmup": {"held": 1}}  # fmt: skip
            return _phase(ran[-1], **({} if name == "identity" else readings))

        return run

    monkeypatch.setattr(gs, "identity", phase("identity"))
    monkeypatch.setattr(gs, "eight_b", phase("8b"))
    # stock8b beside plugin8b: its first half, plugin8b, then its second half
    monkeypatch.setattr(
        gs, "eight_b_warm", lambda a, srv, plugin: (ran.append("stock8b:warm"), 1.0)
    )
    monkeypatch.setattr(gs, "eight_b_measure", lambda a, srv, part, since: (
        ran.append("stock8b:measure"), phase("8b")(a, {}, plugin=False))[1])  # fmt: skip
    state, out = tmp_path / "state", tmp_path / "out"
    argv = ["run", "--cpu-smoke", "--state", str(state), "--out", str(out)]
    assert gs.main(argv) == 1  # plugin8b failed
    assert ran == ["identity", "stock8b:warm", "plugin8b", "stock8b:measure", "stock8b"]
    assert spawned == ["identity", "stock8b", "plugin8b"]
    assert "the first try fails" in json.loads((state / "plugin8b.json").read_text())["error"]
    ran.clear(), spawned.clear()
    assert gs.main(argv) == 0
    assert ran == spawned == ["plugin8b"]  # only the failed phase, only its servers
    assert gs.main([*argv, "--phases", "stock8b"]) == 0 and ran == ["plugin8b"]
    with pytest.raises(SystemExit):
        gs.main([*argv, "--phases", "identity,nope"])


def test_a_phase_is_not_started_without_its_recorded_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.gpu.serving import run as gs
    from benchmarks.gpu.serving.plan import need_s

    _no_servers(monkeypatch, tmp_path)
    monkeypatch.setattr(gs, "identity", lambda a, procs: _phase("identity"))
    state, out = tmp_path / "state", tmp_path / "out"
    budget = need_s("identity") + 1  # identity fits; plugin8b's need is over what is left
    assert need_s("plugin8b") > budget
    argv = ["run", "--cpu-smoke", "--state", str(state), "--out", str(out), "--budget-s"]
    assert gs.main([*argv, str(budget), "--phases", "identity,plugin8b"]) == 1
    assert "error" not in json.loads((state / "identity.json").read_text())
    err = json.loads((state / "plugin8b.json").read_text())["error"]
    assert err.startswith("not started:") and f"recorded need is {need_s('plugin8b'):.0f} s" in err


def test_identity_needs_the_scored_requests_served_from_the_compacted_prefix() -> None:
    """The identity figure cannot pass vacuously: scores equal to stock's count only when the
    plugin's counter says every scored request read the compacted prefix."""
    from benchmarks.gpu.serving.phases import LOGPROB_TOL, identity_verdict

    close = LOGPROB_TOL / 2
    assert identity_verdict(True, close, 1.0, rows_served=6, scored=6) is True
    assert identity_verdict(True, close, 1.0, rows_served=0, scored=6) is False  # none read it
    assert identity_verdict(True, close, 1.0, rows_served=5, scored=6) is False
    assert identity_verdict(True, 2 * LOGPROB_TOL, 1.0, rows_served=6, scored=6) is False
    assert identity_verdict(True, close, close, rows_served=6, scored=6) is False  # control
    assert identity_verdict(False, 0.0, 1.0, rows_served=0, scored=6) is None  # not installed


def test_stock8b_second_half_needs_the_idle_figure_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stock8b's second half waits up to 32 s for SGLang's idle pool figure: without that time
    left it is not started, and its record keeps the first half's readings."""
    import time

    from benchmarks.gpu.serving import run as gs

    _no_servers(monkeypatch, tmp_path)
    idle = {"decode_tokens_per_s": 1.0}

    def warm(a: Any, srv: Any, plugin: bool) -> tuple[dict[str, Any], float]:
        return {"phase": "stock8b", "idle": idle}, time.monotonic()

    monkeypatch.setattr(gs, "eight_b_warm", warm)
    state, out = tmp_path / "state", tmp_path / "out"
    argv = ["run", "--cpu-smoke", "--state", str(state), "--out", str(out), "--budget-s", "40"]
    assert gs.main([*argv, "--phases", "stock8b,plugin8b"]) == 1
    rec = json.loads((state / "stock8b.json").read_text())
    assert "second half not started" in rec["error"] and rec["idle"] == idle
    assert json.loads((state / "plugin8b.json").read_text())["error"].startswith("not started")
