"""Helpers the compactor tests share: a CompactedPrefix cut from a prefill (`prefix_from`) and
a model cached as huggingface_hub would (`make_hub_cache`, also used by a server test)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from compactor.types import CompactedLayer, CompactedPrefix


def prefix_from(pre, keep=None, beta=None):
    """A CompactedPrefix keeping rows `keep[h]` (default all) of each head, beta (default 0)."""
    layers = []
    hkv, T, d = pre.keys[0].shape
    for k, v in zip(pre.keys, pre.values):
        idx = [torch.arange(T) if keep is None else torch.as_tensor(keep[h]) for h in range(hkv)]
        ks = torch.cat([k[h, i] for h, i in enumerate(idx)])
        vs = torch.cat([v[h, i] for h, i in enumerate(idx)])
        b = torch.zeros(ks.shape[0]) if beta is None else beta
        indptr = torch.tensor(
            [0, *torch.cumsum(torch.tensor([len(i) for i in idx]), 0).tolist()], dtype=torch.int32
        )
        layers.append(CompactedLayer(ks, vs, b, indptr, torch.cat(idx).long()))
    return CompactedPrefix("fp", T, "h", "identity", {}, layers, d, hkv, k.dtype)


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(cache: Path, repo: str, source: Path, commit: str = COMMIT) -> Path:
    """A hub cache entry as huggingface_hub writes it for checkpoint directory `source`:
    blobs, a snapshot of symlinks into them, and refs/main naming the commit. Returns the
    snapshot directory."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name in sorted(p.name for p in source.iterdir() if p.name != "prepared.json"):
        blob = root / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        if name.endswith(".safetensors"):
            blob.symlink_to(source / name)  # no 500 MB copy
        else:
            shutil.copyfile(source / name, blob)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot
