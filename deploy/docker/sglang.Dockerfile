# SGLang with the compaction plugin, GPU (CUDA). Build from the repository root:
#   docker build -f deploy/docker/sglang.Dockerfile -t sglang-compaction:gpu \
#     --build-arg MODEL_SRC=path/in/context/to/checkpoint .      # optional: bake a model in
# Without MODEL_SRC mount the checkpoint at /models/model. It must be the very same checkpoint
# the compaction service loads: results are tied to the weights' fingerprint.
# -devel base: FlashInfer/Triton compile kernels at run time (JIT) and need nvcc.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
       build-essential curl \
    && python3.11 -m venv /opt/venv && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/compactor/src
COPY requirements/ requirements/
# On GPU, SGLang is installed WITH its dependencies (sgl-kernel, flashinfer) in the same
# resolver run as our pins, so a conflict fails the build. No CPU sgl_kernel stand-in here.
RUN pip install -r requirements/base.txt "$(grep '^sglang==' requirements/nodeps.txt)"
# Prefill/decode disaggregation (deploy/k8s/overlays/pd): SGLang's Mooncake transfer backend
# (the CUDA 12 wheel; its engine.so links libibverbs, libnl and libnuma) and the PD router,
# the versions the CPU PD tests run (scripts/setup_pd_deps.sh: the non-CUDA Mooncake wheel).
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libnl-3-200 \
       libnl-route-3-200 libnuma1 && rm -rf /var/lib/apt/lists/* \
    && pip install "mooncake-transfer-engine==0.3.13.post1" "sglang-router==0.3.2" \
    && python -c "import sglang_router.launch_router"
COPY pyproject.toml README.md ./
COPY compactor/ compactor/
COPY sglang_ext/ sglang_ext/
COPY compaction_kernels/ compaction_kernels/
# The plugin registers through the sglang.srt.plugins entry point of this distribution.
RUN pip install --no-deps . && python -c "import sglang_ext, sglang.srt.server_args"

ARG MODEL_SRC=deploy/docker/no-model
COPY ${MODEL_SRC} /models/model

# An unprivileged user (uid 1000, as the Kubernetes manifests' securityContext), owning only
# its home.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin app
USER 1000

EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s \
    CMD ["curl", "-fsS", "http://127.0.0.1:30000/health"]
ENTRYPOINT ["python", "-m", "sglang.launch_server"]
CMD ["--model-path", "/models/model", "--host", "0.0.0.0", "--port", "30000", "--enable-metrics", "--compaction-endpoint", "compactor:50051"]
