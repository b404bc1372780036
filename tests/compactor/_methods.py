"""Two compaction methods for tests, registered on import: `test-identity` (every key, beta
0) and `test-first` (the first t keys)."""

from __future__ import annotations

import dataclasses

import torch

from compactor.methods import CompactionMethod, LayerInput, MethodResult, register_method
from compactor.types import CompactedLayer


@register_method("test-identity")
@dataclasses.dataclass
class _Identity(CompactionMethod):
    """Keeps every key (budget ignored), beta 0: the identity compaction."""

    def compact(self, x: LayerInput) -> MethodResult:
        H, T, _ = x.keys.shape
        indptr = torch.arange(0, H * T + 1, T, dtype=torch.int32)
        layer = CompactedLayer(
            x.keys.reshape(H * T, -1),
            x.values.reshape(H * T, -1),
            torch.zeros(H * T),
            indptr,
            torch.arange(T).repeat(H),
        )
        return MethodResult(layer, {})


@register_method("test-first")
@dataclasses.dataclass
class _First(CompactionMethod):
    """Keeps the first budget keys of each head with beta = 0.5."""

    def compact(self, x: LayerInput) -> MethodResult:
        H, _, D = x.keys.shape
        t = x.budgets[0]
        indptr = torch.arange(0, H * t + 1, t, dtype=torch.int32)
        layer = CompactedLayer(
            x.keys[:, :t].reshape(-1, D),
            x.values[:, :t].reshape(-1, D),
            torch.full((H * t,), 0.5),
            indptr,
            torch.arange(t).repeat(H),
        )
        return MethodResult(layer, {})
