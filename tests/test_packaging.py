"""The wheel carries what an installed levers9 needs to run its programs and its simulator
(`pip install 'levers9[sim]'`, then `python -m sim demo`), and nothing of the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_the_simulator_and_its_data_but_not_the_tests(tmp_path: Path) -> None:
    # Built from a copy, so that setuptools' build/ folder is not left in the work tree.
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "*.egg-info",
            "__pycache__",
            ".*_cache",
            "bench-results",
            "test-artifacts",
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("levers9-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for wanted in (
        "sim/__main__.py",
        "sim/demo.py",
        "sim/kubeapi/store.py",
        "sim/cloud/gcloud",
        "sim/cloud/standin.py",
        "agent/runtime/shim/levers9-shim.c",
        "nvml/standin/libnvidia-ml.c",
        "control/cli/__main__.py",
        "control/ui/static/app.js",
        "control/ui/static/app.css",
        "control/ui/static/app.html",
        "control/ui/static/signin.html",
    ):
        assert wanted in names, wanted
    assert not [name for name in names if name.startswith(("tests/", "bench/"))]
    metadata = next(name for name in names if name.endswith("/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Provides-Extra: sim" in text
