# tierd as a sidecar image. CPU by default; for GPU servers build with
#   --build-arg BASE=nvidia/cuda:13.0.1-runtime-ubuntu24.04 --build-arg EXTRAS=gpu --build-arg TORCH=torch
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG TORCH=torch==2.13.0
ARG EXTRAS=""
RUN (command -v python3 && python3 -m venv --help >/dev/null) || \
    (apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && rm -rf /var/lib/apt/lists/*)
COPY pyproject.toml README.md /src/
COPY tierd /src/tierd
RUN python3 -m venv /opt/tierd && /opt/tierd/bin/pip install --no-cache-dir "${TORCH}" && \
    /opt/tierd/bin/pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}"

FROM ${BASE}
RUN (command -v python3 >/dev/null) || \
    (apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*)
COPY --from=build /opt/tierd /opt/tierd
RUN useradd --system --uid 10001 --home-dir /var/lib/tierd --create-home tierd
USER tierd
ENV PATH=/opt/tierd/bin:$PATH \
    TIERD_SOCKET=/run/tierd/tierd.sock \
    TIERD_DATA_DIR=/var/lib/tierd \
    TIERD_METRICS=0.0.0.0:9464
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=5s CMD ["tierd", "health", "--address", "/run/tierd/tierd.sock"]
ENTRYPOINT ["tierd", "serve"]
