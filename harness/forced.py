"""Teacher-forced scoring of answers on a live server: per answer token, the server's log-prob
of it and its own top-1 there (`teacher_forced`), and the figures two scorings of the same
answers are compared by (`logprob_gap`, `top1_share`). Through a PD pair:
`harness.pd.pd_teacher_forced`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from harness.launch import HTTPServer

__all__ = ["UNSCORED", "Forced", "logprob_gap", "teacher_forced", "top1_share"]

UNSCORED = math.nan  # the log-prob of an answer token a scoring could not reach


@dataclass
class Forced:
    """One answer scored teacher-forced on a server: per answer token, the server's log-prob
    of it and its own top-1 token there (`UNSCORED` and -1 where the scoring could not reach
    it, see `harness.pd.pd_teacher_forced`)."""

    logprobs: list[float]
    top1: list[int]

    def agreement(self, answer: Sequence[int]) -> list[bool]:
        """Per token: is the server's top-1 the answer's token (does not compound)."""
        return [int(a) == b for a, b in zip(answer, self.top1, strict=True)]


def logprob_gap(a: Sequence[Forced], b: Sequence[Forced], skip: int = 0) -> float:
    """Mean |log-prob difference| of two scorings of the same answers, over every answer's
    tokens from token `skip` on that both scored."""
    return statistics.mean(
        abs(x - y)
        for fa, fb in zip(a, b, strict=True)
        for x, y in zip(fa.logprobs[skip:], fb.logprobs[skip:], strict=True)
        if not (math.isnan(x) or math.isnan(y))
    )


def top1_share(forced: Sequence[Forced], answers: Sequence[Sequence[int]], skip: int = 0) -> float:
    """Share of the answers' tokens (from token `skip` on, those scored) that are the
    scoring's top-1."""
    hits = [h for f, a in zip(forced, answers, strict=True)
            for h, t in zip(f.agreement(a)[skip:], f.top1[skip:], strict=True) if t >= 0]  # fmt: skip
    return sum(hits) / len(hits)


def teacher_forced(server: HTTPServer, prompt: Sequence[int], answer: Sequence[int]) -> Forced:
    """Score `answer` after `prompt` (token ids) on `server` in one prefill: ``input_ids`` =
    prompt + answer, ``logprob_start_len`` = len(prompt) - 1 (SGLang gives no log-prob at that
    first position). With log-probs asked, SGLang reuses its cache only up to that start, so a
    compacted prefix shorter than the prompt is read as it would be by a plain request."""
    if not answer:
        return Forced([], [])
    out = server.post("/generate", {
        "input_ids": [*prompt, *answer], "return_logprob": True, "top_logprobs_num": 1,
        "logprob_start_len": len(prompt) - 1,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    })  # fmt: skip
    meta = out["meta_info"]
    lps = meta["input_token_logprobs"][-len(answer) :]
    tops = meta["input_top_logprobs"][-len(answer) :]
    if len(lps) != len(answer) or len(tops) != len(answer):
        raise RuntimeError(f"{len(lps)} log-probs for {len(answer)} answer tokens")
    return Forced([float(x[0]) for x in lps], [int(t[0][1]) for t in tops])
