"""HTTP clients of benchmarks/gpu_serving.py's phases: token-id requests to a live SGLang
server started with `--skip-tokenizer-init`, bursts timed from its scheduler log, and what
the server reports about itself."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._gpu_serving_lib import decode_lines, step_time_s

__all__ = ["burst", "flush_cache", "generate_ids", "random_ids", "score_ids", "server_facts"]


def _post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=1200) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


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


def burst(srv: Any, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Send every prompt at once; the scheduler log's full-batch decode lines give the speed."""
    offset = Path(srv.log_path).stat().st_size
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(lambda p: generate_ids(srv.url, p, max_new), prompts))
    wall = time.perf_counter() - t0
    with open(srv.log_path, "rb") as f:
        f.seek(offset)
        lines = decode_lines(f.read().decode(errors="replace"))
    full = [x for x in lines if x.running == len(prompts)]
    step = step_time_s(lines, len(prompts))
    return {
        "wall_s": wall,
        "output_tokens": sum(len(o.get("output_ids", [])) for o in outs),
        "full_batch_lines": len(full),
        "decode_tokens_per_s": None if step is None else len(prompts) / step,
        "decode_step_s": step,
        "cuda_graph_lines": sum(x.cuda_graph for x in full),
    }


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
