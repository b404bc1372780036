"""Preflight for scripts/gpu_serving.sh, run on a CPU: the imports a GPU try would fail on.

1. sgl_kernel: every `from sgl_kernel[.sub] import name` / `import sgl_kernel[.sub]` anywhere in
   the installed SGLang (AST scan) must resolve in the check-only stand-in (scripts/gpu_standin),
   loaded in a fresh subprocess with that folder first on sys.path (the venv's CPU stand-in, also
   named sgl_kernel, never answers). The stand-in has no catch-all, so a miss is a real gap.
2. unavailable packages: a `python -S` subprocess sees only what the GPU machine has (a symlink
   view of site-packages filtered to GPU_IMAGE_PACKAGES, scripts/gpu_wheels.txt and FlashInfer;
   the stand-in; the stdlib), fakes an H100 as tests/benchmarks/test_gpu_serving_smoke.py does and
   installs the stand-in's `_gpu_shims` (its SHIMS table). It imports CLOSURE_MODULES (their
   module-level closure runs for real, platform branches as on CUDA sm90), then runs every
   function-level import statement of LAYER_PATH_FILES that no try/except ImportError guards.
   Needing a package the GPU machine lacks is a problem unless ALLOWLIST says why that statement
   is off a bf16 Llama's path; packages the GPU machine has but this venv lacks (FlashInfer,
   CuPy, pynvml) cannot be followed here and are notes (-v).

Both subprocesses run benchmarks/gpu/preflight/probe.py (stdlib-only at module level).

    python -m benchmarks.gpu.preflight.kernels [-v]    # exit 1 if any problem
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from importlib.util import resolve_name
from pathlib import Path
from typing import NamedTuple

from benchmarks import ROOT
from benchmarks.gpu.preflight.probe import Finding, Statement, run_probe

STANDIN_DIR = ROOT / "scripts" / "gpu_standin"
WHEELS = ROOT / "scripts" / "gpu_wheels.txt"


def _words(text: str, prefix: str = "", suffix: str = "") -> tuple[str, ...]:
    return tuple(f"{prefix}{w}{suffix}" for w in text.split())


# /work/.library/device/KINDS.md, "Python packages already there" (the 'cuda' image, 2026-11-17)
GPU_IMAGE_PACKAGES = _words(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
    werkzeug wheel wrapt xarray xxhash yarl zipp"""
)
EXTRA_AVAILABLE = ("flashinfer-python",)  # installed from the slim FlashInfer bundle
# import names of GPU-side distributions this venv may lack (the rest come from metadata or
# the distribution name itself)
IMPORT_NAMES: dict[str, tuple[str, ...]] = {
    "cupy-cuda13x": ("cupy",),
    "cuda-core": ("cuda",),
    "flashinfer-python": ("flashinfer",),
    "nvidia-ml-py": ("pynvml",),
    "opencv-python-headless": ("cv2",),
    "py-cpuinfo": ("cpuinfo",),
    "scikit-image": ("skimage",),
    "scikit-learn": ("sklearn",),
}

CLOSURE_MODULES = _words(
    """srt.models.llama srt.layers.sampler srt.layers.attention.flashinfer_backend
    srt.layers.attention.triton_backend srt.model_executor.model_runner srt.managers.scheduler
    srt.mem_cache.memory_pool srt.model_executor.runner.decode_cuda_graph_runner
    srt.model_executor.runner.prefill_cuda_graph_runner
    srt.model_executor.runner_backend.full_cuda_graph_backend
    srt.model_executor.runner_backend_utils.weak_ref_tensor srt.entrypoints.http_server
    srt.managers.tokenizer_manager srt.managers.detokenizer_manager launch_server""",
    "sglang.",
)
LAYER_PATH_FILES = _words(
    """models/llama layers/dual_gemm layers/linear layers/activation layers/layernorm
    layers/rotary_embedding/__init__ layers/rotary_embedding/base layers/rotary_embedding/factory
    layers/rotary_embedding/utils layers/vocab_parallel_embedding layers/logits_processor
    layers/radix_attention layers/sampler layers/quantization/unquant
    layers/attention/flashinfer_backend layers/attention/triton_backend""",
    "srt/",
    ".py",
)
# (importing file, imported module) -> why a bf16 Llama on an H100 never runs that import
ALLOWLIST: dict[tuple[str, str], str] = {
    ("sglang/srt/layers/activation.py", "sgl_kernel_npu.activation.situ"):
        "SiTU's forward_npu: Ascend NPU dispatch only; a Llama's MLP uses SiluAndMul",
    ("sglang/srt/layers/rotary_embedding/base.py", "vllm._custom_ops"):
        "fallback rope kernel for platforms other than CUDA/HIP (CUDA takes sglang.kernels)",
    ("sglang/srt/layers/attention/triton_backend.py", "sglang.srt.dllm.attention"):
        "diffusion-LLM FA4 attention (dllm_fa4), only for dLLM models",
    ("sglang/srt/layers/quantization/unquant.py", "sglang.kernels.ops.gemm.cutedsl_bf16_gemm"):
        "--bf16-gemm-backend cutedsl: SM100 only (chosen by auto on SM100, refused below it)",
}  # fmt: skip


