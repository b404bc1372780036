"""`BudgetReport`: how many entries a compacted prefix kept, and how that budget was chosen.

Every "ratio" in this project is the kept fraction (0.1 keeps a tenth of the entries); how many
times smaller the prefix is, is `CompactedPrefix.times_smaller()`. A compaction asks for a
ratio or a token count per KV head (`CompactionSpec`); with a target error the ratio is chosen
by held-out error among candidates (`compactor.pipeline.target`), and some methods choose
their own (GVote). The report says what was asked and what was used, typed, beside the
prefix's `params` (what the method ran with).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BudgetReport"]


@dataclass(frozen=True)
class BudgetReport:
    """The budget of one compacted prefix.

    Attributes:
        ratio_asked: the spec's kept fraction (None: a token count was asked).
        tokens_asked: the spec's kept entries per KV head (None: a ratio was asked).
        ratio_chosen: the kept fraction a target-error search chose, or the mean of a
            method's own choices (GVote); None: the budget asked was used (`ratio_used`).
        budget_per_head: the entries per KV head of the uniform plan, sink tokens included.
        head_table: [L][H_kv] entries per head when they differ per head (sinks included);
            None: every head kept `budget_per_head`.
        head_source: where `head_table` came from (a sensitivity-curves file).
        target_error: the held-out error asked for (None: a fixed budget).
        estimated_error: the held-out error estimate at `ratio_chosen` (None: no target).
        search: the target-error search's record (candidates and their errors).
    """

    ratio_asked: float | None
    tokens_asked: int | None
    ratio_chosen: float | None
    budget_per_head: int
    head_table: list[list[int]] | None = None
    head_source: str | None = None
    target_error: float | None = None
    estimated_error: float | None = None
    search: dict[str, Any] | None = None

    @property
    def ratio_used(self) -> float | None:
        """The kept fraction the fit used: the one chosen, else the one asked (None: a token
        count was asked)."""
        return self.ratio_chosen if self.ratio_chosen is not None else self.ratio_asked

    @property
    def per_head(self) -> str:
        """ "uniform" or "sensitivity": whether the heads kept different counts."""
        return "uniform" if self.head_table is None else "sensitivity"

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able record (what a saved or sent prefix carries)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BudgetReport:
        """Rebuild from :meth:`as_dict`; ValueError naming a missing or unknown field."""
        if not isinstance(data, dict):
            raise ValueError(f"a budget report must be a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"budget report has unknown fields {unknown}")
        try:
            report = cls(**data)
        except TypeError as e:
            raise ValueError(f"budget report: {e}") from None
        report._check()
        return report

    def _check(self) -> None:
        """ValueError naming a field of the wrong type (a report is the sender's JSON)."""

        def number(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        def count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        checks = {
            "ratio_asked": self.ratio_asked is None or number(self.ratio_asked),
            "tokens_asked": self.tokens_asked is None or count(self.tokens_asked),
            "ratio_chosen": self.ratio_chosen is None or number(self.ratio_chosen),
            "budget_per_head": count(self.budget_per_head),
            "head_table": self.head_table is None
            or (
                isinstance(self.head_table, list)
                and all(isinstance(r, list) and all(count(x) for x in r) for r in self.head_table)
            ),
            "head_source": self.head_source is None or isinstance(self.head_source, str),
            "target_error": self.target_error is None or number(self.target_error),
            "estimated_error": self.estimated_error is None or number(self.estimated_error),
            "search": self.search is None or isinstance(self.search, dict),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"budget report fields of the wrong type: {bad}")
