"""`CompactorService`: `compactor serve` as a real process (Ray workers), ready and then gone.

The demo and the serving benchmark start the service this way; stopping it must leave no
process behind: not the service, not Ray's raylet/GCS, not its worker actors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compactor.client import CompactorClient
from harness.launch import CompactorService, ServerStartError

pytestmark = pytest.mark.slow


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_service_process_serves_then_leaves_no_process(
    prepared_model: Path, tmp_path: Path
) -> None:
    svc = CompactorService(prepared_model, tmp_path / "svc.log", workers=1)
    with svc:
        pgid = svc.pid
        assert pgid is not None
        with CompactorClient(svc.endpoint) as client:
            info = client.model_info()
            assert "am-highest" in client.list_methods()
        assert info.model_fingerprint and info.num_layers == 30
        assert _group_alive(pgid)
    assert not _group_alive(pgid), "processes of the service's group survived stop()"
    assert "compactor serving on" in (tmp_path / "svc.log").read_text()


def test_service_that_cannot_start_says_why(tmp_path: Path) -> None:
    svc = CompactorService(tmp_path / "no-such-model", tmp_path / "svc.log", startup_timeout=60)
    with pytest.raises(ServerStartError, match="exited with code"), svc:
        pass
    assert svc.pid is None
