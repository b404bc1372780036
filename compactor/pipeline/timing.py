"""Stage timing of one compaction: :class:`StageTimes` and the paired wall/CPU :class:`Stopwatch`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

__all__ = ["Lap", "StageTimes", "Stopwatch"]


@dataclass(frozen=True)
class StageTimes:
    """Wall seconds per stage; `per_layer` is selection+fit of each layer.

    `cpu_*` are process CPU seconds of the same stages (all threads summed): with one torch
    thread they show the cost free of the wait for a core on a busy machine.
    """

    prefill: float
    queries: float
    compaction: float
    total: float
    per_layer: tuple[float, ...] = field(default_factory=tuple)
    cpu_prefill: float = 0.0
    cpu_queries: float = 0.0
    cpu_compaction: float = 0.0
    cpu_total: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Seconds by stage: every field but `per_layer`, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "per_layer"}


@dataclass
class Lap:
    """One measured span: wall (perf_counter) and process-CPU (process_time) seconds."""

    wall: float = 0.0
    cpu: float = 0.0


class Stopwatch:
    """Wall and CPU seconds per named stage, summed over every :meth:`measure` of it.

    Started at construction; :meth:`times` closes it into a StageTimes (``total`` = since
    the start, so work outside any stage counts in ``total`` only).
    """

    STAGES = ("prefill", "queries", "compaction")

    def __init__(self) -> None:
        self._start = (time.perf_counter(), time.process_time())
        self.stages: dict[str, Lap] = {name: Lap() for name in self.STAGES}

    @contextmanager
    def measure(self, stage: str) -> Iterator[Lap]:
        """Time the block into `stage` (mutates this stopwatch); yields the block's own Lap,
        filled in when the block ends."""
        lap = Lap()
        t, c = time.perf_counter(), time.process_time()
        try:
            yield lap
        finally:
            lap.wall, lap.cpu = time.perf_counter() - t, time.process_time() - c
            total = self.stages[stage]
            total.wall += lap.wall
            total.cpu += lap.cpu

    def times(self, per_layer: tuple[float, ...] = ()) -> StageTimes:
        """The StageTimes so far; `per_layer` is each layer's compaction wall time."""
        s = self.stages
        return StageTimes(
            s["prefill"].wall,
            s["queries"].wall,
            s["compaction"].wall,
            time.perf_counter() - self._start[0],
            per_layer,
            cpu_prefill=s["prefill"].cpu,
            cpu_queries=s["queries"].cpu,
            cpu_compaction=s["compaction"].cpu,
            cpu_total=time.process_time() - self._start[1],
        )
