"""The most work one compaction request may ask of a worker (the service's caps).

A spec is the client's to choose, so every knob that scales a worker's work has a ceiling
here: the number of reference queries, generated tokens, prompts, follow-ups and their
lengths, solver iterations, and how finely the KV may be chunked; and every method parameter
a request may set has its type and bounds (`compactor.spec.method_limits`). A request over a cap is
refused before any work is queued (a ValueError naming the field, its value and the cap,
which the service answers with INVALID_ARGUMENT).
Each cap is a `compactor serve --max-*` / `--min-*` flag (generated from the fields below) and
is reported by GetModelInfo (`limits`). Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compactor.spec.fields import SpecError
from compactor.spec.method_limits import Caps, check_method_params
from compactor.spec.query_config import MAX_QUERIES_PER_HEAD

if TYPE_CHECKING:
    from compactor.spec.compaction import CompactionSpec

__all__ = ["MAX_QUEUE", "MAX_REQUESTS_PER_TENANT", "WorkLimits"]

# Compactions that may wait for a worker (`compactor serve --max-queue`), and the requests
# one caller may have in progress (`--max-requests-per-tenant`): a quarter of the queue, so
# no caller fills it alone (without mTLS every caller is the one tenant "").
MAX_QUEUE = 64
MAX_REQUESTS_PER_TENANT = MAX_QUEUE // 4


def _cap(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class WorkLimits:
    """Caps on one request's work; `check_spec` and `check_follow_ups` raise ValueError
    at the first one over."""

    max_queries: int = _cap(
        MAX_QUERIES_PER_HEAD, "reference queries kept per KV head (queries.max_queries_per_head)"
    )
    max_random_queries: int = _cap(8192, "queries of the random source (queries.random_count)")
    max_self_study_tokens: int = _cap(
        512, "tokens generated per self-study prompt (queries.self_study_tokens)"
    )
    max_self_study_prompts: int = _cap(16, "self-study prompts (queries.self_study_prompts)")
    max_follow_ups: int = _cap(64, "follow-up token sequences sent with one request")
    max_follow_up_tokens: int = _cap(4096, "tokens of one follow-up sequence")
    max_follow_up_answer_tokens: int = _cap(
        256, "answer tokens generated after each follow-up (queries.follow_up_answer_tokens)"
    )
    max_self_study_prompt_chars: int = _cap(
        4096, "characters of one self-study prompt (queries.self_study_prompts)"
    )
    max_method_iterations: int = _cap(
        64, "solver rounds a method parameter may ask for (method_params nnls_iters)"
    )
    min_chunk_tokens: int = _cap(256, "smallest KV chunk a spec may ask for (chunk_size)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WorkLimits.{f.name} must be an int >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        """Name -> cap (what GetModelInfo reports)."""
        return {f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def check_spec(self, spec: CompactionSpec, prefix_tokens: int | None = None) -> None:
        """Raise SpecError (a ValueError) naming the field of the first cap `spec` asks more
        than, or of the first method parameter a request may not set as it does
        (`method_limits`: bounds against `prefix_tokens`, unbounded by the prefix when None)."""
        caps = Caps(prefix_tokens or 2**62, self.max_queries, self.max_method_iterations)
        check_method_params(spec.method, dict(spec.method_params), caps)
        q = spec.queries
        asked: list[tuple[str, str, int]] = [
            ("max_queries", "queries.max_queries_per_head", q.max_queries_per_head),
            ("max_random_queries", "queries.random_count", q.random_count),
            ("max_self_study_tokens", "queries.self_study_tokens", q.self_study_tokens),
            ("max_self_study_prompts", "queries.self_study_prompts", len(q.self_study_prompts)),
            ("max_follow_up_answer_tokens", "queries.follow_up_answer_tokens",
             q.follow_up_answer_tokens),
        ]  # fmt: skip
        longest = max(map(len, q.self_study_prompts), default=0)
        asked.append(("max_self_study_prompt_chars", "queries.self_study_prompts", longest))
        self._over(asked)
        if spec.chunk_size is not None and spec.chunk_size < self.min_chunk_tokens:
            raise SpecError(
                f"chunk_size = {spec.chunk_size} is under this server's limit "
                f"{self.min_chunk_tokens} (compactor serve --min-chunk-tokens)",
                "chunk_size",
            )

    def check_follow_ups(self, follow_ups: Sequence[Sequence[int]]) -> None:
        """Raise ValueError when there are more follow-ups, or a longer one, than allowed."""
        longest = max(map(len, follow_ups), default=0)
        self._over([("max_follow_ups", "follow_ups", len(follow_ups)),
                    ("max_follow_up_tokens", "follow_ups (longest)", longest)])  # fmt: skip

    def _over(self, asked: list[tuple[str, str, int]]) -> None:
        """A SpecError naming the spec field (a plain ValueError for follow-ups)."""
        for cap, name, value in asked:
            if value > getattr(self, cap):
                message = (
                    f"{name} = {value} is over this server's limit {getattr(self, cap)} "
                    f"(compactor serve --{cap.replace('_', '-')})"
                )
                if name.startswith("follow_ups"):
                    raise ValueError(message)
                raise SpecError(message, name)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One `--max-*` / `--min-*` flag per cap (default: the field's default)."""
        group = parser.add_argument_group("limits on one request's work")
        for f in dataclasses.fields(cls):
            group.add_argument(
                f"--{f.name.replace('_', '-')}", type=int, default=f.default, metavar="N",
                help=f"{f.metadata['help']} (default {f.default})",
            )  # fmt: skip

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> WorkLimits:
        """The caps a namespace of `add_cli_args` holds (ValueError names a bad one)."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
