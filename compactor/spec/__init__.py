"""What a compaction computes, in one place (torch-free):

- `compaction`: `CompactionSpec` (method, budget, queries, chunking, head budgets), its
  validation and JSON form;
- `query_config`: `QueryConfig`, the reference queries' sources and sizes;
- `fields`: the field metadata every knob carries, and the errors that name a field;
- `limits`: `WorkLimits`, the caps on one request's work a service enforces;
- `cli_args`: the spec as command-line flags (the CLI and the SGLang plugin share them).

The names below are this package's surface; the modules import each other, never it.
"""

from compactor.spec.cli_args import (
    UsageError,
    add_field_args,
    add_spec_args,
    field_values,
    spec_flags,
    spec_from_args,
    usage_error,
)
from compactor.spec.compaction import (
    AUTO_CHUNK_TOKENS,
    DEFAULT_AUTO_RATIO,
    HEAD_BUDGET_CHOICES,
    TARGET_ERROR_RATIOS,
    CompactionSpec,
    parse_chunk_tokens,
    spec_fields,
)
from compactor.spec.fields import LabelledError, SpecError
from compactor.spec.limits import WorkLimits
from compactor.spec.query_config import QUERY_SOURCES, SELF_STUDY_PROMPTS, QueryConfig

__all__ = [
    "AUTO_CHUNK_TOKENS",
    "DEFAULT_AUTO_RATIO",
    "HEAD_BUDGET_CHOICES",
    "QUERY_SOURCES",
    "SELF_STUDY_PROMPTS",
    "TARGET_ERROR_RATIOS",
    "CompactionSpec",
    "LabelledError",
    "QueryConfig",
    "SpecError",
    "UsageError",
    "WorkLimits",
    "add_field_args",
    "add_spec_args",
    "field_values",
    "parse_chunk_tokens",
    "spec_fields",
    "spec_flags",
    "spec_from_args",
    "usage_error",
]
