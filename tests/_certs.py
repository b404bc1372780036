"""Test certificates made with the openssl CLI: a CA, a server certificate for 127.0.0.1 /
localhost, and client certificates (each its own mTLS identity, CN = its name)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, names: tuple[str, ...] = ("server", "client", "client-b")) -> Path:
    """`d`/ca.pem (+ ca.key) and, per name, NAME.pem + NAME.key signed by it; returns `d`."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found (needed to generate test certificates)")
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in names:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", f"{name}.pem",
                 cwd=d)  # fmt: skip
    return d