class KernelImport(NamedTuple):
    """One name SGLang imports from sgl_kernel (name None: `import sgl_kernel[.sub]`)."""

    file: str  # relative to the site dir: sglang/srt/...
    line: int
    module: str  # sgl_kernel or sgl_kernel.<sub>
    name: str | None

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


def _is_kernel(module: str | None) -> bool:
    return (module or "").partition(".")[0] == "sgl_kernel"


def sgl_kernel_imports(sglang_root: Path) -> list[KernelImport]:
    """Every sgl_kernel import in every .py under `sglang_root` (the `sglang` package dir)."""
    out: list[KernelImport] = []
    for path in sorted(sglang_root.rglob("*.py")):
        source = path.read_bytes()
        if b"sgl_kernel" not in source:  # parsing all of SGLang takes half a minute
            continue
        rel = path.relative_to(sglang_root.parent).as_posix()
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_kernel(node.module):
                assert node.module is not None
                out += [KernelImport(rel, node.lineno, node.module, a.name if a.name != "*"
                                     else None) for a in node.names]  # fmt: skip
            elif isinstance(node, ast.Import):
                out += [KernelImport(rel, node.lineno, a.name, None) for a in node.names
                        if _is_kernel(a.name)]  # fmt: skip
    return sorted(out, key=lambda k: (k.file, k.line, k.module, k.name or ""))


def unresolved_kernel_imports(imports: Iterable[KernelImport], standin_dir: Path) -> list[str]:
    """One line per sgl_kernel import the stand-in does not resolve, with its first importer."""
    first: dict[str, KernelImport] = {}
    for imp in sorted(imports, key=lambda k: (k.file, k.line)):
        first.setdefault(imp.target, imp)
    targets = sorted(first)
    request = {"standin": str(standin_dir), "targets": [[first[t].module, first[t].name]
                                                         for t in targets]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        answer = run_probe("resolve_main", request, Path(tmp), isolated=False,
                           path=[str(standin_dir)])  # fmt: skip
    if "error" in answer:
        return [f"sgl_kernel stand-in {standin_dir}: {answer['error']}"]
    return [f"sgl_kernel: {t} does not resolve in the GPU stand-in ({why}); first imported at "
            f"{first[t].file}:{first[t].line}"
            for t, why in zip(targets, answer["unresolved"], strict=True) if why]  # fmt: skip


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def gpu_distributions(wheels: Path = WHEELS) -> set[str]:
    """Normalised names of the distributions the GPU machine has (image + wheelhouse)."""
    names = {*GPU_IMAGE_PACKAGES, *EXTRA_AVAILABLE}
    for line in wheels.read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req:
            names.add(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])
    return {_norm(n) for n in names}


def available_import_names(site: Path, dists: set[str]) -> set[str]:
    """Top-level import names the GPU machine has: `dists`' packages (metadata of `site`, else
    IMPORT_NAMES or the distribution name), the stand-in `sgl_kernel`, the stdlib."""
    names = {d.replace("-", "_") for d in dists} | {"sgl_kernel", *sys.stdlib_module_names}
    for d in dists:
        names.update(IMPORT_NAMES.get(d, ()))
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if _norm(dist.metadata["Name"] or "") in dists:
            tops = (dist.read_text("top_level.txt") or "").split()
            files = [f.parts[0] for f in dist.files or () if f.parts and f.parts[0] != ".."]
            names.update(tops or (p.split(".")[0] for p in files
                                  if not p.endswith((".dist-info", ".data"))))  # fmt: skip
    return names


def _site_view(site: Path, names: set[str], dists: set[str], dest: Path) -> None:
    """Symlinks to the entries of `site` the GPU machine has (sgl_kernel: the stand-in's)."""
    dest.mkdir()
    for entry in site.iterdir():
        if entry.name.endswith(".dist-info"):
            keep = _norm(entry.name[: -len(".dist-info")].rsplit("-", 1)[0]) in dists
        else:
            top = entry.name.split(".")[0]
            keep = top in names and top != "sgl_kernel"
        if keep:
            (dest / entry.name).symlink_to(entry)


def _catches_import(handler: ast.ExceptHandler) -> bool:
    caught = ast.unparse(handler.type) if handler.type else "Exception"
    return any(w in caught for w in ("ImportError", "ModuleNotFoundError", "Exception"))


