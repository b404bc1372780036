"""Stubs of the check-only GPU stand-in: ops and submodules it names but does not implement
(driven by `_names.STUBS`; see __init__.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.machinery import ModuleSpec
from types import ModuleType


def unsupported(name: str) -> Callable[..., None]:
    """A function for `sgl_kernel.<name>` that raises NotImplementedError naming it and the
    stand-in (`name` may be dotted: "kvcacheio.transfer_kv_direct")."""

    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the check-only GPU stand-in "
            "(scripts/gpu_standin): SGLang imports it on some platform or feature path; a bf16 "
            "Llama on CUDA never calls it"
        )

    module, _, short = f"sgl_kernel.{name}".rpartition(".")
    op.__name__ = op.__qualname__ = short
    op.__module__ = module
    return op


def missing_attribute(public: str) -> Callable[[str], object]:
    """A module `__getattr__` for `public` (e.g. "sgl_kernel.flash_attn"): AttributeError
    naming the stand-in, so a name SGLang never imports fails loudly and `getattr(m, n,
    default)` still gets its default."""

    def __getattr__(name: str) -> object:
        raise AttributeError(
            f"{public}.{name} is not provided by the check-only GPU stand-in "
            "(scripts/gpu_standin); this code path needs the real sglang-kernel"
        )

    return __getattr__


def stub_module(fullname: str, sub: str, names: Iterable[str]) -> ModuleType:
    """Submodule `sgl_kernel.<sub>` (registered as `fullname`) whose `names` are
    `unsupported` ops; anything else raises AttributeError."""
    public = f"sgl_kernel.{sub}"
    mod = ModuleType(
        fullname,
        f"`{public}` of the check-only GPU stand-in (scripts/gpu_standin): SGLang imports "
        "it on some platform or feature path; each name raises NotImplementedError when called.",
    )
    mod.__spec__ = ModuleSpec(fullname, None, origin=__file__)
    names = tuple(names)
    for n in names:
        setattr(mod, n, unsupported(f"{sub}.{n}"))
    mod.__all__ = list(names)  # type: ignore[attr-defined]
    mod.__getattr__ = missing_attribute(public)  # type: ignore[method-assign]
    return mod
