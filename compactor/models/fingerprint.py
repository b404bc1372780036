"""Model fingerprints: a short, stable identity for a checkpoint.

A compacted prefix is only valid for the exact weights it was computed with, so both the
compaction service and the SGLang plugin compute this fingerprint from the checkpoint and
compare it. It hashes `config.json` (canonical JSON), then, for each weight file SGLang loads
(:func:`compactor.models.paths.weight_files`: safetensors, else PyTorch `.bin`, else `.pt`),
its name, its size and sixteen 64 KiB samples spread over it; for a safetensors file the
header (names, dtypes, shapes, offsets) too, and the samples cover its data section. It
costs milliseconds on a multi-GB checkpoint yet differs between two fine-tunes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO

from compactor.models.paths import WEIGHT_PATTERNS, resolve_checkpoint, weight_files

_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


def fingerprint(
    model: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> str:
    """Return a hex fingerprint (32 chars) of checkpoint `model`.

    `model` is a checkpoint directory or a Hub ID found in the local Hugging Face cache
    (`revision` and `cache_dir` as in :func:`compactor.models.paths.resolve_checkpoint`);
    nothing is downloaded.

    Raises:
        ValueError: `model` cannot be resolved to a directory, or that directory has no
            config.json or no weight file; the message names the path and what was looked for.
    """
    root = resolve_checkpoint(model, revision=revision, cache_dir=cache_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"not a model directory (no config.json): {root}")
    kind, weights = weight_files(root)
    if not weights:
        raise ValueError(
            f"no weights in model directory {root}: looked for {', '.join(WEIGHT_PATTERNS)}"
        )
    sample = _sample_safetensors if kind == "safetensors" else _sample_file
    h = hashlib.sha256()
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in weights:
        h.update(path.name.encode())
        h.update(sample(path))
    return h.hexdigest()[:32]


def _sample_safetensors(path: Path) -> bytes:
    """The header plus evenly spaced samples of the data section of one safetensors file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        parts = [f.read(header_len)]
        parts += _samples(f, 8 + header_len, size)
    parts.append(str(size).encode())
    return b"".join(parts)


def _sample_file(path: Path) -> bytes:
    """Evenly spaced samples of a whole file (a PyTorch `.bin` / `.pt` pickle or zip)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        parts = _samples(f, 0, size)
    parts.append(str(size).encode())
    return b"".join(parts)


def _samples(f: BinaryIO, start: int, size: int) -> list[bytes]:
    """_SAMPLES reads of _SAMPLE_BYTES at evenly spaced offsets of [start, size)."""
    span = max(size - start - _SAMPLE_BYTES, 0)
    out = []
    for i in range(_SAMPLES):
        f.seek(start + span * i // max(_SAMPLES - 1, 1))
        out.append(f.read(_SAMPLE_BYTES))
    return out
