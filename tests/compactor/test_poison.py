"""The poison table: workers lost per prefix, bounded in time and size; the pool refuses a
prefix that lost 2 workers without touching a replica (service-level test:
tests/compactor/service/test_service_resilience.py)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from compactor.spec import CompactionSpec
from compactor.workers.errors import PoisonedJob, WorkerLost
from compactor.workers.job import CompactJob
from compactor.workers.poison import PoisonTable, poison_key
from compactor.workers.pool import PoolConfig, Replica, WorkerPool


def _job(first: int, ratio: float = 0.5, tenant: str = "") -> CompactJob:
    spec = CompactionSpec(method="am-highest", ratio=ratio)
    return CompactJob("fp", (first, 2, 3), spec, tenant=tenant)


def test_table_counts_forgets_after_ttl_and_is_bounded() -> None:
    now = [0.0]
    t = PoisonTable(threshold=2, ttl_s=10.0, max_keys=3, clock=lambda: now[0])
    t.check("a")
    assert t.lost("a") == 1
    t.check("a")  # one loss: still allowed
    now[0] = 5.0
    assert t.lost("a") == 2
    with pytest.raises(PoisonedJob, match=r"lost 2 workers \(limit 2\).* next 10 s"):
        t.check("a")
    now[0] = 14.9
    with pytest.raises(PoisonedJob):
        t.check("a")
    now[0] = 15.0  # ttl after the last loss
    t.check("a")
    assert t.count("a") == 0 and len(t) == 0
    for k in "bcde":
        t.lost(k)
    assert len(t) == 3 and t.count("b") == 0  # least recently lost out first


def test_key_is_the_prefix_per_tenant_not_the_spec() -> None:
    assert poison_key(_job(1)) == poison_key(_job(1, ratio=0.25))
    assert poison_key(_job(1)) != poison_key(_job(9))
    assert poison_key(_job(1)) != poison_key(_job(1, tenant="cn:b"))


class _Dying(Replica):
    """Dies (WorkerLost) on prefixes starting with 13; answers others."""

    runs: ClassVar[list[tuple[str, int]]] = []

    async def run(self, job_id: str, job: CompactJob, *_old: Any) -> Any:
        _Dying.runs.append((self.name, job.token_ids[0]))
        if job.token_ids[0] == 13:
            self.alive = False
            raise WorkerLost(f"worker {self.name} died")
        return "ok"


def test_pool_refuses_a_prefix_after_two_lost_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    _Dying.runs.clear()
    names = iter(range(100))

    async def new_replica(self: WorkerPool) -> Replica:
        return _Dying(f"r{next(names)}")

    monkeypatch.setattr(WorkerPool, "_new_replica", new_replica)
    restarts: list[int] = []

    async def main() -> None:
        pool = await WorkerPool.start(
            PoolConfig(model_dir="unused", workers=3, max_retries=5),
            on_restart=lambda: restarts.append(1),
        )
        try:
            with pytest.raises(PoisonedJob, match="lost 2 workers"):
                await pool.run(_job(13))
            for ratio in (0.5, 0.25, 0.1):  # retries, other specs: refused before any replica
                with pytest.raises(PoisonedJob):
                    await pool.run(_job(13, ratio))
            assert await pool.run(_job(14)) == "ok"
        finally:
            await pool.close()

    asyncio.run(main())
    assert len(restarts) == 2
    assert [first for _, first in _Dying.runs] == [13, 13, 14]