def function_level_imports(sglang_root: Path, files: Sequence[str]) -> list[Statement]:
    """Import statements in function bodies of `files` (relative to `sglang_root`) that no
    try/except ImportError guards (a guarded one has SGLang's own fallback)."""
    out: list[Statement] = []
    for rel in files:
        tree = ast.parse((sglang_root / rel).read_bytes())
        guarded = {n.lineno for t in ast.walk(tree) if isinstance(t, ast.Try)
                   and any(map(_catches_import, t.handlers)) for st in t.body
                   for n in ast.walk(st) if isinstance(n, ast.Import | ast.ImportFrom)}  # fmt: skip
        module = "sglang." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
        seen: set[int] = set()
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for st in ast.walk(fn):
                if isinstance(st, ast.Import | ast.ImportFrom) and st.lineno not in guarded | seen:
                    seen.add(st.lineno)
                    target = (", ".join(a.name for a in st.names) if isinstance(st, ast.Import)
                              else resolve_name("." * st.level + (st.module or ""), package))  # fmt: skip
                    out.append(Statement(f"sglang/{rel}", st.lineno, module, target,
                                         ast.unparse(st)))  # fmt: skip
    return out


def unavailable_imports(
    sglang_root: Path,
    standin_dir: Path,
    *,
    closure: Sequence[str] = CLOSURE_MODULES,
    layer_files: Sequence[str] = LAYER_PATH_FILES,
    notes: list[str] | None = None,
) -> list[str]:
    """Problem lines: imports a bf16 Llama served on CUDA reaches that need a package the GPU
    machine lacks (not served by a `_gpu_shims` shim, not in ALLOWLIST), import errors, and
    stale ALLOWLIST entries. Allowlisted and unfollowable ones go to `notes`."""
    missing = [f for f in layer_files if not (sglang_root / f).is_file()]
    if missing:
        return [f"layer-path file(s) not in {sglang_root}: {missing}"]
    site = sglang_root.parent
    dists = gpu_distributions()
    names = available_import_names(site, dists)
    statements = function_level_imports(sglang_root, layer_files)
    request = {"standin": str(standin_dir), "names": sorted(names), "closure": list(closure),
               "statements": statements}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        request["view"] = str(Path(tmp) / "site")
        _site_view(site, names, dists, Path(tmp) / "site")
        answer = run_probe("unavailable_main", request, Path(tmp), isolated=True,
                           path=[request["standin"], request["view"]])  # fmt: skip
    if "error" in answer:
        return [f"unavailable-imports probe failed: {answer['error']}"]
    problems, used = [], set()
    for f in sorted(set(map(Finding._make, answer["findings"]))):
        where = f"{f.file}:{f.line}: import of {f.target}"
        reason = ALLOWLIST.get((f.file, f.target))
        if reason is not None or f.kind == "unchecked":
            used.add((f.file, f.target))
            note = f"allowed ({reason})" if reason else f"`{f.detail}` not installed here"
            if notes is not None:
                notes.append(f"{where} needs `{f.detail}` ({f.at}): {note}")
        elif f.kind == "missing":
            problems.append(f"{where} needs `{f.detail}`, absent on the GPU machine ({f.at}): "
                            "shim the module (scripts/gpu_standin/_gpu_shims) or allowlist it")  # fmt: skip
        else:
            problems.append(f"{where} fails: {f.detail} ({f.at})")
    scanned = {f"sglang/{f}" for f in layer_files} - {
        st.file for st in statements if st.module in answer["broken"]
    }  # a file whose module did not import ran none of its statements
    problems += [f"stale ALLOWLIST entry {key}: no such import finding any more"
                 for key in sorted(ALLOWLIST.keys() - used) if key[0] in scanned]  # fmt: skip
    return problems


def check(sglang_root: Path, standin_dir: Path) -> list[str]:
    """All problem lines of both checks (empty: nothing a CPU can find)."""
    imports = sgl_kernel_imports(sglang_root)
    return [*unresolved_kernel_imports(imports, standin_dir),
            *unavailable_imports(sglang_root, standin_dir)]  # fmt: skip


def installed_sglang() -> Path:
    """The installed `sglang` package directory (found, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the problems (and with -v the notes); exit 1 if any."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sglang-root", type=Path, help="the sglang package dir (default: installed)")
    ap.add_argument("--standin", type=Path, default=STANDIN_DIR)
    ap.add_argument("-v", "--verbose", action="store_true", help="also print the notes")
    args = ap.parse_args(argv)
    spec = importlib.util.find_spec("sglang")  # not imported
    root = args.sglang_root or Path(
        next(iter(spec.submodule_search_locations or [])) if spec else ""
    )
    imports = sgl_kernel_imports(root)
    notes: list[str] = []
    problems = [*unresolved_kernel_imports(imports, args.standin),
                *unavailable_imports(root, args.standin, notes=notes)]  # fmt: skip
    print(f"{len(imports)} sgl_kernel imports ({len({i.target for i in imports})} names) in {root}; "
          f"{len(problems)} problem(s), {len(notes)} note(s)")  # fmt: skip
    for line in (notes if args.verbose else []) + problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
