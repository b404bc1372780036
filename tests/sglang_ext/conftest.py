"""Fixtures of the plugin's tests (helpers: `_radix`, `_attention`, `_fixtures`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compactor.types import CompactedPrefix
from tests.sglang_ext._radix import T, compact_rooms


@pytest.fixture(scope="module")
def compacted(prepared_model: Path) -> tuple[list[int], CompactedPrefix, str]:
    """Token ids of T tokens of a fixed text, their real compaction (am-highest, 0.25) and the
    model's fingerprint; their original KV is registered for `insert_fresh`."""
    from compactor.models import fingerprint

    ids, prefix = compact_rooms(prepared_model, T)
    return ids, prefix, fingerprint(prepared_model)
