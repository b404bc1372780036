"""Generation after a (full or compacted) prefix: one sequence (:func:`greedy_generate`) or
several prompts at once over the prefix held once (:func:`batched_generate`), greedy or
sampled. Shape legend: :mod:`compactor.hf.decode` (B rows, V vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from compactor.hf.decode import PrefixState

__all__ = ["batched_generate", "greedy_generate"]


@torch.inference_mode()
def greedy_generate(
    model: Any,
    state: PrefixState,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Append `prompt_ids` to `state` and decode up to `max_new_tokens` tokens.

    Greedy when ``temperature == 0``, else sampling with `generator`. Stops after an EOS id
    (which is included). Mutates `state`.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = state.forward(model, list(prompt_ids), last_only=True)[-1]
    out: list[int] = []
    eos = set(eos_ids)
    for step in range(max_new_tokens):
        if temperature == 0:
            tok = int(logits.argmax())
        else:
            tok = int(_sample(logits, temperature, generator))
        out.append(tok)
        if tok in eos or step == max_new_tokens - 1:
            break
        logits = state.forward(model, [tok], last_only=True)[-1]
    return out


@torch.inference_mode()
def batched_generate(
    model: Any,
    state: PrefixState,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    check: Callable[[], None] | None = None,
) -> list[list[int]]:
    """:func:`greedy_generate` for several prompts at once after one shared prefix.

    Prompts are left-padded (padding masked out, positions counted per row), decoded for
    `max_new_tokens` steps in one batch over the prefix held once (each row's cache holds
    only its own tokens, in a static cache of prompt width + max_new_tokens - 1 columns:
    any number of prompts, one batch), and each output is cut after its first EOS. The
    tokens stay on the model's device until the end (one host sync). Greedy decoding runs
    its steps through ``SharedPrefixRows.greedy`` (one CUDA graph replay per token on
    CUDA). `state` must be fresh (use ``state.fork()``; it is mutated). `check` is called
    before every forward call (the prompt's, then one per generated token): it may raise
    to abort the generation (cancellation).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("batched_generate: need non-empty prompts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device="cpu")
    pad = torch.ones(len(prompts), width, dtype=torch.bool, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), device="cpu")
        pad[i, width - len(p) :] = False
    rows = state.start_rows(model, len(prompts), width + max_new_tokens - 1)
    check = check or (lambda: None)
    check()
    logits = state.forward(model, ids, last_only=True, pad=pad)[:, -1]
    if temperature == 0:
        return _cut_at_eos(rows.greedy(model, logits, max_new_tokens, check), eos_ids)
    steps = []
    for step in range(max_new_tokens):
        tok = _sample(logits, temperature, generator).squeeze(1)
        steps.append(tok)
        if step < max_new_tokens - 1:
            check()
            logits = state.forward(model, tok[:, None], last_only=True)[:, -1]
    return _cut_at_eos(torch.stack(steps, 1), eos_ids)


def _cut_at_eos(tokens: torch.Tensor, eos_ids: Sequence[int]) -> list[list[int]]:
    """Rows of tokens [B, steps] as lists, each cut after its first EOS (one host sync)."""
    out, eos = [], set(eos_ids)
    for row in tokens.tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        out.append(row[:cut])
    return out


def _sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of logits [..., V] sampled at `temperature`: [..., 1] int64.

    Draws on the generator's device (moving the probabilities there and the tokens back
    when it differs from the logits': pass a generator on the model's device to avoid it).
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if generator is None or generator.device == probs.device:
        return torch.multinomial(probs, 1, generator=generator)
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).to(probs.device)
