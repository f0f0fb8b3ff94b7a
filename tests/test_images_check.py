"""The image checks: images/check.py passes on our Dockerfiles and names the rule and line on
broken ones, and the worker Job the controlplane renders starts the worker image's real program
with the mounts and privileges the agent needs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from agent.daemon.cli import main as agent_main
from agent.runtime.shim import ShimBuildError, shim_path
from control.kube.manifests import PoolSettings, job_manifest

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
WORKER = IMAGES / "worker.Dockerfile"
CONTROL = IMAGES / "control.Dockerfile"
SETTINGS = PoolSettings(name="gke-a100", namespace="levers9", image="worker:latest")


def _load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_check", IMAGES / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs resolves the classes' module by name
    spec.loader.exec_module(module)
    return module


check = _load_check()


def _rules(text: str, role: str) -> list[tuple[int, str]]:
    return [(f.line, f.rule) for f in check.check(text, role=role)]


def _line_of(text: str, start: str) -> int:
    """The number of the last line beginning with `start` (comments do not count)."""
    return [i for i, line in enumerate(text.splitlines(), start=1) if line.startswith(start)][-1]


@pytest.mark.parametrize("path", [WORKER, CONTROL], ids=["worker", "control"])
def test_our_dockerfiles_pass(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(IMAGES / "check.py"), str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean" in result.stdout


def test_unpinned_from_is_named_with_its_line() -> None:
    text = WORKER.read_text()
    bad = re.sub(r"^FROM \$\{PYTHON_BASE\}$", "FROM python:3.11-slim-bookworm", text, flags=re.M)
    assert bad != text
    assert (_line_of(text, "FROM ${PYTHON_BASE}"), "pinned-base") in _rules(bad, "worker")
    # An ARG default without a digest is caught through the FROM that uses it.
    bad_arg = re.sub(r"@sha256:[0-9a-f]{64}", "", text)
    assert [rule for _, rule in _rules(bad_arg, "worker")] == ["pinned-base", "pinned-base"]


def test_cli_prints_file_line_and_rule_and_fails(tmp_path: Path) -> None:
    bad = tmp_path / "control.Dockerfile"
    bad.write_text(CONTROL.read_text().replace("USER 10001\n", ""))
    result = subprocess.run(
        [sys.executable, str(IMAGES / "check.py"), str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert re.search(rf"^{re.escape(str(bad))}:\d+: non-root: .*USER 10001", result.stdout, re.M)


def test_shell_form_entrypoint() -> None:
    text = WORKER.read_text()
    bad = text.replace('ENTRYPOINT ["levers9-agent"]', "ENTRYPOINT levers9-agent")
    line = _line_of(text, "ENTRYPOINT")
    assert (line, "exec-form") in _rules(bad, "worker")


def test_compiler_in_final_stage() -> None:
    text = WORKER.read_text()
    bad = text.replace("runc fuse3", "runc gcc fuse3")
    line = (
        _line_of(text, " && apt-get install -y --no-install-recommends runc") - 1
    )  # the RUN starts a line above
    findings = check.check(bad, role="worker")
    assert [(f.line, f.rule) for f in findings] == [(line, "no-compiler-in-final")]
    assert "gcc" in findings[0].message
    # The build stage may use gcc: that is where the shim is compiled.
    assert "gcc" in text.split("AS build")[1].split("FROM")[0]


def test_missing_user_in_control() -> None:
    text = CONTROL.read_text()
    assert _rules(text.replace("USER 10001\n", ""), "control") == [
        (_line_of(text, "FROM ${PYTHON_BASE}"), "non-root")
    ]
    assert _rules(text.replace("USER 10001", "USER root"), "control") == [
        (_line_of(text, "USER 10001"), "non-root")
    ]


def test_other_rules() -> None:
    text = WORKER.read_text()
    cases = {
        "apt-slim": text.replace(" --no-install-recommends runc", " runc"),
        "no-secret-env": text.replace(
            "ENV LEVERS9_SHIM_BINARY=", "ENV API_TOKEN=x LEVERS9_SHIM_BINARY="
        ),
        "no-remote-add": text + "ADD https://example.com/x.tar.gz /x\n",
        "healthcheck": re.sub(r"^HEALTHCHECK.*\n", "", text, flags=re.M),
        "worker-cmd": text.replace('CMD ["run"]', 'CMD ["self-check"]'),
        "entrypoint": text.replace(
            'ENTRYPOINT ["levers9-agent"]', 'ENTRYPOINT ["levers9-agent", "run"]'
        ),
    }
    for rule, bad in cases.items():
        assert rule in [r for _, r in _rules(bad, "worker")], rule


def _final_argv(path: Path, args: list[str]) -> list[str]:
    """What a container runs: ENTRYPOINT, then the pod's args (which replace CMD)."""
    final = check.final_stage(check.parse(path.read_text()))
    entrypoint = next(i for i in reversed(final) if i.keyword == "ENTRYPOINT")
    argv = check.exec_form(entrypoint.arguments)
    assert argv is not None
    return [*argv, *args]


