"""Model fingerprints: a short, stable identity for a checkpoint directory.

A compacted prefix is only valid for the exact weights it was computed with, so both the
compaction service and the SGLang plugin compute this fingerprint from the model directory
and compare it. It hashes `config.json` (canonical JSON), each safetensors file's header
(names, dtypes, shapes, offsets) and sixteen 64 KiB samples spread over each file's data, so
it costs milliseconds on a multi-GB checkpoint yet differs between two fine-tunes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


def fingerprint(model_dir: str | Path) -> str:
    """Return a hex fingerprint (32 chars) of the checkpoint in `model_dir`.

    Raises:
        ValueError: `model_dir` has no config.json or no *.safetensors file.
    """
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"not a model directory (no config.json): {root}")
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"no *.safetensors weights in model directory: {root}")
    h = hashlib.sha256()
    h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in weights:
        h.update(path.name.encode())
        h.update(_sample_safetensors(path))
    return h.hexdigest()[:32]


def _sample_safetensors(path: Path) -> bytes:
    """The header plus evenly spaced samples of the data section of one safetensors file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        parts = [f.read(header_len)]
        data_start = 8 + header_len
        span = max(size - data_start - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            f.seek(data_start + span * i // max(_SAMPLES - 1, 1))
            parts.append(f.read(_SAMPLE_BYTES))
    parts.append(str(size).encode())
    return b"".join(parts)
