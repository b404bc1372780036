#!/usr/bin/env bash
# The GPU run: a real SGLang server with the plugin on a CUDA machine without network, with a
# wheelhouse, and the compaction speed benchmark. Run from the repo root; on the GPU machine
# with its own python3 (torch + triton), no .venv.
#
#   bash scripts/gpu_serving.sh preflight     # HERE, on CPU: every check a GPU run could fail
#   bash scripts/gpu_serving.sh plan          # HERE: the device calls, their seconds; exit 1 if
#                                             #   they do not fit one session's device time
#   bash scripts/gpu_serving.sh pack          # HERE (pip works): .whl/gpu_serving/site.tar.xz
#   OUT=/tmp/o bash scripts/gpu_serving.sh    # THERE, call 1 (carry .whl/gpu_serving): the
#                                             #   serving phases, the GPU tests beside them
#   OUT=/tmp/o bash scripts/gpu_serving.sh compaction   # THERE, call 2: compaction speed,
#                                             #   then the compacted decode step's attention
#
# The wheelhouse is ONE archive (xz of the unpacked files, under the 64 MiB a call carries):
# the wheels of scripts/gpu_wheels.txt (SGLang 0.5.23 and the pure-Python needs a CUDA image
# with torch lacks) unpacked as pip would install them with --no-deps, and FlashInfer 0.7.2's
# serving bundle (the members benchmarks/gpu/preflight/flashinfer.py lists: Python code, headers,
# the sources SGLang's FlashInfer backend JIT-compiles). Left out (PACK_DROP): SGLang's
# diffusion server (sglang/multimodal_gen) and its benchmark extension, which serving never
# imports. No model travels: the run makes random-weight checkpoints on the GPU and serves
# token ids. Not in the wheelhouse: sglang-kernel (SGLang's compiled CUDA package: too large,
# built for another torch). scripts/gpu_standin/ (a CHECK-ONLY torch stand-in for the
# sgl_kernel ops SGLang imports, and for the CuteDSL dual GEMM's module) goes first on
# PYTHONPATH for this script only; it is never installed. The plugin's entry point is a
# hand-written dist-info in /tmp/site; the code is this tree.
#
# Call 1 installs once (a warm machine keeps /tmp/site and the phase records), starts the GPU
# tests (`pytest -m gpu`, niced) beside the serving run, and gives the phases what is left of
# BUDGET_S (default 540: the plan's command limit); GPU_SERVING_ARGS adds flags of
# `python -m benchmarks.gpu.serving.run run` (e.g. --compaction-timeout 90). PHASES=a,b runs only those; a phase whose
# record in /tmp/gpu_serving/state holds no error is not run again. What comes back in $OUT:
# gpu_serving.json + .png, logs.tar.gz (every log and phase record).
set -u
cd "$(dirname "$0")/.."
WHEELHOUSE=.whl/gpu_serving
PACK_DROP=(sglang/multimodal_gen "sglang/srt/rust_extensions/_bench*.so")

case "${1:-}" in
    preflight) exec "${PY:-.venv/bin/python}" -m benchmarks.gpu.preflight.run "${@:2}" ;;
    plan) exec "${PY:-.venv/bin/python}" -m benchmarks.gpu.serving.plan "${@:2}" ;;
    pack | compaction | "") ;;
    *) echo "usage: bash $0 [preflight|plan|pack|compaction]" >&2; exit 2 ;;
esac

