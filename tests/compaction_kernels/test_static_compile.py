"""The static cascade's kernels compile for a Hopper GPU (sm_90) on this CPU, with the Triton
wheel's own compiler: what the interpreter runs here (address loads cast to pointers, early
returns of padding tiles) is also what the GPU compiler accepts. The compiles run in a
subprocess without TRITON_INTERPRET (under it every kernel is an interpreted function)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def compile_for_hopper(fn: Any, constexprs: dict[str, Any], model: dict[str, str]) -> int:
    """`fn` compiled for sm_90: pointer arguments typed by `model` (default: fp32 for the
    fp32 buffers, else int64), the other arguments int64 (fp32 `sm_scale_log2`); returns
    the cubin's size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fp32 = {"Beta", "OPart", "LPart", "LsePart", "Lse"}
    names, sig = fn.arg_names, {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n[0].isupper():
            sig[n] = model.get(n, "*fp32" if n in fp32 else "*i64")
        else:
            sig[n] = "fp32" if n == "sm_scale_log2" else "i64"
    consts = {(names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn, signature=sig, constexprs=consts)
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"])


def main() -> None:
    from compaction_kernels.biased_attention._kernels import _combine_splits
    from compaction_kernels.biased_attention._static_kernels import (
        _gather_slots,
        _static_attn_fwd,
    )

    bf16 = {"Q": "*bf16", "K": "*bf16", "V": "*bf16"}
    for addressed in (True, False):
        meta = dict(H_KV=8, GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64,
                    SPLITS=8, ADDRESSED=addressed, PRECISION="tf32")  # fmt: skip
        print("static_attn", addressed, compile_for_hopper(_static_attn_fwd, meta, bf16))
    meta = dict(HEAD_DIM=128, BLOCK_S=16, BLOCK_D=128, MASKED_SPLITS=8)
    print("combine", compile_for_hopper(_combine_splits, meta, {"Out": "*bf16"}))
    i32 = {"ReqToToken": "*i32", "Out": "*i32"}
    print("gather", compile_for_hopper(_gather_slots, {"BLOCK": 256}, i32))


def test_static_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = [line.split()[-1] for line in run.stdout.splitlines()]
    assert len(sizes) == 4 and all(int(s) > 0 for s in sizes), run.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
