"""CHECK-ONLY startup hook of scripts/gpu_standin (first on PYTHONPATH for
scripts/gpu_serving.sh alone, so Python runs it in every process, SGLang's scheduler children
included): installs `_gpu_shims`' finder, which imports nothing until a shimmed module is
imported, then runs the sitecustomize this one shadows (the interpreter's or a site
directory's), if there is one.
"""

from __future__ import annotations

import os
import sys

import _gpu_shims

_gpu_shims.install()


def _chain() -> None:
    """Execute the next `sitecustomize` on sys.path after this folder."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(module_from_spec(spec))


_chain()
