"""The picklable request and result of one compaction (they cross the Ray boundary)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from compactor.spec import DEFAULT_AUTO_RATIO, HEAD_BUDGET_CHOICES, CompactionSpec, SpecError
from compactor.spec.limits import WorkLimits
from compactor.types import CompactedPrefix, prefix_hash
from compactor.workers.errors import InvalidRequest

__all__ = [
    "DEFAULT_AUTO_RATIO",
    "HEAD_BUDGET_CHOICES",
    "KV_DTYPE_CHOICES",
    "CompactJob",
    "JobResult",
    "safe_log_id",
]

# spec.head_budgets a request may ask for: HEAD_BUDGET_CHOICES (uniform, or the worker
# model's sensitivity curves); file paths are not accepted.
# Result keys/values dtypes a request may ask for ("" = float32, as computed).
KV_DTYPE_CHOICES: tuple[str, ...] = ("", "float16", "bfloat16")
# The longest client-given id (request_id) written to a log as is; longer ones are cut.
LOG_ID_CHARS = 64


def safe_log_id(text: str, limit: int = LOG_ID_CHARS) -> str:
    """A client-given id (request_id) fit for a log line: printable ASCII without whitespace
    (any other character becomes "?"), cut to `limit` characters ("..." marks a cut)."""
    out = "".join(
        c if c.isascii() and c.isprintable() and not c.isspace() else "?" for c in text[:limit]
    )
    return out + "..." if len(text) > limit else out


@dataclass(frozen=True)
class CompactJob:
    """One compaction request, already decoded from the wire.

    `spec` has its budget set (budget "auto" is resolved to a ratio before the job is
    built) or a `target_error` (the worker chooses the ratio). `follow_ups` are the token sequences of the ``follow-up`` query source: hints
    the request that starts a compaction brings, not part of :meth:`key`, so requests for
    the same prefix with other follow-ups (another replica's questions) share its result.
    `request_id` is for logs only (written through :func:`safe_log_id`: it is the client's) and
    is not part of :meth:`key` either. `kv_dtype` is the dtype
    the service casts the result's keys/values to before encoding (one of
    KV_DTYPE_CHOICES; "" = float32, as computed); the worker ignores it. `fit_round` is 0
    for a prefix's first fit and n for its n-th refit on more follow-ups: part of
    :meth:`key` when > 0, so a refit is not answered with the cached first fit. `tenant`
    is who asked (the service fills it from the caller's mTLS identity): part of :meth:`key`
    when set, so one tenant never shares a result, a compaction in flight or a cache hit with
    another, and nothing one tenant sends changes what another gets.
    """

    model_fingerprint: str
    token_ids: tuple[int, ...]
    spec: CompactionSpec
    follow_ups: tuple[tuple[int, ...], ...] = ()
    request_id: str = ""
    kv_dtype: str = ""
    fit_round: int = 0
    tenant: str = ""

    def key(self) -> str:
        """Identity of the result: what determines it, i.e. the model, the prefix tokens, the
        spec (method, budget, query policy, ...), the kv dtype, the fit round and the tenant;
        not the follow-ups."""
        ident: dict[str, object] = {
            "model": self.model_fingerprint,
            "prefix": prefix_hash(self.token_ids),
            "spec": self.spec.key(),
        }
        if self.kv_dtype:  # absent for float32: keys of float32 results stay as they were
            ident["kv_dtype"] = self.kv_dtype
        if self.fit_round:  # absent for first fits: their keys stay as they were
            ident["fit_round"] = self.fit_round
        if self.tenant:  # absent without an identity: keys stay as they were
            ident["tenant"] = self.tenant
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def check_spec(
        spec: CompactionSpec, limits: WorkLimits | None = None, prefix_tokens: int | None = None
    ) -> None:
        """The service's policy on a spec, before any work: the work caps of `limits`
        (default: `WorkLimits()`'s) and the method parameters a request may set, bounded by
        `prefix_tokens` when given; then ``spec.validate()`` (builds the method), and head
        budgets only "uniform" / "auto" (no file paths). Raises a ValueError (SpecError for
        the spec's own checks) naming the field."""
        (limits or WorkLimits()).check_spec(spec, prefix_tokens)  # a ValueError naming the field
        spec.validate()
        if spec.head_budgets not in HEAD_BUDGET_CHOICES:
            raise SpecError(
                f"head_budgets must be one of {list(HEAD_BUDGET_CHOICES)}, got "
                f"{spec.head_budgets!r}",
                "head_budgets",
            )

    def validate(
        self,
        max_prefix_tokens: int,
        vocab_size: int | None = None,
        limits: WorkLimits | None = None,
    ) -> None:
        """Raise InvalidRequest naming the first problem (builds the method to check it);
        `limits` caps the work asked (default: `WorkLimits()`'s)."""
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
        if any(not f for f in self.follow_ups):
            raise InvalidRequest("a follow-up token sequence is empty")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise InvalidRequest(
                f"kv_dtype must be one of {['float32', *KV_DTYPE_CHOICES[1:]]}, got "
                f"{self.kv_dtype!r}"
            )
        limits = limits or WorkLimits()
        try:
            self.check_spec(self.spec, limits, n)
            limits.check_follow_ups(self.follow_ups)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if self.spec.is_auto:
            raise InvalidRequest("give exactly one of ratio and tokens, or a target_error")
        if "follow-up" in self.spec.queries.sources and not self.follow_ups:
            raise InvalidRequest("query source 'follow-up' needs follow-up token sequences")


@dataclass(frozen=True)
class JobResult:
    """A finished compaction: the prefix plus where and how long it ran."""

    prefix: CompactedPrefix
    worker: str
    compute_seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