def _worker_job() -> dict[str, Any]:
    manifests = job_manifest(
        SETTINGS, "n1", 2, "w-n1", "w-n1-token", "https://cp.example:8443", token="t0ken"
    )
    container = manifests.job["spec"]["template"]["spec"]["containers"][0]
    assert isinstance(container, dict)
    return container


def test_worker_job_runs_the_agent_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    container = _worker_job()
    argv = _final_argv(WORKER, container["args"])
    assert argv == ["levers9-agent", "run"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[argv[0]] == "agent.daemon.cli:main"
    # `run` is a subcommand the agent's parser knows: an unknown one exits 2 through argparse,
    # a known one gets as far as reading its settings (and fails on the ones missing here).
    with pytest.raises(SystemExit) as unknown:
        agent_main(["walk"])
    assert unknown.value.code == 2
    for name in [k for k in os.environ if k.startswith("LEVERS9_")]:
        monkeypatch.delenv(name)
    assert agent_main(argv[1:]) == 2


def test_worker_job_mounts_what_the_agent_reads_and_is_privileged() -> None:
    container = _worker_job()
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert env["LEVERS9_STATE_DIR"] in mounted
    assert env["LEVERS9_GPU_DRIVER_DIR"] in mounted
    assert "/dev" in mounted
    assert container["securityContext"] == {"privileged": True}


def test_control_image_serves() -> None:
    assert _final_argv(CONTROL, []) == ["levers9-control", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["levers9-control"] == "control.main:main"


def test_the_worker_image_points_the_agent_at_its_prebuilt_shim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker image has no compiler: the agent takes the shim the build stage compiled."""
    text = WORKER.read_text()
    match = re.search(r"^ENV LEVERS9_SHIM_BINARY=(\S+)$", text, re.M)
    assert match is not None
    assert "COPY --from=build /out/libexec /usr/local/libexec/levers9" in text
    assert match.group(1) == "/usr/local/libexec/levers9/levers9-shim"
    prebuilt = tmp_path / "levers9-shim"
    prebuilt.write_bytes(b"prebuilt shim")
    monkeypatch.setenv("LEVERS9_SHIM_BINARY", str(prebuilt))
    monkeypatch.setenv("CC", "/nonexistent/compiler")  # never called
    installed = shim_path(tmp_path / "cache")
    assert installed.read_bytes() == b"prebuilt shim"
    assert os.access(installed, os.X_OK)
    assert shim_path(tmp_path / "cache") == installed
    monkeypatch.setenv("LEVERS9_SHIM_BINARY", str(tmp_path / "missing"))
    with pytest.raises(ShimBuildError, match="LEVERS9_SHIM_BINARY names"):
        shim_path(tmp_path / "other-cache")
