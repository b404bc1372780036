"""benchmarks/gpu/preflight/flashinfer.py: the include-following rules on small made-up trees,
the bundle selection, and the real flashinfer_python 0.7.2 wheel (today's bundle passes; one
without cutlass/tools/util/include fails naming cutlass/util/command_line.h, as nvcc did on
the GPU). benchmarks/gpu/wheelhouse.py's cache and error paths too."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu import wheelhouse as _wheels
from benchmarks.gpu.preflight.flashinfer import (
    ENTRY_SOURCES,
    REQUIREMENT,
    MissingInclude,
    bundle_members,
    check,
    main,
    missing_includes,
)
from benchmarks.gpu.wheelhouse import DEFAULT_CACHE, fetch_wheel

D = "flashinfer/data/"
CSRC = D + "csrc/"
INC = D + "include/"
UTIL = D + "cutlass/tools/util/include/"


def _run(files: dict[str, bytes], bundle: set[str], entry: str) -> list[MissingInclude]:
    return missing_includes(files, bundle, entries=[entry])


def test_quote_include_resolves_next_to_includer_first() -> None:
    files = {
        INC + "flashinfer/a.cuh": b'#include "b.cuh"\n',
        INC + "flashinfer/b.cuh": b"",  # next to a.cuh: this one
        INC + "b.cuh": b"",  # found through -I only if the first is absent
    }
    got = _run(files, {INC + "flashinfer/a.cuh"}, INC + "flashinfer/a.cuh")
    assert got == [MissingInclude(INC + "flashinfer/a.cuh", 1, "b.cuh", INC + "flashinfer/b.cuh")]
    del files[INC + "flashinfer/b.cuh"]
    got = _run(files, {INC + "flashinfer/a.cuh"}, INC + "flashinfer/a.cuh")
    assert [m.resolved for m in got] == [INC + "b.cuh"]


def test_quote_include_with_dotdot_is_normalised() -> None:
    files = {CSRC + "sub/a.cu": b'#include "../common.h"\n', CSRC + "common.h": b""}
    got = _run(files, {CSRC + "sub/a.cu"}, CSRC + "sub/a.cu")
    assert [m.resolved for m in got] == [CSRC + "common.h"]


def test_include_dirs_searched_in_compile_order() -> None:
    # -I cccl comes before -isystem include, and tools/util/include is a search dir
    files = {
        CSRC + "a.cu": b"#include <cuda/x.h>\n#include <cutlass/util/command_line.h>\n",
        D + "cccl/libcudacxx/include/cuda/x.h": b"",
        INC + "cuda/x.h": b"",
        UTIL + "cutlass/util/command_line.h": b"",
    }
    got = _run(files, {CSRC + "a.cu"}, CSRC + "a.cu")
    assert [(m.line, m.resolved) for m in got] == [
        (1, D + "cccl/libcudacxx/include/cuda/x.h"),
        (2, UTIL + "cutlass/util/command_line.h"),
    ]


def test_angle_include_ignores_includer_dir() -> None:
    files = {
        CSRC + "sub/a.cu": b"#include <c.h>\n",
        CSRC + "sub/c.h": b"",  # next to the includer: not searched for <>
        INC + "c.h": b"",
    }
    got = _run(files, {CSRC + "sub/a.cu"}, CSRC + "sub/a.cu")
    assert [m.resolved for m in got] == [INC + "c.h"]
    files[CSRC + "sub/a.cu"] = b'#include "c.h"\n'
    got = _run(files, {CSRC + "sub/a.cu"}, CSRC + "sub/a.cu")
    assert [m.resolved for m in got] == [CSRC + "sub/c.h"]


def test_system_and_generated_headers_are_ignored() -> None:
    files = {
        CSRC + "a.cu": (
            b"#include <cuda_runtime.h>\n#include <torch/all.h>\n"
            b'#include "tvm/ffi/container/array.h"\n#include "batch_prefill_config.inc"\n'
            b"#include <vector>\n#include <flashinfer/x.cuh>\n"
        ),
        INC + "flashinfer/x.cuh": b"#include <cstdint>\n",
    }
    followed: set[str] = set()
    bundle = {CSRC + "a.cu", INC + "flashinfer/x.cuh"}
    assert missing_includes(files, bundle, entries=[CSRC + "a.cu"], followed=followed) == []
    assert followed == {CSRC + "a.cu", INC + "flashinfer/x.cuh"}


def test_missing_header_named_with_includer_and_line_transitively() -> None:
    files = {
        CSRC + "a.cu": b"// x\n#include <flashinfer/cutlass_utils.cuh>\n",
        INC + "flashinfer/cutlass_utils.cuh": b"#pragma once\n\n  #  include <cutlass/util/x.h>\n",
        UTIL + "cutlass/util/x.h": b'#include "y.h"\n',
        UTIL + "cutlass/util/y.h": b"",
    }
    bundle = {CSRC + "a.cu", INC + "flashinfer/cutlass_utils.cuh"}
    assert _run(files, bundle, CSRC + "a.cu") == [
        MissingInclude(UTIL + "cutlass/util/x.h", 1, "y.h", UTIL + "cutlass/util/y.h"),
        MissingInclude(
            INC + "flashinfer/cutlass_utils.cuh", 3, "cutlass/util/x.h", UTIL + "cutlass/util/x.h"
        ),
    ]
    assert _run(files, set(files), CSRC + "a.cu") == []


def test_all_preprocessor_branches_are_followed() -> None:
    files = {
        CSRC + "a.cu": (
            b"#if defined(SM90)\n#include <p.h>\n#elif 0\n#include <q.h>\n"
            b"#else\n#include <r.h>\n#endif\n/*\n#include <s.h>\n*/\n// #include <t.h>\n"
        ),
        **{INC + f"{c}.h": b"" for c in "pqrst"},
    }
    got = _run(files, {CSRC + "a.cu"}, CSRC + "a.cu")
    # a line-commented include is skipped; one inside a /* */ block is counted: conservative
    assert [m.header for m in got] == ["p.h", "q.h", "r.h", "s.h"]


def test_cycles_terminate() -> None:
    files = {
        INC + "a.h": b'#include "b.h"\n#include "a.h"\n',
        INC + "b.h": b'#include "a.h"\n',
    }
    followed: set[str] = set()
    got = missing_includes(files, {INC + "a.h"}, entries=[INC + "a.h"], followed=followed)
    assert followed == {INC + "a.h", INC + "b.h"}
    assert [(m.includer, m.header) for m in got] == [(INC + "a.h", "b.h")]


def test_directory_tree_same_as_mapping(tmp_path: Path) -> None:
    files = {
        CSRC + "a.cu": b"#include <flashinfer/x.cuh>\n",
        INC + "flashinfer/x.cuh": b'#include "y.cuh"\n',
        INC + "flashinfer/y.cuh": b"",
    }
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    bundle = {CSRC + "a.cu", INC + "flashinfer/x.cuh"}
    as_dir = missing_includes(tmp_path, bundle, entries=[CSRC + "a.cu"])
    assert as_dir == _run(files, bundle, CSRC + "a.cu")
    assert [m.resolved for m in as_dir] == [INC + "flashinfer/y.cuh"]


def test_bundle_members_selection() -> None:
    names = [
        "flashinfer/__init__.py",
        "flashinfer/jit/env.py",
        "flashinfer/data/build_backend.py",  # Python under data/: no
        "flashinfer/data/aot/x.so",
        "flashinfer_python-0.7.2.dist-info/METADATA",
        "b12x/__init__.py",  # another top-level package of the wheel: no
        INC + "flashinfer/page.cuh",
        D + "cccl/thrust/thrust/sort.h",
        D + "spdlog/include/spdlog/spdlog.h",
        D + "cutlass/include/cute/tensor.hpp",
        UTIL + "cutlass/util/command_line.h",
        D + "cutlass/tools/util/scripts/split_test_cmake.py",  # no
        D + "cutlass/python/cutlass/x.py",  # no
        CSRC + "batch_prefill_sm90.cu",
        CSRC + "batch_decode_kernel_inst.jinja",
        CSRC + "tvm_ffi_utils.h",
        CSRC + "norm.cu",
        CSRC + "rope.cu",  # no
        CSRC + "xqa/mha.cuh",  # csrc subfolders: no
        CSRC + "nv_internal/x.h",
        INC + "flashinfer/",  # a directory entry: no
    ]
    assert bundle_members(names) == sorted(
        [
            "flashinfer/__init__.py",
            "flashinfer/jit/env.py",
            "flashinfer_python-0.7.2.dist-info/METADATA",
            INC + "flashinfer/page.cuh",
            D + "cccl/thrust/thrust/sort.h",
            D + "spdlog/include/spdlog/spdlog.h",
            D + "cutlass/include/cute/tensor.hpp",
            UTIL + "cutlass/util/command_line.h",
            CSRC + "batch_prefill_sm90.cu",
            CSRC + "batch_decode_kernel_inst.jinja",
            CSRC + "tvm_ffi_utils.h",
            CSRC + "norm.cu",
        ]
    )


# --- the real wheel (pip download once into .venv/gpu-check-wheels; seconds after that) ---


@pytest.fixture(scope="module")
def wheel() -> Path:
    return fetch_wheel(REQUIREMENT, DEFAULT_CACHE)


def test_real_wheel_bundle_passes(wheel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(wheel) == []
    with zipfile.ZipFile(wheel) as zf:
        members = bundle_members(zf.namelist())
    for srcs in ENTRY_SOURCES.values():
        assert set(srcs) <= set(members)
    assert main(["check", "--wheel", str(wheel)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("ok: ") and f"bundle {len(members)} files" in out[0]
    assert main(["list", "--wheel", str(wheel)]) == 0
    assert capsys.readouterr().out.split() == members


def test_real_wheel_without_cutlass_util_fails(
    wheel: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with zipfile.ZipFile(wheel) as zf:
        members = bundle_members(zf.namelist())
    slim = {m for m in members if not m.startswith(UTIL)}
    assert len(slim) < len(members)
    problems = check(wheel, slim)
    hit = [p for p in problems if "cutlass/util/command_line.h" in p]
    assert len(hit) == 1
    assert "flashinfer/data/include/flashinfer/cutlass_utils.cuh:" in hit[0]
    assert all(p.startswith("missing ") and UTIL in p for p in problems)
    # the sm90 prefill reaches it; an entry dropped from the bundle is named as such
    no_entry = set(members) - {CSRC + "batch_prefill_sm90.cu"}
    assert any("batch_prefill_sm90.cu is not in the bundle" in p for p in check(wheel, no_entry))


# --- benchmarks/gpu/wheelhouse.py ---


def test_fetch_wheel_uses_cache_without_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pip(*_a: object, **_k: object) -> None:
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(_wheels.subprocess, "run", no_pip)
    (tmp_path / "foo_bar-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "foo_bar-2.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (tmp_path / "foo_bar-3.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")  # not 3.12
    (tmp_path / "foo_bar-4.0-cp312-cp312-macosx_11_0_arm64.whl").write_bytes(b"")  # not linux
    assert fetch_wheel("Foo-Bar==1.0", tmp_path).name == "foo_bar-1.0-py3-none-any.whl"
    assert fetch_wheel("foo_bar", tmp_path).name.startswith("foo_bar-2.0-cp312")


def test_fetch_wheel_raises_with_pip_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **_k: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(_wheels.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        fetch_wheel("nothing_here==9.9", tmp_path / "cache")
    cmd = seen[0]
    assert cmd[-1] == "nothing_here==9.9" and "--no-deps" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in cmd and "--only-binary=:all:" in cmd
