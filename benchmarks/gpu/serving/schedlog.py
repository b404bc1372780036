"""SGLang's scheduler log, read: its `Decode batch` lines and the decode step time from them."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

__all__ = ["DecodeLine", "decode_lines", "step_time_s"]


_DECODE = re.compile(
    r"Decode batch.*?#running-req:\s*(\d+).*?\w+ graph:\s*(True|False).*?"
    r"gen throughput \(token/s\):\s*([0-9.]+)"
)


@dataclass(frozen=True)
class DecodeLine:
    """One `Decode batch` line of SGLang's scheduler log (`--decode-log-interval 1`)."""

    running: int
    cuda_graph: bool
    tokens_per_s: float


def decode_lines(log_text: str) -> list[DecodeLine]:
    """Every decode line of a scheduler log, in order."""
    return [DecodeLine(int(r), g == "True", float(t)) for r, g, t in _DECODE.findall(log_text)]


def step_time_s(lines: list[DecodeLine], running: int) -> float | None:
    """Median decode step time (running / tokens per s) over the lines with exactly
    `running` requests in the batch (None when there is none)."""
    steps = [
        x.running / x.tokens_per_s for x in lines if x.running == running and x.tokens_per_s > 0
    ]
    return statistics.median(steps) if steps else None
