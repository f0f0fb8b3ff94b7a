"""GPU health as a user sees it: a card that fails is taken out and its task says why, a card
someone else uses is seen, and no task lands on a quarantined card.

One loopback installation (`sim.cluster.open_cluster`: Kubernetes stand-in, simulated kubelet
whose agent loads the NVML stand-in, controlplane, registry), one node whose direct-mode worker
holds every card. A card's trouble is written into the node's NVML description while the agent
runs (`nvml.standin.write_description`), so the agent meets it through pynvml's real calls:

- `xid_to_reported_p50_s`, `xid_to_reported_max_s`: from XID 79 (the GPU has fallen off the
  bus) written for the card a running one-card task holds, until both the task is failed with a
  reason naming XID 79 and `GET /v1/machines` (what `levers9 machine list` shows) lists the card
  unhealthy; once per card, `injections` cards in all. Target <= 2 s.
- `placed_on_quarantined`: of `placements` one-card tasks run after the injections, how many
  were given a quarantined card. Target 0.
- `squatter_to_out_p50_s`, `squatter_to_out_max_s`: from a process outside levers9 (a host
  `sleep`) written onto a free card until the machines list shows the card occupied, and so out
  of placement; `squatter_gone_to_back_p50_s` until it is back once the process is gone. Each
  comes and goes at a seeded random point of the agent's look cycle (it looks at processes every
  `LEVERS9_GPU_HEALTH_POLL_S`, 2 s), so the figures spread over one cycle. Target <= 5 s.

The worker's registration heartbeat is left at its default (30 s, an input): a change reaches
the controlplane because the agent registers again at once, not because a heartbeat came.

    python -m bench.gpuhealth [--quick] --json FILE

Needs root, runc and docker-registry (`make deps`).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from bench.report import Results, run_planned
from control.cli.client import ControlClient
from control.models import MachineList, TaskRequest, TaskState, TaskView
from nvml.standin import (
    StandinNode,
    StandinProcess,
    change_device,
    nvlinked_node,
    with_xid,
    write_description,
)
from sim.cluster import Cluster, PoolSpec, open_cluster
from sim.kubeapi.http import start_kube_standin
from sim.kubelet import SimNode
from sim.registry import busybox_image, push, running_registry

TARGET = "target: xid_to_reported <= 2 s, squatter_to_out <= 5 s, placed_on_quarantined = 0"
NODE = "gpu-node-1"
POOL = "direct"
WORKSPACE = "team-a"
XID = 79
HEARTBEAT_S = 30.0
HEALTH_POLL_S = 2.0
CLUSTER_START_DEADLINE_S = 120.0
CHANGE_DEADLINE_S = 60.0
LOOK_EVERY_S = 0.01
SEED = 40
"""Seeds where in the agent's look cycle each squatter comes and goes."""


@attrs.frozen
class Plan:
    injections: int
    placements: int
    squatters: int
    spare_cards: int
    """Cards left healthy after the injections: how many placements run at once."""


FULL = Plan(injections=20, placements=1000, squatters=10, spare_cards=4)
QUICK = Plan(injections=5, placements=50, squatters=3, spare_cards=3)


class BenchError(Exception):
    pass


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Looks every `LOOK_EVERY_S` until `await condition()` is true; BenchError naming `what`
    after `CHANGE_DEADLINE_S`."""
    with trio.move_on_after(CHANGE_DEADLINE_S):
        # Asked over the API, as a user or script would see it: nothing to wait on but time.
        while not await condition():  # noqa: ASYNC110
            await trio.sleep(LOOK_EVERY_S)
        return
    raise BenchError(f"{what}: not seen within {CHANGE_DEADLINE_S:.0f} s")


def card_states(machines: MachineList, uuid: str) -> set[str]:
    """What the machines list says of card `uuid` of the node: its problem states (none when it
    serves)."""
    return {
        problem.state
        for machine in machines.machines
        if machine.node == NODE
        for problem in machine.card_problems
        if problem.uuid == uuid
    }


@attrs.define
class Node:
    """The node's NVML description as this benchmark last wrote it."""

    path: Path
    model: StandinNode

    def index_of(self, uuid: str) -> int:
        return next(i for i, d in enumerate(self.model.devices) if d.uuid == uuid)

    def write(self, index: int, **changes: object) -> None:
        self.model = change_device(self.model, index, **changes)
        write_description(self.path, self.model)


async def task_cards(cluster: Cluster, task_id: str) -> tuple[str, ...]:
    assert cluster.control is not None
    record = await cluster.control.dispatcher.store.get(WORKSPACE, task_id)
    return tuple(record.cards)


async def running_task(client: ControlClient, image: str) -> TaskView:
    task = await client.create_task(TaskRequest(image=image, command=("sleep", "600"), cards=1))

    async def running() -> bool:
        nonlocal task
        task = await client.task(task.id)
        if task.state in (TaskState.FAILED, TaskState.LOST, TaskState.SUCCEEDED):
            raise BenchError(f"task {task.id} ended before it ran: {task.reason}")
        return task.state is TaskState.RUNNING

    await until(running, "running")
    return task


async def measure_xids(
    cluster: Cluster, client: ControlClient, node: Node, image: str, count: int
) -> tuple[list[float], set[str]]:
    samples: list[float] = []
    quarantined: set[str] = set()
    for _ in range(count):
        task = await running_task(client, image)
        (uuid,) = await task_cards(cluster, task.id)
        index = node.index_of(uuid)
        began = time.perf_counter()
        node.write(index, xid_events=with_xid(node.model.devices[index], XID).xid_events)

        async def failed(task_id: str = task.id) -> bool:
            view = await client.task(task_id)
            return view.state is TaskState.FAILED and f"XID {XID}" in (view.reason or "")

        async def shown(card: str = uuid) -> bool:
            return "unhealthy" in card_states(await client.machines(), card)

        await until(failed, "task failed")
        await until(shown, "card unhealthy")
        samples.append(time.perf_counter() - began)
        quarantined.add(uuid)
    return samples, quarantined


