"""Everything a GPU serving run (scripts/gpu_serving.sh) could fail on that a CPU can check.

    bash scripts/gpu_serving.sh preflight [--skip wheelhouse]     # = python -m benchmarks.gpu.preflight.run

Checks, each printed with what it found; the exit status is the number that failed:

- server-args: every SGLang server the run starts (`benchmarks.gpu.serving.run argv`) has its
  flags parsed by SGLang's own `ServerArgs` parser, with the plugin's flags only where the
  plugin is loaded (a stock server does not know them). An ambiguous or unknown flag fails.
- sgl-kernel: every `sgl_kernel` import in the installed SGLang resolves against the GPU
  stand-in (scripts/gpu_standin), and the optional CUDA-only packages a bf16 Llama reaches
  are available there or answered by the stand-in (`benchmarks.gpu.preflight.kernels`).
- flashinfer: every `#include` reachable from the sources SGLang's FlashInfer backend and
  sampler JIT-compile resolves inside the serving bundle (`benchmarks.gpu.preflight.flashinfer`).
- tree-core: a torch other than the one SGLang's wheel pins selects SGLang's pure-Python radix
  tree core (its compiled core misreads the tensors of another torch: `insert value must be
  an int64 tensor, got Float`).
- wheelhouse: `scripts/gpu_serving.sh pack` makes one archive that, with the working tree,
  fits what one device call carries (`benchmarks.gpu.serving.plan.TREE_LIMIT_MIB`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from benchmarks import ROOT

STANDIN = ROOT / "scripts" / "gpu_standin"
OTHER_TORCH = "2.11.0+cu130"  # a CUDA torch SGLang 0.5.23's wheel was not built against


class _Refused(ValueError):
    """argparse's error, raised instead of exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


def sglang_parser(plugin: bool) -> argparse.ArgumentParser:
    """SGLang's `launch_server` parser, with the plugin's flags when the plugin is loaded."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(allow_abbrev=True)
    ServerArgs.add_cli_args(parser)
    if plugin:
        from sglang_ext.config import add_cli_args

        add_cli_args(parser)
    return parser


class Server(NamedTuple):
    """One SGLang server of the GPU run: whether the plugin is loaded, and its flags."""

    plugin: bool
    flags: list[str]


def servers() -> dict[str, Server]:
    """Each server of the GPU run, by name (`python -m benchmarks.gpu.serving.run argv`)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu.serving.run", "argv"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"benchmarks.gpu.serving.run argv failed: {out.stderr[-2000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return {name: Server(bool(s["plugin"]), list(s["flags"])) for name, s in found.items()}


def check_server_args(run: dict[str, Server] | None = None) -> list[str]:
    """Problems parsing each server's flags with SGLang's parser (none: all parse)."""
    problems = []
    for name, server in (servers() if run is None else run).items():
        try:
            sglang_parser(server.plugin).parse_args(server.flags)
        except _Refused as exc:
            loaded = "plugin loaded" if server.plugin else "plugin not loaded"
            problems.append(f"server-args: the {name} server ({loaded}): SGLang says: {exc}")
    return problems


def check_sgl_kernel(standin: Path = STANDIN) -> list[str]:
    from benchmarks.gpu.preflight.kernels import check, installed_sglang

    return [f"sgl-kernel: {p}" for p in check(installed_sglang(), standin)]


def check_flashinfer(bundle: set[str] | None = None) -> list[str]:
    from benchmarks.gpu.preflight.flashinfer import REQUIREMENT, check
    from benchmarks.gpu.wheelhouse import DEFAULT_CACHE, fetch_wheel

    wheel = fetch_wheel(REQUIREMENT, DEFAULT_CACHE)
    return [f"flashinfer: {p}" for p in check(wheel, bundle)]


def check_tree_core() -> list[str]:
    from benchmarks.gpu.serving.run import tree_core_env

    env = tree_core_env(OTHER_TORCH)
    if env.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND") != "python":
        return [
            f"tree-core: with torch {OTHER_TORCH} the servers keep SGLang's compiled radix tree "
            "core, which misreads that torch's tensors (set SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
            "=python there)"
        ]
    return []


def check_wheelhouse() -> list[str]:
    """Pack the wheelhouse into a temporary folder: one archive that travels, with the working
    tree, within one device call."""
    from benchmarks.gpu.serving.plan import TREE_LIMIT_MIB, tree_mib

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            ["bash", "scripts/gpu_serving.sh", "pack"], cwd=ROOT, capture_output=True, text=True,
            env={**os.environ, "PACK_DIR": tmp, "PY": sys.executable}, timeout=1200,
        )  # fmt: skip
        if proc.returncode:
            return [f"wheelhouse: pack failed: {(proc.stdout + proc.stderr)[-2000:]}"]
        files = sorted(p.name for p in Path(tmp).iterdir())
        archive = (Path(tmp) / "site.tar.xz").stat().st_size / 2**20 if files else 0.0
    total = tree_mib((), 0.0) + archive
    print(f"  wheelhouse: {files}, {archive:.1f} MiB; {total:.1f} MiB with the working tree")
    if files != ["MANIFEST", "site.tar.xz"] or total > TREE_LIMIT_MIB:
        return [f"wheelhouse: {files} of {archive:.1f} MiB; with the working tree {total:.1f} MiB "
                f"travel, at most {TREE_LIMIT_MIB:g} in one call"]  # fmt: skip
    return []


CHECKS: dict[str, Callable[[], list[str]]] = {
    "server-args": check_server_args,
    "sgl-kernel": check_sgl_kernel,
    "flashinfer": check_flashinfer,
    "tree-core": check_tree_core,
    "wheelhouse": check_wheelhouse,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help=f"comma-separated checks to skip: {list(CHECKS)}")
    a = ap.parse_args(argv)
    skip = {s for s in a.skip.split(",") if s}
    if unknown := skip - set(CHECKS):
        ap.error(f"--skip: unknown checks {sorted(unknown)}; choose from {list(CHECKS)}")
    failed = 0
    for name, check in CHECKS.items():
        if name in skip:
            print(f"{name}: skipped")
            continue
        problems = check()
        failed += bool(problems)
        print(f"{name}: {'FAILED' if problems else 'ok'}")
        for p in problems:
            print(f"  {p}")
    print(f"preflight: {len(CHECKS) - len(skip) - failed} ok, {failed} failed")
    return failed


if __name__ == "__main__":
    sys.exit(main())
