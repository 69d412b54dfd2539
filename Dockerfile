# tierd as a sidecar image: CUDA runtime, tierd with the `gpu` extra (cupy, kvikio),
# a non-root user, metrics on 9464, and a health check through gRPC health.
#   docker build -t tierd .
# A CPU-only image for machines without a GPU:
#   docker build -t tierd:cpu --build-arg BASE=python:3.12-slim --build-arg EXTRAS= --build-arg TORCH=torch==2.13.0
ARG BASE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${BASE} AS build
ARG TORCH=torch
ARG EXTRAS=gpu
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
        rm -rf /var/lib/apt/lists/*; \
    fi
COPY pyproject.toml README.md /src/
COPY tierd /src/tierd
RUN python3 -m venv /opt/tierd && \
    /opt/tierd/bin/pip install --no-cache-dir "${TORCH}" && \
    /opt/tierd/bin/pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}"

FROM ${BASE}
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*; \
    fi && \
    groupadd --system --gid 10001 tierd && \
    useradd --system --uid 10001 --gid tierd --home-dir /var/lib/tierd --create-home tierd && \
    mkdir -p /run/tierd && chown tierd:tierd /run/tierd && chmod 0700 /run/tierd
COPY --from=build /opt/tierd /opt/tierd
USER 10001:10001
ENV PATH=/opt/tierd/bin:$PATH \
    TIERD_SOCKET=/run/tierd/tierd.sock \
    TIERD_DATA_DIR=/var/lib/tierd \
    TIERD_METRICS=0.0.0.0:9464
EXPOSE 9464
VOLUME ["/var/lib/tierd"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["tierd", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tierd", "serve"]
