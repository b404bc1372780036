"""CHECK-ONLY import shims for scripts/gpu_serving.sh (this folder goes first on PYTHONPATH
there alone; never installed for users).

`SHIMS` is the one table: {module SGLang imports: shim file in this folder}. `install()` puts
a meta-path finder first that serves the shim file's code under the module's own name, for
exactly those names, when (and only when) something imports one; it is called by this
folder's sitecustomize.py, so every Python process SGLang spawns (PYTHONPATH is inherited)
gets it. benchmarks/gpu/preflight/kernels.py reads the table: an import of a package absent from
the GPU machine counts as resolved only while a shim here serves the module that needs it.
Stdlib only, nothing imported until a shimmed module is.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

HERE = os.path.dirname(os.path.realpath(__file__))

SHIMS: dict[str, str] = {
    # CuTe-DSL dual GEMM (needs nvidia-cutlass-dsl, `import cutlass`): DualGemm._select_mode
    # imports it while building every Llama MLP on CUDA; it answers False before SM100.
    "sglang.kernels.ops.gemm.cutedsl_dual_gemm": "cutedsl_dual_gemm.py",
}


class ShimFinder:
    """Meta-path finder for the modules of `SHIMS` (None for every other name)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        shim = SHIMS.get(fullname)
        if shim is None:
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(fullname, os.path.join(HERE, shim))


def install() -> None:
    """Put a ShimFinder first on sys.meta_path (once per process)."""
    if not any(isinstance(f, ShimFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, ShimFinder())
