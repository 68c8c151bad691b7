# CPU image of deepinfer (the reference ops; what `docker compose up` runs). The GPU image is Dockerfile.nvidia.
# Build context: .dockerignore lets in only what the COPY lines below name.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY kernels ./kernels
COPY services ./services
COPY proto ./proto
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    && pip install ".[otlp]"
# An unprivileged user (uid 10001, the runAsUser of deploy/kubernetes) owning the directories services write:
# /models (generated tiny models), /kv (the kvstore's disk tier), /cache (DEEPINFER_CACHE_DIR). A named volume
# mounted on one of them starts with this ownership.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin deepinfer \
    && mkdir -p /models /kv /cache && chown deepinfer:deepinfer /models /kv /cache
USER 10001
ENV DEEPINFER_ACCELERATOR=cpu DEEPINFER_CACHE_DIR=/cache
# `deepinfer up` runs the whole mesh in this one container; beyond loopback it needs DEEPINFER_API_KEYS (or
# DEEPINFER_API_KEY_FILE). docker-compose.yml and deploy/kubernetes run one service per container instead.
ENTRYPOINT ["deepinfer"]
CMD ["up", "--host", "0.0.0.0"]
