# The worker image the controlplane's Jobs run: the agent and what it drives on the node (runc,
# rclone with fuse3, iproute2 and nftables for container networking).
#
# The Job sets `args: ["run"]`, which replaces CMD, so the program lives in ENTRYPOINT and the
# subcommand in CMD: `levers9-agent run` either way.
#
# The shim: agent.runtime.shim.shim_path compiles levers9-shim.c with gcc on first use. No compiler
# ships in the final stage: the build stage compiles the shim with the agent's own shim_path (so
# the same flags) and LEVERS9_SHIM_BINARY points the agent at that binary.
#
# The base is pinned by digest; CI's image build refreshes it (`docker buildx imagetools inspect
# python:3.11-slim-bookworm`) when it moves the pin. Override with --build-arg PYTHON_BASE=...
ARG PYTHON_BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_BASE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY control control
COPY nvml nvml
RUN pip wheel --no-cache-dir --wheel-dir /wheels .
RUN mkdir -p /out/libexec \
 && python -c "import shutil; from pathlib import Path; from agent.runtime.shim import shim_path; shutil.copy(shim_path(Path('/tmp/shim-build')), '/out/libexec/levers9-shim')" \
 && chmod 0755 /out/libexec/levers9-shim

FROM ${PYTHON_BASE}
# Debian stable's security updates would break exact version pins, so packages are left unpinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends runc rclone fuse3 iproute2 nftables ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY --from=build /out/libexec /usr/local/libexec/levers9
ENV LEVERS9_SHIM_BINARY=/usr/local/libexec/levers9/levers9-shim
HEALTHCHECK CMD ["levers9-agent", "self-check"]
ENTRYPOINT ["levers9-agent"]
CMD ["run"]
