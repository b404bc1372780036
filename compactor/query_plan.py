"""The token-level plan of a reference-query set: what each source appends after the prefix.

Sources (``QUERY_SOURCES``):
  context-prefill  queries of the prefix's own tokens (the fit set the paper warns about).
  repeat-prefill   ``{C} Repeat the previous context. {C}``: queries of the second copy of
                   C, which attend over the first (the prefix cache).
  repeat-turn      the same repeat asked as a chat turn (kvpress's KVzip framing):
                   ``{C}\n\nRepeat the previous context exactly.{close user turn, open the
                   assistant's} {C}``; queries of the instruction, the turn and the copy.
  self-study       the model answers four kinds of prompts about the prefix (summarize, ask
                   questions, quote/continue, structure); queries of prompt + answer.
  random           Gaussian vectors scaled to the mean norm of the real prefix queries.
  follow-up        real follow-up token sequences (questions users asked of this prefix),
                   optionally with the model's own greedy answer to each appended
                   (``follow_up_answer_tokens``), generated on the full prefix.

Every source but ``context-prefill`` and ``random`` is a *continuation*: tokens appended
after the prefix. They are fixed once here (:func:`plan_queries`, which runs any generation
on the full prefix); :mod:`compactor.query_capture` then runs them and records their queries.
Generation can take long (one forward call per generated token), so it takes a `checkpoint` callback:
called with the stage's name ("self-study generation", "follow-up answer generation") once
per generated token, it may raise to abort (the service's cancellation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compactor import hf
from compactor.spec import QueryConfig, SpecError

__all__ = ["Checkpoint", "Continuation", "QueryPlan", "assistant_turn", "plan_queries"]

REPEAT_INSTRUCTION = " Repeat the previous context. "
REPEAT_TURN_INSTRUCTION = "\n\nRepeat the previous context exactly."
# Tokens of one self-study prompt a worker runs (the prompts are batched, so each row is as
# long as the longest; the service also caps their characters, WorkLimits).
MAX_SELF_STUDY_PROMPT_TOKENS = 512

Checkpoint = Callable[[str], None]  # called with a stage name; may raise to abort


@dataclass(frozen=True)
class Continuation:
    """Tokens appended after the prefix; queries of tokens[keep_from:] are used."""

    source: str
    tokens: list[int]
    keep_from: int = 0


@dataclass
class QueryPlan:
    """The fixed token-level plan of a query set (see module docstring)."""

    config: QueryConfig
    continuations: list[Continuation] = field(default_factory=list)
    context_queries: list[torch.Tensor] | None = None  # per layer [H_kv, T, D] (GQA-pooled n)
    query_norms: list[torch.Tensor] | None = None  # per layer [H_kv] mean real query norm


def plan_queries(
    model: Any,
    tokenizer: Any,
    token_ids: Sequence[int],
    prefill: hf.PrefillResult,
    config: QueryConfig,
    follow_ups: Sequence[Sequence[int]] | None = None,
    checkpoint: Checkpoint | None = None,
) -> QueryPlan:
    """Fix the continuations of every source (runs self-study generation on the full prefix).

    Args:
        token_ids: the prefix [T].
        prefill: its :func:`hf.prefill` result (with queries when ``context-prefill`` or
            ``random`` is asked for).
        follow_ups: token sequences for the ``follow-up`` source.
        checkpoint: called once per generated token (see the module docstring).
    Raises:
        ValueError: a source needs what is missing (a tokenizer, follow-ups, prefix queries).
    """
    info = hf.model_info(model)
    plan = QueryPlan(config)
    needs_q = {"context-prefill", "random"} & set(config.sources)
    if needs_q:
        if prefill.queries is None:
            raise ValueError(f"sources {sorted(needs_q)} need prefill(..., with_queries=True)")
        pooled = [hf.pool_gqa(q.float(), info.num_kv_heads) for q in prefill.queries]
        plan.context_queries = pooled
        plan.query_norms = [p.norm(dim=-1).mean(dim=1) for p in pooled]
    for source in config.sources:
        if source == "repeat-prefill":
            instr = _encode(tokenizer, REPEAT_INSTRUCTION) if tokenizer is not None else []
            plan.continuations.append(Continuation(source, instr + list(token_ids), len(instr)))
        elif source == "repeat-turn":
            text = REPEAT_TURN_INSTRUCTION + assistant_turn(tokenizer)
            instr = _encode(tokenizer, text) if tokenizer is not None else []
            plan.continuations.append(Continuation(source, instr + list(token_ids)))
        elif source == "self-study":
            if tokenizer is None:
                raise ValueError("the self-study source needs a tokenizer")
            plan.continuations.extend(_self_study(model, tokenizer, prefill, config, checkpoint))
        elif source == "follow-up":
            if not follow_ups:
                raise ValueError("the follow-up source needs follow_ups (token sequences)")
            seqs = [list(seq) for seq in follow_ups]
            if any(len(seq) == 0 for seq in seqs):
                raise ValueError("a follow-up token sequence is empty")
            if config.follow_up_answer_tokens:
                check = _stage(checkpoint, "follow-up answer generation")
                n = config.follow_up_answer_tokens
                answers = _generate(model, tokenizer, prefill, seqs, n, 0.0, 0, check)
                seqs = [seq + ans for seq, ans in zip(seqs, answers)]
            plan.continuations.extend(Continuation(source, seq) for seq in seqs)
    return plan


def assistant_turn(tokenizer: Any) -> str:
    """The text that closes an open user turn and opens the assistant's, from `tokenizer`'s
    chat template; "\n" without one."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    marker = "\x00TURN\x00"
    msgs = [{"role": "user", "content": marker}]
    full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return str(full).split(marker)[1]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _generate(
    model: Any,
    tokenizer: Any,
    prefill: hf.PrefillResult,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    check: Callable[[], None] | None = None,
) -> list[list[int]]:
    """The model's answers to `prompts` on the full prefix, decoded as one batch (cut at EOS).

    The prefix's KV cache is held once for all rows (``hf.batched_generate``). Sampling
    (temperature > 0) draws from one generator on the model's device, seeded `seed`.
    `check` is called before every forward call (``hf.batched_generate``'s): it may raise
    to abort.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    return hf.batched_generate(
        model,
        hf.PrefixState.full(prefill),
        prompts,
        max_new_tokens,
        eos_ids=[eos] if eos is not None else [],
        temperature=temperature,
        generator=gen,
        check=check,
    )


def _stage(checkpoint: Checkpoint | None, stage: str) -> Callable[[], None] | None:
    """`checkpoint` bound to the name of `stage` (None stays None)."""
    if checkpoint is None:
        return None
    return lambda: checkpoint(stage)


def _self_study(
    model: Any,
    tokenizer: Any,
    prefill: hf.PrefillResult,
    config: QueryConfig,
    checkpoint: Checkpoint | None = None,
) -> list[Continuation]:
    """One generated answer per prompt, on the full prefix (greedy or sampled)."""
    prompts = [_encode(tokenizer, f"\n\n{p}\n") for p in config.self_study_prompts]
    longest = max(map(len, prompts), default=0)
    if longest > MAX_SELF_STUDY_PROMPT_TOKENS:
        raise SpecError(
            f"queries.self_study_prompts: a prompt of {longest} tokens is over the "
            f"{MAX_SELF_STUDY_PROMPT_TOKENS} a worker runs",
            "queries.self_study_prompts",
        )
    answers = _generate(
        model,
        tokenizer,
        prefill,
        prompts,
        config.self_study_tokens,
        config.temperature,
        config.seed,
        _stage(checkpoint, "self-study generation"),
    )
    return [Continuation("self-study", p + a) for p, a in zip(prompts, answers)]
