"""`make demo-ha`: the controlplane as three replicas over PostgreSQL, and one of them killed
while a task runs.

The same real parts as `make demo` (a docker-registry with busybox, the Kubernetes API
stand-in, worker Jobs run by the simulated kubelet, runc containers, the `levers9` CLI), with
the controlplane as the chart runs it for `replicaCount: 3`: three `levers9-control serve`
processes over one PostgreSQL 15 server started for the demo, behind one Service
(`sim.replicas`). One pool reaches its worker directly, the other through the worker's tunnel.

A task that prints a line every half second is followed with `levers9 task logs -f`; midway the
replica holding the task's worker is killed with SIGKILL. The worker's tunnel lands on another
replica, the follow goes on without losing or repeating a line, and the task succeeds. Exits 0
only if every step worked, else it says which step failed and exits 1.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import trio

from sim.cluster import PoolSpec
from sim.demo import DemoFailed, deadline, run_demo_main, say
from sim.kubeapi.http import start_kube_standin
from sim.kubelet import SimNode
from sim.postgres import running_postgres
from sim.registry import busybox_image, running_registry
from sim.replicas import ReplicatedCluster, open_replicated_cluster

WORKSPACE = "team-a"
TICKS = 24
TICK_COMMAND = ("sh", "-c", f"for i in $(seq 1 {TICKS}); do echo tick $i; sleep 0.5; done")
STEP_S = 60.0


async def _levers9(cluster: ReplicatedCluster, *args: str, workspace: str = WORKSPACE) -> str:
    say(f"\n$ levers9 {shlex.join(args)}")
    with deadline(f"levers9 {args[0]}", STEP_S):
        result = await cluster.cli(*args, workspace=workspace)
    out = result.stdout.decode(errors="replace").rstrip()
    for text in (result.stderr.decode(errors="replace").rstrip(), out):
        if text:
            say(text)
    if result.returncode != 0:
        raise DemoFailed(f"levers9 {args[0]} exited {result.returncode}; its output is above")
    return out


async def _holder(cluster: ReplicatedCluster, worker: str, not_: str | None = None) -> str:
    """The replica holding `worker` (once one other than `not_` does)."""
    while True:
        async with cluster.client("operator") as client:
            listed = {w.worker_id: w for w in (await client.workers()).workers}
        found = listed.get(worker)
        if found is not None and found.connected and found.replica not in (None, not_):
            assert found.replica is not None
            return found.replica
        await trio.sleep(0.2)


async def run_demo(workdir: Path) -> None:
    say("starting PostgreSQL, a registry, the Kubernetes API stand-in and 3 replicas ...")
    with (
        running_postgres() as server,
        running_registry(workdir / "registry") as registry,
    ):
        name = f"levers9_{secrets.token_hex(3)}"
        with server.admin() as conn:
            conn.execute(f"CREATE DATABASE {name}")
        registry.push("busybox", "latest", busybox_image())
        image = registry.ref("busybox:latest")
        kube = start_kube_standin(workdir / "kube")
        try:
            async with open_replicated_cluster(
                workdir / "cluster",
                kube.kube,
                nodes=[
                    (SimNode("gpu-node-a", 1), "direct-pool"),
                    (SimNode("gpu-node-b", 2), "tunnel-pool"),
                ],
                pools=[PoolSpec("direct-pool"), PoolSpec("tunnel-pool", tunnel=True)],
                database={"url": server.url(name), "password": server.password},
                agent_env={"LEVERS9_LOG_LEVEL": "WARNING"},
            ) as cluster:
                say(f"controlplane {cluster.url}: 3 replicas over {server.url(name)}")
                with deadline("both workers connecting", STEP_S):
                    await cluster.wait_workers(2)
                await _levers9(cluster, "worker", "list", workspace="operator")
                # Two cards: best fit sends it to the tunnel pool's worker.
                out = await _levers9(
                    cluster, "run", "--detach", "--gpus", "2", image, "--", *TICK_COMMAND
                )
                task_id = out.split()[-1]
                await follow_and_kill(cluster, task_id)
                await _levers9(cluster, "worker", "list", workspace="operator")
                await _levers9(cluster, "task", "get", task_id)
                say(
                    "\ndemo finished: the replica holding the task's worker was killed mid-task; "
                    "the worker came back on another replica, the follow lost no line and the "
                    "task succeeded"
                )
        finally:
            kube.stop()


async def follow_and_kill(cluster: ReplicatedCluster, task_id: str) -> None:
    say(f"\n$ levers9 task logs -f {task_id}   (replica killed at tick 6)")
    lines: list[str] = []
    killed = trio.Event()
    with deadline("following the task", STEP_S * 2):
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "control.cli", "task", "logs", "-f", task_id],
            env=cluster.cli_env(WORKSPACE),
            stdout=subprocess.PIPE,
        )
        assert process.stdout is not None
        async with trio.open_nursery() as nursery:
            pending = b""
            async for chunk in process.stdout:
                pending += chunk
                *done, pending = pending.split(b"\n")
                for raw in done:
                    line = raw.decode(errors="replace")
                    lines.append(line)
                    say(f"  {line}")
                    if line == "tick 6" and not killed.is_set():
                        killed.set()
                        nursery.start_soon(_kill_holder, cluster, task_id)
            await process.wait()
    expected = [f"tick {i}" for i in range(1, TICKS + 1)]
    if lines != expected:
        raise DemoFailed(f"the follow showed {lines!r}, not tick 1 to tick {TICKS} once each")


async def _kill_holder(cluster: ReplicatedCluster, task_id: str) -> None:
    async with cluster.client(WORKSPACE) as client:
        worker = (await client.task(task_id)).worker
    assert worker is not None
    holder = await _holder(cluster, worker)
    index = int(holder.split("_")[0].rsplit("-", 1)[1])
    say(f"  [killing replica {holder} (SIGKILL), which holds worker {worker}]")
    await cluster.kill(index)
    moved = await _holder(cluster, worker, not_=holder)
    say(f"  [worker {worker} is held by replica {moved} now]")


def main() -> int:
    if os.geteuid() != 0:
        say("demo-ha needs root (runc containers, PostgreSQL run as the postgres user)")
        return 2
    return run_demo_main(run_demo, "levers9-demo-ha-")


if __name__ == "__main__":
    sys.exit(main())
