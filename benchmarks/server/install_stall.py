"""Install stall: the decode-step (TPOT) spike while a compacted prefix installs.

    python -m benchmarks.server.install_stall [--chunk-mb 64,1] [--smoke]

On the embedded SmolLM2-135M model, CPU, with a real `compactor serve` (in-process workers
unless `--ray`). One SGLang server at a time (`SGLANG_LOG_MS=1`: log lines carry millisecond
wall-clock stamps), started with `--compaction-install-chunk-mb` C. Runs: "computed" (C = the
first `--chunk-mb`; the service computes the result on the cores the server decodes on), then
"cached" for every C (the same document on a fresh server: the service's cache answers, so
the install is not mixed with the compaction's compute). On each server:

1. warm-up: a short answer on another ~1.9k-token document (one hit: no compaction);
2. a long greedy streaming decode (`ignore_eos`) of an unrelated prompt; the client stamps
   every streamed chunk's arrival (`time.time()`, the clock the log uses);
3. after `--steady-s` seconds, two questions on the shared document (110 sentences, ~1.9k
   tokens), one after the other, `--trigger-tokens` each: the second hit sends the document
   to the service (`compaction requested` in the log) and the result is installed at the
   scheduler's poll point (`installed compacted prefix`, stamped after the last layer);
4. `--after-s` seconds after the install the client closes the stream.

Every inter-token gap (a chunk's arrival minus the previous one's, over the chunk's tokens) is
labelled by the first window it overlaps:

- `install`: the gaps that hold the install's writes: after the gap the result arrived in,
  up to the one holding the `installed` stamp (the result's arrival: the `requested` stamp +
  the plugin's own submit-to-result latency, `sglang:compaction_latency_seconds_sum`),
  widened by `--install-margin-s` (default 0); `prefill_in_install_gaps` flags a `Prefill
  batch` stamp in or one steady step before those gaps (a heuristic: the stamp can trail
  the prefill's forward);
- `result`: the gap the result arrived in (the scheduler process receives and checks it on
  the runner's thread; its token was due before the next poll point);
- `trigger`: from sending the first question to the second's answer (their prefills share
  the batch: ordinary prefill interference, not install cost);
- `compaction`: from `requested` to the result's arrival;
- `steady`: the rest.

Reports per run: steady TPOT (median of `steady`; its p90 and max are the noise reference),
the install gaps' max and median, their ratio to steady (target: max < 1.10x) and the share
of steady gaps at least as long as the install's worst (noise rank), the same for
the other windows, result-to-installed (an upper bound on the install: it includes waiting
for the next poll point, up to one scheduler iteration), the install's bytes, the load
average before and after. Writes benchmarks/results/install_stall.json (command, commit,
machine, date) and .png (gaps over time, windows shaded, install marked). On a CPU the
install is about 1-5 MiB, one or a few layers' writes per iteration: the figure says
whether an install of this size stalls decoding on a loaded CPU, not what GiB-sized
installs into a GPU pool do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import ROOT, add_options

# Gap and LABELS: re-exported for tests/benchmarks/test_install_stall.py
from benchmarks.server._install_stall_analysis import (  # noqa: F401
    LABELS,
    LOCAL_GAPS,
    TARGET_RATIO,
    Gap,
    gaps,
    install_window,
    label,
    log_events,
    summarize,
)


@dataclass
class TokenStream:
    """A streamed greedy /generate on a thread: `arrivals` [(time.time(), tokens so far)]."""

    url: str
    text: str
    max_new_tokens: int
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TokenStream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the stream at its next chunk (the server aborts the request) and join."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    @property
    def finished(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _run(self) -> None:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(
            self.url + "/generate",
            data=json.dumps(
                {"text": self.text, "stream": True, "sampling_params": params}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for raw in resp:
                    now = time.time()
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    meta = json.loads(line[len("data:") :]).get("meta_info", {})
                    self.arrivals.append((now, int(meta.get("completion_tokens", 0))))
                    if self._stop.is_set():
                        return
        except BaseException as e:  # reported by the caller
            self.error = e


def wait_in_log(path: Path, offset: int, needles: tuple[str, ...], timeout_s: float) -> str:
    """Read `path` from `offset` until one of `needles` appears; returns the slice read."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        if any(n in text for n in needles):
            return text
        time.sleep(0.05)
    raise TimeoutError(f"none of {needles} in {path} after {timeout_s:.0f} s")


