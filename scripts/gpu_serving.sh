#!/usr/bin/env bash
# A real SGLang server with the plugin on a CUDA machine without network, with a wheelhouse:
# benchmarks/gpu_serving.py's three phases in one run, then gpu_serving.json + .png and the logs
# in $OUT. Run from the repo root with the machine's own python3 (torch + triton); no .venv.
#
#   bash scripts/gpu_serving.sh preflight     # HERE, on CPU: every check a GPU run could fail
#   bash scripts/gpu_serving.sh pack          # HERE (pip works): the wheelhouse, .whl/gpu_serving/p1..p2
#   OUT=/tmp/o bash scripts/gpu_serving.sh    # THERE, with the parts copied next to the repo
#
# The wheelhouse (in parts of at most PART_MB MiB, default 48; `pack` prints them):
#   - the wheels of scripts/gpu_wheels.txt (SGLang 0.5.23 and the pure-Python needs a CUDA
#     image with torch lacks), installed with --no-deps into /tmp/site;
#   - FlashInfer 0.7.2's serving bundle: the members benchmarks/_preflight_flashinfer.py lists
#     (Python code, headers, and the sources SGLang's FlashInfer backend and sampler JIT-compile).
# No model travels: the run makes random-weight checkpoints on the GPU and serves token ids.
# Not in the wheelhouse: sglang-kernel (SGLang's compiled CUDA package: too large, built for another
# torch). scripts/gpu_standin/ (a CHECK-ONLY torch stand-in for the sgl_kernel ops SGLang
# imports, and for the CuteDSL dual GEMM's module) goes first on PYTHONPATH for this script
# only; it is never installed. The plugin's entry point is a hand-written dist-info in /tmp/site;
# the code is this tree.
#
# Parts are staged into /tmp/gpu_serving/stage (parts copied in over several runs add up there);
# once all are there the script installs them and runs every phase within BUDGET_S seconds
# (default 540), writing each phase's record as it ends.
set -u
cd "$(dirname "$0")/.."
PARTS=.whl/gpu_serving
PART_MB=${PART_MB:-48}

if [ "${1:-}" = preflight ]; then
    exec "${PY:-.venv/bin/python}" -m benchmarks.gpu_preflight "${@:2}"
fi

if [ "${1:-}" = pack ]; then
    # Here, on a machine with pip: download, build the bundle, split into parts.
    set -e
    PY=${PY:-.venv/bin/python}
    w=$(mktemp -d)
    plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
          --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
          --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
    dl=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
        --implementation cp "${plat[@]}")
    "${dl[@]}" -d "$w/files" -r <(grep -v '^#' scripts/gpu_wheels.txt)
    "${dl[@]}" -d "$w/fi" flashinfer_python==0.7.2
    # the bundle's members: benchmarks/_preflight_flashinfer.py (its `check` vets them on CPU)
    "$PY" -m benchmarks._preflight_flashinfer list --wheel "$w"/fi/flashinfer_python-*.whl > "$w/fi/list"
    (cd "$w/fi" && unzip -q flashinfer_python-*.whl \
        && tar -cJf "$w/files/flashinfer_serving.tar.xz" -T list)
    (cd "$w/files" && sha256sum -- * > ../MANIFEST)
    PARTS=${PACK_DIR:-$PARTS}
    rm -rf "$PARTS" && mkdir -p "$PARTS"
    # first-fit by size into parts of PART_MB MiB; every part holds the manifest
    "$PY" - "$w" "$PARTS" "$PART_MB" <<'EOF'
import os, shutil, sys
w, parts, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
files = sorted(os.listdir(f"{w}/files"), key=lambda f: -os.path.getsize(f"{w}/files/{f}"))
bins: list[list[str]] = []
sizes: list[int] = []
for f in files:
    s = os.path.getsize(f"{w}/files/{f}")
    i = next((i for i, u in enumerate(sizes) if u + s <= mb << 20), None)
    if i is None:
        bins.append([]), sizes.append(0)
        i = len(bins) - 1
    bins[i].append(f)
    sizes[i] += s
for i, fs in enumerate(bins, 1):
    os.makedirs(f"{parts}/p{i}")
    shutil.copy(f"{w}/MANIFEST", f"{parts}/p{i}/MANIFEST")
    for f in fs:
        shutil.copy(f"{w}/files/{f}", f"{parts}/p{i}/{f}")
    print(f"p{i}: {len(fs)} files, {sizes[i - 1] >> 20} MiB")
EOF
    rm -rf "$w"
    exit 0  # .whl/ is in .gitignore: the parts are copied to the GPU machine, never committed
fi

OUT=${OUT:-/tmp/gpu_serving_out}
WORK=${GPU_SERVING_WORK:-/tmp/gpu_serving}
STAGE=$WORK/stage
SITE=${GPU_SERVING_SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$OUT" "$STAGE" "$WORK/state"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# 1. stage the parts found next to the repository
for part in "$PARTS"/p*; do
    [ -d "$part" ] && cp -f "$part"/* "$STAGE"/ && echo "staged $(basename "$part")"
done
if [ ! -f "$STAGE/MANIFEST" ]; then
    echo "nothing staged: copy .whl/gpu_serving/pN here first (made by bash scripts/gpu_serving.sh pack)"
    exit 2
fi
missing=$(cd "$STAGE" && while read -r _ f; do [ -f "$f" ] || echo "$f"; done < MANIFEST)
if [ -n "$missing" ]; then
    echo "staged so far; still missing (copy their parts next):"
    echo "$missing" | sed 's/^/  /'
    exit 0
fi

# 2. install once: wheels, FlashInfer, the plugin's entry point
if [ ! -f "$WORK/installed" ]; then
    (cd "$STAGE" && sha256sum -c --quiet MANIFEST) || { echo "staged files corrupt"; exit 1; }
    mkdir -p "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$STAGE"/*.whl || exit 1
    tar -xJf "$STAGE/flashinfer_serving.tar.xz" -C "$SITE" || exit 1
    di="$SITE/sglang_compaction-0.1.0.dist-info"
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: sglang-compaction\nVersion: 0.1.0\n' > "$di/METADATA"
    printf '[sglang.srt.plugins]\ncompaction = sglang_ext:register\n' > "$di/entry_points.txt"
    touch "$WORK/installed"
    echo "installed into $SITE"
fi
export PYTHONPATH=$PWD/scripts/gpu_standin:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export COMPACTOR_HOME=$WORK/compactor

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton, sglang, flashinfer, sgl_kernel; print('torch', torch.__version__, \
'triton', triton.__version__, 'sglang', sglang.__version__, 'flashinfer', flashinfer.__version__, \
'sgl_kernel stand-in', getattr(sgl_kernel, '__standin__', False))" 2>&1 | tee -a "$OUT/gpu.txt"

# 3. the phases, one run (each record and the merged report written as each phase ends)
timeout $((${BUDGET_S:-540} + 30)) "$PY" -m benchmarks.gpu_serving run --state "$WORK/state" \
    --out "$OUT" --budget-s "${BUDGET_S:-540}" 2>&1 | grep -v "it/s]" | tee "$OUT/run.log" | tail -60
status=${PIPESTATUS[0]}
(cd "$WORK/state" && tar -czf "$OUT/logs.tar.gz" logs *.json 2>/dev/null)
exit "$status"
