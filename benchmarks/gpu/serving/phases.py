"""The phases of benchmarks/gpu/serving/run.py on live SGLang servers (`--skip-tokenizer-init`:
token ids in and out), and their HTTP clients: bursts timed from the scheduler log, and what
the server reports about itself.

Each phase takes its processes, already started (`gpu_serving.run` starts every phase's
service and servers together), by name, and returns its record: the phase's readings and
`backends` / `cuda_graphs`, which `GpuServingResult.merge` gathers.
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.gpu.serving.schedlog import decode_lines, step_time_s

__all__ = [
    "COMPACTED_ROWS",
    "burst",
    "eight_b",
    "eight_b_measure",
    "eight_b_warm",
    "flush_cache",
    "generate_ids",
    "identity",
    "identity_verdict",
    "random_ids",
    "score_ids",
    "served_backend",
    "server_facts",
]

LOGPROB_TOL = 0.05  # nats: identity vs stock, each scored token
CONTROL_FRACTION = 0.5  # identity's largest shift <= this x the control's mean shift
# request rows the plugin served from a compacted prefix (its attention backend counts them)
COMPACTED_ROWS = "sglang:compaction_compacted_rows_total"
_WRAPS = re.compile(r"sglang_ext: attention backend '\w+' wraps '(\w+)'")


def identity(a: Any, procs: dict[str, Any]) -> dict[str, Any]:
    """Stock vs keep-only at ratio 1 (every key, beta 0) on the identity model, compared by
    the log-probabilities SGLang gives a fixed answer (random weights make greedy ties likely).
    The identity server must stay within `LOGPROB_TOL` of stock on every scored token, move
    at most `CONTROL_FRACTION` as far as stock moves when it reads another document, and have
    served every scored request from the compacted prefix (`COMPACTED_ROWS` moved by as many
    rows): else the scores could come from the uncompacted prefix, equal to stock's trivially.
    """
    from harness.workload import metric, wait_for_compactions

    w = a.w
    vocab = w.small.vocab
    doc, other = random_ids(w.identity_doc, 1, vocab), random_ids(w.identity_doc, 2, vocab)
    qs = [random_ids(w.question_tokens, 10 + i, vocab) for i in range(w.identity_questions)]
    answers = [random_ids(w.answer_tokens, 50 + i, vocab) for i in range(len(qs))]
    srv = {"stock": procs["stock"], "identity": procs["identity"]}
    for q in qs[:2]:
        generate_ids(srv["identity"].url, doc + q, 1)
    comp = wait_for_compactions(srv["identity"], 1, a.compaction_timeout, progress=True)
    rows_before = metric(srv["identity"], COMPACTED_ROWS)
    scores = {
        name: [score_ids(s.url, doc + q, ans) for q, ans in zip(qs, answers)]
        for name, s in srv.items()
    }
    rows_scored = _counter_after(srv["identity"], COMPACTED_ROWS, rows_before + len(qs))
    rows_scored -= rows_before
    control = [score_ids(srv["stock"].url, other + q, ans) for q, ans in zip(qs, answers)]
    greedy = {
        name: [generate_ids(s.url, doc + q, w.answer_tokens)["output_ids"] for q in qs]
        for name, s in srv.items()
    }
    facts = {name: server_facts(s) for name, s in srv.items()}
    shift = [abs(x - y) for a_, b_ in zip(scores["stock"], scores["identity"])
             for x, y in zip(a_, b_)]  # fmt: skip
    ctrl = [abs(x - y) for a_, b_ in zip(scores["stock"], control) for x, y in zip(a_, b_)]
    max_shift, mean_ctrl = max(shift), sum(ctrl) / len(ctrl)
    log_text = Path(srv["identity"].log_path).read_text(errors="replace")
    return {
        "phase": "identity",
        "model": str(srv["stock"].model_path),
        "compaction": comp,
        "logprob_max_abs_diff": max_shift,
        "control_mean_abs_diff": mean_ctrl,
        "logprob_tolerance": {"abs": LOGPROB_TOL, "of_control": CONTROL_FRACTION},
        "scored_requests": len(qs),
        "compacted_rows_scored": rows_scored,
        "scores": scores,
        "greedy_equal_per_question": [x == y for x, y in zip(*greedy.values())],
        "greedy": greedy,
        "identity_outputs_equal": identity_verdict(
            comp.get("installed_total", 0) >= 1, max_shift, mean_ctrl, rows_scored, len(qs)
        ),
        "rejections": [ln for ln in log_text.splitlines() if "compaction result rejected" in ln],
        "server": facts,
        "backends": [served_backend(s, facts[n]) for n, s in srv.items()],
        "cuda_graphs": [not f.get("disable_cuda_graph", False) for f in facts.values()],
    }


def identity_verdict(
    installed: bool, max_shift: float, control_mean: float, rows_served: float, scored: int
) -> bool | None:
    """The identity figure: None (not measured) unless the identity fit was installed; True
    when the largest log-prob shift is within `LOGPROB_TOL` and `CONTROL_FRACTION` of the
    control's mean AND the `scored` requests were all served from the compacted prefix
    (`rows_served` of them counted by the plugin); False otherwise."""
    if not installed:
        return None
    within = max_shift <= LOGPROB_TOL and max_shift <= CONTROL_FRACTION * control_mean
    return within and rows_served >= scored


def eight_b(a: Any, procs: dict[str, Any], plugin: bool) -> dict[str, Any]:
    """One 8B-shaped server (stock, or the plugin's with its service): `eight_b_warm`, then
    `eight_b_measure`."""
    name = "plugin8b" if plugin else "stock8b"
    rec, idle_since = eight_b_warm(a, procs[name], plugin)
    return eight_b_measure(a, procs[name], rec, idle_since)


def eight_b_warm(a: Any, srv: Any, plugin: bool) -> tuple[dict[str, Any], float]:
    """Idle decode (two bursts of distinct prompts, the second the figure), then the shared
    prefix's two warm-up requests (the plugin's: and its install). Returns the record so far
    and when the server went idle (`time.monotonic()`)."""
    from harness.workload import wait_for_compactions

    w = a.w
    vocab = w.big.vocab
    name = "plugin8b" if plugin else "stock8b"
    rec: dict[str, Any] = {"phase": name, "model": str(srv.model_path), "workload": asdict(w)}
    rec["server"] = server_facts(srv)
    # twice, other prompts each time: the first burst pays one-time costs (allocator growth,
    # lazily compiled kernels), the second is the figure
    for key, seed in (("idle_first", 1000), ("idle", 2000)):
        idle = [random_ids(w.idle_prompt, seed + i, vocab) for i in range(w.batch)]
        rec[key] = burst(srv, idle, w.idle_out)
    print(f"  [{name}] idle decode {rec['idle']['decode_tokens_per_s']} tok/s", flush=True)
    flush_cache(srv.url)
    for p in prefix_prompts(w)[:2]:
        generate_ids(srv.url, p, 1)
    if plugin:
        rec["compaction"] = wait_for_compactions(srv, 1, a.compaction_timeout, progress=True)
    return rec, time.monotonic()


def eight_b_measure(a: Any, srv: Any, rec: dict[str, Any], idle_since: float) -> dict[str, Any]:
    """KV slots held once idle since `idle_since` (SGLang's pool counters; a stock server's
    are republished ~32 s after it went idle, so other work may run in between), then the
    decode step of `batch` requests on the shared prefix. Completes `rec` and returns it."""
    from harness.pool import read_pool

    rec["pool_after_warmup"] = read_pool(srv.url, idle_since=idle_since).as_dict()
    rec["prefix"] = burst(srv, prefix_prompts(a.w), a.w.prefix_out)
    print(f"  [{rec['phase']}] held {rec['pool_after_warmup']['held']} slots, decode step "
          f"{rec['prefix']['decode_step_s']} s", flush=True)  # fmt: skip
    facts = rec["server"]
    rec["backends"] = [served_backend(srv, facts)]
    # the figure reads the idle burst: a batch on a compacted prefix runs eagerly by design
    # (`prefix.cuda_graph_lines` says how many of its lines did)
    idle_graphs = rec["idle"]["cuda_graph_lines"] == rec["idle"]["full_batch_lines"] > 0
    rec["cuda_graphs"] = [not facts.get("disable_cuda_graph", False), idle_graphs]
    return rec


def prefix_prompts(w: Any) -> list[list[int]]:
    """The shared prefix followed by each of `w.batch` questions."""
    vocab = w.big.vocab
    prefix = random_ids(w.prefix_tokens, 7, vocab)
    return [prefix + random_ids(w.question_tokens, 100 + i, vocab) for i in range(w.batch)]


def _post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=1200) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _counter_after(srv: Any, name: str, want: float, timeout_s: float = 5.0) -> float:
    """`name` on srv's /metrics once it reaches `want`, or its value after `timeout_s` (the
    plugin exports at its scheduler poll, about once a second when idle)."""
    from harness.workload import metric

    deadline = time.monotonic() + timeout_s
    while (value := metric(srv, name)) < want and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def generate_ids(url: str, ids: list[int], max_new: int, ignore_eos: bool = True) -> dict[str, Any]:
    """Greedy generation from token ids; the answer has `output_ids`."""
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": ignore_eos}
    return _post(url, {"input_ids": ids, "sampling_params": params})


def score_ids(url: str, context: list[int], answer: list[int]) -> list[float]:
    """The log-probability of each `answer` token after `context` (teacher-forced): SGLang's
    `input_token_logprobs` over the answer span of context + answer (its first entry, the
    last context token, has none)."""
    out = _post(url, {
        "input_ids": context + answer,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": len(context) - 1,
    })  # fmt: skip
    rows = out["meta_info"]["input_token_logprobs"][-len(answer) :]
    got = [(lp, int(tok)) for lp, tok, *_ in rows]
    if [tok for _, tok in got] != answer or any(lp is None for lp, _ in got):
        raise RuntimeError(f"SGLang scored {got}, not each token of the answer {answer}")
    return [float(lp) for lp, _ in got]


def burst(srv: Any, prompts: list[list[int]], max_new: int, tries: int = 3) -> dict[str, Any]:
    """Send every prompt at once; the scheduler log's full-batch decode lines give the speed.

    A busy host can stagger the requests' arrival so that they never decode as one batch
    (nothing to time at this batch size): the burst is then sent again, up to `tries` times
    in all (the prompts are cached by then; the decode step is what is timed). `attempts`
    says how many it took."""
    attempts = 0
    while True:
        attempts += 1
        offset = Path(srv.log_path).stat().st_size
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            outs = list(pool.map(lambda p: generate_ids(srv.url, p, max_new), prompts))
        wall = time.perf_counter() - t0
        lines = decode_lines(_settled_log(Path(srv.log_path), offset))
        full = [x for x in lines if x.running == len(prompts)]
        step = step_time_s(lines, len(prompts))
        if step is not None or attempts >= tries:
            break
    return {
        "wall_s": wall,
        "output_tokens": sum(len(o.get("output_ids", [])) for o in outs),
        "full_batch_lines": len(full),
        "decode_tokens_per_s": None if step is None else len(prompts) / step,
        "decode_step_s": step,
        "cuda_graph_lines": sum(x.cuda_graph for x in full),
        "attempts": attempts,
    }


def _settled_log(path: Path, offset: int, quiet_s: float = 0.5, timeout_s: float = 5.0) -> str:
    """The log written after `offset`, once it stopped growing for `quiet_s` (a scheduler's
    last lines can reach the file after its answers reach us)."""
    deadline = time.monotonic() + timeout_s
    size = -1
    while (now := path.stat().st_size) != size and time.monotonic() < deadline:
        size = now
        time.sleep(quiet_s)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def flush_cache(url: str) -> None:
    """Empty the radix cache (SGLang answers plain text; 400 while requests are running)."""
    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/flush_cache answered {resp.status}: {resp.read()[:200]!r}")


def random_ids(n: int, seed: int, vocab: int, low: int = 100) -> list[int]:
    """`n` token ids drawn uniformly from [low, vocab) (low keeps clear of special ids)."""
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


def served_backend(srv: Any, facts: dict[str, Any]) -> str:
    """The attention backend SGLang runs for `srv`: a plugin server's is the one the plugin's
    `compaction` backend wraps (its log says which it built), a stock server's the one
    `/server_info` reports."""
    if getattr(srv, "plugin", False):
        found = _WRAPS.findall(Path(srv.log_path).read_text(errors="replace"))
        if found:
            return str(found[-1])
    return str(facts.get("attention_backend"))


def server_facts(srv: Any) -> dict[str, Any]:
    """What SGLang itself reports: its attention backends and whether CUDA graphs are on."""
    info = json.loads(urllib.request.urlopen(srv.url + "/server_info", timeout=30).read())
    found: dict[str, Any] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("attention_backend", "decode_attention_backend",
                         "prefill_attention_backend", "disable_cuda_graph"):  # fmt: skip
                    found.setdefault(k, v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(info)
    return found
