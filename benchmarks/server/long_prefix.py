"""Long prefixes through the real service: time per phase and peak memory of `compactor serve`.

    nice -n 10 python -m benchmarks.server.long_prefix --tokens 8192 32768
    # writes benchmarks/results/long_prefix.json

For each T: a fresh `compactor serve --in-process --max-prefix-tokens T` (its own process, so
its peak RSS is this compaction's alone; the limit is raised to T because SmolLM2 has 8192
positions: past them RoPE still computes, quality is not the point here, memory and time
are) gets one Compact request over loopback gRPC for a T-token document with the plugin's
default policy (sglang_ext.config): method am-highest, ratio 0.1, on-policy, the follow-up
query source with the model's own 32-token answers to two questions. Reported per T: the
client's wall time, the worker's time per stage (prefill / queries / compaction), the service process's peak RSS (VmHWM from
/proc, and the highest RSS sampled every 0.25 s) and its RSS once warm (after a 256-token
warm-up request), against the KV bytes of the prefix (fp32: L x 2 x H_kv x T x D x 4) and
the result's bytes. The service picks the chunk size itself (`auto_chunk_size`: chunks
of 8192 tokens above 8192) unless --chunk-size is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import add_options
from harness.provenance import ROOT, provenance

__all__ = ["QUESTIONS", "document_ids", "peak_rss_bytes", "run_one"]

RESULT = ROOT / "benchmarks" / "results" / "long_prefix.json"
QUESTIONS = ("What is the first room?", "Who wrote the report?")
WARMUP_TOKENS = 256


def document_ids(tokenizer: Any, tokens: int) -> list[int]:
    """`tokens` token ids of the harness's synthetic document (repeated as needed)."""
    from harness.workload import document

    ids: list[int] = []
    index = 0
    while len(ids) < tokens:
        ids += tokenizer(document(400, index=index % 3), add_special_tokens=False)["input_ids"]
        index += 1
    return ids[:tokens]


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (the process's peak resident set) from /proc, in bytes; None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Sampler:
    """Highest RSS of a process tree, sampled every `period` s in a thread until stopped."""

    def __init__(self, pid: int, period: float = 0.25) -> None:
        self.pid, self.period, self.peak = pid, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.period)


def run_one(
    model: Path,
    tokens: int,
    method: str,
    ratio: float,
    chunk_size: int | None,
    workdir: Path,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One fresh service (extra environment `env`), one compaction of a `tokens`-token
    prefix; the figures of one row."""
    from transformers import AutoTokenizer

    from compactor.client import CompactorClient
    from compactor.models import fingerprint
    from compactor.service.engine import ModelSummary
    from compactor.spec import CompactionSpec, QueryConfig
    from harness.launch import CompactorService, start_all

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = document_ids(tok, tokens)
    follow_ups = [tok(f"\nQuestion: {q}\nAnswer:")["input_ids"] for q in QUESTIONS]
    spec = CompactionSpec(
        method=method,
        ratio=ratio,
        chunk_size=chunk_size,
        queries=QueryConfig(sources=("follow-up",), follow_up_answer_tokens=32),
        on_policy=True,
    )
    info = ModelSummary.read(model)
    kv_bytes = info.num_layers * 2 * info.num_kv_heads * tokens * info.head_dim * 4
    with contextlib.ExitStack() as stack:
        service = CompactorService(
            model,
            workdir / f"service_{tokens}.log",
            in_process=True,
            extra_args=["--max-prefix-tokens", str(tokens)],
            env=dict(env or {}),
        )
        start_all(stack, [service])
        pid = service.pid
        if pid is None:
            raise RuntimeError("the service has no pid")
        sampler = stack.enter_context(_Sampler(pid))
        with CompactorClient(service.endpoint) as client:
            # warm-up: the worker loads its model and torch its thread pools on a first job
            client.compact_prefix(ids[:WARMUP_TOKENS], fingerprint(model), spec, follow_ups)
            loaded = sampler.sample()
            print(f"T={tokens}: service warm (pid {pid}, RSS {loaded / 2**20:.0f} MiB)", flush=True)
            t0 = time.perf_counter()
            res = client.compact_prefix(ids, fingerprint(model), spec, follow_ups, timeout=7200)
            wall = time.perf_counter() - t0
        hwm = peak_rss_bytes(pid)
    prefix = res.prefix
    row = {
        "tokens": tokens,
        "method": method,
        "ratio": ratio,
        "chunk_size": prefix.params.get("chunk_size"),
        "wall_s": round(wall, 2),
        "compute_s": round(res.compute_seconds, 2),
        "stage_s": {k: round(v, 2) for k, v in res.stage_seconds.items()},
        "rss_loaded_bytes": loaded,
        "peak_rss_bytes": hwm,
        "peak_rss_sampled_bytes": sampler.peak,
        "growth_bytes": None if hwm is None else hwm - loaded,
        "kv_bytes": kv_bytes,
        "growth_over_kv": None if hwm is None else round((hwm - loaded) / kv_bytes, 2),
        "result_bytes": prefix.nbytes(),
        "kept_fraction": round(prefix.kept_fraction(), 4),
        "service_env": dict(env or {}),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    add_options(ap, method="am-highest", ratio=0.1)
    ap.add_argument("--chunk-size", type=int, default=None, help="default: the service's rule")
    ap.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the service (repeatable), e.g. MALLOC_MMAP_THRESHOLD_=1048576",
    )
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.service_env)

    from compactor.models import resolve_model

    model = Path(resolve_model(args.model))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in args.tokens:
            rows.append(run_one(model, t, args.method, args.ratio, args.chunk_size, Path(tmp), env))
            out = {"provenance": provenance(), "model": args.model, "rows": rows}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")  # after every row
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
