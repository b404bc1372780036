"""Start and stop real server processes (tests, demo, benchmarks).

`SGLangServer` runs `python -m sglang.launch_server`, `CompactorService` runs
`python -m compactor serve`; each takes a free loopback port, waits until it answers
(`/health`, or a gRPC `GetModelInfo`), keeps the log in a file, and on exit kills the whole
process group (SGLang's scheduler and detokenizer, Ray's raylet and actors), also on
exceptions and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_ext.adapter.hooks import ACTIVE_ENV

PLUGIN_GROUP = "sglang.srt.plugins"  # SGLang's entry-point group for general plugins
NO_PLUGIN = "none"  # an allow-list entry that names no installed plugin


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message has its log tail."""


class HTTPStatusError(RuntimeError):
    """A server answered an HTTP error status; the message has the body it sent (SGLang puts
    its reason there, e.g. a failed KV transfer), which urllib's own error leaves unread."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} answered {status}: {body}")
        self.url, self.status, self.body = url, status, body


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (the OS picks it; never a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stock_plugins() -> str:
    """The `SGLANG_PLUGINS` allow-list that loads every installed SGLang plugin but ours.

    SGLang loads every plugin of its entry-point group unless `SGLANG_PLUGINS` names the ones
    to load; an empty value means all. With no other plugin installed, the list names one that
    does not exist, so that nothing is loaded.
    """
    from importlib.metadata import entry_points

    from sglang_ext.adapter.hooks import PLUGIN_NAME

    others = sorted({ep.name for ep in entry_points(group=PLUGIN_GROUP)} - {PLUGIN_NAME})
    return ",".join(others) or NO_PLUGIN


class ManagedProcess:
    """A child process in its own session, killed with its whole group on `stop()`.

    Subclasses give `command()` and `_ready()` (True once the process answers).

    A port picked here (`port=0`) is free when picked but can be taken before the server binds
    it (an outgoing connection of another process draws from the same ephemeral range); a
    process that says so in its log is stopped and spawned again on a new port, up to
    `BIND_ATTEMPTS` times. It need not exit first: SGLang's HTTP server logs the failed bind
    and then hangs in shutdown while its scheduler lives on.
    """

    BIND_ATTEMPTS = 3
    _picked_port = False

    log_path: str | Path
    startup_timeout: float
    host: str
    port: int
    env: dict[str, str]
    _proc: subprocess.Popen[bytes] | None

    def command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # a test-only switch; servers must not inherit it
        env.pop(ACTIVE_ENV, None)  # set by a server's own main process, never inherited
        env.update(self.env)
        return env

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> Any:
        """Spawn the process and wait until it answers; returns self."""
        self.spawn()
        self.wait_ready()
        return self

    def spawn(self) -> None:
        """Spawn the process without waiting (start several, then `wait_ready()` each)."""
        if self.port == 0 or self._picked_port:
            self.port = free_port(self.host)
            self._picked_port = True
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed by the child's exit
        self._proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._child_env(),
            start_new_session=True,
        )
        log.close()

    def restart(self) -> Any:
        """Stop the process and start it again on the same port (a restart behind a fixed
        address: whoever points at it keeps pointing at it); returns self. The log of the
        life before is kept beside the new one, as `<log>.before-restart`."""
        self.stop()
        log = Path(self.log_path)
        if log.exists():
            log.replace(log.with_name(log.name + ".before-restart"))
        self._picked_port = False  # keep the port: a lost bind race now fails the start
        return self.start()

    def stop(self) -> None:
        """Ask the process to stop (`_ask_to_stop`), SIGKILL its group once the leader is gone
        or after 15 s; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for kill, wait in ((self._ask_to_stop, 15.0), (self._kill_group, 10.0)):
            try:
                kill(proc.pid)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if kill != self._kill_group:  # the leader is gone: take down what it left behind
                with contextlib.suppress(ProcessLookupError):
                    self._kill_group(proc.pid)
            break

    def _ask_to_stop(self, pid: int) -> None:
        """SIGTERM to the process group."""
        os.killpg(pid, signal.SIGTERM)

    @staticmethod
    def _kill_group(pid: int) -> None:
        os.killpg(pid, signal.SIGKILL)

    def _lost_port_race(self) -> bool:
        """True if the process exited because the port picked for it was taken meanwhile."""
        return self._picked_port and "address already in use" in self.log_tail().lower()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> Any:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        if self._proc is None:
            raise RuntimeError("spawn() the process before waiting for it")
        name = type(self).__name__
        deadline = time.monotonic() + self.startup_timeout
        attempts = 1
        while time.monotonic() < deadline:
            lost_port = self._lost_port_race()
            if lost_port and attempts < self.BIND_ATTEMPTS:
                attempts += 1
                self.stop()  # the leader and whatever it started
                self.spawn()  # a fresh port; the log restarts
                continue
            code = self._proc.poll()
            if code is not None or lost_port:
                why = f"exited with code {code}" if code is not None else "could not bind"
                raise ServerStartError(f"{name} {why}; log tail:\n" + self.log_tail())
            if self._ready():
                return
            time.sleep(1.0)
        raise ServerStartError(
            f"{name} not ready after {self.startup_timeout:.0f} s; log tail:\n" + self.log_tail()
        )


