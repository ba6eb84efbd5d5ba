# The shardps worker image: `shardps worker` with torch (CPU build by default), scikit-learn
# for the demo data, matplotlib for --plot. It can run every other subcommand as well.
#
#   docker build -f deploy/docker/worker.Dockerfile -t shardps/worker .
#   make wheelhouse && docker build -f deploy/docker/worker.Dockerfile \
#       --build-arg OFFLINE=1 -t shardps/worker .           # air-gapped: wheels from ./wheelhouse only
#   docker build -f deploy/docker/worker.Dockerfile -t shardps/worker:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # GPU workers
#
# Build context: the repository root (.dockerignore keeps .venv, .git and the rest out).
# A CUDA base brings its distribution's python3 (Ubuntu 24.04: 3.12); an OFFLINE build for it
# needs a wheelhouse built for that Python and with that torch build (see docs/deploy.md).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
# Debian/Ubuntu bases without Python (such as CUDA images) get the distribution's python3.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 shardps \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/shardps --create-home \
        --shell /usr/sbin/nologin shardps

# The dependency list of pyproject.toml, alone: editing anything else in pyproject.toml
# (tool settings, the version) leaves the dependency layer below cached.
FROM base AS requirements
COPY pyproject.toml /src/
RUN python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["worker"]))' \
        > /requirements.txt

FROM base AS deps
# OFFLINE=1: pip reads only the wheelhouse (WHEELHOUSE, a folder of the build context whose
# name starts with "wheelhouse", made by `make wheelhouse`), never an index. OFFLINE=0: the index
# (PyPI, or the PIP_INDEX_URL build argument, which pip reads from the environment), torch's
# own index TORCH_INDEX_URL (the CPU builds by default) and the wheelhouse if present.
ARG OFFLINE=0
ARG WHEELHOUSE=wheelhouse
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# constraints.txt always matches, so this COPY works when the wheelhouse folder is absent.
COPY constraints.txt ${WHEELHOUSE}* /wheels/
COPY --from=requirements /requirements.txt /tmp/requirements.txt
# The dependencies (torch is the big one; setuptools builds shardps below) in a stage of their
# own: source edits reuse it.
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then src=--no-index; else src="--extra-index-url $TORCH_INDEX_URL"; fi; \
    python3 -m venv /opt/shardps; \
    /opt/shardps/bin/pip install --no-cache-dir --disable-pip-version-check $src --find-links /wheels \
        -c /wheels/constraints.txt -r /tmp/requirements.txt "setuptools>=77"

FROM deps AS build
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY shardps /src/shardps
COPY server /src/server
COPY worker /src/worker
COPY tools /src/tools
RUN /opt/shardps/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-index --no-deps \
        --no-build-isolation -w /dist /src

FROM base
# The dependency layer is the same image layer across source edits; shardps goes on top.
# pip stays in the venv so that derived images can add their own packages.
COPY --from=deps /opt/shardps /opt/shardps
COPY --from=build /dist /tmp/dist
# The workers' numba kernels (deduplication, routing, the Step reply, the lookups' backward) compiled into NUMBA_CACHE_DIR, owned by
# the runtime user (see server.Dockerfile): a container loads them instead of compiling them.
RUN /opt/shardps/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --no-deps /tmp/dist/*.whl \
 && rm -rf /tmp/dist \
 && NUMBA_CACHE_DIR=/opt/shardps/numba-cache /opt/shardps/bin/python -c \
        'import logging; from shardps.worker.runtime import prepare_kernels; assert prepare_kernels(logging)[2] > 0' \
 && chown -R shardps:shardps /opt/shardps/numba-cache
ENV PATH=/opt/shardps/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    SHARDPS_LOG_FORMAT=json \
    MPLCONFIGDIR=/tmp/matplotlib \
    NUMBA_CACHE_DIR=/opt/shardps/numba-cache
USER shardps:shardps
WORKDIR /home/shardps
# 9102: the worker's Prometheus /metrics when started with --metrics-port 9102.
EXPOSE 9102
# A worker serves no gRPC: its health is that of the link to its resource manager
# (SHARDPS_MANAGER, the same variable the worker reads), checked with the gRPC health protocol.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["sh", "-c", "exec shardps health \"${SHARDPS_MANAGER:-127.0.0.1:7070}\""]
ENTRYPOINT ["shardps"]
CMD ["worker"]
