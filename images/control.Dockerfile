# The controlplane image: `levers9-control serve --config FILE`, as a non-root user (numeric, so
# Kubernetes' runAsNonRoot can verify it without reading /etc/passwd).
#
# The program lives in a virtual environment at /opt/levers9 (on PATH), made with the base's own
# python3, so the same file builds on the release base (python.org's build in /usr/local) and on
# a Debian base (/usr/bin/python3 with python3-venv).
#
# The release base is the one pinned below, by digest; CI's image build refreshes it (`docker
# buildx imagetools inspect python:3.11-slim-bookworm`) when it moves the pin. Where that registry
# cannot be reached, `make images` builds the same base (Debian 12, python3.11, ca-certificates,
# netbase, tzdata) from Debian's packages and passes it as --build-arg PYTHON_BASE=...
ARG PYTHON_BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_BASE} AS build
RUN python3 -m venv /opt/levers9
ENV PATH=/opt/levers9/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY wire wire
COPY workerapi workerapi
COPY proc proc
COPY agent agent
COPY control control
COPY nvml nvml
# levers9[control]: the base packages and the controlplane's own, not the agent's. A build
# that must trust a CA of its own (an egress proxy's) gives it as the secret `build-ca`
# (`--secret id=build-ca,src=FILE`), mounted for this step only and kept by no layer.
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
 && pip wheel --no-cache-dir --wheel-dir /wheels '.[control]' \
 && pip install --no-cache-dir --no-index /wheels/*.whl

FROM ${PYTHON_BASE}
COPY --from=build /opt/levers9 /opt/levers9
ENV PATH=/opt/levers9/bin:$PATH
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin levers9
USER 10001
EXPOSE 8443
ENTRYPOINT ["levers9-control", "serve"]
CMD ["--config", "/etc/levers9/values.yaml"]
