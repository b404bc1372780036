"""benchmarks/gpu/preflight/kernels.py against the real SGLang in .venv, and the check-only GPU
stand-in it checks (scripts/gpu_standin): the sgl_kernel import scan and its resolution, the
names table's stubs, utils.is_arch_support_pdl, scalar_type, the dual-GEMM shim (in
subprocesses, as the GPU script's PYTHONPATH gives it) and the unavailable-imports probe. The
whole check on the real SGLang (`check`, its ALLOWLIST not stale) runs in the preflight,
tests/benchmarks/test_gpu_preflight.py."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmarks.gpu.preflight import kernels as pk

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "scripts" / "gpu_standin"
SGLANG = pk.installed_sglang()
DUAL_GEMM = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"


@pytest.fixture(scope="module")
def imports() -> list[pk.KernelImport]:
    return pk.sgl_kernel_imports(SGLANG)


@pytest.fixture(scope="module")
def sk() -> ModuleType:
    """The GPU stand-in under another name (the venv's CPU stand-in keeps `sgl_kernel`)."""
    pkg = STANDIN / "sgl_kernel"
    spec = importlib.util.spec_from_file_location(
        "preflight_standin_sgl_kernel", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _copy_standin(tmp_path: Path) -> Path:
    copy = tmp_path / "gpu_standin"
    shutil.copytree(STANDIN, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_scan_finds_module_level_and_lazy_imports(imports: list[pk.KernelImport]) -> None:
    where = {(i.file, i.target): i.line for i in imports}
    pdl = where[("sglang/srt/layers/attention/triton_backend.py",
                 "sgl_kernel.utils.is_arch_support_pdl")]  # fmt: skip
    assert ("sglang/srt/layers/sampler.py", "sgl_kernel.top_k_renorm_prob") in where  # module level
    assert ("sglang/srt/layers/rotary_embedding/base.py", "sgl_kernel.rotary_embedding") in where
    assert ("sglang/srt/mem_cache/pool_host/_kvcacheio.py", "sgl_kernel.kvcacheio") in where
    src = (SGLANG / "srt/layers/attention/triton_backend.py").read_text().splitlines()
    assert "from sgl_kernel.utils import is_arch_support_pdl" in src[pdl - 1]
    assert all(i.module.partition(".")[0] == "sgl_kernel" for i in imports)  # not sgl_kernel_npu
    assert sum(i.file.startswith("sglang/srt/") for i in imports) >= 100


def test_function_level_statements_skip_guarded_ones() -> None:
    stmts = pk.function_level_imports(
        SGLANG, ["srt/layers/activation.py", "srt/layers/dual_gemm.py"]
    )
    by_target = {(s.file.rsplit("/", 1)[1], s.target): s for s in stmts}
    assert ("activation.py", "sgl_kernel_npu.activation.situ") in by_target
    assert not any(t == "xielu.ops" for _, t in by_target)  # inside try/except ImportError
    assert by_target[("dual_gemm.py", DUAL_GEMM)].module == "sglang.srt.layers.dual_gemm"
    for (file, _), reason in pk.ALLOWLIST.items():
        assert reason and file.removeprefix("sglang/") in pk.LAYER_PATH_FILES


def test_current_standin_resolves_every_kernel_import(imports: list[pk.KernelImport]) -> None:
    assert pk.unresolved_kernel_imports(imports, STANDIN) == []


def test_standin_without_utils_fails(imports: list[pk.KernelImport], tmp_path: Path) -> None:
    copy = _copy_standin(tmp_path)
    (copy / "sgl_kernel" / "utils.py").unlink()
    lines = pk.unresolved_kernel_imports(imports, copy)
    assert len(lines) == 1, lines
    assert "sgl_kernel.utils.is_arch_support_pdl" in lines[0]
    assert "sglang/srt/layers/attention/triton_backend.py:" in lines[0]


def test_standin_without_a_table_name_fails(imports: list[pk.KernelImport], tmp_path: Path) -> None:
    """The names table drives the stubs and nothing else answers (no catch-all)."""
    copy = _copy_standin(tmp_path)
    names = copy / "sgl_kernel" / "_names.py"
    names.write_text(names.read_text().replace('"merge_state_v2",', ""))
    lines = pk.unresolved_kernel_imports(imports, copy)
    assert len(lines) == 1 and "sgl_kernel.merge_state_v2 does not resolve" in lines[0], lines


def test_names_table_is_the_scan_less_what_is_implemented(
    sk: ModuleType, imports: list[pk.KernelImport]
) -> None:
    stubs = sys.modules[f"{sk.__name__}._names"].STUBS
    tabled = {f"sgl_kernel.{n}" for n in stubs[""]} | {
        f"sgl_kernel.{sub}.{n}" for sub, names in stubs.items() if sub for n in names
    }
    real = {f"sgl_kernel.{n}" for n in sk._IMPLEMENTED} | {
        "sgl_kernel.utils.is_arch_support_pdl", "sgl_kernel.scalar_type.ScalarType",
        "sgl_kernel.scalar_type.scalar_types"}  # fmt: skip
    modules = {"sgl_kernel", *(f"sgl_kernel.{s}" for s in stubs if s), "sgl_kernel.utils",
               "sgl_kernel.scalar_type"}  # fmt: skip
    scanned = {i.target for i in imports} - modules
    assert not tabled & real
    assert scanned == tabled | real  # every imported name, and no stub SGLang never imports


def test_stub_ops_raise_naming_themselves(sk: ModuleType) -> None:
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.merge_state_v2 .*check-only GPU"):
        sk.merge_state_v2(torch.zeros(1))
    fa = importlib.import_module(f"{sk.__name__}.flash_attn")  # registered in sys.modules
    assert fa is sk.flash_attn and fa.flash_attn_varlen_func.__name__ == "flash_attn_varlen_func"
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.flash_attn\.flash_attn_varlen_f"):
        fa.flash_attn_varlen_func(q=None)
    with pytest.raises(AttributeError, match="check-only GPU stand-in"):
        _ = fa.flash_attn_not_imported_by_sglang
    assert getattr(sk.top_k, "_FAST_TOPK_SUPPORTED_K", (2048,)) == (2048,)  # QSA's getattr
    assert "merge_state_v2" in sk.__all__ and "rmsnorm" in sk.__all__


def test_is_arch_support_pdl(sk: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    pdl = importlib.import_module(f"{sk.__name__}.utils").is_arch_support_pdl
    pdl.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pdl() is False  # no CUDA device
    for cap, want in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        pdl.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=cap: c)
        assert pdl() is want
    pdl.cache_clear()


def test_scalar_type(sk: ModuleType) -> None:
    st = importlib.import_module(f"{sk.__name__}.scalar_type")
    t = st.scalar_types
    assert (t.uint4b8.size_bits, t.uint4b8.min(), t.uint4b8.max()) == (4, -8, 7)
    assert (t.uint8b128.min(), t.uint8b128.max(), t.int8.min(), t.uint4.max()) == (
        -128,
        127,
        -128,
        15,
    )
    assert [str(x) for x in (t.uint4b8, t.float8_e4m3fn, t.float4_e2m1f, t.bfloat16)] == [
        "uint4b8", "float8_e4m3fn", "float4_e2m1f", "float16_e8m7"]  # fmt: skip
    assert st.ScalarType.from_id(t.uint8b128.id) == t.uint8b128 and t.uint4b8.has_bias()
    assert t.float8_e4m3fn.is_floating_point() and not t.uint4.is_signed()
    with pytest.raises(NotImplementedError, match="stand-in"):
        t.float8_e4m3fn.max()


def _run(code: str, pythonpath: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)  # fmt: skip


def test_dual_gemm_shim_in_subprocesses(tmp_path: Path) -> None:
    """With the stand-in dir on PYTHONPATH (as scripts/gpu_serving.sh sets it) the shim serves
    the module in the process and in a spawned child; a shadowed sitecustomize still runs."""
    (tmp_path / "sitecustomize.py").write_text(
        f"open({str(tmp_path / 'chained')!r}, 'w').write('yes')\n"
    )
    code = f"""
import multiprocessing as mp, sys
def probe(q):
    from {DUAL_GEMM} import MAX_DUAL_GEMM_DECODE_TOKENS, DualGemmQuantMode, can_use_dual_gemm
    m = sys.modules[{DUAL_GEMM!r}]
    q.put((m.__file__, can_use_dual_gemm(1, 4096, 14336, DualGemmQuantMode.UNQUANT),
           MAX_DUAL_GEMM_DECODE_TOKENS, "cutlass" in sys.modules))
if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    probe(q)
    p = mp.get_context("spawn").Process(target=probe, args=(q,))
    p.start(); p.join()
    print(q.get(), q.get(), sep="\\n")
"""
    script = tmp_path / "probe.py"
    script.write_text(code)
    proc = _run(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                f"{STANDIN}:{tmp_path}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shim = str(STANDIN / "_gpu_shims" / "cutedsl_dual_gemm.py")
    for line in proc.stdout.strip().splitlines()[-2:]:
        assert line == repr((shim, False, 16, False))
    assert (tmp_path / "chained").read_text() == "yes"


def test_shim_resolves_the_dual_gemm_import_and_removing_it_fails(tmp_path: Path) -> None:
    layer = ("srt/layers/dual_gemm.py",)
    assert pk.unavailable_imports(SGLANG, STANDIN, closure=(), layer_files=layer) == []
    copy = _copy_standin(tmp_path)
    shims = copy / "_gpu_shims" / "__init__.py"
    text = shims.read_text()
    assert f'"{DUAL_GEMM}": ' in text
    shims.write_text("\n".join(x for x in text.splitlines() if f'"{DUAL_GEMM}": ' not in x))
    lines = pk.unavailable_imports(SGLANG, copy, closure=(), layer_files=layer)
    assert len(lines) == 1, lines
    assert "sglang/srt/layers/dual_gemm.py:" in lines[0] and DUAL_GEMM in lines[0]
    assert "`cutlass`" in lines[0] and "cutedsl_dual_gemm.py:" in lines[0]


def test_probe_sees_only_what_the_gpu_machine_has() -> None:
    """ray is in this venv but not on the GPU machine: the probe's site view hides it."""
    assert importlib.util.find_spec("ray") is not None
    lines = pk.unavailable_imports(SGLANG, STANDIN, closure=("ray",), layer_files=())
    assert len(lines) == 1 and "needs `ray`, absent on the GPU machine" in lines[0], lines
