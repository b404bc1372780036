"""The picklable request and result of one compaction (they cross the Ray boundary)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compactor.types import CompactedPrefix, prefix_hash

if TYPE_CHECKING:
    from compactor.queries import QueryConfig
from compactor.workers.errors import InvalidRequest

__all__ = [
    "DEFAULT_AUTO_RATIO",
    "DEFAULT_QUERY_SOURCES",
    "HEAD_BUDGET_CHOICES",
    "MAX_FOLLOW_UP_ANSWER_TOKENS",
    "CompactJob",
    "JobResult",
]

# Budget "auto" maps to this ratio until GVote's automatic budget is wired in.
DEFAULT_AUTO_RATIO = 0.1
DEFAULT_QUERY_SOURCES: tuple[str, ...] = ("repeat-prefill",)
# method_params["head_budgets"] (not a method field): uniform, or the worker model's
# sensitivity curves (compact_prefix(head_budgets="auto")); file paths are not accepted.
HEAD_BUDGET_CHOICES: tuple[str, ...] = ("uniform", "auto")
# Bound on generated answer tokens per follow-up (work the request may ask of a worker).
MAX_FOLLOW_UP_ANSWER_TOKENS = 256


@dataclass(frozen=True)
class CompactJob:
    """One compaction request, already decoded from the wire.

    Exactly one of `ratio` / `tokens` is set (budget "auto" is resolved to a ratio before
    the job is built). `request_id` is for logs only and is not part of :meth:`key`.
    `method_params` may hold ``"head_budgets"``: one of HEAD_BUDGET_CHOICES (see
    :meth:`split_params`); it is part of :meth:`key`. `on_policy` and
    `follow_up_answer_tokens` are the query options of ``compact_prefix`` /
    ``QueryConfig``.
    """

    model_fingerprint: str
    token_ids: tuple[int, ...]
    method: str
    method_params: dict[str, Any] = field(default_factory=dict)
    ratio: float | None = DEFAULT_AUTO_RATIO
    tokens: int | None = None
    query_sources: tuple[str, ...] = DEFAULT_QUERY_SOURCES
    follow_ups: tuple[tuple[int, ...], ...] = ()
    on_policy: bool = False
    follow_up_answer_tokens: int = 0
    request_id: str = ""

    def split_params(self) -> tuple[dict[str, Any], str]:
        """(the method's own hyper-parameters, the head-budget choice, default "uniform")."""
        params = dict(self.method_params)
        return params, str(params.pop("head_budgets", "uniform"))

    def query_config(self) -> QueryConfig:
        """The pipeline's QueryConfig for this job (ValueError if a source is unknown)."""
        from compactor.queries import QueryConfig

        return QueryConfig(
            sources=tuple(self.query_sources),
            follow_up_answer_tokens=self.follow_up_answer_tokens,
        )

    def key(self) -> str:
        """Identity of the result: (model, prefix hash, method, every parameter)."""
        ident = {
            "model": self.model_fingerprint,
            "prefix": prefix_hash(self.token_ids),
            "method": self.method,
            "params": self.method_params,
            "ratio": self.ratio,
            "tokens": self.tokens,
            "sources": list(self.query_sources),
            "follow_ups": [prefix_hash(f) for f in self.follow_ups],
        }
        if self.on_policy or self.follow_up_answer_tokens:  # absent = the keys of before
            ident["on_policy"] = self.on_policy
            ident["follow_up_answer_tokens"] = self.follow_up_answer_tokens
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def validate(self, max_prefix_tokens: int, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first problem (builds the method to check it)."""
        from compactor.methods import get_method

        n = len(self.token_ids)
        if n < 2:
            raise InvalidRequest(f"prefix must have at least 2 tokens, got {n}")
        if n > max_prefix_tokens:
            raise InvalidRequest(
                f"prefix has {n} tokens; this server's limit is {max_prefix_tokens}"
            )
        for seq in (self.token_ids, *self.follow_ups):
            if seq and (min(seq) < 0 or (vocab_size is not None and max(seq) >= vocab_size)):
                raise InvalidRequest(f"token id outside [0, vocab_size={vocab_size})")
        if (self.ratio is None) == (self.tokens is None):
            raise InvalidRequest("give exactly one of ratio and tokens")
        if self.ratio is not None and not 0 < self.ratio <= 1:
            raise InvalidRequest(f"ratio must be in (0, 1], got {self.ratio}")
        if self.tokens is not None and self.tokens < 1:
            raise InvalidRequest(f"tokens must be >= 1, got {self.tokens}")
        if any(not f for f in self.follow_ups):
            raise InvalidRequest("a follow-up token sequence is empty")
        if "follow-up" in self.query_sources and not self.follow_ups:
            raise InvalidRequest("query source 'follow-up' needs follow-up token sequences")
        if not 0 <= self.follow_up_answer_tokens <= MAX_FOLLOW_UP_ANSWER_TOKENS:
            raise InvalidRequest(
                f"follow_up_answer_tokens must be in [0, {MAX_FOLLOW_UP_ANSWER_TOKENS}], got "
                f"{self.follow_up_answer_tokens}"
            )
        params, head_budgets = self.split_params()
        if head_budgets not in HEAD_BUDGET_CHOICES:
            raise InvalidRequest(
                f"method_params.head_budgets must be one of {list(HEAD_BUDGET_CHOICES)}, "
                f"got {self.method_params['head_budgets']!r}"
            )
        try:
            json.dumps(self.method_params)
            self.query_config()
            get_method(self.method, **params)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(str(exc)) from None


@dataclass(frozen=True)
class JobResult:
    """A finished compaction: the prefix plus where and how long it ran."""

    prefix: CompactedPrefix
    worker: str
    compute_seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
