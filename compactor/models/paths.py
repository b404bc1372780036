"""Where a checkpoint lives on disk, found the way SGLang finds it, without any network call.

SGLang's `--model-path` (and transformers' `from_pretrained`) takes a local directory or a
Hugging Face Hub ID such as ``meta-llama/Llama-3.1-8B-Instruct``. A Hub ID is looked up in
the local hub cache::

    <cache>/models--<org>--<name>/refs/<revision or main>   (a file holding a commit hash)
    <cache>/models--<org>--<name>/snapshots/<commit>/       (config.json, weights, ...)

with `<cache>` = SGLang's `--download-dir` when given, then the hub cache
(:func:`hf_hub_cache`). Nothing here downloads: a Hub ID that is not in the cache is a
ValueError naming the folders looked in.

:func:`weight_files` lists the files SGLang's default loader reads (`--load-format auto`):
``*.safetensors``, else PyTorch ``*.bin``, else ``*.pt``, without trainer state files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["WEIGHT_PATTERNS", "hf_hub_cache", "resolve_checkpoint", "weight_files"]

# In SGLang's order of preference (DefaultModelLoader._prepare_weights, load format auto).
WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt")
# Trainer state saved next to the weights; SGLang skips it too.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
# huggingface_hub's REPO_ID_REGEX: an optional namespace, then a name (ASCII . _ - allowed).
_REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", re.ASCII)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at each call.

    The same rule as `huggingface_hub.constants.HF_HUB_CACHE` (which is fixed at import):
    ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.
    """
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    home = os.path.expandvars(os.path.expanduser(home))
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def resolve_checkpoint(
    model: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """The local directory of checkpoint `model`: a directory, or a Hub ID in the cache.

    Args:
        model: a checkpoint directory, or a Hub ID (``org/name`` or ``name``).
        revision: branch, tag or commit of a Hub ID (SGLang's `--revision`); default main.
        cache_dir: a hub cache searched before :func:`hf_hub_cache` (SGLang's
            `--download-dir`).

    Raises:
        ValueError: `model` is neither an existing directory nor a Hub ID whose snapshot is
            in the local cache; the message names the folders looked in.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    if not _is_repo_id(name):
        raise ValueError(f"model {name!r} is not a directory, nor a Hugging Face Hub ID (org/name)")
    caches = [Path(cache_dir).expanduser()] if cache_dir else []
    caches.append(hf_hub_cache())
    looked: list[str] = []
    for cache in caches:
        repo = cache / ("models--" + name.replace("/", "--"))
        ref = repo / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else revision
        if commit:
            snapshot = repo / "snapshots" / commit
            if snapshot.is_dir():
                return snapshot
            looked.append(str(snapshot))
        else:
            looked.append(str(ref))
    raise ValueError(
        f"model {name!r} is not a directory and no snapshot of it is in the local Hugging "
        f"Face cache (looked for {', '.join(looked)}; downloads are never made: fetch it "
        "first, e.g. `huggingface-cli download`, or set HF_HUB_CACHE / HF_HOME)"
    )


def weight_files(model_dir: str | Path) -> tuple[str, list[Path]]:
    """`(format, files)`: the weights SGLang's default loader reads from `model_dir`.

    `format` is "safetensors", "bin" or "pt": the first of WEIGHT_PATTERNS with a file;
    `files` are sorted by name, trainer state excluded. `("", [])` when there is none.
    """
    root = Path(model_dir)
    for pattern in WEIGHT_PATTERNS:
        found = root.glob(pattern)  # is_file: a broken cache symlink is no weight file
        files = sorted(p for p in found if p.name not in _NOT_WEIGHTS and p.is_file())
        if files:
            return pattern.removeprefix("*."), files
    return "", []


def _is_repo_id(name: str) -> bool:
    return (
        _REPO_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
    )