if [ "${1:-}" = pack ]; then
    # Here, on a machine with pip: download, unpack into one site folder, one xz archive.
    set -e
    PY=${PY:-.venv/bin/python}
    w=$(mktemp -d)
    trap 'rm -rf "$w"' EXIT
    plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
          --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
          --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
    dl=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
        --implementation cp "${plat[@]}")
    "${dl[@]}" -d "$w/files" -r <(grep -v '^#' scripts/gpu_wheels.txt)
    "${dl[@]}" -d "$w/fi" flashinfer_python==0.7.2
    mkdir -p "$w/site"
    for whl in "$w"/files/*.whl; do  # a wheel's purelib/platlib root is the site folder
        unzip -q -o "$whl" -x '*.data/*' -d "$w/site"
    done
    # FlashInfer: only the bundle's members (benchmarks/gpu/preflight/flashinfer.py; its `check`
    # vets them on CPU)
    "$PY" -m benchmarks.gpu.preflight.flashinfer list --wheel "$w"/fi/flashinfer_python-*.whl > "$w/fi/list"
    (cd "$w/fi" && unzip -q flashinfer_python-*.whl && tar -cf - -T list) | tar -xf - -C "$w/site"
    for drop in "${PACK_DROP[@]}"; do
        # shellcheck disable=SC2086  # the glob in a PACK_DROP entry expands here
        (cd "$w/site" && rm -rf $drop)
    done
    out=${PACK_DIR:-$WHEELHOUSE}
    rm -rf "$out" && mkdir -p "$out"
    (cd "$w/site" && tar -cf - .) | xz -9 -T2 > "$out/site.tar.xz"
    (cd "$out" && sha256sum site.tar.xz > MANIFEST)
    echo "wheelhouse: $out/site.tar.xz, $(($(stat -c %s "$out/site.tar.xz") >> 20)) MiB"
    exit 0  # .whl/ is in .gitignore: carried to the GPU machine, never committed
fi

OUT=${OUT:-/tmp/gpu_serving_out}
WORK=${GPU_SERVING_WORK:-/tmp/gpu_serving}
SITE=${GPU_SERVING_SITE:-/tmp/site}
PY=${PY:-python3}
T0=$(date +%s)
mkdir -p "$OUT" "$WORK/state/logs"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

if [ "${1:-}" = compaction ]; then
    # Call 2: torch, Triton and transformers are the machine's own; nothing to install. Then
    # the plugin's per-layer attention work in one compacted decode step (no server).
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    timeout $((${BUDGET_S:-300} + 60)) "$PY" -m benchmarks.gpu.compaction_speed_gpu --skip layer \
        --budget-s "${BUDGET_S:-300}" --out "$OUT" 2>&1 | tee "$OUT/compaction.log" | tail -40
    status=${PIPESTATUS[0]}
    timeout 120 "$PY" -m benchmarks.gpu.cascade_step --out "$OUT/cascade_step.json" 2>&1 \
        | tee "$OUT/cascade_step.log" | tail -5
    exit $((status | PIPESTATUS[0]))
fi

# 1. install once: the wheelhouse, the plugin's entry point
if [ ! -f "$WORK/installed" ]; then
    if [ ! -f "$WHEELHOUSE/site.tar.xz" ]; then
        echo "no wheelhouse: make it with 'bash scripts/gpu_serving.sh pack' and carry $WHEELHOUSE"
        exit 2
    fi
    (cd "$WHEELHOUSE" && sha256sum -c --quiet MANIFEST) || { echo "wheelhouse corrupt"; exit 1; }
    mkdir -p "$SITE" && tar -xJf "$WHEELHOUSE/site.tar.xz" -C "$SITE" || exit 1
    di="$SITE/sglang_compaction-0.1.0.dist-info"
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: sglang-compaction\nVersion: 0.1.0\n' > "$di/METADATA"
    printf '[sglang.srt.plugins]\ncompaction = sglang_ext:register\n' > "$di/entry_points.txt"
    touch "$WORK/installed"
    echo "installed into $SITE in $(($(date +%s) - T0)) s"
fi
export PYTHONPATH=$PWD/scripts/gpu_standin:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export COMPACTOR_HOME=$WORK/compactor

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$WORK/state/logs/gpu.txt"
"$PY" -c "import torch, triton, sglang, flashinfer, sgl_kernel; print('torch', torch.__version__, \
'triton', triton.__version__, 'sglang', sglang.__version__, 'flashinfer', flashinfer.__version__, \
'sgl_kernel stand-in', getattr(sgl_kernel, '__standin__', False))" 2>&1 | tee -a "$WORK/state/logs/gpu.txt"

# 2. the kernels' and the cascade's GPU tests beside the servers' start (niced: the FlashInfer
# JIT comes first), stopped after GPU_TESTS_S (default 190) so that they are over before the
# servers are ready and the first figure is read
nice -n 10 timeout "${GPU_TESTS_S:-190}" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/compaction_kernels tests/sglang_ext/test_attention_triton.py \
    tests/sglang_ext/test_cascade.py > "$WORK/state/logs/gpu_tests.log" 2>&1 &
tests=$!

# 3. the phases, in what is left of BUDGET_S (each record and the merged report written as
# each phase ends)
left=$((${BUDGET_S:-540} - ($(date +%s) - T0)))
timeout $((left + 15)) "$PY" -m benchmarks.gpu.serving.run run --state "$WORK/state" --out "$OUT" \
    --budget-s $((left - 15)) ${PHASES:+--phases "$PHASES"} ${GPU_SERVING_ARGS:-} 2>&1 \
    | grep -v "it/s]" \
    | tee "$WORK/state/logs/run.log" | tail -60
status=${PIPESTATUS[0]}
wait "$tests"
echo "gpu tests exit $?" >> "$WORK/state/logs/gpu_tests.log"
(cd "$WORK/state" && tar -czf "$OUT/logs.tar.gz" logs ./*.json 2>/dev/null)
echo "=== gpu tests: $(grep -E "passed|failed|error" "$WORK/state/logs/gpu_tests.log" | tail -1)"
exit "$status"