async def measure_placements(
    cluster: Cluster, client: ControlClient, image: str, count: int, at_once: int
) -> tuple[int, list[str]]:
    """Runs `count` one-card tasks, `at_once` at a time; how many succeeded, and the cards they
    were given."""
    succeeded = 0
    given: list[str] = []

    async def one() -> None:
        nonlocal succeeded
        task = await client.create_task(TaskRequest(image=image, command=("true",), cards=1))
        with trio.fail_after(CHANGE_DEADLINE_S):
            done = await client.wait_task(task.id)
        succeeded += done.state is TaskState.SUCCEEDED
        given.extend(await task_cards(cluster, task.id))

    left = count
    while left:
        batch = min(at_once, left)
        async with trio.open_nursery() as nursery:
            for _ in range(batch):
                nursery.start_soon(one)
        left -= batch
    return succeeded, given


async def measure_squatters(
    client: ControlClient, node: Node, free: Sequence[str], count: int
) -> tuple[list[float], list[float]]:
    out: list[float] = []
    back: list[float] = []
    phases = random.Random(SEED)
    squatter = await trio.lowlevel.open_process(["sleep", "3600"])  # outside levers9
    try:
        for round_ in range(count):
            uuid = free[round_ % len(free)]
            index = node.index_of(uuid)
            # At a random point of the agent's look cycle: the previous step was seen at one of
            # its looks, and writing right after it would always wait the whole cycle.
            await trio.sleep(phases.uniform(0, HEALTH_POLL_S))
            began = time.perf_counter()
            node.write(index, processes=(StandinProcess(pid=squatter.pid),))

            async def occupied(card: str = uuid) -> bool:
                return "occupied" in card_states(await client.machines(), card)

            await until(occupied, "card occupied")
            out.append(time.perf_counter() - began)
            await trio.sleep(phases.uniform(0, HEALTH_POLL_S))
            began = time.perf_counter()
            node.write(index, processes=())

            async def serving(card: str = uuid) -> bool:
                return not card_states(await client.machines(), card)

            await until(serving, "card back")
            back.append(time.perf_counter() - began)
    finally:
        squatter.kill()
        await squatter.wait()
    return out, back


async def run_benchmark(workdir: Path, plan: Plan) -> tuple[Results, dict[str, float]]:
    cards = plan.injections + plan.spare_cards
    with running_registry(workdir / "registry") as registry:
        push(registry.url, "busybox", "latest", busybox_image())
        image = f"{registry.host}/busybox:latest"
        running = start_kube_standin(workdir / "kube")
        try:
            async with open_cluster(
                workdir / "cluster",
                running.kube,
                nodes=[(SimNode(NODE, cards), POOL)],
                pools=[PoolSpec(POOL)],
                agent_env={
                    "LEVERS9_REGISTER_INTERVAL_S": str(HEARTBEAT_S),
                    "LEVERS9_GPU_HEALTH_POLL_S": str(HEALTH_POLL_S),
                },
            ) as cluster:
                with trio.fail_after(CLUSTER_START_DEADLINE_S):
                    await cluster.wait_workers(1)
                node = Node(cluster.kubelet.nvml_description(NODE), nvlinked_node(cards))
                async with cluster.client(WORKSPACE) as client:
                    warm = await client.create_task(TaskRequest(image=image, command=("true",)))
                    with trio.fail_after(CLUSTER_START_DEADLINE_S):
                        await client.wait_task(warm.id)
                    print(f"xid: {plan.injections} cards, one after another", flush=True)
                    xids, quarantined = await measure_xids(
                        cluster, client, node, image, plan.injections
                    )
                    print(f"placements: {plan.placements} one-card tasks", flush=True)
                    succeeded, given = await measure_placements(
                        cluster, client, image, plan.placements, plan.spare_cards
                    )
                    free = [d.uuid for d in node.model.devices if d.uuid not in quarantined]
                    print(f"squatters: {plan.squatters}", flush=True)
                    out, back = await measure_squatters(client, node, free, plan.squatters)
        finally:
            running.stop()
    if succeeded != plan.placements:
        raise BenchError(f"{plan.placements - succeeded} of the placements did not succeed")
    figures = {
        "xid_to_reported_p50_s": statistics.median(xids),
        "xid_to_reported_max_s": max(xids),
        "placed_on_quarantined": float(sum(1 for uuid in given if uuid in quarantined)),
        "squatter_to_out_p50_s": statistics.median(out),
        "squatter_to_out_max_s": max(out),
        "squatter_gone_to_back_p50_s": statistics.median(back),
    }
    inputs = {
        "cards": float(cards),
        "injections": float(plan.injections),
        "placements": float(len(given)),
        "squatters": float(plan.squatters),
        "heartbeat_s": HEARTBEAT_S,
        "health_poll_s": HEALTH_POLL_S,
    }
    return Results(figures=figures, anchors={}, ratios={}), inputs


def main(argv: Sequence[str] | None = None) -> None:
    run_planned(
        argv,
        prog="python -m bench.gpuhealth",
        description="A failing card's task failed with its reason and the card shown out; no "
        "task on a quarantined card; a squatter seen.",
        quick_help="fewer cards and placements",
        plans=(FULL, QUICK),
        run=run_benchmark,
        target=TARGET,
    )


if __name__ == "__main__":
    main()
