"""Ops the check-only GPU stand-in names but does not implement (see __init__.py)."""

from __future__ import annotations

from collections.abc import Callable


def unsupported(name: str) -> Callable[..., None]:
    """A function named `name` that raises NotImplementedError naming the stand-in."""

    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the check-only GPU stand-in "
            "(scripts/gpu_standin): SGLang imports it on CUDA, a bf16 Llama never calls it"
        )

    op.__name__ = name
    return op
