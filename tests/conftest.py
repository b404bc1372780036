"""Shared fixtures and markers.

- `gpu`: skipped unless a CUDA device is present.
- `sglang`: starts a real SGLang server (slow; deselect with `-m "not sglang"`).
- `prepared_model`: the embedded SmolLM2-135M checkpoint, prepared once per machine.
Servers bind 127.0.0.1 on ports the OS picks; no fixed ports.
"""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on CPU-only machines. This must be set before
# triton is first imported anywhere in the test process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (marker gpu)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def prepared_model() -> Path:
    """Path of the prepared fp32 SmolLM2-135M checkpoint (converted on first use, ~40 s)."""
    from compactor.models import prepare_model

    return prepare_model("smollm2-135m")
