"""A prefill/decode (PD) disaggregated SGLang pair on CPU, behind sglang-router (the PD tests).

`pd_pair(...)` builds the two `SGLangServer`s: both `--device cpu` with the Mooncake transfer
backend over TCP (`mooncake_tcp`) and one bootstrap port; prefill with `CPU_PREFILL_ENV` (no
early send of its cached prefix, a CUDA-only step under overlap scheduling); decode keeps its
own radix cache (`--disaggregation-decode-enable-radix-cache`) and refreshes its metrics every
step.
`PDRouter` runs sglang-router's mini load balancer in front of them; `pd_teacher_forced`
scores an answer through it as decode reads it. What they need beyond
the project's venv (the Mooncake wheel, sglang-router, the libraries Mooncake links) is
installed by `make pd-deps` (scripts/setup_pd_deps.sh) under `PD_DEPS`; `pd_env()` puts it on
the children's paths. Every port is picked free on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from harness.forced import UNSCORED, Forced
from harness.launch import HTTPServer, HTTPStatusError, SGLangServer, free_port

__all__ = ["CPU_PREFILL_ENV", "PD_DEPS", "PDRouter", "pd_env", "pd_pair", "pd_teacher_forced"]

PD_DEPS = Path(__file__).resolve().parent.parent / "third_party" / ".pd-deps"


# SGLang's early send of prefill's cached prefix records a torch.cuda.Event under overlap
# scheduling (see sglang_ext.adapter.pd._warn_early_send): off on a CPU prefill server.
CPU_PREFILL_ENV = {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}
# SGLang's own limits (seconds, default 300 each) on a request waiting for its KV transfer on
# decode and for decode's KV indices on prefill; past them the request fails with a 500.
TRANSFER_TIMEOUT_ENV = ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")  # fmt: skip


def pd_env(component: str = "server") -> dict[str, str]:
    """Environment for a PD server (`server`: Mooncake on PYTHONPATH, its libraries on
    LD_LIBRARY_PATH, SGLang's host IP on loopback) or the `router` (sglang-router).

    Raises:
        FileNotFoundError: `make pd-deps` has not run.
    """
    if not (PD_DEPS / ".setup-stamp").is_file():
        raise FileNotFoundError(f"{PD_DEPS} is missing: run `make pd-deps`")
    path = [str(PD_DEPS / ("router" if component == "router" else "site"))]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    env = {"PYTHONPATH": os.pathsep.join(path)}
    if component != "router":
        libs = [str(PD_DEPS / "libs" / d / "x86_64-linux-gnu") for d in ("usr/lib", "lib")]
        if os.environ.get("LD_LIBRARY_PATH"):
            libs.append(os.environ["LD_LIBRARY_PATH"])
        env.update(LD_LIBRARY_PATH=os.pathsep.join(libs), SGLANG_HOST_IP="127.0.0.1")
    return env


def pd_pair(
    model_path: str | Path,
    log_dir: Path,
    prefill_args: list[str] | None = None,
    decode_args: list[str] | None = None,
    max_total_tokens: int = 8192,
    prefill_plugin: bool = True,
    transfer_timeout_s: int | None = None,
) -> tuple[SGLangServer, SGLangServer, int]:
    """(prefill, decode, prefill's bootstrap port), the servers not started. Prefill runs with the plugin installed and no
    `--compaction-endpoint` unless `prefill_args` says otherwise (`prefill_plugin=False`:
    SGLang without the plugin at all); decode gets `decode_args` (e.g. the plugin's flags).
    `transfer_timeout_s` sets both servers' `TRANSFER_TIMEOUT_ENV` (SGLang's 300 s if None)."""
    timeouts = {k: str(transfer_timeout_s) for k in TRANSFER_TIMEOUT_ENV if transfer_timeout_s}
    bootstrap = free_port()
    common = [
        "--disaggregation-transfer-backend", "mooncake_tcp",
        "--disaggregation-bootstrap-port", str(bootstrap), "--enable-metrics",
    ]  # fmt: skip
    prefill = SGLangServer(
        model_path, log_dir / "prefill.log", max_total_tokens=max_total_tokens,
        plugin=prefill_plugin, env={**pd_env(), **CPU_PREFILL_ENV, **timeouts},
        extra_args=[*common, "--disaggregation-mode", "prefill", "--nccl-port",
                    str(free_port()), *(prefill_args or [])],
    )  # fmt: skip
    decode = SGLangServer(
        model_path, log_dir / "decode.log", max_total_tokens=max_total_tokens,
        env={**pd_env(), **timeouts},
        extra_args=[*common, "--disaggregation-mode", "decode", "--nccl-port", str(free_port()),
                    "--disaggregation-decode-enable-radix-cache", "--decode-log-interval", "1",
                    *(decode_args or [])],
    )  # fmt: skip
    return prefill, decode, bootstrap


@dataclass
class PDRouter(HTTPServer):
    """sglang-router's mini load balancer (`--pd-disaggregation --mini-lb`) in front of one
    prefill server (its URL and bootstrap port) and one decode server."""

    GENERATE_TIMEOUT_S = 600.0

    prefill_url: str
    bootstrap_port: int
    decode_url: str
    log_path: str | Path
    startup_timeout: float = 120.0
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=lambda: pd_env("router"))
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--mini-lb", "--prefill", self.prefill_url, str(self.bootstrap_port),
            "--decode", self.decode_url, "--host", self.host, "--port", str(self.port),
        ]  # fmt: skip


def pd_teacher_forced(
    router: HTTPServer, prompt: Sequence[int], answer: Sequence[int], parallel: int = 4
) -> Forced:
    """Score `answer` after `prompt` (token ids) through a PD pair, as decode reads it.

    A PD prefill server computes every log-prob of the prompt itself (over its own full
    cache), so `harness.workload.teacher_forced` would never reach decode. Here each answer
    token j >= 1 is the second token of its own greedy request, ``input_ids`` = prompt +
    answer[:j-1]: prefill makes the first token (which must be answer[j-1]), decode the
    second, over its own cache, and reports the log-prob of answer[j] and its top-1 there.
    Token 0 is prefill's, as in serving. Where prefill's greedy token is not the answer's
    (a near-tie that prefill's numerics break the other way), the next token cannot be scored
    this way: its log-prob is NaN and its top-1 -1 (`logprob_gap` and `top1_share` skip it).
    Prefill's tokens do not depend on decode, so two pairs with the same prefill skip the
    same positions. A request whose KV transfer SGLang reports failed (a 500 naming
    `KVTransferError`: on a busy 2-core machine one request in about 250 sat in prefill's
    bootstrap queue until SGLang's transfer timeout, with the plugin not on decode) is sent
    once more, with a line on stderr; the transfer carries no log-prob.

    Raises:
        ValueError: `answer` has fewer than two tokens.
    """
    answer = [int(t) for t in answer]
    if len(answer) < 2:
        raise ValueError(f"an answer of {len(answer)} token(s): decode scores from the second on")

    def second(j: int) -> tuple[float, int, float, int]:
        request = {
            "input_ids": [*prompt, *answer[: j - 1]], "return_logprob": True,
            "top_logprobs_num": 1, "token_ids_logprob": [answer[j]],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
        }  # fmt: skip
        try:
            out = router.post("/generate", request)
        except HTTPStatusError as err:
            if "KVTransferError" not in err.body:
                raise
            print(f"pd_teacher_forced: token {j} sent again after {err}", file=sys.stderr)
            out = router.post("/generate", request)
        meta = out["meta_info"]
        first = int(out["output_ids"][0])
        if first != answer[j - 1]:
            return UNSCORED, -1, UNSCORED, -1
        return (float(meta["output_token_logprobs"][0][0]), first,
                float(meta["output_token_ids_logprobs"][1][0][0]),
                int(meta["output_top_logprobs"][1][0][1]))  # fmt: skip

    with ThreadPoolExecutor(parallel) as pool:
        rows = list(pool.map(second, range(1, len(answer))))
    return Forced([rows[0][0]] + [r[2] for r in rows], [rows[0][1]] + [r[3] for r in rows])
