"""Minimal repro (run by hand in an environment with torch 2.11.0 and sglang 0.5.23): SGLang 0.5.23's prebuilt Rust TreeCore (built against torch
2.14.x) misreads an int64 tensor's dtype under torch 2.11.

Under torch 2.11, c10::impl::PyObjectSlot still has the extra
`std::atomic<PyInterpreter*> pyobj_interpreter_` member (removed by 2.14), so
every TensorImpl field after pyobj_slot_ sits 8 bytes later than the extension
expects; its inlined `scalar_type()` reads the low 16 bits of `numel_` as the
dtype (TypeMeta index), and `device()` reads garbage too."""

import sys
from array import array

import torch
from sglang.srt.mem_cache.rust_tree_core.extension import bindings as b

print("python", sys.version.split()[0], "| torch", torch.__version__)

print("extension:", b.__file__)
core = b.RustUnifiedTreeCoreBinding(
    b.TreeCoreInitParamsBinding(eviction_policy="lru", page_size=1, device="cpu"),
    [0],  # ComponentType.FULL
)
for n in (1, 2, 3, 4, 5, 6, 7, 8, 16):
    core.reset()
    value = torch.arange(n).to(dtype=torch.int64, copy=True)  # as unified_radix_cache does
    try:
        core.begin_insert(b.InsertParamsBinding(key=array("q", range(n)), value=value))
        r = "begin_insert OK"
    except Exception as e:
        r = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"
    print(f"int64 value, numel={n:2d} -> {r}")
