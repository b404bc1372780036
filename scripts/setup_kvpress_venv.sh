#!/usr/bin/env bash
# Create (or reuse) third_party/.kvpress-venv: NVIDIA kvpress, the peer implementation that
# benchmarks/offline/kvpress_crosscheck.py compares our SnapKV / StreamingLLM / KVCompose / KVzip
# against. It lives in its own venv because kvpress 0.5.5 pins transformers < 5.3 while the
# project runs transformers 5.19. `make test` runs this first: the cross-check test
# (tests/integration/test_methods_real_model.py) fails without the venv. Idempotent (stamp
# file; a fresh build takes ~1.5 min and ~6 GB); the folder is gitignored.
# torch 2.14.1 comes from the local wheel cache when the machine has it (no CUDA needed).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=third_party/.kvpress-venv
STAMP="$VENV/.setup-stamp"
PINS=(
  "torch==2.14.1"
  "transformers==5.2.0"
  "kvpress==0.5.5"
  "accelerate==1.15.0"
  "numpy==2.4.6"
  "pandas<3"
  "safetensors==0.8.0"
)
want="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
    && "$VENV/bin/python" -c "import kvpress, torch, transformers" 2>/dev/null; then
  echo "setup_kvpress_venv: $VENV is up to date"
  exit 0
fi
# A venv whose interpreter no longer starts (Python upgraded or moved) is rebuilt from scratch.
if [[ -e "$VENV" ]] && ! "$VENV/bin/python" -c "" 2>/dev/null; then
  echo "setup_kvpress_venv: $VENV is broken; recreating it"
  rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup_kvpress_venv: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
echo "setup_kvpress_venv: installing ${PINS[*]} (first run: a few minutes)"
"${PIP[@]}" install -q "${PINS[@]}"
"$VENV/bin/python" -c "import kvpress, transformers; print('kvpress ok, transformers', transformers.__version__)"
echo "$want" > "$STAMP"
echo "setup_kvpress_venv: done"
