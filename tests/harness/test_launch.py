"""`harness.launch`: a server whose picked port is taken before it binds starts on another."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import launch

_SERVE = """
import socket, sys, time
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as exc:
    print(f"ERROR: {exc.strerror}", flush=True)  # 'Address already in use', as uvicorn says
    if sys.argv[2] == "hang":  # as SGLang does: its scheduler keeps the process alive
        time.sleep(60)
    sys.exit(1)
s.listen()
print("listening", flush=True)
time.sleep(60)
"""


@dataclass
class _Binder(launch.ManagedProcess):
    log_path: Path
    startup_timeout: float = 30.0
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    _proc: object = None
    after_error: str = "exit"  # or "hang"

    def command(self) -> list[str]:
        return [sys.executable, "-c", _SERVE, str(self.port), self.after_error]

    def _ready(self) -> bool:  # its own line, not a connect (the holder would answer that)
        return "listening" in self.log_tail()


def _taken_ports(monkeypatch: pytest.MonkeyPatch, count: int) -> list[socket.socket]:
    """Make `free_port` answer `count` ports that are held by listening sockets first."""
    holders = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        holders.append(s)
    answers = [s.getsockname()[1] for s in holders]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda host: answers.pop(0) if answers else real(host))
    return holders


@pytest.mark.parametrize("after_error", ["exit", "hang"])
def test_a_port_taken_before_the_bind_is_replaced(
    tmp_path: Path, monkeypatch, after_error: str
) -> None:
    holders = _taken_ports(monkeypatch, 1)
    with _Binder(log_path=tmp_path / "log", after_error=after_error) as proc:
        assert proc.port != holders[0].getsockname()[1]
        with socket.socket() as probe, pytest.raises(OSError):  # the child holds the new port
            probe.bind(("127.0.0.1", proc.port))
    for s in holders:
        s.close()


@pytest.mark.parametrize("after_error", ["exit", "hang"])
def test_it_gives_up_after_the_attempts_and_shows_the_log(
    tmp_path: Path, monkeypatch, after_error: str
) -> None:
    holders = _taken_ports(monkeypatch, launch.ManagedProcess.BIND_ATTEMPTS)
    proc = _Binder(log_path=tmp_path / "log", after_error=after_error)
    with pytest.raises(launch.ServerStartError, match="Address already in use"):
        proc.start()
    proc.stop()
    for s in holders:
        s.close()


def test_a_port_the_caller_chose_is_never_changed(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _Binder(log_path=tmp_path / "log", port=port)
        with pytest.raises(launch.ServerStartError, match="exited with code 1"):
            proc.start()
        proc.stop()
        assert proc.port == port


def test_a_restart_keeps_a_picked_port(tmp_path: Path) -> None:
    with _Binder(log_path=tmp_path / "log") as proc:
        port, first = proc.port, proc.pid
        proc.restart()
        assert proc.port == port and proc.pid != first
        assert "listening" in (tmp_path / "log.before-restart").read_text()  # the first life
        with socket.socket() as probe, pytest.raises(OSError):  # the new child holds it
            probe.bind(("127.0.0.1", port))
