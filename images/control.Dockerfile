# The controlplane image: `levers9-control serve --config FILE`, as a non-root user (numeric, so
# Kubernetes' runAsNonRoot can verify it without reading /etc/passwd).
#
# The base is pinned by digest; CI's image build refreshes it (`docker buildx imagetools inspect
# python:3.11-slim-bookworm`) when it moves the pin. Override with --build-arg PYTHON_BASE=...
ARG PYTHON_BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY control control
COPY nvml nvml
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_BASE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin levers9
USER 10001
EXPOSE 8443
ENTRYPOINT ["levers9-control", "serve"]
CMD ["--config", "/etc/levers9/values.yaml"]
