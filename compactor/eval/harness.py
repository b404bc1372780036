"""Evaluate compacted prefixes on held-out FUTURE tokens (never the fit set).

Shape legend: T prefix tokens, n held-out queries, H_kv KV heads, D head dim, V vocab.

For each case (a prefix + follow-up questions) the *full* model is run once
(:func:`build_reference`): it answers each question greedily, and the queries of question +
answer tokens (post-RoPE, GQA-pooled, recorded under the full cache) are the held-out set.
A compacted prefix is then scored (:func:`evaluate_prefix`) by
  - attention errors per layer/head on those held-out queries (``compactor.attention_metrics``),
  - logppl: mean NLL of the full model's own greedy answer tokens, teacher-forced under the
    compacted cache (logppl_gap = compacted - full; 0 for the full cache),
  - agreement: fraction of answer positions where the compacted argmax = the full token,
  - niah_accuracy: expected-answer substrings in the compacted model's greedy answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compactor import hf
from compactor.attention_metrics import attention_errors
from compactor.eval.niah import score_answer
from compactor.query_capture import cat_pooled, reservoir
from compactor.types import CompactedPrefix

__all__ = ["EvalCase", "Reference", "build_reference", "evaluate_prefix", "summarize"]


@dataclass(frozen=True)
class EvalCase:
    """A prefix [T] and its follow-up questions (token ids), with expected answers for NIAH.

    ``expected[i] == ()`` marks question i as unscored (it still feeds the held-out queries,
    logppl and agreement).
    """

    name: str
    prefix_ids: list[int]
    questions: list[list[int]]
    expected: list[tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        if len(self.prefix_ids) < 2:
            raise ValueError(
                f"case {self.name!r}: prefix too short ({len(self.prefix_ids)} tokens)"
            )
        if not self.questions or any(len(q) == 0 for q in self.questions):
            raise ValueError(f"case {self.name!r}: needs non-empty questions")
        if self.expected is not None and len(self.expected) != len(self.questions):
            raise ValueError(
                f"case {self.name!r}: {len(self.expected)} expected answers for {len(self.questions)} questions"
            )


@dataclass
class Reference:
    """What the full cache does on a case (see module docstring)."""

    case: EvalCase
    prefill: hf.PrefillResult
    answers: list[list[int]]  # the full model's greedy answer per question
    full_nll: list[torch.Tensor]  # per question [len(answer)] fp32
    heldout: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_kv, n, D]
    niah_scores: list[float] = field(default_factory=list)
    seconds: float = 0.0


def build_reference(
    model: Any,
    tokenizer: Any,
    case: EvalCase,
    answer_tokens: int = 16,
    max_heldout: int = 2048,
    seed: int = 0,
) -> Reference:
    """Run the full cache on `case` (prefill, greedy answers, held-out queries, NLL)."""
    if answer_tokens < 1:
        raise ValueError(f"answer_tokens must be >= 1, got {answer_tokens}")
    t0 = time.perf_counter()
    info = hf.model_info(model)
    eos = _eos(tokenizer)
    pre = hf.prefill(model, case.prefix_ids)
    full = hf.PrefixState.full(pre)
    ref = Reference(case, pre, [], [])
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in range(info.num_layers)}
    for qi, q in enumerate(case.questions):
        ans = hf.greedy_generate(model, full.fork(), q, answer_tokens, eos_ids=eos)
        with hf.record_queries(model) as rec:
            logits = full.fork().forward(model, q + ans)
        for layer in parts:
            parts[layer].append(hf.pool_gqa(rec[layer][0].float(), info.num_kv_heads))
        ref.answers.append(ans)
        ref.full_nll.append(_nll(logits, len(q), ans))
        if case.expected is not None and case.expected[qi]:
            ref.niah_scores.append(score_answer(_decode(tokenizer, ans), case.expected[qi]))
    g = info.group_size
    ref.heldout = {i: reservoir(cat_pooled(p, g), max_heldout, seed, g) for i, p in parts.items()}
    ref.seconds = time.perf_counter() - t0
    return ref


def evaluate_prefix(
    model: Any,
    tokenizer: Any,
    ref: Reference,
    prefix: CompactedPrefix | None,
    niah: bool = False,
) -> dict[str, Any]:
    """Score `prefix` (None = the full cache) against `ref`; returns a flat metrics dict.

    Keys: output_rel_err, mass_rel_err (means over layers and heads), per_layer_output_rel_err,
    per_layer_mass_rel_err ([L] means over heads), logppl, logppl_full, logppl_gap, agreement,
    niah_accuracy (None unless `niah` and the case has expected answers).
    """
    info = hf.model_info(model)
    case = ref.case
    if prefix is not None and prefix.logical_length != len(case.prefix_ids):
        raise ValueError(
            f"prefix logical_length {prefix.logical_length} != case T {len(case.prefix_ids)}"
        )
    state = (
        hf.PrefixState.full(ref.prefill)
        if prefix is None
        else hf.PrefixState.from_compacted(prefix)
    )
    out_l, mass_l = [], []
    for li in range(info.num_layers):
        if prefix is None:
            out_l.append(0.0)
            mass_l.append(0.0)
            continue
        err = attention_errors(
            ref.heldout[li],
            ref.prefill.keys[li],
            ref.prefill.values[li],
            prefix.layers[li],
            info.sm_scale,
        )
        out_l.append(float(err.output_rel_err.mean()))
        mass_l.append(float(err.mass_rel_err.mean()))
    nll_c, nll_f, agree, total, scores = 0.0, 0.0, 0, 0, []
    eos = _eos(tokenizer)
    for qi, (q, ans) in enumerate(zip(case.questions, ref.answers)):
        logits = state.fork().forward(model, q + ans)
        nll_c += float(_nll(logits, len(q), ans).sum())
        nll_f += float(ref.full_nll[qi].sum())
        pred = logits[len(q) - 1 : len(q) - 1 + len(ans)].argmax(-1)
        target = torch.tensor(ans)
        agree += int((pred == target).sum())
        total += len(ans)
        if niah and case.expected is not None and case.expected[qi]:
            if bool((pred == target).all()):
                gen = ans  # greedy decoding would follow the teacher-forced path exactly
            else:
                gen = hf.greedy_generate(model, state.fork(), q, len(ans), eos_ids=eos)
            scores.append(score_answer(_decode(tokenizer, gen), case.expected[qi]))
    return {
        "output_rel_err": sum(out_l) / len(out_l),
        "mass_rel_err": sum(mass_l) / len(mass_l),
        "per_layer_output_rel_err": out_l,
        "per_layer_mass_rel_err": mass_l,
        "logppl": nll_c / total,
        "logppl_full": nll_f / total,
        "logppl_gap": (nll_c - nll_f) / total,
        "agreement": agree / total,
        "niah_accuracy": (sum(scores) / len(scores)) if scores else None,
    }


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean of every numeric (or per-layer list) field over `records` (one per case)."""
    if not records:
        raise ValueError("summarize: no records")
    out: dict[str, Any] = {}
    for key in records[0]:
        vals = [r[key] for r in records]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            out[key] = sum(vals) / len(vals)
        elif all(isinstance(v, list) for v in vals):
            out[key] = [sum(x) / len(x) for x in zip(*vals)]
        elif all(v is None for v in vals):
            out[key] = None
        else:
            nums = [v for v in vals if isinstance(v, int | float)]
            out[key] = sum(nums) / len(nums) if nums else vals[0]
    return out


def _nll(logits: torch.Tensor, q_len: int, ans: Sequence[int]) -> torch.Tensor:
    """NLL [len(ans)] of `ans` tokens given logits [q_len + len(ans), V] of question + answer."""
    lp = torch.log_softmax(logits[q_len - 1 : q_len - 1 + len(ans)].float(), dim=-1)
    return -lp.gather(1, torch.tensor(list(ans)).view(-1, 1)).squeeze(1)


def _eos(tokenizer: Any) -> list[int]:
    eid = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return [int(eid)] if eid is not None else []


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))
