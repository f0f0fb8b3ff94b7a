"""A running agent watches its cards: a card that reports a critical XID is quarantined and the
container on it fails naming the card and the XID; a process outside levers9 on a card takes it
out of placement until it is gone. The controlplane hears each change at once (the heartbeat is
set to an hour, so only the agent's nudge can tell it).

The agent runs in this process beside a controlplane, with the NVML stand-in loaded here; the
test changes the stand-in's description while the agent runs (`write_description`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
import trio

from agent.daemon.config import HealthConfig
from agent.daemon.run import run_agent
from agent.runtime.config import ContainerConfig
from control.api.server import Controlplane
from control.workers.registry import WorkerEntry
from nvml.standin import (
    StandinNode,
    StandinProcess,
    change_device,
    nvlinked_node,
    standin_device,
    write_description,
)
from sim.configs import control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config
from wire.errors import ApiError, ErrorCode
from workerapi.client import WorkerClient
from workerapi.models import CardState, ContainerSpec, ContainerState, ContainerStatus

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode, MakeDevDir
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.nvml_fixtures", "tests.registry_fixtures"]

UUIDS = [standin_device(i).uuid for i in range(2)]
POLL_S = 0.1


async def wait_for_entry(
    control: Controlplane, worker_id: str, condition: Callable[[WorkerEntry], bool]
) -> WorkerEntry:
    """The worker's registry entry once `condition` holds (callers bound the wait)."""
    while True:
        for entry in control.registry.entries():
            if entry.worker_id == worker_id and entry.registered_at and condition(entry):
                return entry
        await trio.sleep(0.02)


def problem(entry: WorkerEntry, index: int) -> tuple[str, str] | None:
    for card in entry.problem_cards:
        if card.index == index:
            return str(card.state), card.reason
    return None


async def wait_for_status(
    worker: WorkerClient, container_id: str, condition: Callable[[ContainerStatus], bool]
) -> ContainerStatus:
    """The container's status once `condition` holds (callers bound the wait)."""
    while True:
        status = await worker.container(container_id)
        if condition(status):
            return status
        await trio.sleep(0.02)


async def start(
    tmp_path: Path,
    nursery: trio.Nursery,
    mode: str,
    containers: ContainerConfig | None = None,
    policy: str = "fail",
) -> tuple[Controlplane, str]:
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    config = attrs.evolve(
        agent_config(pki, control.port, mode=mode),
        register_interval_s=3600.0,
        health=HealthConfig(poll_s=POLL_S, policy=policy),
        containers=containers,
    )
    await nursery.start(run_agent, config)
    return control, config.worker_id


@pytest.mark.parametrize("mode", ["direct", "tunnel"])
async def test_a_foreign_process_occupies_a_card_until_it_is_gone_and_xid_79_quarantines(
    tmp_path: Path,
    describe_node: DescribeNode,
    monkeypatch: pytest.MonkeyPatch,
    nursery: trio.Nursery,
    mode: str,
) -> None:
    node = nvlinked_node(2)
    path = describe_node(node)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    control, worker = await start(tmp_path, nursery, mode)
    with trio.fail_after(30):
        await wait_for_entry(control, worker, lambda e: e.cards == 2)

    squatted = change_device(node, 1, processes=(StandinProcess(4242, 1024 << 20),))
    write_description(path, squatted)
    with trio.fail_after(30):
        entry = await wait_for_entry(control, worker, lambda e: problem(e, 1) is not None)
    assert entry.cards == 1
    assert problem(entry, 1) == (
        CardState.OCCUPIED.value,
        "used by process outside levers9: pid 4242, 1024 MiB",
    )

    write_description(path, node)
    with trio.fail_after(30):
        entry = await wait_for_entry(control, worker, lambda e: e.cards == 2)
    assert entry.problem_cards == ()

    write_description(path, change_device(node, 0, xid_events=((1, 79),)))
    with trio.fail_after(30):
        entry = await wait_for_entry(control, worker, lambda e: problem(e, 0) is not None)
    state, reason = problem(entry, 0) or ("", "")
    assert state == CardState.UNHEALTHY.value
    assert "XID 79" in reason and UUIDS[0] in reason and "falling off the bus" in reason
    assert entry.cards == 1

    write_description(path, node)  # quarantine is final: the card does not come back
    with trio.fail_after(30):
        client = await control.registry.client_for(worker)
        info = await client.worker()
    states = {c.index: c.state for c in info.cards}
    assert states == {0: CardState.UNHEALTHY, 1: CardState.SERVING}


def _containers(tmp_path: Path) -> ContainerConfig:
    return ContainerConfig(
        state_dir=tmp_path / "state",
        object_budget_bytes=1 << 30,
        free_floor_bytes=0,
        log_max_bytes=1 << 20,
        allow_local_registries=True,
    )


@pytest.fixture
def gpu_containers(
    describe_node: DescribeNode,
    make_dev_dir: MakeDevDir,
    driver_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Path, StandinNode]:
    node = nvlinked_node(2)
    path = describe_node(node)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    monkeypatch.setenv("LEVERS9_GPU_DEV_DIR", str(make_dev_dir(range(2))))
    monkeypatch.setenv("LEVERS9_GPU_DRIVER_DIR", str(driver_dir))
    monkeypatch.setenv("LEVERS9_GPU_CDI_DIRS", "")
    return path, node


@pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")
@pytest.mark.parametrize("policy", ["fail", "mark"])
async def test_the_container_on_a_card_that_reports_xid_79_fails_naming_card_and_xid(
    tmp_path: Path,
    registry: SharedRegistry,
    gpu_containers: tuple[Path, StandinNode],
    nursery: trio.Nursery,
    policy: str,
) -> None:
    path, node = gpu_containers
    control, worker_id = await start(
        tmp_path,
        nursery,
        "tunnel",
        containers=_containers(tmp_path),
        policy=policy,
    )
    with trio.fail_after(30):
        await wait_for_entry(control, worker_id, lambda e: e.cards == 2)
        worker = await control.registry.client_for(worker_id)
        holder = await worker.create_container(
            ContainerSpec(image=registry.busybox, id="holder", cards=1, command=("sleep", "600"))
        )
    assert holder.state == ContainerState.RUNNING
    (uuid,) = holder.cards
    index = UUIDS.index(uuid)

    write_description(path, change_device(node, index, xid_events=((1, 79),)))
    with trio.fail_after(30):
        entry = await wait_for_entry(control, worker_id, lambda e: problem(e, index) is not None)
    assert entry.cards == 1
    with trio.fail_after(30):
        await wait_for_status(worker, "holder", lambda s: any("XID 79" in e for e in s.events))
        if policy == "fail":
            status = await worker.wait_container("holder")
    if policy == "fail":
        assert status.state == ContainerState.FAILED
        assert status.error is not None
        assert f"card {index} ({uuid})" in status.error and "XID 79" in status.error
    else:
        status = await worker.container("holder")
        assert status.state == ContainerState.RUNNING
        await worker.stop_container("holder", grace_s=0)

    with pytest.raises(ApiError) as refused:
        await worker.create_container(
            ContainerSpec(image=registry.busybox, id="both", cards=2, command=("true",))
        )
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
    other = await worker.create_container(
        ContainerSpec(image=registry.busybox, id="other", cards=1, command=("sleep", "600"))
    )
    assert other.cards == (UUIDS[1 - index],)
    await worker.stop_container("other", grace_s=0)
