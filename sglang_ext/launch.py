"""Start and stop a real SGLang server process (tests, demo, benchmarks).

`SGLangServer` runs `python -m sglang.launch_server` on a free loopback port, waits for
`/health`, keeps the server's log in a file, and on exit kills the whole process tree (the
server spawns scheduler and detokenizer processes), also on exceptions and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message has its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (the OS picks it; never a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class SGLangServer:
    """A real SGLang HTTP server for one model.

    Attributes:
        model_path: checkpoint directory.
        log_path: where the server's stdout/stderr go.
        device: "cpu" sets SGLANG_USE_CPU_ENGINE=1 and `--device cpu`.
        max_total_tokens: KV pool size in tokens (on CPU the default pool takes ~14 GB).
        extra_args: more `launch_server` flags.
        startup_timeout: seconds to wait for `/health`.
    """

    model_path: str | Path
    log_path: str | Path
    device: str = "cpu"
    max_total_tokens: int = 8192
    extra_args: list[str] = field(default_factory=list)
    startup_timeout: float = 240.0
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", self.host,
            "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens),
        ]  # fmt: skip
        if self.device == "cpu":
            cmd += ["--device", "cpu"]
        return cmd + list(self.extra_args)

    def start(self) -> SGLangServer:
        if self.port == 0:
            self.port = free_port(self.host)
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # a test-only switch; the server must not inherit it
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.update(self.env)
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed by the child's exit
        self._proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self._wait_healthy()
        return self

    def stop(self) -> None:
        """Kill the server's whole process group; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def generate(self, text: str, max_new_tokens: int = 16, **sampling: Any) -> dict[str, Any]:
        """POST /generate (greedy by default); returns the JSON answer."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        return self.post("/generate", {"text": text, "sampling_params": params})

    def post(self, path: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            result: dict[str, Any] = json.loads(resp.read())
        return result

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> SGLangServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        if self._proc is None:
            raise RuntimeError("start() the server before waiting for it")
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"SGLang server exited with code {self._proc.returncode}; log tail:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise ServerStartError(
            f"SGLang server not healthy after {self.startup_timeout:.0f} s; log tail:\n"
            + self.log_tail()
        )