def run_one(srv: Any, chunk_mb: int, service: str, a: argparse.Namespace) -> dict[str, Any]:
    """One measured stream with one install on `srv`; returns its record."""
    from harness.workload import document, metric, prompt, questions

    doc = document(a.sentences, 0)
    # warm the decode path and a long prefill (the first one of a fresh server is slow) on
    # another document: one hit, no compaction
    srv.generate(prompt(document(a.sentences, 3), "Who keeps the ledger?"), max_new_tokens=8)
    log = Path(srv.log_path)
    offset = log.stat().st_size
    load_before = os.getloadavg()
    stream = TokenStream(srv.url, a.decode_prompt, a.max_decode_tokens).start()
    while not stream.arrivals and not stream.finished:
        time.sleep(0.01)
    time.sleep(a.steady_s)
    trigger_start = time.time()
    for q in questions()[:2]:
        srv.generate(prompt(doc, q), max_new_tokens=a.trigger_tokens)
    trigger_end = time.time()
    try:
        wait_in_log(log, offset, ("installed compacted prefix", "uncompacted"), a.timeout_s)
        time.sleep(a.after_s)
    finally:
        stream.stop()
    if stream.error is not None:
        raise RuntimeError(f"decode stream failed: {stream.error!r}")
    ev = log_events(log.read_bytes()[offset:].decode(errors="replace"))
    if ev["fallbacks"] or len(ev["installed"]) != 1 or len(ev["requested"]) != 1:
        raise RuntimeError(f"expected one request and one install, got {ev}:\n{srv.log_tail()}")
    latency = metric(srv, "sglang:compaction_latency_seconds_sum")
    requested, inst = ev["requested"][0], ev["installed"][0]
    result_at, installed = requested + latency, inst["t"]
    saved = metric(srv, "sglang:compaction_bytes_saved")
    per_slot = saved / max(inst["T"] - inst["slots"], 1)
    m = a.install_margin_s
    gs = gaps(stream.arrivals)
    if not gs or gs[-1].end < installed + a.after_s / 2:
        raise RuntimeError("the decode ended before the install; raise --max-decode-tokens")
    windows = {
        "install": install_window(gs, result_at, installed, m),
        "result": (result_at, result_at),
        "trigger": (trigger_start, trigger_end),
        "compaction": (requested, result_at),
        "steady": (0.0, 0.0),
    }
    t0 = stream.arrivals[0][0]
    summary = summarize(gs, windows)
    held = [g for g in gs if label(g, windows) == "install"]
    span = (held[0].start - summary["steady_tpot_ms"] / 1e3, held[-1].end) if held else (0, 0)
    rec = {
        "install_chunk_mb": chunk_mb,
        "install_step_ms": a.step_ms,
        "service": service,
        "decode_tokens": stream.arrivals[-1][1],
        "multi_token_chunks": sum(g.tokens > 1 for g in gs),
        "prefix_tokens": inst["T"],
        "install_slots": inst["slots"],
        "install_bytes": round(per_slot * inst["slots"]),
        "compaction_latency_s": latency,
        "result_to_installed_ms": (installed - result_at) * 1e3,
        "load_avg_before": list(load_before),
        "load_avg_after": list(os.getloadavg()),
        # a prefill scheduled in (or just before) the install's gaps inflates them too
        "prefill_in_install_gaps": any(span[0] <= t <= span[1] for t in ev["prefills"]),
        **summary,
        # seconds since the stream's first token
        "windows_s": {k: [lo - t0, hi - t0] for k, (lo, hi) in windows.items() if hi > 0},
        "installed_at_s": installed - t0,
        "requested_at_s": requested - t0,
        "prefills_at_s": [t - t0 for t in ev["prefills"]],
        "gaps": [[round(g.end - t0, 4), round(g.tpot_s * 1e3, 3), label(g, windows)] for g in gs],
    }
    inst_ratio = rec["install"]["max_over_steady"]
    print(
        f"  [chunk {chunk_mb} MiB, {service}] steady TPOT {rec['steady_tpot_ms']:.1f} ms over "
        f"{rec['steady']['gaps']} gaps; install window {rec['install']['gaps']} gaps, max "
        f"{rec['install']['max_ms']:.1f} ms ({inst_ratio:.2f}x), median "
        f"{rec['install']['median_ms']:.1f} ms, {rec['install']['steady_share_at_least_max']:.1%} "
        f"of steady gaps as long; trigger max {rec['trigger']['max_ms'] or 0:.0f} "
        f"ms; install {rec['install_bytes'] / 2**20:.2f} MiB, result->installed "
        f"{rec['result_to_installed_ms']:.0f} ms; vs the {LOCAL_GAPS} steady gaps after it "
        f"({rec['local_steady_after_install_ms'] or 0:.1f} ms): max "
        f"{rec['install_max_over_local_steady'] or 0:.2f}x, median "
        f"{rec['install_median_over_local_steady'] or 0:.2f}x; load {load_before[0]:.1f}",
        flush=True,
    )
    return rec


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "install": "tab:red",
        "result": "tab:purple",
        "trigger": "tab:orange",
        "compaction": "tab:gray",
    }
    fig, axes = plt.subplots(len(records), 1, figsize=(11, 3.2 * len(records)), squeeze=False)
    for ax, r in zip(axes[:, 0], records):
        for name, (lo, hi) in r["windows_s"].items():
            ax.axvspan(lo, hi, color=colors[name], alpha=0.15, label=f"{name} window")
        xs = [g[0] for g in r["gaps"]]
        ax.plot(xs, [g[1] for g in r["gaps"]], ".-", ms=3, lw=0.6, color="tab:blue")
        ax.axvline(r["installed_at_s"], color="tab:red", lw=1.2, label="installed (log, ms)")
        steady = r["steady_tpot_ms"]
        ax.axhline(steady, color="k", lw=0.8, ls="--", label=f"steady {steady:.1f} ms")
        ax.axhline(steady * TARGET_RATIO, color="k", lw=0.6, ls=":", label="+10%")
        ax.set_yscale("log")
        ax.set_ylabel("inter-token gap (ms)")
        ratio = r["install"]["max_over_steady"]
        ax.set_title(
            f"--compaction-install-chunk-mb {r['install_chunk_mb']}, result {r['service']} "
            f"({r['compaction_latency_s']:.1f} s): install "
            f"{r['install_bytes'] / 2**20:.1f} MiB, worst gap in its window {ratio:.2f}x steady",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the decode's first token")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunk-mb", default="64,1", help="install chunk sizes, one server each")
    ap.add_argument(
        "--step-ms", type=float, default=2.0, help="--compaction-install-step-ms of every run"
    )
    add_options(ap, ratio=0.1, method="am-highest")
    ap.add_argument("--sentences", type=int, default=110, help="document size (110: ~1.9k tok)")
    add_options(ap, decode_prompt="Write a long story about a dragon and a knight.")
    add_options(ap, max_decode_tokens=4000, trigger_tokens=1, steady_s=10.0, after_s=10.0)
    add_options(ap, install_margin_s=0.0, max_total_tokens=8192)
    ap.add_argument("--ray", action="store_true", help="Ray workers (default: in-process)")
    ap.add_argument("--timeout-s", type=float, default=400.0)
    ap.add_argument("--smoke", action="store_true", help="one server, small document")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    if a.smoke:
        a.chunk_mb, a.sentences, a.steady_s, a.after_s = "64", 30, 2.0, 2.0
    chunks = [int(c) for c in a.chunk_mb.split(",") if c]

    import signal

    from compactor.models import prepare_model
    from harness.launch import CompactorService, SGLangServer, start_all
    from harness.provenance import provenance
    from harness.workload import compaction_args

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    prov = provenance()
    model = prepare_model(a.model)
    logs = Path(tempfile.mkdtemp(prefix="install-stall-"))
    print(f"logs under {logs}", flush=True)
    records = []
    with contextlib.ExitStack() as stack:
        svc = CompactorService(a.model, logs / "compactor.log", in_process=not a.ray)
        start_all(stack, [svc])
        # the first run's compaction is computed by the service, on the cores the server
        # decodes on; the same document on a fresh server is then a cache hit, so the
        # install is not mixed with the service's compute
        runs = [("computed", chunks[0]), *(("cached", c) for c in chunks)]
        for i, (service, chunk) in enumerate(runs[:1] if a.smoke else runs):
            extra = [
                "--enable-metrics",
                *compaction_args(svc.endpoint, a.ratio, a.method, min_hits=2),
                "--compaction-install-chunk-mb", str(chunk),
                "--compaction-install-step-ms", str(a.step_ms),
            ]  # fmt: skip
            srv = SGLangServer(
                model,
                logs / f"sglang-{i}-chunk{chunk}-{service}.log",
                max_total_tokens=a.max_total_tokens,
                extra_args=extra,
                env={"SGLANG_LOG_MS": "1"},
            )
            with srv:  # one server at a time: each binds its threads to every core
                records.append(run_one(srv, chunk, service, a))
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / ("install_stall_smoke" if a.smoke else "install_stall")
    meta = {
        "provenance": prov,
        "total_s": time.perf_counter() - t0,
        "args": {k: str(v) for k, v in vars(a).items()},
        "target_max_over_steady": TARGET_RATIO,
        "resolution": (
            "token arrivals: client time.time() per streamed chunk (us); install: the plugin's "
            "'installed compacted prefix' log line, SGLANG_LOG_MS=1 (1 ms), written after the "
            "last layer; result arrival: 'compaction requested' stamp + the plugin's "
            "submit-to-result latency (sglang:compaction_latency_seconds_sum)"
        ),
    }
    Path(f"{stem}.json").write_text(json.dumps({"records": records, **meta}, indent=1))
    plot(records, Path(f"{stem}.png"), f"decode TPOT while a compacted prefix installs "
         f"(SmolLM2-135M, CPU, {a.method} ratio {a.ratio}, load {prov['load_avg'][0]:.1f})")  # fmt: skip
    print(f"wrote {stem}.json and {stem}.png ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
