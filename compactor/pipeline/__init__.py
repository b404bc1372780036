"""Compact one prefix end to end: prefill -> reference queries -> method per layer -> validate.

Shape legend: T prefix tokens, s sink tokens, t_h kept entries of KV head h (sinks
included), n reference queries, H_kv KV heads, D head dim.

`compact_prefix` (:mod:`.compact`) runs them. Stages (one module each): :mod:`.inputs` (prefill, query plan, off-policy queries, the
``reuse`` cache), :mod:`.budget_plan` (uniform / sensitivity / per-layer planned budgets per
layer and chunk), :mod:`.target` (``spec.target_error``: the ratio chosen by held-out
error, then a refit), :mod:`.layers` (the layer loop: chunks, sinks, on-policy stream),
:mod:`.timing` (StageTimes and the wall/CPU stopwatch).

Why per-block compaction is exact in structure (sinks and chunks): for one query q the
attention over the prefix splits over disjoint key blocks B_1..B_m as

    out(q) = sum_b M_b(q) * o_b(q) / sum_b M_b(q),   M_b(q) = sum_{j in B_b} exp(q.k_j*scale + beta_j)

with o_b the block's own softmax output. A compacted block that reproduces both its local
output o_b and its mass M_b reproduces the whole prefix (and, with the new tokens as one more
block, the whole attention). So sinks are kept verbatim (beta 0: their o and M are
untouched), and a long prefix can be cut into KV chunks that are compacted independently
(each fitted to the same reference queries, whose masses per chunk simply add) and
concatenated per head. Reference queries all come after the prefix (except the
``context-prefill`` source, which is not restricted per chunk: an approximation there).
"""

from compactor.pipeline.budget_plan import head_budget_curves, split_budget
from compactor.pipeline.compact import Hooks, compact_prefix
from compactor.pipeline.inputs import resolve_fingerprint
from compactor.pipeline.layers import assemble_layer
from compactor.pipeline.target import RatioChoice
from compactor.pipeline.timing import StageTimes

__all__ = [
    "Hooks",
    "RatioChoice",
    "StageTimes",
    "assemble_layer",
    "compact_prefix",
    "head_budget_curves",
    "resolve_fingerprint",
    "split_budget",
]
