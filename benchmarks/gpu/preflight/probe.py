"""The fresh interpreters of benchmarks/gpu/preflight/kernels.py: `run_probe` starts one on this
file, which runs one of its entry points, `resolve_main` (does the GPU stand-in resolve each
sgl_kernel import) or `unavailable_main` (`-S`: which imports fail on the GPU machine's
packages), on a JSON request and writes a JSON answer. This module imports only the stdlib at
module level: the `-S` interpreter has no site-packages and no repository on sys.path.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, NamedTuple


class Statement(NamedTuple):
    """A function-level import statement on the Llama layer path."""

    file: str
    line: int
    module: str  # the module the statement runs in
    target: str  # the module it imports
    code: str


class Finding(NamedTuple):
    """An import the probe saw fail (kind: missing | unchecked | error)."""

    kind: str
    file: str
    line: int
    target: str
    detail: str  # the absent package, or the error
    at: str  # where the failing import ran


def run_probe(
    fn: str, request: dict[str, Any], tmp: Path, *, isolated: bool, path: list[str]
) -> dict[str, Any]:
    """Run this file's `fn(request)` in a fresh interpreter (`-S`: no site-packages when
    isolated) in `tmp`, with `path` first on its module path (PYTHONPATH, as the GPU run
    puts the stand-in there); its JSON answer, or {"error": ...}."""
    req, res = tmp / "request.json", tmp / "result.json"
    req.write_text(json.dumps(request))
    boot = ("import importlib.util as u, json, sys; s = u.spec_from_file_location('_preflight', "
            "sys.argv[1]); m = u.module_from_spec(s); sys.modules[s.name] = m; "
            "s.loader.exec_module(m); r = getattr(m, sys.argv[2])(json.load(open(sys.argv[3]))); "
            "json.dump(r, open(sys.argv[4], 'w'))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(path))  # fmt: skip
    cmd = [sys.executable, *(["-S"] if isolated else []), "-c", boot, __file__, fn, str(req)]
    proc = subprocess.run([*cmd, str(res)], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=1200)  # fmt: skip
    if not res.exists():
        return {"error": f"probe exited {proc.returncode}: {proc.stderr[-2000:]}"}
    answer: dict[str, Any] = json.loads(res.read_text())
    return answer


def resolve_main(request: dict[str, Any]) -> dict[str, Any]:
    """(subprocess, the stand-in first on PYTHONPATH) Which of request["targets"] ([module,
    name|None]) the stand-in lacks."""
    try:
        sk = importlib.import_module("sgl_kernel")
    except Exception as e:
        return {"error": f"the stand-in does not import: {e!r}"}
    if not Path(sk.__file__ or "").resolve().is_relative_to(Path(request["standin"]).resolve()):
        return {"error": f"sgl_kernel came from {sk.__file__}, not {request['standin']}"}
    out: list[str | None] = []
    for module, name in request["targets"]:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            out.append(f"no module {module} ({e})")
            continue
        try:  # as `from m import n` does: an attribute, else a submodule
            if name is not None and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")
            out.append(None)
        except Exception as e:
            out.append(f"{module} has no {name} ({type(e).__name__})")
    return {"unresolved": out}


def unavailable_main(request: dict[str, Any]) -> dict[str, Any]:
    """(subprocess, `-S`) Import the closure and the layer modules, then run the statements
    of the modules that imported; the failures as Findings."""
    view, names = request["view"], set(request["names"])  # both first on PYTHONPATH
    if (Path(request["standin"]) / "_gpu_shims").is_dir():
        importlib.import_module("_gpu_shims").install()
    _fake_h100()
    found: list[Finding] = []
    statements = list(map(Statement._make, request["statements"]))
    broken = set()
    for module in dict.fromkeys([*request["closure"], *(st.module for st in statements)]):
        try:
            importlib.import_module(module)
        except Exception as e:
            broken.add(module)
            kind, detail, at = _classify(e, names, view)
            file, _, line = (at or f"{module}:0").rpartition(":")
            target = getattr(e, "name", None) or module
            found.append(Finding(kind, file, int(line), target, detail, f"importing {module}"))
    for st in statements:
        if st.module in broken:
            continue
        package = st.module if st.file.endswith("__init__.py") else st.module.rpartition(".")[0]
        try:
            exec(compile(st.code, "<preflight>", "exec"), {"__name__": st.module,
                                                           "__package__": package})  # fmt: skip
        except Exception as e:
            kind, detail, at = _classify(e, names, view)
            found.append(Finding(kind, st.file, st.line, st.target, detail, at or "the statement"))
    return {"findings": found, "broken": sorted(broken)}


def _fake_h100() -> None:
    """(subprocess) SGLang's import-time view of one H100 (as the smoke test fakes it)."""
    for name in ("sglang.srt.utils.common", "sglang.srt.utils"):
        for attr in ("is_cuda", "is_cuda_alike"):
            setattr(importlib.import_module(name), attr, lambda: True)
    torch = importlib.import_module("torch")
    fakes = {"is_available": lambda: True, "device_count": lambda: 1,
             "get_device_capability": lambda *a, **k: (9, 0),
             "get_device_name": lambda *a, **k: "NVIDIA H100 80GB HBM3"}  # fmt: skip
    for attr, fake in fakes.items():
        setattr(torch.cuda, attr, fake)
    torch.version.cuda = "13.0"


def _classify(e: BaseException, names: set[str], view: str) -> tuple[str, str, str | None]:
    """(kind, detail, where the failing import ran) of an import's exception."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<") and f.filename != __file__]  # fmt: skip
    at = None
    if frames:
        at = f"{frames[-1].filename.removeprefix(view + os.sep)}:{frames[-1].lineno}"
    if isinstance(e, ModuleNotFoundError) and e.name:
        top = e.name.split(".")[0]
        if top not in names:
            return "missing", top, at
        if importlib.util.find_spec(top) is None:
            return "unchecked", top, at
    return "error", f"{type(e).__name__}: {e}", at
