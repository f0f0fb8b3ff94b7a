"""The agent claims its cards at start and reports them (GET /v1/worker, registration).

The agent runs as its own process, as in a worker Job, with pynvml loading the stand-in
libnvidia-ml through LD_LIBRARY_PATH, exactly the path a GPU node's driver library takes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import trio

from control.api.server import Controlplane
from nvml.standin import (
    StandinProcess,
    nvlinked_node,
    standin_device,
    standin_environ,
    write_node,
)
from sim.configs import WORKER_TOKENS, control_config, make_pki
from sim.controlplane import run_controlplane

pytest_plugins = ["tests.nvml_fixtures"]


async def test_worker_reports_claimed_cards(
    tmp_path: Path, standin_library: Path, nursery: trio.Nursery
) -> None:
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    node = nvlinked_node(4, {2: {"processes": (StandinProcess(pid=424242),)}})
    description = write_node(tmp_path / "node.json", node)
    env = dict(os.environ)
    env.update(standin_environ(standin_library, description))
    env.update(
        NVIDIA_VISIBLE_DEVICES="all",
        LEVERS9_WORKER_ID="w-tunnel",
        LEVERS9_WORKER_TOKEN=WORKER_TOKENS["w-tunnel"],
        LEVERS9_MODE="tunnel",
        LEVERS9_CONTROLPLANE_URL=f"https://127.0.0.1:{control.port}",
        LEVERS9_CONTROLPLANE_CA=str(pki.ca_file),
        LEVERS9_NODE_NAME="gpu-node-1",
        LEVERS9_CONTAINERS="off",
    )
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "agent.daemon.cli", "run"], env=env
    )
    try:
        with trio.fail_after(20):
            client = await control.registry.client_for("w-tunnel")
            info = await client.worker()
        assert info.node == "gpu-node-1"
        assert [c.index for c in info.cards] == [0, 1, 2, 3]
        states = {c.index: c.state for c in info.cards}
        assert states == {0: "serving", 1: "serving", 2: "refused", 3: "serving"}
        refused = next(c for c in info.cards if c.index == 2)
        assert "424242" in refused.reason
        assert any("424242" in p for p in info.gpu_problems)
        assert info.driver_version
    finally:
        process.terminate()
        with trio.move_on_after(5):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_agent_self_check_command_reports_cards(
    tmp_path: Path, standin_library: Path
) -> None:
    import json

    # Two cards; the second fell off the bus (XID 79), so the worker would not use it.
    description = write_node(tmp_path / "node.json", nvlinked_node(2, {1: {"xids": (79,)}}))
    env = dict(os.environ)
    env.update(standin_environ(standin_library, description))
    env["NVIDIA_VISIBLE_DEVICES"] = "all"
    env["LEVERS9_STATE_DIR"] = str(tmp_path / "state")
    result = await trio.run_process(
        [sys.executable, "-m", "agent.daemon.cli", "self-check", "--json"],
        env=env,
        capture_stdout=True,
        check=False,
    )
    report = json.loads(result.stdout)
    gpu = {c["name"]: c for c in report["checks"] if c["section"] == "gpu"}
    assert (gpu["nvml"]["status"], gpu["nvml"]["reason"]) == ("ok", "NVML loads and lists 2 cards")
    first, second = standin_device(0), standin_device(1)
    assert gpu["card 0"]["status"] == "ok", gpu["card 0"]
    assert gpu["card 0"]["reason"] == f"{first.uuid}, {first.name}, 80 GiB: serving"
    assert gpu["card 1"]["status"] == "warn", gpu["card 1"]
    assert second.uuid in gpu["card 1"]["reason"] and "XID 79" in gpu["card 1"]["reason"]
    assert "reset the card" in gpu["card 1"]["action"]
    assert "card 2" not in gpu
    assert gpu["claim"]["reason"].startswith("1 of 2 cards serve"), gpu["claim"]
    statuses = {c["status"] for c in report["checks"]}
    assert statuses <= {"ok", "warn", "fail"}
    assert result.returncode == (1 if "fail" in statuses else 0)
