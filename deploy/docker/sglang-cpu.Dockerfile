# SGLang with the compaction plugin, CPU-only (local use, the compose file). Build from the
# repository root, after the compactor CPU image (its model is copied, byte for byte, so both
# sides see the same weights fingerprint):
#   docker build -f deploy/docker/compactor-cpu.Dockerfile -t compactor:cpu .
#   docker build -f deploy/docker/sglang-cpu.Dockerfile -t sglang-compaction:cpu .
ARG COMPACTOR_IMAGE=compactor:cpu
FROM ${COMPACTOR_IMAGE} AS model

FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 SGLANG_USE_CPU_ENGINE=1
RUN apt-get update && apt-get install -y --no-install-recommends curl libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/compactor/src
COPY requirements/ requirements/
# Same recipe as scripts/setup.sh: pinned pure-Python needs, SGLang --no-deps; CPU torch.
# torch/torchvision from the PyTorch CPU index alone (pinned in base.txt); then everything
# from PyPI alone: no package name is ever looked up on two indexes (dependency confusion).
RUN grep -E '^(torch|torchvision)==' requirements/base.txt \
    | pip install --no-deps --index-url https://download.pytorch.org/whl/cpu -r /dev/stdin \
    && pip install -r requirements/base.txt \
    && pip install --no-deps -r requirements/nodeps.txt
COPY third_party/sgl-kernel-cpu/ third_party/sgl-kernel-cpu/
COPY pyproject.toml README.md ./
COPY compactor/ compactor/
COPY sglang_ext/ sglang_ext/
COPY compaction_kernels/ compaction_kernels/
# The pure-torch sgl_kernel stand-in: CPU images only.
RUN pip install --no-deps ./third_party/sgl-kernel-cpu . \
    && python -c "import sgl_kernel, sglang_ext, sglang.srt.server_args"
COPY --from=model /models/model /models/model

# An unprivileged user (uid 1000, as the Kubernetes manifests' securityContext), owning only
# its home.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin app
USER 1000

EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s \
    CMD ["curl", "-fsS", "http://127.0.0.1:30000/health"]
ENTRYPOINT ["python", "-m", "sglang.launch_server"]
CMD ["--model-path", "/models/model", "--host", "0.0.0.0", "--port", "30000", "--device", "cpu", "--max-total-tokens", "16384", "--enable-metrics", "--compaction-endpoint", "compactor:50051"]
