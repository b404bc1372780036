"""Checkpoints found the way SGLang finds them (a directory, or a Hub ID in the local Hugging
Face cache, never downloaded) and fingerprinted whatever their weight format."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compactor.models import (
    fingerprint,
    hf_hub_cache,
    read_prepared,
    resolve_checkpoint,
    resolve_model,
    weight_files,
)
from tests.compactor._fixtures import COMMIT, make_hub_cache


@pytest.fixture
def hub(prepared_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_CACHE pointed at a fresh cache holding `org/name` (the prepared model)."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return make_hub_cache(cache, "org/name", prepared_model)


def _old_safetensors_fingerprint(root: Path) -> str:
    """The fingerprint as it was before other formats were accepted (results cached under
    it must stay valid): config, then each safetensors file's name, header, samples, size."""
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((root / "config.json").read_text()), sort_keys=True).encode())
    for path in sorted(root.glob("*.safetensors")):
        h.update(path.name.encode())
        size = path.stat().st_size
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(n))
            span = max(size - 8 - n - 65536, 0)
            for i in range(16):
                f.seek(8 + n + span * i // 15)
                h.update(f.read(65536))
        h.update(str(size).encode())
    return h.hexdigest()[:32]


def test_safetensors_fingerprints_are_unchanged(prepared_model: Path) -> None:
    record = read_prepared("smollm2-135m")
    assert record is not None
    assert fingerprint(prepared_model) == _old_safetensors_fingerprint(prepared_model)
    assert fingerprint(prepared_model) == record.fingerprint


def test_hub_id_resolves_from_the_local_cache(hub: Path, prepared_model: Path) -> None:
    assert resolve_checkpoint("org/name") == hub
    assert resolve_model("org/name") == hub
    assert fingerprint("org/name") == fingerprint(hub) == fingerprint(prepared_model)
    assert resolve_checkpoint("org/name", revision=COMMIT) == hub  # a commit, no ref needed
    assert resolve_checkpoint(str(hub)) == hub  # a directory is taken as it is
    from compactor.service.engine import ModelSummary

    summary = ModelSummary.read(resolve_model("org/name"))
    assert summary.fingerprint == fingerprint(prepared_model) and summary.context_length == 8192


def test_revision_and_download_dir(
    hub: Path, prepared_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "f" * 40
    v1 = make_hub_cache(tmp_path / "hub", "org/name", prepared_model, commit=other)
    (hub.parents[1] / "refs" / "main").write_text(COMMIT)  # make_hub_cache moved main
    (hub.parents[1] / "refs" / "v1").write_text(other)
    assert resolve_checkpoint("org/name") == hub
    assert resolve_checkpoint("org/name", revision="v1") == v1
    # --download-dir is searched first, the hub cache after it
    mine = make_hub_cache(tmp_path / "downloads", "org/name", prepared_model)
    assert resolve_checkpoint("org/name", cache_dir=tmp_path / "downloads") == mine
    assert resolve_checkpoint("org/name", cache_dir=tmp_path / "empty") == hub
    # single-name repos (no organisation) and HF_HOME's default location
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    solo = make_hub_cache(tmp_path / "home" / "hub", "gpt2", prepared_model)
    assert resolve_checkpoint("gpt2") == solo


def test_unresolvable_models_name_what_was_looked_for(hub: Path, tmp_path: Path) -> None:
    cache = hub.parents[2]
    missing = cache / "models--org--missing" / "refs" / "main"
    with pytest.raises(
        ValueError, match="no snapshot of it is in the local Hugging Face cache"
    ) as e:
        resolve_checkpoint("org/missing")
    assert "'org/missing'" in str(e.value) and str(missing) in str(e.value)
    gone = hub.parent / ("e" * 40)
    with pytest.raises(ValueError, match=f"looked for {gone}"):
        resolve_checkpoint("org/name", revision="e" * 40)
    for bad in ("/no/such/dir", "org/name/extra", "a--b", "org/../x"):
        with pytest.raises(ValueError, match=f"model '{bad}' is not a directory, nor a Hug"):
            resolve_checkpoint(bad)
    with pytest.raises(ValueError, match="neither a known model") as e:
        resolve_model("org/missing")
    assert str(missing) in str(e.value)
    with pytest.raises(ValueError, match=r"nor a directory containing config\.json"):
        resolve_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    (empty / "model.safetensors").symlink_to(tmp_path / "nowhere")  # broken blob link
    with pytest.raises(ValueError, match=rf"no weights in model directory {empty}: looked for "):
        fingerprint(empty)
    with pytest.raises(ValueError, match=r"\*\.safetensors, \*\.bin, \*\.pt"):
        fingerprint(empty)


def _bin_checkpoint(root: Path, scale: float = 1.0, name: str = "pytorch_model.bin") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(300, 64, generator=g) * scale, "norm": torch.ones(64)}
    torch.save(state, root / name)
    return root


def test_pytorch_bin_and_pt_checkpoints_are_fingerprinted(tmp_path: Path) -> None:
    a = _bin_checkpoint(tmp_path / "a")
    assert weight_files(a) == ("bin", [a / "pytorch_model.bin"])
    fp = fingerprint(a)
    assert len(fp) == 32 and fingerprint(_bin_checkpoint(tmp_path / "b")) == fp
    assert fingerprint(_bin_checkpoint(tmp_path / "c", scale=1.001)) != fp  # other weights
    # trainer state beside the weights is not a weight file (SGLang skips it too)
    torch.save({"lr": 1.0}, a / "training_args.bin")
    torch.save({"step": 3}, a / "optimizer.pt")
    assert weight_files(a) == ("bin", [a / "pytorch_model.bin"]) and fingerprint(a) == fp
    # .pt only when there is neither safetensors nor .bin, as SGLang's loader falls back
    pt = _bin_checkpoint(tmp_path / "pt", name="model.pt")
    assert weight_files(pt) == ("pt", [pt / "model.pt"])
    assert fingerprint(pt) != fp
    # safetensors win over .bin: the fingerprint is the safetensors-only one
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, a / "model.safetensors")
    only = tmp_path / "only"
    only.mkdir()
    shutil.copyfile(a / "config.json", only / "config.json")
    shutil.copyfile(a / "model.safetensors", only / "model.safetensors")
    assert weight_files(a)[0] == "safetensors" and fingerprint(a) == fingerprint(only)


