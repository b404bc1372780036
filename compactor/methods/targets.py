"""What a refit matches: the original layer's attention mass and outputs on the reference
queries (:class:`Targets`), computed lazily and in blocks.

Shape legend: T prefix tokens, n reference queries, H_kv KV heads, D head dim.

Memory: the [H_kv, n, T] fp32 mass features are never built beyond ``block_bytes`` at once
(:class:`Targets` works through blocks of heads and queries when they would not fit).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_BYTES", "CHUNK_BYTES", "Targets", "reference_targets"]

# Largest fp32 work block of logits / mass features (bytes): above it, heads and queries
# are processed in blocks.
BLOCK_BYTES = 2 << 30
# Work chunks of the streaming pass over the logits on the CPU (bytes): cache-sized.
CHUNK_BYTES = 8 << 20


class Targets:
    """What the compacted layer must reproduce, per KV head and reference query.

    Built from keys/values [H_kv, T, D] and queries [H_kv, n, D]; everything is computed on
    first use and then kept (nothing is mutated but this cache):

    * ``mass`` [H_kv, n] fp32: sum over T of phi (>= 1), ``rowmax`` [H_kv, n] fp32: m(q),
      ``out`` [H_kv, n, D] fp32 original attention outputs: one pass over cache-sized
      blocks of queries (no [H_kv, n, T] tensor is built);
    * ``key_rms()`` [H_kv, T]: RMS over the queries of each key's attention weight (in the
      same pass when asked first);
    * ``phi`` [H_kv, n, T] fp32 mass features exp(q K' s - rowmax) (in (0, 1]), and
      ``phi_heads(h0, h1)`` the rows of some heads: built on demand and kept when all of
      phi fits in ``block_bytes`` (else rebuilt per call: use blocks of
      ``heads_per_block()`` heads);
    * ``features(idx)`` [H_kv, n, t]: phi at the kept indices (from the kept keys unless
      phi is kept).
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        sm_scale: float,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes!r}")
        self.keys, self.values, self.queries = keys, values, queries
        self.sm_scale = float(sm_scale)
        self.block_bytes = int(block_bytes)
        self._phi: torch.Tensor | None = None
        self._stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._rms: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(H_kv, n, T)."""
        return (self.keys.shape[0], self.queries.shape[1], self.keys.shape[1])

    @property
    def mass(self) -> torch.Tensor:
        """[H_kv, n] fp32."""
        return self._stats_pass()[0]

    @property
    def rowmax(self) -> torch.Tensor:
        """[H_kv, n] fp32."""
        return self._stats_pass()[1]

    @property
    def out(self) -> torch.Tensor:
        """[H_kv, n, D] fp32."""
        return self._stats_pass()[2]

    def key_rms(self) -> torch.Tensor:
        """[H_kv, T] RMS over the reference queries of each key's attention weight."""
        if self._rms is None and self._phi is not None:
            sq = self._phi.new_zeros(self._phi.shape[0], self._phi.shape[2])
            for h0, h1, i0, i1 in self._chunks():
                attn = self._phi[h0:h1, i0:i1] / self.mass[h0:h1, i0:i1].unsqueeze(-1)
                sq[h0:h1] += attn.square_().sum(1)
            self._rms = sq.div_(self.shape[1]).sqrt_()
        return self._rms if self._rms is not None else self._stats_pass(want_rms=True)[3]

    @property
    def phi(self) -> torch.Tensor:
        """[H_kv, n, T] fp32, whatever its size (prefer :meth:`phi_heads` in blocks)."""
        return self.phi_heads(0, self.shape[0]) if self._phi is None else self._phi

    def heads_per_block(self) -> int:
        """How many heads' phi [n, T] fit in ``block_bytes`` (at least 1)."""
        _, n, T = self.shape
        return max(1, self.block_bytes // max(1, 4 * n * T))

    def phi_heads(self, h0: int, h1: int) -> torch.Tensor:
        """phi of heads h0..h1-1: [h1 - h0, n, T] fp32 (a view when phi is kept)."""
        H, n, T = self.shape
        if self._phi is None and 4 * H * n * T <= self.block_bytes:
            phi = self._logits(self.keys, self.queries)
            if self._stats is None:  # the stats come with it
                m = phi.amax(-1)
                phi.sub_(m.unsqueeze(-1)).exp_()
                s = phi.sum(-1)
                out = torch.bmm(phi, self.values.float()).div_(s.unsqueeze(-1))
                self._stats = (s, m, out)
            else:
                phi.sub_(self.rowmax.unsqueeze(-1)).exp_()
            self._phi = phi
        if self._phi is not None:
            return self._phi[h0:h1]
        phi = self._logits(self.keys[h0:h1], self.queries[h0:h1])
        return phi.sub_(self.rowmax[h0:h1].unsqueeze(-1)).exp_()

    def features(self, idx: torch.Tensor, h0: int = 0, h1: int | None = None) -> torch.Tensor:
        """phi of heads h0..h1-1 (default all) at the indices idx [h1 - h0, t] (padding: any
        valid index): [h1 - h0, n, t]."""
        h1 = self.shape[0] if h1 is None else h1
        if self._phi is not None:
            phi = self._phi[h0:h1]
            return torch.gather(phi, 2, idx.unsqueeze(1).expand(-1, phi.shape[1], -1))
        keys = self.keys[h0:h1]
        ck = torch.gather(keys, 1, idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1]))
        logits = self._logits(ck, self.queries[h0:h1])
        return logits.sub_(self.rowmax[h0:h1].unsqueeze(-1)).exp_()

    # ---- private -----------------------------------------------------------------------
    def _logits(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return torch.bmm(queries.float(), keys.float().transpose(1, 2)).mul_(self.sm_scale)

    def _chunks(self) -> list[tuple[int, int, int, int]]:
        """(h0, h1, i0, i1) blocks of heads x queries of at most block_bytes fp32 logits
        each, and at most CHUNK_BYTES (cache-sized) on the CPU; at least one query row."""
        H, n, T = self.shape
        limit = self.block_bytes
        if self.keys.device.type == "cpu":
            limit = min(limit, CHUNK_BYTES)
        rows = max(1, limit // max(1, 4 * T))
        hb, nb = (min(H, rows // n), n) if rows >= n else (1, rows)
        return [
            (h0, min(H, h0 + hb), i0, min(n, i0 + nb))
            for h0 in range(0, H, hb)
            for i0 in range(0, n, nb)
        ]

    def _stats_pass(
        self, want_rms: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mass, rowmax, out, key_rms) from one pass over :meth:`_chunks` (key_rms is
        computed only when asked, else it is an empty tensor)."""
        if self._stats is not None and (self._rms is not None or not want_rms):
            return (*self._stats, self._rms if self._rms is not None else self._stats[0][:0])
        H, n, T = self.shape
        dev = self.keys.device
        mass = torch.empty(H, n, device=dev)
        rowmax = torch.empty(H, n, device=dev)
        out = torch.empty(H, n, self.keys.shape[-1], device=dev)
        sq = torch.zeros(H, T, device=dev) if want_rms else None
        for h0, h1, i0, i1 in self._chunks():
            phi = self._logits(self.keys[h0:h1], self.queries[h0:h1, i0:i1])
            m = phi.amax(-1)
            phi.sub_(m.unsqueeze(-1)).exp_()
            s = phi.sum(-1)
            rowmax[h0:h1, i0:i1], mass[h0:h1, i0:i1] = m, s
            v = self.values[h0:h1].float()
            out[h0:h1, i0:i1] = torch.bmm(phi, v).div_(s.unsqueeze(-1))
            if sq is not None:
                sq[h0:h1] += phi.div_(s.unsqueeze(-1)).square_().sum(1)
        self._stats = (mass, rowmax, out)
        if sq is not None:
            self._rms = sq.div_(n).sqrt_()
        return self._stats_pass(want_rms)


def reference_targets(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    sm_scale: float,
    block_bytes: int = BLOCK_BYTES,
) -> Targets:
    """Targets of the original layer. keys/values [H_kv, T, D], queries [H_kv, n, D].

    Lazy: nothing is computed until a field is read (see :class:`Targets`).
    """
    return Targets(keys, values, queries, sm_scale, block_bytes)
