"""CPU preflight for the slim FlashInfer bundle in scripts/gpu_serving.sh's wheelhouse.

The bundle holds only part of the flashinfer_python 0.7.2 wheel (Python code, headers, some
csrc sources); the GPU machine JIT-compiles from it. This module names the bundle's members
(``bundle_members``, which ``pack`` uses) and checks, from the wheel alone, that every header
the JIT reaches from the sources SGLang 0.5.23 compiles is in it (``missing_includes``).

    python -m benchmarks.gpu.preflight.flashinfer check [--wheel PATH]   # exit 1 if any missing
    python -m benchmarks.gpu.preflight.flashinfer list --wheel PATH      # the bundle's members
"""

from __future__ import annotations

import argparse
import fnmatch
import posixpath
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

REQUIREMENT = "flashinfer_python==0.7.2"
DATA = "flashinfer/data/"
CSRC = DATA + "csrc/"
INC = DATA + "include/"

# Search path of every JIT compile, in order: flashinfer/jit/cpp_ext.py build_common_cflags
# puts the vendored CCCL first with -I (env.CCCL_INCLUDE_DIRS), then get_system_includes as
# -isystem: FLASHINFER_INCLUDE_DIR, FLASHINFER_CSRC_DIR, CUTLASS_INCLUDE_DIRS (cutlass/include
# AND cutlass/tools/util/include) and SPDLOG_INCLUDE_DIR. (Python, CUDA and tvm-ffi/dlpack
# include dirs come from the GPU machine, not the wheel.) The modules below add no
# extra_include_paths.
INCLUDE_DIRS: tuple[str, ...] = (
    DATA + "cccl/cub",
    DATA + "cccl/libcudacxx/include",
    DATA + "cccl/thrust",
    DATA + "include",
    DATA + "csrc",
    DATA + "cutlass/include",
    DATA + "cutlass/tools/util/include",
    DATA + "spdlog/include",
)

# What the JIT reads or compiles for SGLang 0.5.23's FlashInfer backend
# (layers/attention/flashinfer_backend.py: BatchPrefillWith{Paged,Ragged}KVCacheWrapper with
# backend fa2 or fa3 (auto picks fa3 on sm90), BatchDecodeWithPagedKVCacheWrapper,
# cascade.merge_state) and sampler (layers/sampler.py: flashinfer.sampling), plus page and
# norm; bf16, head_dim 64/128 (head_dim only changes -D flags and template arguments, not files).
# The .jinja templates are rendered into the generated *_config.inc / *_kernel_*.cu files, so
# their #includes are compiled; the csrc .cu files are copied next to them (quote includes of
# the generated .inc files resolve nowhere in the wheel and are ignored).
ENTRY_SOURCES: dict[str, tuple[str, ...]] = {
    # jit/attention/modules.py gen_customize_batch_decode_module (+ gen_batch_decode_module's
    # variant_decl "#include<flashinfer/attention/variants.cuh>")
    "batch_decode": (
        CSRC + "batch_decode_customize_config.jinja",
        CSRC + "batch_decode_kernel_inst.jinja",
        CSRC + "batch_decode.cu",
        CSRC + "batch_decode_jit_binding.cu",
        INC + "flashinfer/attention/variants.cuh",
    ),
    # gen_customize_batch_prefill_module, backend "fa2": module_surface "full" (prefill.py
    # gen_batch_prefill_module / _gen_batch_prefill_primary_module) and "paged"
    # (_gen_batch_prefill_independent_paged_module); batch_prefill_paged.cuh is copied too.
    "batch_prefill_fa2": (
        CSRC + "batch_prefill_customize_config.jinja",
        CSRC + "batch_prefill_paged_kernel_inst.jinja",
        CSRC + "batch_prefill_ragged_kernel_inst.jinja",
        CSRC + "batch_prefill.cu",
        CSRC + "batch_prefill_jit_binding.cu",
        CSRC + "batch_prefill_paged.cu",
        CSRC + "batch_prefill_paged_jit_binding.cu",
        CSRC + "batch_prefill_paged.cuh",
        INC + "flashinfer/attention/variants.cuh",
    ),
    # gen_customize_batch_prefill_module, backend "fa3", not fp8 (_gen_batch_prefill_module's
    # variant_decl "#include<flashinfer/attention/hopper/variants.cuh>")
    "batch_prefill_sm90": (
        CSRC + "batch_prefill_sm90_customize_config.jinja",
        CSRC + "batch_prefill_paged_sm90_kernel_inst.jinja",
        CSRC + "batch_prefill_ragged_sm90_kernel_inst.jinja",
        CSRC + "batch_prefill_sm90.cu",
        CSRC + "batch_prefill_sm90_jit_binding.cu",
        INC + "flashinfer/attention/hopper/variants.cuh",
    ),
    # jit/cascade.py gen_cascade_module (merge_state)
    "cascade": (CSRC + "cascade.cu", CSRC + "flashinfer_cascade_binding.cu"),
    # jit/sampling.py gen_sampling_module
    "sampling": (
        CSRC + "sampling.cu",
        CSRC + "renorm.cu",
        CSRC + "flashinfer_sampling_binding.cu",
    ),
    # jit/page.py gen_page_module
    "page": (CSRC + "page.cu", CSRC + "flashinfer_page_binding.cu"),
    # jit/norm.py gen_norm_module
    "norm": (CSRC + "norm.cu", CSRC + "flashinfer_norm_binding.cu"),
}

