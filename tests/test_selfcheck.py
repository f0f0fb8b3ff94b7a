"""`levers9-agent self-check`: what an operator sees about the worker's GPUs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agent.selfcheck import (
    Check,
    SelfCheckContext,
    Status,
    containers_section,
    gpu_section,
    main_self_check,
    render_json,
    render_table,
    run_checks,
)
from nvml.standin import StandinNode, StandinProcess, nvlinked_node, write_node

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode, MakeDevDir, RunPython

pytest_plugins = ["tests.nvml_fixtures"]


@pytest.fixture
def node_environ(make_dev_dir: MakeDevDir, driver_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a worker pod on a 2-card node, with its roots under a temp dir."""
    return {
        "LEVERS9_GPU_DEV_DIR": str(make_dev_dir(range(2))),
        "LEVERS9_GPU_DRIVER_DIR": str(driver_dir),
        "LEVERS9_GPU_CDI_DIRS": "",
        "LEVERS9_PODRESOURCES_SOCKET": str(tmp_path / "no-kubelet.sock"),
        "NVIDIA_VISIBLE_DEVICES": "all",
    }


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in report["checks"]}


def test_self_check_end_to_end_on_a_healthy_node(
    run_python: RunPython, node_environ: dict[str, str], tmp_path: Path
) -> None:
    node = write_node(tmp_path / "node.json", nvlinked_node(2))
    result = run_python(["-m", "agent.selfcheck", "--json"], node_environ, node=node)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    checks = by_name(report)
    assert {c["section"] for c in report["checks"]} == {"gpu", "containers"}
    assert checks["nvml"]["status"] == "ok"
    assert checks["driver"]["reason"] == "driver 550.54.15, CUDA 12.4"
    assert checks["card 0"]["status"] == checks["card 1"]["status"] == "ok"
    assert "NVIDIA A100-SXM4-80GB" in checks["card 1"]["reason"]
    assert checks["card 1"]["reason"].endswith("80 GiB: serving")
    assert checks["claim"]["status"] == "ok"
    assert checks["device nodes"]["status"] == "ok"
    assert "nvidia0, nvidia1, nvidiactl" in checks["device nodes"]["reason"]
    assert checks["driver directory"]["status"] == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="the container checks expect root (CI runs as root)")
def test_container_checks_name_what_works_and_why_checkpoint_does_not(tmp_path: Path) -> None:
    checks = {
        c.name: c
        for c in containers_section(SelfCheckContext({"LEVERS9_STATE_DIR": str(tmp_path)}))
    }
    for name in ("root", "runc", "overlayfs", "cgroups", "nftables", "state dir"):
        assert checks[name].status is Status.OK, checks[name]
    assert checks["runc"].reason.startswith("runc version")
    assert str(tmp_path) in checks["state dir"].reason
    # criu fails on this kernel: process checkpoint is reported unavailable, with criu's reason.
    checkpoint = checks["checkpoint"]
    if checkpoint.status is not Status.OK:
        assert checkpoint.status is Status.WARN
        assert "unavailable" in checkpoint.reason
        assert "snapshots work" in checkpoint.action


def test_a_state_dir_that_is_not_a_directory_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    context = SelfCheckContext({"LEVERS9_STATE_DIR": str(tmp_path / "a-file")})
    checks = {c.name: c for c in containers_section(context)}
    assert checks["state dir"].status is Status.FAIL
    assert "not a directory" in checks["state dir"].reason
    assert "LEVERS9_STATE_DIR" in checks["state dir"].action


def test_a_refused_card_is_a_warning_with_what_to_do(
    run_python: RunPython, node_environ: dict[str, str], tmp_path: Path
) -> None:
    node = write_node(
        tmp_path / "node.json", nvlinked_node(2, {1: {"processes": (StandinProcess(4242),)}})
    )
    result = run_python(["-m", "agent.selfcheck"], node_environ, node=node)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    warned = next(line for line in lines if line.startswith("warn"))
    assert "card 1" in warned
    assert "held by process 4242 that is not ours" in warned
    assert "-> stop that workload" in lines[lines.index(warned) + 1]
    gpu_lines = [line for line in lines if " gpu " in f" {line} "]
    assert sum(1 for line in gpu_lines if line.startswith("ok")) == 6
    assert sum(1 for line in gpu_lines if line.startswith("warn")) == 1
    assert lines[-1].endswith("0 fail")


def test_a_node_without_a_working_driver_fails(run_python: RunPython, tmp_path: Path) -> None:
    node = write_node(
        tmp_path / "node.json", StandinNode(devices=(), init_error="DRIVER_NOT_LOADED")
    )
    environ = {"LEVERS9_GPU_CDI_DIRS": "", "LEVERS9_GPU_DEV_DIR": str(tmp_path)}
    result = run_python(["-m", "agent.selfcheck", "--json"], environ, node=node)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    nvml = by_name(report)["nvml"]
    assert nvml["status"] == "fail"
    assert "kernel driver is not loaded" in nvml["reason"]
    assert nvml["action"]


def test_no_usable_card_and_no_driver_directory_fail(
    describe_node: DescribeNode, tmp_path: Path
) -> None:
    describe_node(nvlinked_node(1, {0: {"xids": (79,)}}))
    environ = {
        "LEVERS9_GPU_DEV_DIR": str(tmp_path / "dev"),
        "LEVERS9_GPU_DRIVER_DIR": str(tmp_path / "no-driver"),
        "LEVERS9_GPU_CDI_DIRS": "",
        "LEVERS9_PODRESOURCES_SOCKET": str(tmp_path / "no-kubelet.sock"),
        "NVIDIA_VISIBLE_DEVICES": "0",
    }
    checks = {c.name: c for c in gpu_section(SelfCheckContext(environ))}
    assert checks["card 0"].status is Status.WARN
    assert checks["claim"].status is Status.FAIL
    assert checks["device nodes"].status is Status.FAIL
    assert "nvidiactl" in checks["device nodes"].reason
    assert checks["driver directory"].status is Status.FAIL
    assert "LEVERS9_GPU_DRIVER_DIR" in checks["driver directory"].action


def test_a_crashing_section_is_a_failed_check_not_a_crash() -> None:
    def broken_section(context: SelfCheckContext) -> list[Check]:
        raise RuntimeError("boom")

    def fine_section(context: SelfCheckContext) -> list[Check]:
        return [Check("fine", "thing", Status.OK, "works")]

    checks = run_checks(SelfCheckContext({}), [broken_section, fine_section])
    assert [(c.section, c.status) for c in checks] == [
        ("broken", Status.FAIL),
        ("fine", Status.OK),
    ]
    assert "RuntimeError: boom" in checks[0].reason
    assert json.loads(render_json(checks))["ok"] is False
    table = render_table(checks)
    assert table.splitlines()[0].split() == ["STATUS", "SECTION", "CHECK", "REASON"]
    assert table.endswith("1 ok, 0 warn, 1 fail")


def test_main_self_check_exit_status(
    describe_node: DescribeNode, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    describe_node(StandinNode(devices=(), init_error="DRIVER_NOT_LOADED"))
    monkeypatch.setenv("LEVERS9_GPU_CDI_DIRS", "")
    assert main_self_check(["--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
