"""Fixtures for tests that need NVML: the stand-in library, node descriptions, device nodes.

Test modules load them with `pytest_plugins = ["tests.nvml_fixtures"]` and import from here only
for type checking (importing at run time would keep pytest from rewriting this module's asserts).

In-process tests load the stand-in once per session by path (`load_in_process`); pynvml's own
`CDLL("libnvidia-ml.so.1")` then finds it by soname, and each test's node description is read at
that test's first `nvmlInit`. Tests that need a fresh process (the console entry point, a node
without the library) get one through `run_python`, with LD_LIBRARY_PATH as a node's loader uses.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from nvml.standin import (
    ENV_VAR,
    StandinError,
    StandinNode,
    build_standin,
    load_in_process,
    make_device_nodes,
    standin_environ,
    write_node,
)

REPO = Path(__file__).resolve().parents[1]

DescribeNode = Callable[[StandinNode | Mapping[str, Any]], Path]
MakeDevDir = Callable[[Iterable[int]], Path]
RunPython = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def standin_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libnvidia-ml.so.1, built once per session."""
    try:
        return build_standin(tmp_path_factory.getbasetemp() / "nvml-standin")
    except StandinError as exc:
        pytest.fail(f"the NVML stand-in could not be built: {exc}")


@pytest.fixture(scope="session")
def standin_loaded(standin_library: Path) -> Path:
    """The stand-in, loaded into this process so pynvml uses it."""
    try:
        load_in_process(standin_library)
    except StandinError as exc:
        pytest.skip(reason=f"needs the NVML stand-in in this process: {exc}")
    return standin_library


@pytest.fixture
def describe_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, standin_loaded: Path
) -> DescribeNode:
    """Makes NVML in this process describe the given node from its next session on; returns the
    description's path, which `write_description` rewrites to change an open session."""

    def describe(node: StandinNode | Mapping[str, Any]) -> Path:
        path = write_node(tmp_path / "node.json", node)
        monkeypatch.setenv(ENV_VAR, str(path))
        return path

    return describe


@pytest.fixture
def make_dev_dir(tmp_path: Path) -> MakeDevDir:
    """Creates a /dev-like directory with real character device nodes for the given minors plus
    the driver's control nodes. Needs root (mknod); skips saying so otherwise."""

    def make(minors: Iterable[int]) -> Path:
        try:
            return make_device_nodes(tmp_path / "dev", minors)
        except PermissionError:
            pytest.skip(reason="needs root: creates device nodes with mknod")

    return make


@pytest.fixture
def driver_dir(tmp_path: Path) -> Path:
    """A driver directory laid out like GKE's /home/kubernetes/bin/nvidia."""
    driver = tmp_path / "nvidia-driver"
    (driver / "bin").mkdir(parents=True)
    (driver / "lib64").mkdir()
    (driver / "bin" / "nvidia-smi").write_text("#!/bin/sh\n")
    (driver / "lib64" / "libcuda.so.1").write_text("")
    return driver


@pytest.fixture
def run_python(standin_library: Path) -> RunPython:
    """Runs this venv's python in the repository, in a clean environment plus `env`; with
    `node=` (a description file) the stand-in is on its library path."""

    def run(
        args: list[str], env: Mapping[str, str] | None = None, *, node: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", ENV_VAR)}
        if node is not None:
            clean.update(standin_environ(standin_library, node))
        clean.update(env or {})
        return subprocess.run(
            [sys.executable, *args],
            env=clean,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


@pytest.fixture
def without_real_nvml() -> None:
    """Skips on machines with a real libnvidia-ml, where 'no library' cannot be shown."""
    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip(reason="a real libnvidia-ml is here, so a node without one cannot be shown")
