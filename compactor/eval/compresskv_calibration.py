"""Offline CompressKV calibration: Semantic-Retrieval-Head scores and per-layer errors.

Shape legend: L layers, P tokens of one calibration sequence (prefix + question + answer),
T prefix tokens, n query positions, H_q / H_kv query / KV heads, G = H_q // H_kv, D head dim.

On needle cases from :func:`compactor.eval.niah.make_niah` (teacher-forced with the right
answer ``" <key> is <value>."``):

* ``srh_scores[l][j]``: mean over (case, answer-value token that the model predicts
  correctly) of the attention mass query head j of layer l puts, from the position that
  predicts the token, on the whole value span inside the document (CompressKV's Semantic
  Retrieval Head score). Cases with no correct token are skipped (counted in the JSON).
* ``layer_errors[l]``: mean normalized error ||o' - o|| / ||o|| of layer l's attention
  output over the prefix, for the question + answer queries, when that layer alone keeps
  ``min_budget`` prefix tokens per KV head chosen SnapKV-style by those same queries.

:func:`save_calibration` writes ``compresskv_calibration.json`` into the model directory
(where ``compresskv`` looks for it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from compactor.methods.compresskv import CALIBRATION_FILE

__all__ = [
    "answer_span_mass",
    "calibrate_compresskv",
    "layer_budget_error",
    "save_calibration",
]


def answer_span_mass(
    queries: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    span: tuple[int, int],
    scale: float,
) -> torch.Tensor:
    """Attention mass [H_q, n] that each query puts on keys span[0]:span[1].

    queries [H_q, n, D] post-RoPE at sequence positions [n]; keys [H_kv, P, D] post-RoPE
    (causal: query i sees keys 0..positions[i]).
    """
    hq, hkv = queries.shape[0], keys.shape[0]
    if hq % hkv:
        raise ValueError(f"H_q={hq} is not a multiple of H_kv={hkv}")
    k = keys.float().repeat_interleave(hq // hkv, dim=0)  # [H_q, P, D]
    logits = torch.bmm(queries.float(), k.transpose(1, 2)) * scale  # [H_q, n, P]
    future = torch.arange(k.shape[1]).unsqueeze(0) > positions.reshape(-1, 1)
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return probs[..., span[0] : span[1]].sum(-1)


def layer_budget_error(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, budget: int, scale: float
) -> float:
    """Normalized attention-output error when keys/values [H_kv, T, D] keep ``budget``
    tokens per head by the mean attention of queries [H_kv, n, D] (all after the prefix)."""
    from compactor.methods._scoring import attention_probs, topk_selection

    probs = attention_probs(keys, queries, scale)  # [H, n, T]
    out = torch.bmm(probs, values.float())
    b = min(budget, keys.shape[1])
    sel = topk_selection(probs.mean(1), [b] * keys.shape[0])
    g = sel.indices.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    ck, cv = torch.gather(keys, 1, g), torch.gather(values, 1, g)
    out_c = torch.bmm(attention_probs(ck, queries, scale), cv.float())
    err = (out_c - out).norm(dim=-1) / out.norm(dim=-1).clamp_min(1e-12)
    return float(err.mean())


@torch.inference_mode()
def calibrate_compresskv(
    model: Any,
    tokenizer: Any,
    *,
    num_cases: int = 6,
    num_tokens: int = 384,
    min_budget: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """SRH scores [L][H_q] and layer errors [L] on ``num_cases`` single-needle cases.

    Raises ValueError when no case produced a correct answer token (no SRH signal).
    """
    from compactor import hf
    from compactor.eval.niah import make_niah

    if num_cases < 1 or min_budget < 1:
        raise ValueError(f"need num_cases >= 1 and min_budget >= 1, got {num_cases}, {min_budget}")
    t0 = time.perf_counter()
    info = hf.model_info(model)
    L, hq = info.num_layers, info.num_q_heads
    srh = torch.zeros(L, hq, dtype=torch.float64)
    n_correct, cases_used, errs = 0, 0, torch.zeros(L, dtype=torch.float64)
    for i in range(num_cases):
        case = make_niah(tokenizer, num_tokens, "single", seed=seed + i)
        seq = _teacher_forced(tokenizer, case)
        ids = torch.tensor(seq["ids"]).unsqueeze(0)
        from transformers import DynamicCache

        cache: Any = DynamicCache()
        with hf.record_queries(model) as rec:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
        steps = [t for t in seq["value_positions"] if int(logits[t - 1].argmax()) == seq["ids"][t]]
        T = seq["prefix_len"]
        for li in range(L):
            q_all, k, v = rec[li][0], cache.layers[li].keys[0], cache.layers[li].values[0]
            qp = hf.pool_gqa(q_all[:, T:], info.num_kv_heads)
            errs[li] += layer_budget_error(qp, k[:, :T], v[:, :T], min_budget, info.sm_scale)
            if steps:
                pos = torch.tensor(steps) - 1
                mass = answer_span_mass(q_all[:, pos], pos, k, seq["value_span"], info.sm_scale)
                srh[li] += mass.sum(-1).double()
        n_correct += len(steps)
        cases_used += bool(steps)
        if progress:
            print(f"case {i}: {len(steps)}/{len(seq['value_positions'])} value tokens correct")
    if n_correct == 0:
        raise ValueError("no calibration case produced a correct answer token: no SRH signal")
    return {
        "method": "compresskv",
        "srh_scores": (srh / n_correct).tolist(),
        "layer_errors": (errs / num_cases).tolist(),
        "num_layers": L,
        "num_q_heads": hq,
        "num_kv_heads": info.num_kv_heads,
        "settings": {
            "num_cases": num_cases,
            "num_tokens": num_tokens,
            "min_budget": min_budget,
            "seed": seed,
            "kind": "single",
        },
        "correct_value_tokens": n_correct,
        "cases_with_signal": cases_used,
        "seconds": time.perf_counter() - t0,
    }


def save_calibration(model_dir: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as ``compresskv_calibration.json`` in ``model_dir``; returns the path."""
    path = Path(model_dir) / CALIBRATION_FILE
    path.write_text(json.dumps(data, indent=1))
    return path


def _teacher_forced(tokenizer: Any, case: Any) -> dict[str, Any]:
    """Token ids of prefix + question + answer, the value span in the prefix, and the
    sequence positions of the answer's value tokens."""
    key, value = case.needles[0]
    question = case.questions[0].text
    answer = f" {key} is {value}."
    enc = tokenizer(case.prefix, add_special_tokens=False, return_offsets_mapping=True)
    pre_ids, offs = enc["input_ids"], enc["offset_mapping"]
    needle = f"The special magic number for {key} is {value}."
    c0 = case.prefix.index(needle) + needle.index(value)
    c1 = c0 + len(value)
    span_tok = [i for i, (a, b) in enumerate(offs) if a < c1 and b > c0]
    q_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    aenc = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
    v0 = answer.index(value)
    a_val = [i for i, (a, b) in enumerate(aenc["offset_mapping"]) if a < v0 + len(value) and b > v0]
    base = len(pre_ids) + len(q_ids)
    return {
        "ids": list(pre_ids) + list(q_ids) + list(aenc["input_ids"]),
        "prefix_len": len(pre_ids),
        "value_span": (min(span_tok), max(span_tok) + 1),
        "value_positions": [base + i for i in a_val],
    }
