"""`levers9-agent self-check`: what an operator sees about the worker's GPUs, node, objects
directory and controlplane."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from agent.daemon.config import ConfigError, load_config
from agent.daemon.selfcheck import (
    BUSYBOX,
    Check,
    SelfCheckContext,
    Status,
    cap_eff_from_status,
    clock_skew_check,
    containers_section,
    controlplane_checks,
    free_space_check,
    gpu_section,
    main_self_check,
    objects_section,
    privileges_check,
    rclone_check,
    read_settings,
    render_json,
    render_table,
    run_checks,
    run_trivial_container,
    settings_section,
)
from control.api.server import Controlplane
from nvml.standin import StandinNode, StandinProcess, nvlinked_node, write_node
from sim.configs import WORKER_TOKENS, make_pki
from sim.configs import control_config as make_control_config
from sim.controlplane import run_controlplane

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
        "LEVERS9_STATE_DIR": str(tmp_path / "state"),
    }


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in report["checks"]}


def test_self_check_end_to_end_on_a_healthy_node(
    run_python: RunPython, node_environ: dict[str, str], tmp_path: Path
) -> None:
    node = write_node(tmp_path / "node.json", nvlinked_node(2))
    result = run_python(["-m", "agent.daemon.selfcheck", "--json"], node_environ, node=node)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    checks = by_name(report)
    assert {c["section"] for c in report["checks"]} == {
        "gpu",
        "containers",
        "node",
        "objects",
        "controlplane",
    }
    assert checks["nvml"]["status"] == "ok"
    assert checks["driver"]["reason"] == "driver 550.54.15, CUDA 12.4"
    assert checks["card 0"]["status"] == checks["card 1"]["status"] == "ok"
    assert "NVIDIA A100-SXM4-80GB" in checks["card 1"]["reason"]
    assert checks["card 1"]["reason"].endswith("80 GiB: serving")
    assert checks["claim"]["status"] == "ok"
    assert checks["device nodes"]["status"] == "ok"
    assert "nvidia0, nvidia1, nvidiactl" in checks["device nodes"]["reason"]
    assert checks["driver directory"]["status"] == "ok"
    assert checks["rclone"]["status"] == "ok"
    assert checks["rclone"]["reason"].startswith("rclone 1.75")


def test_the_rclone_check_says_the_version_and_warns_of_an_old_one(tmp_path: Path) -> None:
    old = tmp_path / "rclone"
    old.write_text("#!/bin/sh\necho 'rclone v1.60.1-DEV'\n")
    old.chmod(0o755)
    warned = rclone_check(str(old))
    assert warned.status is Status.WARN
    assert "rclone 1.60.1" in warned.reason and "older than 1.75" in warned.reason
    assert "LEVERS9_RCLONE" in warned.action
    missing = rclone_check(str(tmp_path / "nowhere"))
    assert missing.status is Status.FAIL
    assert "does not run" in missing.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="the container checks expect root (CI runs as root)")
def test_container_checks_name_what_works(tmp_path: Path) -> None:
    checks = {
        c.name: c
        for c in containers_section(SelfCheckContext({"LEVERS9_STATE_DIR": str(tmp_path)}))
    }
    for name in ("root", "runc", "overlayfs", "cgroups", "nftables", "state dir"):
        assert checks[name].status is Status.OK, checks[name]
    assert checks["runc"].reason.startswith("runc version")
    assert str(tmp_path) in checks["state dir"].reason
    # Process checkpoints (CRIU) are not part of the product, so they are not checked.
    assert set(checks) == {"root", "runc", "overlayfs", "cgroups", "nftables", "state dir"}


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
    result = run_python(["-m", "agent.daemon.selfcheck"], node_environ, node=node)
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
    result = run_python(["-m", "agent.daemon.selfcheck", "--json"], environ, node=node)
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


# -- settings: read by the parser `levers9-agent run` uses -----------------------------------------

SECRET_TOKEN = "worker-secret-token-0123456789"


def worker_environ(**changes: str) -> dict[str, str]:
    """The environment the worker Job gives the agent (the variables `run` needs)."""
    environ = {
        "LEVERS9_WORKER_ID": "w-1",
        "LEVERS9_WORKER_TOKEN": SECRET_TOKEN,
        "LEVERS9_CONTROLPLANE_URL": "https://cp.example.com:8443",
    }
    environ.update(changes)
    return environ


@pytest.mark.parametrize("budget", ["-1", "10G", "1.5e9"])
def test_a_budget_run_refuses_is_a_failed_check_naming_the_variable(
    budget: str, tmp_path: Path
) -> None:
    environ = worker_environ(
        LEVERS9_OBJECT_BUDGET_BYTES=budget, LEVERS9_STATE_DIR=str(tmp_path / "state")
    )
    with pytest.raises(ConfigError):
        load_config(dict(environ))  # what `run` does with it
    context = SelfCheckContext(environ)
    checks = run_checks(context, [settings_section, objects_section])
    [check] = checks  # no free-space arithmetic on a budget `run` would not use
    assert (check.section, check.name, check.status) == (
        "settings",
        "LEVERS9_OBJECT_BUDGET_BYTES",
        Status.FAIL,
    )
    assert "LEVERS9_OBJECT_BUDGET_BYTES" in check.reason and repr(budget) in check.reason
    assert "LEVERS9_OBJECT_BUDGET_BYTES" in check.action
    assert json.loads(render_json(checks))["ok"] is False


def test_a_refused_floor_fails_even_outside_the_worker_environment(tmp_path: Path) -> None:
    # No worker id, token or URL (the controlplane is then only "not checked"), yet the
    # container settings are still read as `run` reads them.
    environ = {"LEVERS9_FREE_FLOOR_BYTES": "-5", "LEVERS9_STATE_DIR": str(tmp_path)}
    [check] = settings_section(SelfCheckContext(environ))
    assert check.name == "LEVERS9_FREE_FLOOR_BYTES"
    assert check.status is Status.FAIL
    assert objects_section(SelfCheckContext(environ)) == []


@pytest.mark.parametrize(
    "changes",
    [
        {"LEVERS9_MODE": "sideways"},
        {"LEVERS9_CONTROLPLANE_URL": "http://cp"},
        {"LEVERS9_CONTROLPLANE_URL": "https://cp:99999"},
        {"LEVERS9_LISTEN": "7443"},
        {"LEVERS9_PING_INTERVAL_S": "soon"},
        {"LEVERS9_TUNNEL_MAX_AGE_S": "0"},
        {"LEVERS9_CONTROLPLANE_CA": "/nonexistent/ca.pem"},
        {"LEVERS9_CONTAINERS": "maybe"},
        {"LEVERS9_STATE_DIR": "relative/dir"},
        {"LEVERS9_LOG_MAX_BYTES": "big"},
        {"LEVERS9_METRICS_PORT": "metrics"},
        {"LEVERS9_METRICS_HOST": "0.0.0.0"},
    ],
)
def test_the_self_check_refuses_what_run_refuses_in_the_same_words(
    changes: dict[str, str],
) -> None:
    environ = worker_environ(**changes)
    with pytest.raises(ConfigError) as refused:
        load_config(dict(environ))
    [variable] = changes
    assert refused.value.variable == variable
    [check] = settings_section(SelfCheckContext(environ))
    assert (check.name, check.status, check.reason) == (variable, Status.FAIL, str(refused.value))
    [cp] = trio.run(controlplane_checks, read_settings(environ))
    assert cp.status is Status.WARN and variable in cp.reason


def test_good_settings_add_no_check_and_keep_the_token_out(tmp_path: Path) -> None:
    environ = worker_environ(LEVERS9_STATE_DIR=str(tmp_path), LEVERS9_OBJECT_BUDGET_BYTES="1024")
    settings = read_settings(environ)
    assert settings.agent is not None and settings.agent.token == SECRET_TOKEN
    assert environ["LEVERS9_WORKER_TOKEN"] == SECRET_TOKEN  # parsed from a copy
    assert SECRET_TOKEN not in repr(settings)
    assert settings.containers is not None
    assert settings.containers.object_budget_bytes == 1024
    assert settings_section(SelfCheckContext(environ)) == []
    checks = {c.name: c for c in objects_section(SelfCheckContext(environ))}
    assert checks["objects dir"].status is Status.OK


def test_main_self_check_fails_on_a_refused_budget_without_a_traceback_or_the_token(
    describe_node: DescribeNode,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    describe_node(nvlinked_node(1))
    for name, value in worker_environ(
        LEVERS9_OBJECT_BUDGET_BYTES="-1",
        LEVERS9_STATE_DIR=str(tmp_path / "state"),
        LEVERS9_GPU_CDI_DIRS="",
    ).items():
        monkeypatch.setenv(name, value)
    assert main_self_check(["--json"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert SECRET_TOKEN not in out + err
    report = json.loads(out)
    assert report["ok"] is False
    refused = by_name(report)["LEVERS9_OBJECT_BUDGET_BYTES"]
    assert refused["section"] == "settings" and refused["status"] == "fail"
    assert "must be 0 or more" in refused["reason"]
    assert not any(c["section"] == "objects" for c in report["checks"])
    assert "LEVERS9_OBJECT_BUDGET_BYTES" in by_name(report)["reachable"]["reason"]


# -- node ------------------------------------------------------------------------------------------

ROOT_STATUS = "Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n"


def test_cap_sys_admin_is_read_from_capeff() -> None:
    assert cap_eff_from_status(ROOT_STATUS) == 0x1FFFFFFFFFF
    assert cap_eff_from_status("Name:\tx\n") is None
    assert privileges_check(0, cap_eff_from_status(ROOT_STATUS)).status is Status.OK
    without_sys_admin = privileges_check(0, 0x1FFFFFFFFFF & ~(1 << 21))
    assert without_sys_admin.status is Status.FAIL
    assert "CAP_SYS_ADMIN" in without_sys_admin.reason
    assert "privileged" in without_sys_admin.action
    not_root = privileges_check(1000, 0)
    assert not_root.status is Status.FAIL
    assert "uid 1000" in not_root.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="runc needs root (CI runs as root)")
@pytest.mark.skipif(not BUSYBOX.is_file(), reason="needs Debian's busybox-static")
def test_runc_runs_a_trivial_container_and_leaves_nothing_behind() -> None:
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("levers9-selfcheck-*"))
    check = run_trivial_container()
    assert check.status is Status.OK, check
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("levers9-selfcheck-*")) == before


def test_without_busybox_the_container_trial_is_a_warning(tmp_path: Path) -> None:
    check = run_trivial_container(busybox=tmp_path / "no-busybox")
    assert check.status is Status.WARN
    assert "not tried" in check.reason


# -- objects ---------------------------------------------------------------------------------------


def test_free_space_below_budget_and_floor_warns_saying_how_much() -> None:
    gib = 1 << 30
    low = free_space_check(Path("/state"), 20 * gib, 50 * gib, 5 * gib)
    assert low.status is Status.WARN
    assert "20.0 GiB free" in low.reason
    assert "50.0 GiB" in low.reason and "5.0 GiB" in low.reason
    assert "LEVERS9_OBJECT_BUDGET_BYTES" in low.action
    assert free_space_check(Path("/state"), 60 * gib, 50 * gib, 5 * gib).status is Status.OK


def test_a_writable_objects_dir_is_created_for_the_probe_and_left_as_found(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    checks = {
        c.name: c for c in objects_section(SelfCheckContext({"LEVERS9_STATE_DIR": str(state)}))
    }
    assert checks["objects dir"].status is Status.OK
    assert checks["free space"].status in (Status.OK, Status.WARN)
    assert not (tmp_path / "new").exists()


def test_an_objects_dir_that_cannot_be_written_fails(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    context = SelfCheckContext({"LEVERS9_STATE_DIR": str(tmp_path / "a-file")})
    checks = {c.name: c for c in objects_section(context)}
    assert checks["objects dir"].status is Status.FAIL
    assert str(tmp_path / "a-file") in checks["objects dir"].reason
    assert "LEVERS9_STATE_DIR" in checks["objects dir"].action


# -- controlplane ----------------------------------------------------------------------------------


def test_clock_skew_from_the_date_header() -> None:
    now = datetime.datetime(2024, 5, 1, 12, 0, 0, tzinfo=datetime.UTC)
    assert clock_skew_check("Wed, 01 May 2024 12:00:03 GMT", now).status is Status.OK
    off = clock_skew_check("Wed, 01 May 2024 11:55:00 GMT", now)
    assert off.status is Status.WARN
    assert "+300 s" in off.reason
    missing = clock_skew_check(None, now)
    assert missing.status is Status.WARN
    assert "no Date header" in missing.reason


@pytest.mark.parametrize(
    ("environ", "unset"),
    [
        ({}, "LEVERS9_WORKER_ID"),
        ({"LEVERS9_WORKER_ID": "w-1", "LEVERS9_WORKER_TOKEN": "t"}, "LEVERS9_CONTROLPLANE_URL"),
    ],
)
async def test_an_unset_controlplane_setting_is_a_warning(
    environ: dict[str, str], unset: str
) -> None:
    [check] = await controlplane_checks(read_settings(environ))
    assert check.status is Status.WARN
    assert check.reason == f"not checked: {unset} is not set"
    assert "worker's environment" in check.action


async def _controlplane_environ(tmp_path: Path, nursery: trio.Nursery) -> dict[str, str]:
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, make_control_config(pki))
    return {
        "LEVERS9_CONTROLPLANE_URL": f"https://127.0.0.1:{control.port}",
        "LEVERS9_CONTROLPLANE_CA": str(pki.ca_file),
        "LEVERS9_MODE": "tunnel",
        "LEVERS9_WORKER_ID": "w-tunnel",
        "LEVERS9_WORKER_TOKEN": WORKER_TOKENS["w-tunnel"],
    }


async def test_a_reachable_controlplane_accepts_the_tunnel_handshake(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    environ = await _controlplane_environ(tmp_path, nursery)
    checks = {c.name: c for c in await controlplane_checks(read_settings(environ))}
    assert checks["reachable"].status is Status.OK, checks["reachable"]
    assert checks["clock skew"].status in (Status.OK, Status.WARN)
    assert checks["tunnel"].status is Status.OK, checks["tunnel"]
    assert checks["tunnel"].reason == "tunnel handshake accepted"


async def test_a_wrong_ca_fails_naming_tls(tmp_path: Path, nursery: trio.Nursery) -> None:
    environ = await _controlplane_environ(tmp_path, nursery)
    (tmp_path / "other").mkdir()
    environ["LEVERS9_CONTROLPLANE_CA"] = str(make_pki(tmp_path / "other").ca_file)
    [check] = await controlplane_checks(read_settings(environ))
    assert check.status is Status.FAIL
    assert environ["LEVERS9_CONTROLPLANE_URL"] in check.reason
    assert "TLS" in check.reason and "certificate" in check.reason
    assert "CA" in check.action


async def test_a_wrong_worker_token_fails_the_tunnel_without_showing_it(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    environ = await _controlplane_environ(tmp_path, nursery)
    environ["LEVERS9_WORKER_TOKEN"] = "wrong-token-0123456789"
    checks = {c.name: c for c in await controlplane_checks(read_settings(environ))}
    assert checks["reachable"].status is Status.OK
    assert checks["tunnel"].status is Status.FAIL
    assert "refused the worker token" in checks["tunnel"].reason
    assert all("wrong-token" not in c.reason + c.action for c in checks.values())
