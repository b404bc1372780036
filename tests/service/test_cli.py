"""`compactor serve` argument handling that needs no model or server."""

from __future__ import annotations

import socket

import pytest

from compactor.cli import main


def test_serve_reports_a_taken_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model", "smollm2-135m", "--port", str(port), "--in-process"])
    assert "cannot bind" in str(info.value) and str(port) in str(info.value)


def test_serve_and_request_are_registered() -> None:
    with pytest.raises(SystemExit) as info:
        main(["request", "--help"])
    assert info.value.code == 0
