"""Fixtures shared by the unit tests (pytest finds them here without imports)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit._tiny import tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`tiny_llama` (seed 0) saved to a fresh tmp dir, built once per test module."""
    return tiny_llama(tmp_path_factory.mktemp("tiny"))
