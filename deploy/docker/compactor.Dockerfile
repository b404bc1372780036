# Compaction service, GPU (CUDA). Build from the repository root:
#   docker build -f deploy/docker/compactor.Dockerfile -t compactor:gpu \
#     --build-arg MODEL_SRC=path/in/context/to/checkpoint .      # optional: bake a model in
# Without MODEL_SRC nothing is baked: mount a checkpoint at /models/model.
# The same image runs the Ray head (`compactor serve --ray-address auto`) and the GPU workers
# (`ray start --address ...`); the model must sit at the same path on every node.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    COMPACTOR_HOME=/var/lib/compactor VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && python3.11 -m venv /opt/venv && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/compactor/src
# The locked requirements first (layer cache): every distribution pinned, each file's sha256
# checked, nothing resolved at build time. PyPI's torch wheel is the CUDA build.
COPY requirements/ requirements/
RUN pip install --require-hashes --no-deps -r requirements/lock.txt
COPY pyproject.toml README.md ./
COPY compactor/ compactor/
COPY sglang_ext/ sglang_ext/
COPY compaction_kernels/ compaction_kernels/
RUN pip install --no-deps . && compactor --version
COPY deploy/docker/healthcheck.py deploy/ray/wait_for_gpus.py /opt/compactor/

ARG MODEL_SRC=deploy/docker/no-model
COPY ${MODEL_SRC} /models/model

# An unprivileged user (uid 1000, as the Kubernetes manifests' securityContext), owning only
# its home and the service's state directory.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin app \
    && mkdir -p /var/lib/compactor && chown 1000:1000 /var/lib/compactor
USER 1000

# gRPC, Prometheus /metrics, Ray GCS (for the cluster's own nodes only; the Ray dashboard
# stays on loopback)
EXPOSE 50051 9090 6379
# By default: TLS and the token from /etc/compactor (mount the Secret there; see
# deploy/k8s/base/secret.example.yaml). Plaintext on 0.0.0.0 is refused without --insecure.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s \
    CMD ["python", "/opt/compactor/healthcheck.py", "--address", "127.0.0.1:50051", "--tls-ca", "/etc/compactor/ca.crt", "--tls-server-name", "compactor"]
ENTRYPOINT ["compactor", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--model", "/models/model", "--metrics-port", "9090", "--workers", "1", "--tls-cert", "/etc/compactor/tls.crt", "--tls-key", "/etc/compactor/tls.key", "--auth-token-file", "/etc/compactor/token"]
