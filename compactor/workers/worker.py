"""One model replica and the plain compaction function it runs.

:func:`run_compaction` is the single code path of a compaction: the in-process pool calls it
in a thread, the Ray actor (:class:`Worker` wrapped by ``ray.remote``) calls it in its
process. Deterministic: fixed seed; the worker process runs torch on one thread.

Cancellation is cooperative: a compaction checks `should_stop()` before each layer and,
before the layer loop, once per generated token (self-study / follow-up answers) and once per
continuation whose queries are collected (the pipeline's ``Hooks.checkpoint``). A request's
deadline reaches the worker the same way: the service cancels the job when it passes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compactor.workers.errors import Cancelled, InvalidRequest, ModelMismatch
from compactor.workers.job import CompactJob, JobResult

__all__ = ["Worker", "run_compaction"]

log = logging.getLogger(__name__)

# Cancels of jobs that are not running (yet: a Ray cancel may overtake its compact call) are
# remembered, oldest first out, up to this many; cancels of running jobs until they end.
EARLY_CANCELS = 32


def _cancellation_point(
    should_stop: Callable[[], bool], layer_delay_s: float
) -> Callable[[int], None]:
    """`compact_prefix`'s before_layer hook: raise Cancelled once `should_stop()` is true.

    `layer_delay_s` sleeps before each layer: a test-only knob, set only through
    :class:`Worker`'s constructor, to make a compaction deterministically slow.
    """

    def check(layer: int) -> None:
        if layer_delay_s > 0:
            deadline = time.monotonic() + layer_delay_s
            while time.monotonic() < deadline and not should_stop():
                time.sleep(min(0.02, layer_delay_s))
        if should_stop():
            raise Cancelled(f"compaction cancelled before layer {layer}")

    return check


def _stage_checkpoint(should_stop: Callable[[], bool]) -> Callable[[str], None]:
    """`compact_prefix`'s checkpoint hook (per generated token / collected continuation):
    raise Cancelled naming the stage once `should_stop()` is true."""

    def check(stage: str) -> None:
        if should_stop():
            raise Cancelled(f"compaction cancelled during {stage}")

    return check


def run_compaction(
    model: Any,
    tokenizer: Any,
    fingerprint: str,
    job: CompactJob,
    should_stop: Callable[[], bool] = lambda: False,
    layer_delay_s: float = 0.0,
) -> JobResult:
    """Compact `job` with a loaded model; raises Cancelled when `should_stop()` turns true.

    Raises ModelMismatch if the job is for another model; InvalidRequest if it asks for
    head_budgets "auto" and the model has no usable sensitivity curves for the method;
    ValueError from the pipeline.
    """
    from compactor.pipeline import Hooks, compact_prefix, head_budget_curves

    if job.model_fingerprint != fingerprint:
        raise ModelMismatch(
            f"request is for model {job.model_fingerprint!r}; this worker has {fingerprint!r}"
        )
    t0 = time.perf_counter()
    try:  # a missing / mismatched curves file is the request's problem, not INTERNAL
        head_budget_curves(model, job.spec.method, job.spec.head_budgets, fingerprint)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    torch.manual_seed(0)
    hooks = Hooks(
        progress=False,
        before_layer=_cancellation_point(should_stop, layer_delay_s),
        checkpoint=_stage_checkpoint(should_stop),
        model_fingerprint=fingerprint,
    )
    follow_ups = [list(f) for f in job.follow_ups] or None
    prefix, times = compact_prefix(
        model, tokenizer, list(job.token_ids), job.spec, follow_ups, hooks
    )
    return JobResult(
        prefix=prefix,
        worker=f"{os.uname().nodename}:{os.getpid()}",
        compute_seconds=time.perf_counter() - t0,
        stage_seconds=times.as_dict(),
    )


class Worker:
    """Owns one device and one model replica (loaded once); runs one job at a time.

    Used as is by the in-process pool and as the body of the Ray actor. `compact` and
    `cancel` may be called from different threads (the Ray actor has max_concurrency=2).

    Args:
        model_dir: local checkpoint directory.
        device: torch device of the replica ("cpu", "cuda").
        torch_threads: if set, ``torch.set_num_threads`` (process-wide) - 1 per worker.
        layer_delay_s: test-only: sleep this long before each layer.
    """

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        torch_threads: int | None = 1,
        layer_delay_s: float = 0.0,
    ) -> None:
        from compactor import hf
        from compactor.models import fingerprint

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.model_dir = str(Path(model_dir))
        self.fingerprint = fingerprint(self.model_dir)
        self.model, self.tokenizer = hf.load_model(self.model_dir, device=device)
        self.layer_delay_s = layer_delay_s
        self._running: set[str] = set()
        self._cancelled: set[str] = set()  # running jobs asked to stop
        self._early: OrderedDict[str, None] = OrderedDict()  # bounded: EARLY_CANCELS
        self._lock = threading.Lock()

    def ready(self) -> str:
        """The model fingerprint (a cheap call to wait for the replica to be loaded)."""
        return self.fingerprint

    def pid(self) -> int:
        return os.getpid()

    def compact_job(self, job_id: str, job: CompactJob) -> JobResult:
        """Run `job`; raises Cancelled if :meth:`cancel` (job_id) is called meanwhile (or
        shortly before: see EARLY_CANCELS)."""
        with self._lock:
            self._running.add(job_id)
            if job_id in self._early:  # cancelled before it started
                del self._early[job_id]
                self._cancelled.add(job_id)
        try:
            return run_compaction(
                self.model,
                self.tokenizer,
                self.fingerprint,
                job,
                should_stop=lambda: self._is_cancelled(job_id),
                layer_delay_s=self.layer_delay_s,
            )
        finally:
            with self._lock:
                self._running.discard(job_id)
                self._cancelled.discard(job_id)

    def cancel(self, job_id: str) -> None:
        """Ask the job `job_id` to stop at its next cancellation point (see the module
        docstring). Only running jobs' ids are kept until they end; the id of a job that is
        not running is kept among the last EARLY_CANCELS such ids (its compact call may
        still be on its way)."""
        with self._lock:
            if job_id in self._running:
                self._cancelled.add(job_id)
                return
            self._early[job_id] = None
            self._early.move_to_end(job_id)
            while len(self._early) > EARLY_CANCELS:
                self._early.popitem(last=False)

    def _is_cancelled(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._cancelled
