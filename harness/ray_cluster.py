"""A Ray cluster started the way the deployments start it: `ray start` per node, token auth.

The Ray manifests (`deploy/ray/cluster.yaml`, `deploy/k8s/base/compactor-raycluster.yaml`) run
a head with ``--num-cpus=0`` (no actor lands there) and worker nodes joined with
``ray start --address``, every process with ``RAY_AUTH_MODE=token`` and the token read from a
file (``RAY_AUTH_TOKEN_PATH``). :class:`RayNode` is one such node on this machine: a
``ray start --block`` in its own process group, so that stopping it takes down exactly that
node (its raylet, agents and the workers it spawned) and nothing of another Ray on the host.

    with RayNode.head(tmp / "head.log", token, ray_tmp) as head, \\
            RayNode.worker(tmp / "a.log", token, head.address, num_cpus=1):
        ...  # `compactor serve --ray-address {head.address}` with token_env(token)
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.launch import ManagedProcess, free_port

OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Ray's floor is ~75 MiB; a node here moves little


def write_token(path: Path) -> Path:
    """A fresh Ray auth token (256 bits, hex, as `ray` generates them) in `path`, mode 0600."""
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def token_env(token_path: Path | None) -> dict[str, str]:
    """The environment of a process that talks to the cluster: token auth, the token's file
    (None: token auth on, no token, which the cluster must refuse)."""
    env = {"RAY_AUTH_MODE": "token"}
    if token_path is not None:
        env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    return env


def _lineage(pid: int) -> list[int]:
    """`pid` and its ancestors' pids (Linux /proc): a raylet starts its workers in process
    groups of their own, so a worker is placed by its raylet parent."""
    out = []
    while pid > 1:
        out.append(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
    return out


@dataclass
class RayNode(ManagedProcess):
    """One Ray node: `ray start --block` with token auth (build with :meth:`head` or
    :meth:`worker`).

    Attributes:
        log_path: the node's `ray start` output.
        token_path: the Ray auth token file.
        join: the head's address ("host:port") for a worker node, None for the head.
        num_cpus: CPUs the node offers to actors (0 on the head, as deployed).
        temp_dir: Ray's root temporary directory (the head's; short: it holds sockets).
        port: the GCS port on the head, the node manager's port on a worker (0: pick one).
    """

    log_path: str | Path
    token_path: Path
    join: str | None = None
    num_cpus: int = 0
    temp_dir: Path | None = None
    startup_timeout: float = 120.0
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @classmethod
    def head(cls, log_path: str | Path, token_path: Path, temp_dir: Path) -> RayNode:
        return cls(log_path, token_path, temp_dir=temp_dir)

    @classmethod
    def worker(
        cls, log_path: str | Path, token_path: Path, join: str, num_cpus: int = 1
    ) -> RayNode:
        return cls(log_path, token_path, join=join, num_cpus=num_cpus)

    @property
    def address(self) -> str:
        """What `ray.init(address=)` / `ray start --address` take (the head's GCS)."""
        if self.join is not None:
            raise ValueError("a worker node has no cluster address of its own; use the head's")
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [
            ray, "start", "--block", "--disable-usage-stats",
            f"--node-ip-address={self.host}",
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--dashboard-agent-listen-port={free_port(self.host)}",
        ]  # fmt: skip
        if self.join is None:
            if self.temp_dir is None:
                raise ValueError("the head needs a temp_dir (Ray's sockets and logs)")
            return [
                *cmd,
                "--head", f"--port={self.port}", "--include-dashboard=false",
                f"--dashboard-port={free_port(self.host)}",
                f"--temp-dir={self.temp_dir}",
                f"--ray-client-server-port={free_port(self.host)}",
            ]  # fmt: skip
        return [*cmd, f"--address={self.join}", f"--node-manager-port={self.port}"]

    def _child_env(self) -> dict[str, str]:
        return super()._child_env() | token_env(self.token_path)

    def _ready(self) -> bool:
        return "Ray runtime started" in self.log_tail(100_000)

    def owns(self, pid: int) -> bool:
        """True if process `pid` (an actor's) runs on this node."""
        return self.pid is not None and any(os.getpgid(p) == self.pid for p in _lineage(pid))