# The bundle: these whole trees (the JIT's include dirs but csrc: all of cccl and spdlog as
# before, cutlass/include, and cutlass/tools/util/include, which flashinfer/cutlass_utils.cuh
# needs for the sm90 prefill: cutlass/util/command_line.h etc.), the csrc files matching
# CSRC_PATTERNS (top level only: ENTRY_SOURCES and csrc's headers), the Python code outside
# data/ and the dist-info.
BUNDLE_TREES: tuple[str, ...] = (
    DATA + "include/",
    DATA + "spdlog/",
    DATA + "cccl/",
    DATA + "cutlass/include/",
    DATA + "cutlass/tools/util/include/",
)
CSRC_PATTERNS: tuple[str, ...] = (
    "batch_decode*",
    "batch_prefill*",
    "*.h",
    "*.cuh",
    "cascade.cu",
    "flashinfer_cascade_binding.cu",
    "sampling.cu",
    "renorm.cu",
    "flashinfer_sampling_binding.cu",
    "page.cu",
    "flashinfer_page_binding.cu",
    "norm.cu",
    "flashinfer_norm_binding.cu",
)

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\r\n]+)[>"]')


class MissingInclude(NamedTuple):
    """An ``#include`` that resolves to a wheel file the bundle lacks."""

    includer: str  # wheel member that has the #include
    line: int  # 1-based
    header: str  # as written between <> or ""
    resolved: str  # the wheel member it names


def bundle_members(names: Iterable[str]) -> list[str]:
    """The wheel members (from ``names``) that the serving bundle holds, sorted."""
    out = []
    for name in names:
        if name.endswith("/"):
            continue
        if name.startswith(CSRC):
            keep = "/" not in name[len(CSRC) :] and any(
                fnmatch.fnmatchcase(name[len(CSRC) :], p) for p in CSRC_PATTERNS
            )
        elif name.startswith(BUNDLE_TREES):
            keep = True
        elif name.startswith("flashinfer/"):  # the Python code, not data files
            keep = name.endswith(".py") and "/data/" not in name
        else:
            first = name.split("/", 1)[0]
            keep = first.startswith("flashinfer_python-") and first.endswith(".dist-info")
        if keep:
            out.append(name)
    return sorted(out)


class _DirFiles(Mapping[str, bytes]):
    """A directory's files as a mapping from posix relative path to content."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def __getitem__(self, key: str) -> bytes:
        path = self._root / key
        if not path.is_file():
            raise KeyError(key)
        return path.read_bytes()

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self._root / key).is_file()

    def __iter__(self) -> Iterator[str]:
        return (p.relative_to(self._root).as_posix() for p in self._root.rglob("*") if p.is_file())

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _ZipFiles(Mapping[str, bytes]):
    """An open zip file's members, read on demand."""

    def __init__(self, zf: zipfile.ZipFile) -> None:
        self._zf = zf
        self._names = {n for n in zf.namelist() if not n.endswith("/")}

    def __getitem__(self, key: str) -> bytes:
        if key not in self._names:
            raise KeyError(key)
        return self._zf.read(key)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _resolve(files: Mapping[str, bytes], includer: str, kind: bytes, header: str) -> str | None:
    """The wheel member an include names, as the compiler searches; None if none."""
    dirs = (posixpath.dirname(includer), *INCLUDE_DIRS) if kind == b'"' else INCLUDE_DIRS
    for d in dirs:
        cand = posixpath.normpath(posixpath.join(d, header))
        if cand in files:
            return cand
    return None


def missing_includes(
    files: Mapping[str, bytes] | Path,
    bundle: set[str],
    entries: Iterable[str] | None = None,
    followed: set[str] | None = None,
) -> list[MissingInclude]:
    """Includes reachable from ``entries`` that resolve in ``files`` but not in ``bundle``.

    ``files`` is the full wheel (member path -> content, or an unpacked directory); entries
    default to every ENTRY_SOURCES file. Includes are followed through every ``#if`` branch;
    those resolving nowhere in ``files`` (CUDA, torch, tvm-ffi, the C++ library, generated
    ``.inc`` files) are ignored. ``followed``, if given, receives every file read.
    """
    if isinstance(files, Path):
        files = _DirFiles(files)
    if entries is None:
        entries = sorted({e for srcs in ENTRY_SOURCES.values() for e in srcs})
    seen = set() if followed is None else followed
    todo = [e for e in entries if e in files]
    seen.update(todo)
    out: list[MissingInclude] = []
    while todo:
        includer = todo.pop()
        for lineno, text in enumerate(files[includer].splitlines(), 1):
            m = _INCLUDE.match(text)
            if m is None:
                continue
            header = m.group(2).decode("utf-8", "replace").strip()
            resolved = _resolve(files, includer, m.group(1), header)
            if resolved is None:
                continue
            if resolved not in bundle:
                out.append(MissingInclude(includer, lineno, header, resolved))
            if resolved not in seen:
                seen.add(resolved)
                todo.append(resolved)
    return sorted(out)


def check(wheel: Path, bundle: set[str] | None = None) -> list[str]:
    """Problems of the serving bundle cut from ``wheel``, one human-readable line each.

    ``bundle`` (member names) defaults to ``bundle_members(wheel's names)``.
    """
    with zipfile.ZipFile(wheel) as zf:
        files = _ZipFiles(zf)
        if bundle is None:
            bundle = set(bundle_members(files))
        problems = []
        for module, srcs in ENTRY_SOURCES.items():
            for src in srcs:
                if src not in files:
                    problems.append(f"{module}: JIT source {src} is not in {wheel.name}")
                elif src not in bundle:
                    problems.append(f"{module}: JIT source {src} is not in the bundle")
        by_header: dict[str, list[MissingInclude]] = {}
        for miss in missing_includes(files, bundle):
            by_header.setdefault(miss.resolved, []).append(miss)
        for resolved, misses in sorted(by_header.items()):
            first = misses[0]
            more = f" (and {len(misses) - 1} more)" if len(misses) > 1 else ""
            problems.append(
                f"missing {first.header} ({resolved}): included by "
                f"{first.includer}:{first.line}{more}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    """The command line: ``check`` or ``list``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.preflight.flashinfer")
    ap.add_argument("command", choices=["check", "list"])
    ap.add_argument("--wheel", type=Path, help=f"default: {REQUIREMENT} from the wheel cache")
    args = ap.parse_args(argv)
    wheel = args.wheel
    if wheel is None:
        from benchmarks.gpu.wheelhouse import DEFAULT_CACHE, fetch_wheel

        wheel = fetch_wheel(REQUIREMENT, DEFAULT_CACHE)
    if args.command == "list":
        with zipfile.ZipFile(wheel) as zf:
            print("\n".join(bundle_members(zf.namelist())))
        return 0
    problems = check(wheel)
    for line in problems:
        print(line)
    if problems:
        return 1
    with zipfile.ZipFile(wheel) as zf:
        files = _ZipFiles(zf)
        members = bundle_members(files)
        followed: set[str] = set()
        missing_includes(files, set(members), followed=followed)
        size = sum(zf.getinfo(n).file_size for n in members)
    print(
        f"ok: {len(followed)} files followed from {len(ENTRY_SOURCES)} JIT modules' sources; "
        f"bundle {len(members)} files, {size / 2**20:.1f} MiB unpacked"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
