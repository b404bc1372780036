"""The service tests' helpers: a server running in its own event-loop thread
(`running_server`), a fast spec, deterministic prefixes and a result comparison."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from compactor.service.engine import ServiceConfig
from compactor.service.server import CompactorServer, ServerConfig
from compactor.spec import CompactionSpec, QueryConfig
from compactor.workers.pool import PoolConfig

T = TypeVar("T")


PREFIX = [(i * 7919) % 40000 + 100 for i in range(64)]  # 64 tokens, deterministic


FAST = CompactionSpec(
    method="am-highest", ratio=0.25, queries=QueryConfig(sources=("repeat-prefill",))
)


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` blocks for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextmanager
def running_server(
    model_dir: Path,
    *,
    mode: str = "local",
    workers: int = 1,
    layer_delay_s: float = 0.0,
    max_queue: int = 64,
    max_prefix_tokens: int | None = 4096,
    service_kwargs: dict[str, Any] | None = None,
    **server_kwargs: Any,
) -> Iterator[tuple[CompactorServer, LoopThread]]:
    pool = PoolConfig(
        model_dir=str(model_dir),
        workers=workers,
        mode=mode,  # type: ignore[arg-type]
        max_queue=max_queue,
        layer_delay_s=layer_delay_s,
        cancel_grace_s=10.0,
    )
    service = ServiceConfig(
        pool=pool, max_prefix_tokens=max_prefix_tokens, **(service_kwargs or {})
    )
    lt = LoopThread()
    try:
        server = lt.run(CompactorServer.start(ServerConfig(service=service, **server_kwargs)))
        try:
            yield server, lt
        finally:
            lt.run(server.stop(grace=5))
    finally:
        lt.close()


def compact_in_background(
    endpoint: str, ids: list[int], model_fp: str, timeout: float
) -> tuple[threading.Thread, dict[str, Any]]:
    """`CompactorClient.compact_prefix(ids)` on a thread of its own, started; the dict gets "res" (the
    result) or "err" (what it raised) when the call ends."""
    from compactor.client import CompactorClient

    out: dict[str, Any] = {}

    def call() -> None:
        with CompactorClient(endpoint) as c:
            try:
                out["res"] = c.compact_prefix(ids, model_fp, FAST, timeout=timeout)
            except Exception as exc:
                out["err"] = exc

    th = threading.Thread(target=call)
    th.start()
    return th, out


def make_prefix(seed: int, n: int = 64) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


def assert_same_prefix(a: Any, b: Any) -> None:
    import torch

    assert a.metadata() == b.metadata()
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name
