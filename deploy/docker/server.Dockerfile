# The shardps server image: the resource manager and server nodes (`shardps manager`,
# `shardps server`). No torch: server nodes do their optimizer math with numpy.
#
#   docker build -f deploy/docker/server.Dockerfile -t shardps/server .
#   make wheelhouse && docker build -f deploy/docker/server.Dockerfile \
#       --build-arg OFFLINE=1 -t shardps/server .          # air-gapped: wheels from ./wheelhouse only
#
# Build context: the repository root (.dockerignore keeps .venv, .git and the rest out).
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
RUN python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"]))' \
        > /requirements.txt

FROM base AS deps
# OFFLINE=1: pip reads only the wheelhouse (WHEELHOUSE, a folder of the build context whose
# name starts with "wheelhouse", made by `make wheelhouse`), never an index. OFFLINE=0: the index
# (PyPI, or the PIP_INDEX_URL build argument, which pip reads from the environment) and the
# wheelhouse if present.
ARG OFFLINE=0
ARG WHEELHOUSE=wheelhouse
ARG PIP_INDEX_URL=https://pypi.org/simple
# constraints.txt always matches, so this COPY works when the wheelhouse folder is absent.
COPY constraints.txt ${WHEELHOUSE}* /wheels/
COPY --from=requirements /requirements.txt /tmp/requirements.txt
# The dependencies (and setuptools, to build shardps below) in a layer of their own: source
# edits reuse it.
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then src=--no-index; else src=; fi; \
    python3 -m venv /opt/shardps; \
    /opt/shardps/bin/pip install --no-cache-dir --disable-pip-version-check $src --find-links /wheels \
        -c /wheels/constraints.txt -r /tmp/requirements.txt "setuptools>=77"

FROM deps AS runtime
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY shardps /src/shardps
COPY server /src/server
COPY worker /src/worker
COPY tools /src/tools
# shardps itself, without the worker extra (no torch). Then drop what only building needs
# (the wheels, the sources, pip, setuptools, the packages' own test suites); documentation,
# manual pages and translations are not needed at run time either. The state, checkpoint and
# cold-tier (--cold-dir) folders belong to the non-root user: Docker copies that ownership
# into fresh named volumes.
# The data path's numba kernels are compiled here, into NUMBA_CACHE_DIR (owned by the runtime
# user, who must be able to write to it for numba to read it): a container loads them in well
# under a second instead of compiling them (a few seconds of CPU) before its first request. A
# host whose CPU differs from the build machine's compiles once into the same folder.
RUN set -eu; \
    /opt/shardps/bin/pip install --no-cache-dir --disable-pip-version-check --no-index --no-deps \
        --no-build-isolation /src; \
    NUMBA_CACHE_DIR=/opt/shardps/numba-cache /opt/shardps/bin/python -c \
        'from shardps.server.node.node import warm_up_kernels; assert warm_up_kernels()[2] > 0'; \
    chown -R shardps:shardps /opt/shardps/numba-cache; \
    /opt/shardps/bin/pip uninstall --yes --quiet setuptools pip; \
    find /opt/shardps/lib -depth -type d -name tests -path '*/site-packages/*' -exec rm -rf {} +; \
    rm -rf /wheels /src /tmp/* /root/.cache /usr/share/doc/* /usr/share/man/* /usr/share/info/* \
        /usr/share/locale/* /var/cache/apt/* /var/lib/apt/lists/*; \
    install -d -o shardps -g shardps /var/lib/shardps/state /var/lib/shardps/cold /checkpoints

# One flat layer: the files deleted above (the wheels among them) leave the image instead of
# hiding in a lower layer (452 MB, of which numba and llvmlite are about 200 MB).
FROM scratch
COPY --from=runtime / /
ENV PATH=/opt/shardps/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    SHARDPS_LOG_FORMAT=json \
    NUMBA_CACHE_DIR=/opt/shardps/numba-cache
USER shardps:shardps
WORKDIR /home/shardps
# 7070 manager gRPC, 9100 manager metrics, 7071 server gRPC, 9101 server metrics.
EXPOSE 7070 7071 9100 9101
# gRPC health of a server node on its default port; the manager's container checks 7070
# instead (docker-compose.yml overrides this test; Kubernetes uses native gRPC probes).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["shardps", "health", "127.0.0.1:7071"]
ENTRYPOINT ["shardps"]
CMD ["server"]
