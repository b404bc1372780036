"""The compaction spec: every knob of one compaction, written out once.

:class:`CompactionSpec` is what ``compact_prefix`` runs, what a ``CompactJob`` carries, what
travels over gRPC (``CompactRequest.spec_json`` = :meth:`CompactionSpec.to_dict` as JSON),
what the ``compactor`` CLI and the SGLang plugin build from their flags
(:mod:`compactor.spec.cli_args` generates those flags from the field metadata here: each knob's
flag name and help text). Adding a knob = one field here (with its flag metadata) plus its use.

Importing this module imports no torch: the SGLang plugin reads it in SGLang's CLI process.
:meth:`CompactionSpec.validate` imports ``compactor.methods`` (lazily) to check the method.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from compactor.spec.fields import SpecError, is_int, is_number, knob, meta
from compactor.spec.query_config import DEFAULT_QUERY_SOURCES, QueryConfig

__all__ = [
    "AUTO_CHUNK_TOKENS",
    "DEFAULT_AUTO_RATIO",
    "HEAD_BUDGET_CHOICES",
    "TARGET_ERROR_RATIOS",
    "CompactionSpec",
    "SpecError",
    "parse_chunk_tokens",
    "spec_fields",
]

# Budget "auto" of a service request (no ratio, tokens or target_error) maps to this ratio
# (`compactor serve --auto-ratio`). A budget chosen by measured error is asked for with
# target_error (compactor.pipeline.target): such a spec is not auto and keeps its ratio (the
# ceiling) or none (the whole candidate grid).
DEFAULT_AUTO_RATIO = 0.1
# Named head-budget choices; any other string is a sensitivity-curves JSON path.
HEAD_BUDGET_CHOICES: tuple[str, ...] = ("uniform", "auto")
# Candidate ratios of a budget chosen by measured error (``target_error``), ascending; a
# spec's ratio, when set with it, is the ceiling (see CompactionSpec.candidate_ratios).
TARGET_ERROR_RATIOS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)
# The service compacts a prefix longer than this, whose spec sets no chunk_size, in KV
# chunks of this many tokens (``compactor.service.engine.auto_chunk_size``; `compactor
# serve --auto-chunk-tokens`). A fit's cost grows faster than its chunk (NNLS and value
# solves on t = ratio x chunk kept keys, OMP re-reading every key per step), so chunks keep it
# linear in T. benchmarks/offline/chunk_quality.py (SmolLM2, am-highest, ratio 0.1): 2 x 4096 at 8k
# kept the attention error within 7% and the logppl gap and agreement no worse than one
# chunk; 2048 at 4k cost 15% attention error (benchmarks/results/chunk_quality.json).
AUTO_CHUNK_TOKENS = 4096


def parse_chunk_tokens(text: str) -> int | None:
    """An auto-chunk limit as typed: a token count >= 64, or 'none' (None: one chunk).

    Raises ValueError naming the text otherwise."""
    if text.strip().lower() == "none":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 64:
        raise ValueError(f"expected a token count >= 64 or 'none', got {text!r}")
    return n


@dataclass(frozen=True)
class CompactionSpec:
    """Everything that decides what one compaction computes (the prefix and follow-ups aside).

    Attributes:
        method: a registered method name (``compactor.methods.list_methods``).
        method_params: the method's hyper-parameters (JSON-able).
        ratio / tokens: per-KV-head budget t = round(ratio * T) or `tokens`, sinks included,
            clamped to [s+1, T]. At most one; both None (and no `target_error`) = "auto",
            which the compaction service resolves to its auto ratio (``compact_prefix``
            needs a budget).
        target_error: choose the ratio by measured error: the smallest candidate ratio
            (:meth:`candidate_ratios`: ``TARGET_ERROR_RATIOS`` below `ratio`, then `ratio`
            itself, the ceiling; the whole grid when `ratio` is None) whose held-out
            attention-output error is <= this (``compactor.pipeline.target``). `tokens`
            must then be None. None = the fixed budget.
        queries: the reference queries (sources and their settings).
        on_policy: compact layers in order; queries for layer l are drawn with layers < l
            already compacted.
        keep_sink_tokens: the first s tokens are kept verbatim with beta 0.
        chunk_size: compact the non-sink KV in chunks of this many tokens (None: one chunk).
        head_budgets: "uniform", "auto" (the model's sensitivity curves for the method) or a
            sensitivity-curves JSON path (see ``compactor.head_budgets.curves``).
    """

    # The defaults (method kvzip, repeat-prefill queries, off-policy) were chosen
    # on the RULER-style dev seeds and reported on the held-out ones (benchmarks/offline/ruler.py;
    # the "defaults" table of docs/results.md). Dev, query-agnostic, 10x: am-omp-fast with
    # repeat-prefill + self-study at 2048 kept no needle, kvzip with those queries 0.29, kvzip
    # with repeat-prefill at 8192 0.86; held-out: 0.00 -> 0.71 (multi-query 0.00 -> 0.71).
    # The cap then went 8192 -> 16384 per head, above what repeat-prefill yields for any prefix
    # the embedded model can repeat (G x T: ~12k at 4k tokens; none dropped at random), on the
    # ~4k-token items where the reservoir lost kvzip the keys of dropped readers (the "~4k"
    # table of docs/results.md). The source then went repeat-prefill -> repeat-turn
    # (compactor.spec.query_config.DEFAULT_QUERY_SOURCES).
    method: str = knob("kvzip", "method", "registered compaction method name", "str")
    method_params: dict[str, Any] = field(
        default_factory=dict,
        metadata=meta("param", "method hyper-parameter (repeatable)", "params", metavar="KEY=JSON"),
    )
    ratio: float | None = knob(None, "ratio", "kept fraction per KV head, e.g. 0.1", "ratio")
    tokens: int | None = knob(None, "tokens", "kept entries per KV head", "tokens")
    target_error: float | None = knob(
        None,
        "target-error",
        "choose the ratio by measured error: the smallest of "
        f"{', '.join(map(str, TARGET_ERROR_RATIOS))} (those below --ratio, then --ratio, "
        "the ceiling) whose held-out relative attention-output error is <= this, e.g. 0.1",
        "float",
    )
    queries: QueryConfig = field(
        default_factory=QueryConfig, metadata=meta("", "reference queries", "group")
    )
    on_policy: bool = knob(
        False, "on-policy", "draw layer l's queries with layers < l compacted", "bool"
    )
    keep_sink_tokens: int = knob(
        4, "keep-sink-tokens", "first tokens kept uncompacted (beta 0)", "int"
    )
    chunk_size: int | None = knob(
        None, "chunk-size", "compact the KV in chunks of this many tokens", "opt_int"
    )
    head_budgets: str = knob(
        "uniform",
        "head-budgets",
        "per-head budgets: uniform; auto = the model's sensitivity curves (made by "
        "`compactor sensitivity`); or a curves JSON path. Same total either way",
        "str",
        metavar="uniform|auto|PATH",
    )

    def __hash__(self) -> int:
        return hash(self.key())

    # ---- checks ------------------------------------------------------------------------
    def validate(self, check_method: bool = True) -> None:
        """Raise SpecError (a ValueError naming the field and value) for the first bad knob.

        With `check_method`, the method is built (``compactor.methods.get_method``, imported
        here) to check its name and parameters.
        """
        if not isinstance(self.method, str) or not self.method:
            raise SpecError(f"method must be a non-empty name, got {self.method!r}", "method")
        if not isinstance(self.method_params, dict) or not all(
            isinstance(k, str) for k in self.method_params
        ):
            raise SpecError(
                f"method_params must be an object with string keys, got {self.method_params!r}",
                "method_params",
            )
        try:
            json.dumps(self.method_params)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"method_params is not JSON-able: {exc}", "method_params") from None
        if self.ratio is not None and not (
            is_number(self.ratio) and math.isfinite(self.ratio) and 0 < self.ratio <= 1
        ):
            raise SpecError(f"ratio must be in (0, 1], got {self.ratio!r}", "ratio")
        if self.tokens is not None and not (is_int(self.tokens) and self.tokens >= 1):
            raise SpecError(f"tokens must be an int >= 1, got {self.tokens!r}", "tokens")
        if self.ratio is not None and self.tokens is not None:
            raise SpecError(
                f"give exactly one of ratio ({self.ratio}) and tokens ({self.tokens})", "ratio"
            )
        if self.target_error is not None:
            te = self.target_error
            if not (is_number(te) and math.isfinite(te) and te > 0):
                raise SpecError(f"target_error must be a number > 0, got {te!r}", "target_error")
            if self.tokens is not None:
                raise SpecError(
                    f"target_error ({te}) chooses a ratio: give no tokens ({self.tokens}); "
                    "a ratio, if given, is the ceiling",
                    "target_error",
                )
        if not isinstance(self.queries, QueryConfig):
            raise SpecError(f"queries must be a QueryConfig, got {self.queries!r}", "queries")
        self.queries.validate()
        if not isinstance(self.on_policy, bool):
            raise SpecError(f"on_policy must be true or false, got {self.on_policy!r}", "on_policy")
        if not is_int(self.keep_sink_tokens) or self.keep_sink_tokens < 0:
            raise SpecError(
                f"keep_sink_tokens must be >= 0, got {self.keep_sink_tokens!r}", "keep_sink_tokens"
            )
        if self.chunk_size is not None and not (is_int(self.chunk_size) and self.chunk_size >= 1):
            raise SpecError(f"chunk_size must be >= 1, got {self.chunk_size!r}", "chunk_size")
        if not isinstance(self.head_budgets, str) or not self.head_budgets:
            raise SpecError(
                f"head_budgets must be uniform, auto or a curves path, got {self.head_budgets!r}",
                "head_budgets",
            )
        if check_method:
            self._check_method()

    def _check_method(self) -> None:
        from compactor.methods import get_method, list_methods

        try:
            get_method(self.method, **self.method_params)
        except (TypeError, ValueError) as exc:
            names = list_methods()
            if self.method not in names:
                raise SpecError(
                    f"unknown method {self.method!r}; available: {', '.join(names)}", "method"
                ) from None
            raise SpecError(str(exc), "method_params") from None

    # ---- budget ------------------------------------------------------------------------
    @property
    def is_auto(self) -> bool:
        """True when neither ratio, tokens nor target_error is set (the service's auto budget)."""
        return self.ratio is None and self.tokens is None and self.target_error is None

    def candidate_ratios(self) -> tuple[float, ...]:
        """The ratios a `target_error` spec tries, ascending: ``TARGET_ERROR_RATIOS`` below
        `ratio` then `ratio` (the ceiling), or the whole grid when `ratio` is None.

        Raises SpecError when `target_error` is not set.
        """
        if self.target_error is None:
            raise SpecError("candidate_ratios needs target_error", "target_error")
        if self.ratio is None:
            return TARGET_ERROR_RATIOS
        return (*(r for r in TARGET_ERROR_RATIOS if r < self.ratio), self.ratio)

    def with_budget(self, ratio: float | None = None, tokens: int | None = None) -> CompactionSpec:
        """This spec with the budget replaced (both None = auto)."""
        return dataclasses.replace(self, ratio=ratio, tokens=tokens)

    def resolve_auto(self, auto_ratio: float) -> CompactionSpec:
        """This spec, with `auto_ratio` as its ratio when its budget is auto."""
        return self.with_budget(ratio=auto_ratio) if self.is_auto else self

    def sink_tokens(self, T: int) -> int:
        """s: the sink tokens kept verbatim in a T-token prefix (at most T - 1)."""
        return min(self.keep_sink_tokens, T - 1)

    def budget_per_head(self, T: int, sinks: int) -> int:
        """t: kept entries per KV head (sinks included) in a T-token prefix, in [sinks+1, T].

        Raises ValueError when the budget is still auto (or, with target_error and no ratio,
        not chosen yet: ``compact_prefix`` chooses it).
        """
        if self.ratio is None and self.tokens is None:
            raise SpecError(
                "give exactly one of ratio and tokens (budget 'auto' is resolved by the "
                "compaction service, a target_error budget by compact_prefix)",
                "ratio",
            )
        raw = round(self.ratio * T) if self.ratio is not None else int(self.tokens or 0)
        return min(T, max(sinks + 1, raw))

    def result_budget(self, T: int) -> int | None:
        """The per-head budget t that bounds a result for a T-token prefix (at most
        L * H_kv * min(T, 2t) entries in all, see ``compactor.service.convert.max_result_bytes``):
        the spec's own, or its ratio ceiling with a target_error; None when the service picks
        it (budget auto) or the method does (``own_budget``)."""
        from compactor.methods import method_class

        if (self.ratio is None and self.tokens is None) or method_class(self.method).own_budget:
            return None
        return self.budget_per_head(T, self.keep_sink_tokens)

    # ---- derived specs -----------------------------------------------------------------
    def replace(self, **changes: Any) -> CompactionSpec:
        """``dataclasses.replace``; ``queries=`` may be a dict of QueryConfig changes."""
        q = changes.get("queries")
        if isinstance(q, dict):
            changes["queries"] = dataclasses.replace(self.queries, **q)
        return dataclasses.replace(self, **changes)

    def for_follow_ups(self, follow_ups: Sequence[Sequence[int]]) -> CompactionSpec:
        """The spec for a prefix that arrives with `follow_ups`: without the ``follow-up``
        source when there are none (``DEFAULT_QUERY_SOURCES`` when no source is left)."""
        if follow_ups or "follow-up" not in self.queries.sources:
            return self
        sources = tuple(s for s in self.queries.sources if s != "follow-up")
        return self.replace(queries={"sources": sources or DEFAULT_QUERY_SOURCES})

    # ---- serialization -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (tuples become lists); :meth:`from_dict` inverts it."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["method_params"] = dict(self.method_params)
        if d["target_error"] is None:  # absent when unset: keys and wire JSON stay as before
            del d["target_error"]
        d["queries"] = {
            f.name: list(v) if isinstance(v := getattr(self.queries, f.name), tuple) else v
            for f in dataclasses.fields(QueryConfig)
        }
        return d

    @classmethod
    def from_dict(cls, data: Any) -> CompactionSpec:
        """Build from :meth:`to_dict` output (missing keys take defaults).

        Raises SpecError for unknown keys, a non-object, or a bad query setting; the other
        values are checked by :meth:`validate`.
        """
        if not isinstance(data, dict):
            raise SpecError(f"a spec must be a JSON object, got {type(data).__name__}")
        d = dict(data)
        _reject_unknown(d, {f.name for f in dataclasses.fields(cls)}, "")
        if "queries" in d:
            q = d["queries"]
            if not isinstance(q, dict):
                raise SpecError(f"queries must be an object, got {q!r}", "queries")
            _reject_unknown(q, {f.name for f in dataclasses.fields(QueryConfig)}, "queries.")
            try:
                d["queries"] = QueryConfig(**q)
            except TypeError as exc:  # a value of the wrong shape for a field
                raise SpecError(str(exc), "queries") from None
        return cls(**d)

    def key(self) -> str:
        """Stable identity: the canonical JSON of :meth:`to_dict` (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def spec_fields() -> list[tuple[str, dataclasses.Field[Any]]]:
    """(dotted path, field) of every knob, QueryConfig's as ``queries.<name>``, in order."""
    out: list[tuple[str, dataclasses.Field[Any]]] = []
    for f in dataclasses.fields(CompactionSpec):
        if f.name == "queries":
            out.extend((f"queries.{q.name}", q) for q in dataclasses.fields(QueryConfig))
        else:
            out.append((f.name, f))
    return out


def _reject_unknown(d: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise SpecError(
            f"unknown spec key(s) {[where + k for k in unknown]}; known: {sorted(known)}",
            where + unknown[0],
        )
