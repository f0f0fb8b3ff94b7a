"""deploy/deploy.sh: helm's arguments passed through, and no key taken from the environment.

The script once read a service-account key from LEVERS9_GKE_SA_JSON and wrote it into a values
file in the repository. These tests run it against a stand-in `helm` that records what it was
given, and check that such a key now reaches neither helm nor any file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "deploy.sh"
CHART = REPO / "deploy" / "chart"

FAKE_KEY_MARKER = "fake-private-key-7d1c0e5b9a"
FAKE_KEY = (
    '{"type": "service_account", "client_email": "x@p.iam.gserviceaccount.com", '
    f'"private_key": "-----BEGIN PRIVATE KEY-----\\n{FAKE_KEY_MARKER}\\n'
    '-----END PRIVATE KEY-----"}'
)

# Records its arguments (NUL-separated) and its environment next to itself.
STAND_IN_HELM = """#!/bin/sh
here=$(dirname "$0")
printf '%s\\0' "$@" > "$here/argv"
env > "$here/env"
echo "stand-in helm ran"
"""


class Run:
    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        helm = self.bin / "helm"
        helm.write_text(STAND_IN_HELM)
        helm.chmod(0o755)
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.work = tmp_path / "work"
        self.work.mkdir()

    def __call__(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        base = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(self.home),
            "TMPDIR": str(self.work),
        }
        return subprocess.run(
            [str(SCRIPT), *args],
            cwd=self.work,
            env={**base, **(env or {})},
            capture_output=True,
            text=True,
            check=False,
        )

    def helm_argv(self) -> list[str]:
        return (self.bin / "argv").read_text().split("\0")[:-1]

    def helm_ran(self) -> bool:
        return (self.bin / "argv").exists()


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


def git_status() -> set[str]:
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.splitlines())


def test_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env bash\n")


def test_helm_arguments_pass_through_in_order(run: Run) -> None:
    extra = ["-f", "a.yaml", "-f", "b.yaml", "--set", "x=y", "--dry-run"]
    done = run(*extra)
    assert done.returncode == 0, done.stderr
    assert "stand-in helm ran" in done.stdout
    argv = run.helm_argv()
    assert argv[:3] == ["upgrade", "--install", "levers9"]
    assert Path(argv[3]).resolve() == CHART.resolve()
    assert argv[4:] == ["--namespace", "levers9-control", "--create-namespace", *extra]


def test_release_and_namespace_come_from_the_environment(run: Run) -> None:
    done = run("-f", "v.yaml", env={"RELEASE": "gpu-cp", "NAMESPACE": "gpu-control"})
    assert done.returncode == 0, done.stderr
    argv = run.helm_argv()
    assert argv[2] == "gpu-cp"
    assert argv[4:7] == ["--namespace", "gpu-control", "--create-namespace"]


def test_arguments_with_spaces_stay_whole(run: Run) -> None:
    done = run("-f", "my values.yaml", "--set-string", "service.annotations.note=a b")
    assert done.returncode == 0, done.stderr
    assert run.helm_argv()[7:] == [
        "-f",
        "my values.yaml",
        "--set-string",
        "service.annotations.note=a b",
    ]


def test_key_in_the_environment_is_ignored_with_a_warning(run: Run, tmp_path: Path) -> None:
    before = git_status()
    done = run("-f", "values.yaml", "-f", "private.yaml", env={"LEVERS9_GKE_SA_JSON": FAKE_KEY})
    assert done.returncode == 0, done.stderr
    assert "LEVERS9_GKE_SA_JSON is set and ignored" in done.stderr
    assert "private values file" in done.stderr
    assert "levers9 cluster join" in done.stderr
    assert FAKE_KEY_MARKER not in done.stdout + done.stderr

    assert run.helm_argv()[7:] == ["-f", "values.yaml", "-f", "private.yaml"]
    # Neither helm's arguments nor its environment (plugins inherit it) carry the key.
    assert FAKE_KEY_MARKER not in "\0".join(run.helm_argv())
    assert "LEVERS9_GKE_SA_JSON" not in (run.bin / "env").read_text()

    # No file anywhere the run could write holds it: its working directory, HOME, TMPDIR ...
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert written
    for path in written:
        assert FAKE_KEY_MARKER not in path.read_text(errors="replace"), path
    # ... and the repository. Others may be editing it now, so the check is on what changed.
    for line in git_status() - before:
        changed = REPO / line[3:].split(" -> ")[-1].strip('"')
        assert not changed.is_relative_to(REPO / "deploy"), line
        if changed.is_file():
            assert FAKE_KEY_MARKER not in changed.read_text(errors="replace"), line


def test_help_prints_usage_without_running_helm(run: Run) -> None:
    done = run("--help")
    assert done.returncode == 0
    assert done.stdout.startswith("Usage: deploy/deploy.sh -f values.yaml -f ")
    assert "RELEASE" in done.stdout
    assert "NAMESPACE" in done.stdout
    assert not run.helm_ran()


def test_no_arguments_is_a_usage_error(run: Run) -> None:
    done = run()
    assert done.returncode == 2
    assert "give your values files" in done.stderr
    assert not run.helm_ran()


def test_missing_helm_is_a_clear_error(tmp_path: Path) -> None:
    # A PATH with what the script itself needs (env, bash, dirname) and no helm.
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("env", "bash", "dirname"):
        found = shutil.which(name)
        assert found is not None, name
        (tools / name).symlink_to(found)
    done = subprocess.run(
        [str(SCRIPT), "-f", "values.yaml"],
        cwd=tmp_path,
        env={"PATH": str(tools), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "deploy.sh: helm is not on PATH; install Helm 3" in done.stderr
    assert done.stdout == ""
