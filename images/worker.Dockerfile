# The worker image the controlplane's Jobs run: the agent and what it drives on the node.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY control control
COPY nvml nvml
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends runc rclone fuse3 iproute2 nftables ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
HEALTHCHECK CMD ["levers9-agent", "self-check"]
ENTRYPOINT ["levers9-agent", "run"]