class HTTPServer(ManagedProcess):
    """A managed process serving SGLang's HTTP API on `host`:`port` (an SGLang server, or a
    router in front of some): ready once `/health` answers 200."""

    GENERATE_TIMEOUT_S = 300.0  # seconds a `generate` call waits for its answer

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def generate(self, text: str, max_new_tokens: int = 16, **sampling: Any) -> dict[str, Any]:
        """POST /generate (greedy by default); returns the JSON answer."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        payload = {"text": text, "sampling_params": params}
        return self.post("/generate", payload, self.GENERATE_TIMEOUT_S)

    def post(self, path: str, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                result: dict[str, Any] = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            body = err.read().decode(errors="replace")[:2000]
            raise HTTPStatusError(self.url + path, err.code, body) from err
        return result

    def flush_cache(self, timeout: float = 60.0) -> None:
        """POST /flush_cache: SGLang empties its radix cache (when no request runs or waits;
        HTTPStatusError when it refuses)."""
        try:
            with urllib.request.urlopen(self.url + "/flush_cache", data=b"", timeout=timeout):
                pass
        except urllib.error.HTTPError as err:
            body = err.read().decode(errors="replace")[:2000]
            raise HTTPStatusError(self.url + "/flush_cache", err.code, body) from err

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


@dataclass
class SGLangServer(HTTPServer):
    """A real SGLang HTTP server for one model.

    Attributes:
        model_path: checkpoint directory.
        log_path: where the server's stdout/stderr go.
        device: "cpu" sets SGLANG_USE_CPU_ENGINE=1, `--device cpu` and `--sleep-on-idle`.
        plugin: False runs SGLang stock: the compaction plugin is not loaded at all
            (`SGLANG_PLUGINS` lists every other installed plugin, see `stock_plugins`).
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
    plugin: bool = True
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", self.host,
            "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens),
        ]  # fmt: skip
        if self.device == "cpu":
            # an idle scheduler otherwise polls its sockets in a loop, a whole core per server
            # (several servers, or a server beside the compaction service, share few cores)
            cmd += ["--device", "cpu", "--sleep-on-idle"]
        return cmd + list(self.extra_args)

    def _child_env(self) -> dict[str, str]:
        env = super()._child_env()
        if self.device == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        if not self.plugin:
            env["SGLANG_PLUGINS"] = stock_plugins()
        return env

    def _ask_to_stop(self, pid: int) -> None:
        """Ctrl-C (SIGINT) to SGLang's main process: it exits in under a second. A SIGTERM to
        the group takes ~5 s: the scheduler dies first, and the main process, seeing a child
        crash, sleeps 5 s before its crash diagnostics. What is left is killed with the group."""
        os.kill(pid, signal.SIGINT)


@dataclass
class CompactorService(ManagedProcess):
    """A real `compactor serve` gRPC service (Ray workers unless `in_process`).

    Attributes:
        model: known model name or checkpoint directory.
        log_path: where the service's stdout/stderr go.
        workers: Ray actors (or threads with `in_process`).
        extra_args: more `compactor serve` flags.
    """

    model: str | Path
    log_path: str | Path
    workers: int = 1
    in_process: bool = False
    extra_args: list[str] = field(default_factory=list)
    startup_timeout: float = 180.0
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "compactor", "serve",
            "--model", str(self.model),
            "--host", self.host,
            "--port", str(self.port),
            "--workers", str(self.workers),
        ]  # fmt: skip
        if self.in_process:
            cmd.append("--in-process")
        return cmd + list(self.extra_args)

    def metrics_port(self, timeout: float = 30.0) -> int:
        """The port `--metrics-port 0` bound, from the line `compactor serve` prints (a port
        picked beforehand could be taken by the service's own gRPC port or another test)."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(r"metrics on http://[^:]+:(\d+)/metrics", self.log_tail(100_000))
            if m:
                return int(m.group(1))
            if time.monotonic() > deadline:
                raise ServerStartError(f"no metrics line in the log:\n{self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        import grpc

        from compactor.client import CompactorClient

        # no client certificate or token here: the service's own log says when it serves
        if {"--tls-cert", "--auth-token-file"} & set(self.extra_args):
            return f"compactor serving on {self.endpoint}" in self.log_tail(100_000)
        try:
            with CompactorClient(self.endpoint) as client:
                client.model_info(timeout=5.0)
            return True
        except grpc.RpcError:
            return False


def start_all(stack: contextlib.ExitStack, processes: Sequence[ManagedProcess]) -> None:
    """Spawn every process, then wait for each (their start-ups overlap); `stack` stops them."""
    for proc in processes:
        stack.callback(proc.stop)
        proc.spawn()
    for proc in processes:
        proc.wait_ready()
