"""Where this project's ratio meets NVIDIA kvpress's: the one conversion between them.

Everywhere in this project a ratio is the kept fraction (0.1 keeps a tenth of the entries);
kvpress's `compression_ratio` is the fraction removed. Every call into kvpress converts here,
and what kvpress keeps is computed here as kvpress computes it. Standard library only: the
kvpress side of a benchmark runs in kvpress's own venv.
"""

from __future__ import annotations

__all__ = ["compression_ratio", "kvpress_kept"]


def compression_ratio(kept: float) -> float:
    """kvpress's `compression_ratio` (the fraction removed) for our kept fraction `kept`.

    Raises:
        ValueError: `kept` not in (0, 1].
    """
    if not 0 < kept <= 1:
        raise ValueError(f"a kept fraction must be in (0, 1], got {kept!r}")
    return 1.0 - kept


def kvpress_kept(num_tokens: int, kept: float) -> int:
    """How many of `num_tokens` entries kvpress keeps at our kept fraction `kept`: its own
    arithmetic, `int(n * (1 - compression_ratio))`, so a count compared with its selection is
    the count it selected (0.2 kept of 200 is 39 there, not 40)."""
    return int(num_tokens * (1 - compression_ratio(kept)))
