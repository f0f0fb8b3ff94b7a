# The controlplane image: `levers9-control serve --config FILE`, as a non-root user.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY control control
COPY nvml nvml
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && useradd --system --uid 10001 levers9
USER 10001
EXPOSE 8443
ENTRYPOINT ["levers9-control", "serve"]
CMD ["--config", "/etc/levers9/values.yaml"]
