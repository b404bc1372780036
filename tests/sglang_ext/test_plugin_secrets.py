"""The plugin's channel secrets: no token on the command line, token from a file (re-read
when it changes) or the environment, no token in plaintext to a remote host unless asked,
TLS settings checked at startup."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from compactor.service.auth import TOKEN_HEADER, TokenAuthInterceptor, TokenFile, token_bytes
from sglang_ext.channel import TOKEN_ENV, endpoint_host, is_loopback
from sglang_ext.compactors import GrpcCompactor
from sglang_ext.config import CompactionConfig, add_cli_args, config_from_namespace

SECRET = "tok-3f9a1c"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server")
    add_cli_args(p)
    return p


def _parse(endpoint: str, *argv: str) -> CompactionConfig | None:
    return config_from_namespace(_parser().parse_args(["--compaction-endpoint", endpoint, *argv]))


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    return path


@pytest.mark.parametrize(
    "argv",
    [["--compaction-token", SECRET], [f"--compaction-token={SECRET}"], ["--compaction-token"]],
)
def test_token_flag_is_refused_naming_file_and_env(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--compaction-endpoint", "127.0.0.1:1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--compaction-token is not accepted" in err
    assert "--compaction-token-file" in err and TOKEN_ENV in err
    assert SECRET not in err


def test_token_from_file_is_checked_at_startup(token_file: Path, tmp_path: Path) -> None:
    cfg = _parse("127.0.0.1:50051", "--compaction-token-file", str(token_file))
    assert cfg is not None and cfg.token_file == str(token_file) and cfg.token is None
    with pytest.raises(ValueError, match=r"^--compaction-token-file: .*No such file"):
        _parse("127.0.0.1:1", "--compaction-token-file", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"^--compaction-token-file: .* is empty"):
        _parse("127.0.0.1:1", "--compaction-token-file", str(tmp_path / "empty"))


def test_token_from_env_is_masked(monkeypatch: pytest.MonkeyPatch, token_file: Path) -> None:
    monkeypatch.setenv(TOKEN_ENV, f" {SECRET} ")
    cfg = _parse("localhost:50051")
    assert cfg is not None and cfg.token == SECRET
    assert SECRET not in repr(cfg) and SECRET not in str(cfg.as_dict())
    assert cfg.as_dict()["token"] == "***"
    with pytest.raises(ValueError, match="one way: --compaction-token-file or"):
        _parse("localhost:50051", "--compaction-token-file", str(token_file))
    monkeypatch.setenv(TOKEN_ENV, "  ")
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} is set but empty"):
        _parse("localhost:50051")


@pytest.mark.parametrize(
    ("endpoint", "host", "loopback"),
    [
        ("127.0.0.1:50051", "127.0.0.1", True),
        ("grpc://127.8.9.10:1", "127.8.9.10", True),
        ("localhost:1", "localhost", True),
        ("[::1]:50051", "::1", True),
        ("inproc://", "", True),
        ("compactor:50051", "compactor", False),
        ("grpc://10.0.0.5:50051", "10.0.0.5", False),
        ("[2001:db8::1]:1", "2001:db8::1", False),
    ],
)
def test_loopback_hosts(endpoint: str, host: str, loopback: bool) -> None:
    if not endpoint.startswith("inproc://"):
        assert endpoint_host(endpoint) == host
    assert is_loopback(endpoint) is loopback


def test_plaintext_token_to_remote_is_refused_naming_both_flags(token_file: Path) -> None:
    with pytest.raises(ValueError, match="plaintext to 'compactor:50051'") as exc:
        _parse("compactor:50051", "--compaction-token-file", str(token_file))
    assert "--compaction-tls" in str(exc.value) and "the compaction token" in str(exc.value)
    assert "--compaction-insecure" in str(exc.value)
    # loopback and the explicit opt-in are accepted
    assert _parse("127.0.0.1:50051", "--compaction-token-file", str(token_file)) is not None
    cfg = _parse(
        "compactor:50051", "--compaction-token-file", str(token_file), "--compaction-insecure"
    )
    assert cfg is not None and cfg.insecure


def test_plaintext_prompts_to_remote_are_refused_even_without_a_token() -> None:
    """Prompts and results would travel in clear: a non-loopback plaintext endpoint needs
    TLS or --compaction-insecure, token or not."""
    with pytest.raises(ValueError, match="prompts and results in plaintext to 'compactor:50051'"):
        _parse("compactor:50051")
    assert _parse("compactor:50051", "--compaction-insecure") is not None
    assert _parse("127.0.0.1:50051") is not None and _parse("inproc://") is not None


def test_plaintext_env_token_to_remote_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, SECRET)
    with pytest.raises(ValueError, match="--compaction-insecure"):
        _parse("grpc://10.0.0.5:50051")
    assert _parse("inproc://") is not None


def _pem(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


def test_tls_settings_are_checked_at_startup(tmp_path: Path, token_file: Path) -> None:
    ca, cert, key = (_pem(tmp_path, n) for n in ("ca.crt", "client.crt", "client.key"))
    with pytest.raises(ValueError, match=r"^a grpcs:// endpoint needs --compaction-tls-ca"):
        _parse("grpcs://svc:1")
    with pytest.raises(ValueError, match=r"^--compaction-tls needs --compaction-tls-ca"):
        _parse("svc:1", "--compaction-tls")
    with pytest.raises(ValueError, match=r"^--compaction-tls-ca: no such file"):
        _parse("grpcs://svc:1", "--compaction-tls-ca", str(tmp_path / "nope.crt"))
    with pytest.raises(ValueError, match=r"^--compaction-tls-cert and --compaction-tls-key go"):
        _parse("grpcs://svc:1", "--compaction-tls-ca", ca, "--compaction-tls-cert", cert)
    with pytest.raises(ValueError, match="need --compaction-tls or a grpcs:// endpoint"):
        _parse("svc:1", "--compaction-tls-ca", ca)
    argv = ["--compaction-tls-ca", ca, "--compaction-tls-cert", cert, "--compaction-tls-key", key]
    cfg = _parse("grpcs://svc:1", *argv, "--compaction-token-file", str(token_file))
    assert (
        cfg is not None and cfg.tls and (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) == (ca, cert, key)
    )
    assert _parse("svc:1", "--compaction-tls", *argv) is not None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_tls_file_is_refused(tmp_path: Path) -> None:
    ca = _pem(tmp_path, "ca.crt")
    os.chmod(ca, 0)
    with pytest.raises(ValueError, match=r"^--compaction-tls-ca: .* is not readable"):
        _parse("grpcs://svc:1", "--compaction-tls-ca", ca)


def _bump(path: Path, text: str) -> None:
    """Rewrite `path` with a different mtime (filesystems with coarse timestamps)."""
    st = path.stat()
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_token_file_is_read_again_only_when_it_changes(
    token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tf = TokenFile(token_file)
    reads: list[Path] = []
    real = Path.read_text

    def counting(self: Path, *a: Any, **k: Any) -> str:
        reads.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", counting)
    assert tf.read() == SECRET and tf.read() == SECRET and len(reads) == 1
    _bump(token_file, "rotated\n")
    assert tf.read() == "rotated" and len(reads) == 2
    token_file.unlink()  # mid-rotation: the last token stays
    assert tf.read() == "rotated"
    with pytest.raises(OSError):
        TokenFile(token_file).read()


def test_grpc_compactor_follows_a_rotated_token_file(token_file: Path, tmp_path: Path) -> None:
    """The real async client: a rotated token changes what it sends and nothing else; the
    results' signing key is another file (a real server's rotation: tests/integration)."""
    key = tmp_path / "signing-key"
    key.write_text("k3y\n")
    cfg = CompactionConfig(endpoint="127.0.0.1:1", token_file=str(token_file),
                           signing_key_file=str(key))  # fmt: skip

    async def check() -> None:  # as the plugin does: the client is built on its loop
        comp = GrpcCompactor(cfg, "fp")
        client = comp._client_for(comp._token())
        assert client.metadata == ((TOKEN_HEADER, f"Bearer {SECRET}"),)
        assert token_bytes(client.signing_key) == b"k3y"
        assert comp._client_for(comp._token()) is client
        _bump(token_file, "rotated\n")
        assert comp._client_for(comp._token()) is client  # the same channel, the new token
        assert client.metadata == ((TOKEN_HEADER, "Bearer rotated"),)
        assert token_bytes(client.signing_key) == b"k3y"  # untouched by the token's rotation
        _bump(key, "n3w\n")
        assert token_bytes(client.signing_key) == b"n3w"  # its own rotation, read at its next use
        await client.close()

    asyncio.run(check())


def test_grpc_compactor_uses_the_env_token() -> None:
    comp = GrpcCompactor(CompactionConfig(endpoint="127.0.0.1:1", token=SECRET), "fp")
    assert comp._token() == SECRET


def test_service_interceptor_follows_a_rotated_token_file(token_file: Path) -> None:
    icpt = TokenAuthInterceptor(TokenFile(token_file))
    assert icpt._expected == f"Bearer {SECRET}".encode()
    _bump(token_file, "rotated\n")
    assert icpt._expected == b"Bearer rotated"
    (token_file.parent / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        TokenAuthInterceptor(TokenFile(token_file.parent / "empty"))
