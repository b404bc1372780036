"""Evaluation of compacted prefixes on held-out future queries (see harness and metrics)."""

from compactor.attention_metrics import AttentionErrors, attention_errors
from compactor.eval.harness import EvalCase, Reference, build_reference, evaluate_prefix, summarize

__all__ = [
    "AttentionErrors",
    "EvalCase",
    "Reference",
    "attention_errors",
    "build_reference",
    "evaluate_prefix",
    "summarize",
]
