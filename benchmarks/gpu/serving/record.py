"""The GPU serving run's result record (benchmarks/results/gpu_serving.json) and its plot."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DECODE_STEP_BOUND", "GpuServingResult", "plot_result"]

# the compacted decode step at 64 requests over stock's, at most (under CUDA graphs; the rest of
# the model alone is about 0.23 of stock's step on the 32k workload)
DECODE_STEP_BOUND = 0.35


@dataclass
class GpuServingResult:
    """benchmarks/results/gpu_serving.json: the issue's GPU done-when figures.

    idle_plugin_throughput_ratio: plugin loaded, nothing compacted, over stock (decode
    tokens/s); identity_outputs_equal: keep-only at ratio 1 (every key, beta 0) gives stock's
    greedy tokens (SmolLM2); prefix_slots_ratio: KV slots held by the 32k prefix, stock over
    compacted (SGLang's pool counters); decode_step_ratio: compacted over stock, 64 requests.
    None where a phase did not run; `details` holds each phase's raw readings.
    """

    device: str
    backend: str | None = None
    cuda_graphs: bool | None = None
    idle_plugin_throughput_ratio: float | None = None
    identity_outputs_equal: bool | None = None
    prefix_slots_ratio: float | None = None
    decode_step_ratio: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def checks(self) -> dict[str, bool | None]:
        """Each done-when bound: True / False, None when not measured."""

        def bound(v: float | None, ok: bool) -> bool | None:
            return None if v is None else ok

        ipt, psr, dsr = (
            self.idle_plugin_throughput_ratio,
            self.prefix_slots_ratio,
            self.decode_step_ratio,
        )
        return {
            "idle_within_3pct": bound(ipt, ipt is not None and ipt >= 0.97),
            "identity_equal": self.identity_outputs_equal,
            "prefix_slots_8x": bound(psr, psr is not None and psr >= 8.0),
            "decode_step_0.35x": bound(dsr, dsr is not None and dsr <= DECODE_STEP_BOUND),
            "flashinfer": None if self.backend is None else self.backend == "flashinfer",
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self) | {"checks": self.checks()}, indent=1) + "\n")

    @classmethod
    def merge(cls, device: str, parts: list[dict[str, Any]]) -> GpuServingResult:
        """One result from the phase records (later phases win on a shared key)."""
        res = cls(device=device)
        backends, graphs = [], []
        for part in parts:
            for key in ("idle_plugin_throughput_ratio", "identity_outputs_equal",
                        "prefix_slots_ratio", "decode_step_ratio"):  # fmt: skip
                if part.get(key) is not None:
                    setattr(res, key, part[key])
            backends += part.get("backends", [])
            graphs += part.get("cuda_graphs", [])
            res.details[part["phase"]] = part
        res.backend = (
            backends[0]
            if backends and len(set(backends)) == 1
            else (",".join(sorted(set(backends))) or None)
        )
        res.cuda_graphs = all(graphs) if graphs else None
        return res


def plot_result(res: GpuServingResult, path: Path) -> None:
    """Four panels, one per figure, each against its done-when bound (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("idle plugin / stock\ndecode tok/s", res.idle_plugin_throughput_ratio, 0.97),
        ("identity == stock\n(1 = equal)", None if res.identity_outputs_equal is None
         else float(res.identity_outputs_equal), 1.0),
        ("prefix KV slots\nstock / compacted", res.prefix_slots_ratio, 8.0),
        ("decode step\ncompacted / stock", res.decode_step_ratio, DECODE_STEP_BOUND),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.2))
    for ax, (label, value, bound) in zip(axes, panels):
        ax.bar([0], [0.0 if value is None else value], color="C0" if value is not None else "0.8")
        ax.axhline(bound, color="k", linestyle="--", linewidth=1)
        ax.set_xticks([])
        ax.set_title(label, fontsize=9)
        ax.text(0, 0, "n/a" if value is None else f"{value:.3g}", ha="center", va="bottom")
    fig.suptitle(
        f"SGLang + plugin on {res.device}: backend {res.backend}, CUDA graphs {res.cuda_graphs}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
