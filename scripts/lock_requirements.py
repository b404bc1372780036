"""Write `requirements/lock.txt`: every distribution `make setup` installs, pinned, with hashes.

The closure is read from an installed environment (the one `make setup` built, this script's
interpreter): the pins of `requirements/base.txt` and everything they require (markers
evaluated here), plus `requirements/nodeps.txt` (installed without dependencies). Each
`name==version` gets the sha256 of every file PyPI lists for that version that can install on
CPython 3.11 under Linux (x86_64 or aarch64 wheels, pure-Python wheels, the sdist), read from
PyPI's JSON simple API (PEP 691). Install with

    pip install --require-hashes --no-deps -r requirements/lock.txt

which refuses any file whose hash is not listed, and any package not in the lock.

    .venv/bin/python scripts/lock_requirements.py            # rewrite requirements/lock.txt
    .venv/bin/python scripts/lock_requirements.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
INDEX = "https://pypi.org/simple"
PLATFORM = re.compile(r"^(any|(many|musl)linux\w*_(x86_64|aarch64))$")
HEADER = """\
# Every distribution `make setup` installs (requirements/base.txt, its dependencies, and
# requirements/nodeps.txt), pinned, with the sha256 of each PyPI file of that version for
# CPython 3.11 on Linux. Written by scripts/lock_requirements.py; do not edit by hand.
#   pip install --require-hashes --no-deps -r requirements/lock.txt
"""


def pins(path: Path) -> list[Requirement]:
    """The requirements of a requirements file (comments and blank lines skipped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(Requirement(line))
    return out


def closure(roots: list[Requirement], no_deps: list[Requirement]) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and what they require, plus `no_deps`.

    Raises SystemExit naming a requirement that is not installed here.
    """
    found: dict[str, str] = {}
    todo = [(r, True) for r in roots] + [(r, False) for r in no_deps]
    while todo:
        req, follow = todo.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"lock: {req} is not installed in {sys.prefix}; run `make setup` first")
        found[name] = dist.version
        if not follow:
            continue
        for spec in dist.requires or []:
            dep = Requirement(spec)
            extras = req.extras or {""}
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append((dep, True))
    return found


def _installs_here(filename: str) -> bool:
    """Whether a file can install on CPython 3.11 / Linux (x86_64, aarch64) or is the sdist."""
    if not filename.endswith(".whl"):
        return filename.endswith((".tar.gz", ".zip"))
    _, _, _, tags = parse_wheel_filename(filename)
    return any(_python_ok(t.interpreter, t.abi) and PLATFORM.match(t.platform) for t in tags)


def _python_ok(interpreter: str, abi: str) -> bool:
    """CPython 3.11 runs it: pure Python 3 (py3, py3X <= 3.11), cp311, or the stable ABI of a
    CPython 3.X <= 3.11 (cp3X-abi3)."""
    m = re.fullmatch(r"(py|cp)3(\d*)", interpreter)
    if not m or (m.group(2) and int(m.group(2)) > 11):
        return False
    if abi == "none":
        return True
    return (abi == "abi3" and m.group(1) == "cp") or (abi == "cp311" and interpreter == "cp311")


def file_version(filename: str) -> str:
    if filename.endswith(".whl"):
        return str(parse_wheel_filename(filename)[1])
    return str(parse_sdist_filename(filename)[1])


def hashes(name: str, version: str) -> list[str]:
    """sha256 of PyPI's files of name==version that install here (sorted); SystemExit if none."""
    req = urllib.request.Request(
        f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    out = set()
    for f in files:
        try:
            ok = file_version(f["filename"]) == version and _installs_here(f["filename"])
        except ValueError:  # a file name PyPI kept from before the naming rules
            continue
        if ok and "sha256" in f.get("hashes", {}):
            out.add(f["hashes"]["sha256"])
    if not out:
        sys.exit(f"lock: PyPI lists no file of {name}=={version} for CPython 3.11 on Linux")
    return sorted(out)


def render(found: dict[str, str], hashed: dict[str, list[str]]) -> str:
    lines = [HEADER]
    for name in sorted(found):
        lines.append(f"{name}=={found[name]} \\")
        lines.extend(f"    --hash=sha256:{h}" + (" \\" if i + 1 < len(hashed[name]) else "")
                     for i, h in enumerate(hashed[name]))  # fmt: skip
    return "\n".join(lines) + "\n"


def read_lock(text: str) -> dict[str, str]:
    """{canonical name: version} of a lock file's text."""
    return {
        canonicalize_name(m.group(1)): m.group(2)
        for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+) \\$", text, re.M)
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="only compare the lock's pins to here")
    args = p.parse_args(argv)
    req = ROOT / "requirements"
    found = closure(pins(req / "base.txt"), pins(req / "nodeps.txt"))
    if args.check:
        locked = read_lock(LOCK.read_text()) if LOCK.exists() else {}
        if locked != found:
            diff = sorted(set(locked.items()) ^ set(found.items()))
            print(f"lock: {LOCK} is out of date: {diff[:20]}", file=sys.stderr)
            return 1
        print(f"lock: {len(found)} distributions, up to date")
        return 0
    try:
        from tqdm import tqdm

        names = tqdm(sorted(found), desc="hashes", unit="pkg")
    except ImportError:
        names = sorted(found)
    hashed = {n: hashes(n, found[n]) for n in names}
    LOCK.write_text(render(found, hashed))
    print(f"lock: wrote {len(found)} distributions to {LOCK.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
