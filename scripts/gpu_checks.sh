#!/usr/bin/env bash
# GPU checks for a CUDA machine (CI has none): the `gpu`-marked tests (kernels, the plugin's
# Triton path, compaction on CUDA) and the decode kernel benchmark, in one run. Run from the
# repo root with the machine's own python3 (torch + triton + pytest); no .venv, no SGLang.
#
#   OUT=/tmp/gpu bash scripts/gpu_checks.sh [triton|all]   (default all)
#
# `all` also times stock FlashInfer decode (no beta) beside the Triton kernel, when FlashInfer
# is importable: if `.whl/` holds `flashinfer_slim.tar.xz` (the flashinfer_python package
# without the kernels we never build) and an apache-tvm-ffi wheel, they are unpacked into
# /tmp/site first (its JIT build takes minutes the first time, cached under
# ~/.cache/flashinfer). Logs and JSON land in $OUT; a summary table is printed last.
#
# Making .whl/ (on a machine with pip access; only the Python code, headers and the batch
# decode/prefill sources of the 65 MB wheel are kept, to keep the bundle small):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d /tmp/w \
#       flashinfer_python==0.7.2 "apache-tvm-ffi>=0.1.11,<0.2"   (add --platform manylinux_2_28_x86_64)
#   (cd /tmp/w && unzip -q flashinfer_python-*.whl && { find flashinfer -name '*.py' \
#       -not -path '*/data/*'; find flashinfer_python-*.dist-info -type f; find \
#       flashinfer/data/{include,spdlog,cccl,cutlass/include} -type f; find flashinfer/data/csrc \
#       -maxdepth 1 -type f \( -name 'batch_decode*' -o -name 'batch_prefill*' -o -name '*.h' \
#       -o -name '*.cuh' \); } > list && tar -cJf flashinfer_slim.tar.xz -T list)
#   cp /tmp/w/flashinfer_slim.tar.xz /tmp/w/apache_tvm_ffi-*.whl .whl/   (~15 MB)
set -u
OUT=${OUT:-/tmp/gpu_checks}
WHAT=${1:-all}
case "$WHAT" in triton | all) ;; *) echo "usage: OUT=DIR bash $0 [triton|all]" >&2; exit 2 ;; esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)

if [ -f .whl/flashinfer_slim.tar.xz ] && [ "$WHAT" != triton ]; then
    mkdir -p /tmp/site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    tar -xJf .whl/flashinfer_slim.tar.xz -C /tmp/site || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"

timeout 300 "${PYTEST[@]}" -m gpu \
    tests/compaction_kernels tests/sglang_ext/test_attention_triton.py \
    tests/sglang_ext/test_cascade.py tests/compactor/test_device_agnostic.py 2>&1 | tee "$OUT/triton_tests.log"
status=${PIPESTATUS[0]}

if [ "$WHAT" != triton ] && "$PY" -c "import flashinfer" 2>/dev/null; then
    # Triton + beta (uniform and ragged per head) beside stock FlashInfer (no beta); the first
    # plan() JIT-compiles FlashInfer.
    timeout 500 "$PY" -m benchmarks.gpu.decode_attention \
        --kernels flashinfer_stock triton_beta triton_beta_ragged \
        --reps 30 --out "$OUT/kernels.json" --plot "$OUT/kernels.png" >"$OUT/bench_all.log" 2>&1
    echo "benchmark exit $?" >>"$OUT/bench_all.log"
else
    timeout 330 "$PY" -m benchmarks.gpu.decode_attention --kernels triton_beta triton_beta_ragged \
        --reps 30 \
        --out "$OUT/kernels_triton.json" --plot "$OUT/kernels_triton.png" >"$OUT/bench_triton.log" 2>&1
    echo "benchmark exit $?" >>"$OUT/bench_triton.log"
fi

echo "=== summary ==="
for f in "$OUT"/*_tests.log; do echo "$(basename "$f"): $(grep -E "passed|failed|error|skipped|exit" "$f" | tail -2 | tr '\n' ' ')"; done
for f in "$OUT"/bench_*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
for j in "$OUT"/kernels*.json; do
    [ -f "$j" ] && "$PY" - "$j" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit("/", 1)[-1], r["device"], f"copy {r['copy_bandwidth_gbs']:.0f} GB/s")
for x in r["results"]:
    if "ms" in x:
        print(f"  {x['kernel']:17s} B={x['batch']:<3d} L={x['length']:<7d} {x['ms']:8.3f} ms "
              f"{x['gbs']:7.0f} GB/s ({x['frac_of_copy_bw']:.2f} of copy)")
EOF
done
exit "$status"