def test_plugin_resolves_hub_ids_before_loading(
    hub: Path, prepared_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_ext.adapter.factory import check_model, resolve_model_dir

    def args(path: str, **kw: object) -> SimpleNamespace:
        return SimpleNamespace(model_path=path, revision=None, download_dir=None, **kw)

    assert resolve_model_dir(args("org/name")) == hub
    assert check_model(args("org/name")) == fingerprint(prepared_model)
    assert check_model(args(str(prepared_model))) == fingerprint(prepared_model)
    # not cached yet: SGLang may still download it, and the cache factory checks it then
    assert check_model(args("org/missing")) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # ... unless it may not
    with pytest.raises(ValueError, match="'org/missing' is not a directory and no snapshot"):
        check_model(args("org/missing"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (hub / "model.safetensors").unlink()  # a checkpoint without weights fails at once
    with pytest.raises(ValueError, match=f"no weights in model directory {hub}"):
        check_model(args("org/name"))


def test_serve_refuses_an_unknown_model_and_a_bad_limit(
    hub: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from compactor.cli import main

    with pytest.raises(SystemExit, match="'org/missing' is not a directory and no snapshot"):
        main(["serve", "--model", "org/missing", "--port", "0", "--in-process"])
    with pytest.raises(SystemExit, match="--max-prefix-tokens must be >= 2, got 0"):
        main(["serve", "--model", "org/name", "--port", "0", "--max-prefix-tokens", "0"])
