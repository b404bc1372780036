"""CLI argument handling that needs no model or server: `compactor serve`, and argument
errors of the spec-taking commands (one line, exit 2, before any model is loaded)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

import pytest

from compactor.cli import main
from compactor.endpoints import is_loopback
from compactor.spec import AUTO_CHUNK_TOKENS, CompactionSpec


def test_serve_reports_a_taken_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model", "smollm2-135m", "--port", str(port), "--in-process"])
    assert "cannot bind" in str(info.value) and str(port) in str(info.value)


def test_serve_binds_again_where_its_last_life_had_clients() -> None:
    """A restart on the same port: the old life closed its clients' connections first, so
    they sit in TIME_WAIT on the port; the port check lets the new listener bind (as gRPC's
    own bind does), and still refuses a port with a listener on it."""
    from compactor.commands.serve import _check_port

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server side closes first: TIME_WAIT on 127.0.0.1:port
        client.close()
        with pytest.raises(SystemExit, match="cannot bind"):
            _check_port("127.0.0.1", port)  # the listener is still there
    _check_port("127.0.0.1", port)  # gone: its old connection does not hold the port


def test_serve_refuses_plaintext_on_a_non_loopback_address(
    monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Prompts would travel in clear: a non-loopback bind needs TLS or an explicit --insecure
    (the refusal comes before any model is resolved or port bound)."""
    from compactor.commands import serve

    for host in ("0.0.0.0", "10.1.2.3", "compactor.internal", "::"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model", "smollm2-135m", "--host", host, "--in-process"])
        assert f"--host {host} is not a loopback address" in str(info.value), host
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost")] \
        == [True] * 5  # fmt: skip

    reached: list[str] = []
    monkeypatch.setattr(serve, "_check_port", lambda host, port: reached.append(host))
    monkeypatch.setattr("compactor.models.resolve_model", lambda m: (_ for _ in ()).throw(
        SystemExit("stop after the checks")))  # fmt: skip
    with pytest.raises(SystemExit, match="stop after the checks"), caplog.at_level("WARNING"):
        main(["serve", "--model", "m", "--host", "0.0.0.0", "--insecure", "--in-process"])
    assert reached == ["0.0.0.0"] and "plaintext on 0.0.0.0 (--insecure)" in caplog.text


def test_serve_and_request_are_registered() -> None:
    with pytest.raises(SystemExit) as info:
        main(["request", "--help"])
    assert info.value.code == 0


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading a model fail loudly: argument errors must come before it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    import compactor.commands.compact as compact_cmd
    import compactor.commands.eval as eval_cmd
    import compactor.hf

    monkeypatch.setattr(compactor.hf, "load_model", refuse)
    monkeypatch.setattr(compact_cmd, "load", refuse)
    monkeypatch.setattr(eval_cmd, "load", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "nosuch", "--ratio", "0.1"], "unknown method 'nosuch'; available: "),
        (["--ratio", "1.5"], "ratio must be in (0, 1], got 1.5"),
        (["--ratio", "0.1", "--input", "MISSING"], "--input: no such file: "),
        (
            ["--ratio", "0.1", "--param", "bogus=1"],
            f"method '{CompactionSpec().method}' has no parameter(s)",
        ),
        (["--ratio", "0.1", "--query-sources", "nope"], "unknown query source 'nope'"),
    ],
)
def test_compact_argument_errors_exit_2_before_loading(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    _no_model(monkeypatch)
    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    args = ["compact", "--model", "smollm2-135m", "--input", str(doc)]
    args += ["--output", str(tmp_path / "p.safetensors"), *argv]
    args = [str(tmp_path / "missing.txt") if a == "MISSING" else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("compactor compact: error: ") and message in err
    assert err.count("\n") == 1 and err.endswith("\n")  # one line, no traceback


def test_eval_bad_method_exits_2_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    _no_model(monkeypatch)
    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    args = ["eval", "--model", "smollm2-135m", "--input", str(doc), "--json", "x.json"]
    assert main([*args, "--methods", "full,am-omp:bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compactor eval: error: am-omp:bogus=1: method 'am-omp' has no")


def test_unexpected_errors_keep_their_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import compactor.commands.compact as compact_cmd

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(compact_cmd, "load", boom)
    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    args = ["compact", "--model", "m", "--input", str(doc), "--output", "o", "--ratio", "0.1"]
    with pytest.raises(RuntimeError, match="boom"):
        main(args)


def _subparser(name: str) -> argparse.ArgumentParser:
    from compactor.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["compact", "request"])
def test_cli_flags_cover_every_spec_knob(command: str) -> None:
    """The spec's flags are generated: the CLI and the plugin cannot drift from the spec."""
    from compactor.spec.cli_args import spec_flags

    options = _subparser(command)._option_string_actions
    for path, flag in spec_flags().items():
        assert flag in options, (command, path, flag)
    assert "--no-on-policy" in options


def test_plugin_flags_cover_every_spec_knob() -> None:
    from compactor.spec import spec_fields
    from compactor.spec.cli_args import spec_flags
    from sglang_ext.config import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = spec_flags("compaction-")
    assert set(flags) == {path for path, _ in spec_fields()}
    for flag in flags.values():
        assert flag in parser._option_string_actions, flag
    # the plugin's flag names of before are kept
    for flag in ("--compaction-method", "--compaction-ratio", "--compaction-tokens",
                 "--compaction-query-sources", "--compaction-follow-up-answer-tokens",
                 "--compaction-on-policy", "--no-compaction-on-policy"):  # fmt: skip
        assert flag in parser._option_string_actions, flag


def test_cli_spec_defaults_are_the_spec_defaults() -> None:
    from compactor.spec import CompactionSpec
    from compactor.spec.cli_args import spec_from_args

    ns = _subparser("compact").parse_args(
        ["--model", "m", "--input", "i", "--output", "o", "--ratio", "0.2"]
    )
    assert spec_from_args(ns) == CompactionSpec(ratio=0.2)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, AUTO_CHUNK_TOKENS), ("2048", 2048), ("none", None), ("NONE", None)],
)
def test_serve_passes_the_auto_chunk_limit_to_the_service(
    value: str | None, expected: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import compactor.commands.serve as serve_cmd

    seen: list[Any] = []

    async def run(config: Any) -> None:
        seen.append(config.service.auto_chunk_tokens)

    monkeypatch.setattr(serve_cmd, "_run", run)
    argv = ["serve", "--model", "smollm2-135m", "--port", "0", "--in-process"]
    main([*argv, "--auto-chunk-tokens", value] if value else argv)
    assert seen == [expected]


def test_serve_refuses_a_tiny_auto_chunk_limit(capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", "smollm2-135m", "--auto-chunk-tokens", "10"])
    assert info.value.code == 2
    assert "expected a token count >= 64 or 'none', got '10'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoint", "10.0.0.5:50051"], "plaintext to 10.0.0.5: pass --tls-ca"),
        (["--endpoint", "compactor:50051", "--auth-token-file", "TOKEN"], "plaintext to compactor"),
        (
            ["--endpoint", "h:1", "--tls-ca", "CA", "--tls-cert", "CERT"],
            "--tls-cert and --tls-key go together",
        ),
        (["--endpoint", "h:1", "--tls-cert", "CERT", "--tls-key", "CERT"], "needs --tls-ca"),
    ],
)
def test_request_refuses_plaintext_to_a_remote_host_and_half_tls(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The token and the prefix never go in clear to another host unless --insecure says so;
    a client certificate is never dropped silently."""
    _no_model(monkeypatch)
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    args = ["request", "--model", "smollm2-135m", "--input", str(tmp_path / "ids.json")]
    args += [str(tmp_path / a) if a in ("TOKEN", "CA", "CERT") else a for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("compactor request: error: ") and message in err, err
    assert err.count("\n") == 1
