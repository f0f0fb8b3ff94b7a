"""The replicated controlplane: what several replicas cost and what they buy, in one run.

Two loopback installations over one PostgreSQL server (`sim.postgres`), each a Kubernetes
stand-in with two GPU nodes whose tunnel-mode workers run real runc containers
(`sim.replicas.open_replicated_cluster`): first with ONE controlplane replica, then with three
behind the Service.

- Placement: bursts of short tasks created through the Service; `tasks_placed_per_s` is how
  many went from created to running per second (the records' own timestamps, first create to
  last running), and `cpu_ms_per_placed_task` the replicas' CPU time over a burst divided by
  its tasks; the median of three bursts each. One replica against three:
  `ratios.placed_3_vs_1` (coordination must not cost throughput) and the CPU each costs.
- Then, with three replicas, simulated agents (containers off, many to a process, each with its
  own TLS connection and WebSocket tunnel through the Service, so spread over the replicas):
  `rss_per_tunnel_kb` (the replicas' resident memory with them, less without, per tunnel);
  `rtt_forwarded_vs_owner` (a worker call, `GET /v1/workers/ID`, through a replica that must
  forward it one hop, against through the replica that holds the tunnel: p50 each); and
  `failover_s`, the replica holding the most tunnels killed with SIGKILL until every one of its
  agents holds its tunnel on another replica (each agent reconnects with the agent's default
  backoff, 0.5 s doubling, jittered; the kill comes once every tunnel has been up for the
  agents' stable period, 60 s, as on a cluster whose agents have run a while). Failover is
  polled every `FAILOVER_POLL_S` (0.5 s), reported as `inputs.failover_poll_s`: each agent's
  time back is late by up to one poll and one listing, the figure's resolution.

    python -m bench.ha [--quick] [--agents N] --json FILE

Needs root, runc, docker-registry and postgresql-15 (`make deps`).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import psutil
import trio

from agent.daemon.config import AgentConfig, TunnelConfig
from bench.report import Results, publish
from bench.tunnel import run_until_sigterm
from control.cli.client import ControlClient, ControlClientError
from control.models import TaskRequest, TaskView
from sim.cluster import REPO, PoolSpec
from sim.kubeapi.http import start_kube_standin
from sim.kubelet import SimNode
from sim.postgres import PostgresServer, running_postgres
from sim.registry import busybox_image, push, running_registry
from sim.replicas import ReplicatedCluster, open_replicated_cluster
from wire.connection import KeepaliveConfig
from wire.errors import ApiError

TARGET = (
    "targets: failover_s <= 10 with 1,000 agents; placed_3_vs_1 >= 0.9; "
    "rtt_forwarded_vs_owner <= 1.5; rss_per_tunnel_kb <= 200"
)
SEED_ENV = "LEVERS9_BENCH_HA_SEED"
"""The agents' tokens derive from it; passed to the agent processes in their environment,
never on a command line."""
AGENTS_PER_PROCESS = 250
FAILOVER_POLL_S = 0.5
"""How often failover asks which replica holds each tunnel, and so the resolution of
`failover_s`: listing 1,000 workers costs the replica asked a few tens of milliseconds, which the
reconnecting agents need, so it is not asked more often."""
DEADLINE_S = 600


@attrs.frozen
class Plan:
    agents: int
    burst: int
    rounds: int
    rtt_calls: int


FULL = Plan(agents=1000, burst=60, rounds=3, rtt_calls=300)
QUICK = Plan(agents=200, burst=20, rounds=3, rtt_calls=100)


def _say(message: str) -> None:
    print(f"bench.ha: {message}", file=sys.stderr, flush=True)


def agent_id(index: int) -> str:
    return f"sim-{index:05d}"


def agent_token(seed: str, index: int) -> str:
    return hmac.new(seed.encode(), agent_id(index).encode(), hashlib.sha256).hexdigest()


# --- the agents' processes -----------------------------------------------------------------


async def run_agents(url: str, ca_file: str, seed: str, first: int, count: int) -> None:
    """`count` agents without containers in this process, each its own tunnel."""
    from agent.daemon.run import run_agent

    async with trio.open_nursery() as nursery:
        for index in range(first, first + count):
            config = AgentConfig(
                worker_id=agent_id(index),
                token=agent_token(seed, index),
                mode="tunnel",
                controlplane_url=url,
                controlplane_ca_file=ca_file,
                register_interval_s=600.0,
                keepalive=KeepaliveConfig(ping_interval_s=15.0, ping_timeout_s=15.0),
                tunnel=TunnelConfig(),
            )
            nursery.start_soon(run_agent, config)
            if index % 50 == 49:
                await trio.sleep(0.2)  # a rollout, not one SYN flood


def agents_main(spec: str) -> None:
    first, _, count = spec.partition(":")
    seed = os.environ[SEED_ENV]
    url, ca = os.environ["LEVERS9_BENCH_HA_URL"], os.environ["LEVERS9_BENCH_HA_CA"]
    os.environ["LEVERS9_LOG_LEVEL"] = "WARNING"
    from proc.logs import setup_logging

    setup_logging("WARNING")
    trio.run(run_until_sigterm, lambda: run_agents(url, ca, seed, int(first), int(count)))


# --- measurements --------------------------------------------------------------------------


def replica_processes(cluster: ReplicatedCluster) -> list[psutil.Process]:
    return [psutil.Process(p.pid) for p in cluster.processes if p is not None]


def cpu_s(processes: Sequence[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def rss_bytes(processes: Sequence[psutil.Process]) -> int:
    return sum(process.memory_info().rss for process in processes)


@attrs.frozen
class Placement:
    per_s: float
    cpu_ms_per_task: float
    p50_s: float


async def measure_placement(
    cluster: ReplicatedCluster, image: str, burst: int, rounds: int
) -> Placement:
    """`rounds` bursts (the median's), each of `burst` tasks created through the Service as
    fast as they are taken; each task sleeps long enough that a burst's all run at once."""
    results = [await _burst(cluster, image, burst) for _ in range(rounds)]
    return Placement(
        per_s=statistics.median(r.per_s for r in results),
        cpu_ms_per_task=statistics.median(r.cpu_ms_per_task for r in results),
        p50_s=statistics.median(r.p50_s for r in results),
    )


async def _burst(cluster: ReplicatedCluster, image: str, burst: int) -> Placement:
    processes = replica_processes(cluster)
    cpu_before = cpu_s(processes)
    created: list[TaskView] = []
    async with cluster.client() as client:
        for _ in range(burst):
            created.append(
                await client.create_task(TaskRequest(image=image, command=("sleep", "4")))
            )
        views = await _wait_running(client, {task.id for task in created})
    cpu = cpu_s(processes) - cpu_before
    first = min(v.created_at for v in views)
    last = max(v.running_at or 0.0 for v in views)
    async with cluster.client() as client:
        for task in created:
            await client.wait_task(task.id)
    return Placement(
        per_s=burst / (last - first),
        cpu_ms_per_task=cpu * 1000 / burst,
        p50_s=statistics.median((v.running_at or 0.0) - v.created_at for v in views),
    )


async def _wait_running(client: ControlClient, ids: set[str]) -> list[TaskView]:
    """Until every task of `ids` has run: one listing a tenth of a second, so the waiting
    adds little to what the replicas are measured doing."""
    while True:
        listed = [v for v in await client.tasks(limit=len(ids) + 10) if v.id in ids]
        ended = [v for v in listed if v.terminal and v.running_at is None]
        if ended:
            raise RuntimeError(f"task {ended[0].id} ended before it ran: {ended[0].reason}")
        if len(listed) == len(ids) and all(v.running_at is not None for v in listed):
            return listed
        await trio.sleep(0.1)


async def holders(cluster: ReplicatedCluster, replica: int) -> dict[str, str | None]:
    """worker id → the replica holding it, as `replica` lists them."""
    async with cluster.client("operator", replica=replica) as client:
        listed = (await client.workers()).workers
    return {w.worker_id: (w.replica if w.connected else None) for w in listed}


async def wait_agents(cluster: ReplicatedCluster, count: int) -> dict[str, str | None]:
    while True:
        held: dict[str, str | None] = {}
        try:
            held = await holders(cluster, 0)
        except* (ApiError, ControlClientError):
            pass  # a replica busy with the agents' handshakes: ask again
        up = sum(1 for worker, at in held.items() if worker.startswith("sim-") and at)
        if up >= count:
            return held
        await trio.sleep(1.0)


async def call_p50_s(cluster: ReplicatedCluster, replica: int, worker: str, calls: int) -> float:
    async with cluster.client("operator", replica=replica) as client:
        await client.worker(worker)  # the peer connection, if any, is dialed here
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await client.worker(worker)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def index_of(replica: str) -> int:
    """A replica's index from its identity (`replica-I_suffix`, its HOSTNAME first)."""
    return int(replica.split("_", maxsplit=1)[0].rsplit("-", 1)[1])


# --- the whole run -------------------------------------------------------------------------


async def one_installation(
    workdir: Path,
    server: PostgresServer,
    image: str,
    replicas: int,
    plan: Plan,
    seed: str,
) -> tuple[Placement, dict[str, float]]:
    name = f"r{replicas}_{secrets.token_hex(3)}"
    with server.admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    database = {"url": server.url(name), "password": server.password}
    running = start_kube_standin(workdir / f"kube-{replicas}")
    tokens = {agent_id(i): agent_token(seed, i) for i in range(plan.agents)} if replicas > 1 else {}
    more: dict[str, float] = {}
    try:
        async with open_replicated_cluster(
            workdir / f"cluster-{replicas}",
            running.kube,
            nodes=[(SimNode("gpu-node-1", 2), "gpu"), (SimNode("gpu-node-2", 2), "gpu")],
            pools=[PoolSpec("gpu", tunnel=True)],
            database=database,
            replicas=replicas,
            worker_tokens=tokens,
            lease_s=15.0,
            # Every agent here comes from 127.0.0.1; on a cluster each node has its own
            # address, and the per-source limit (256) is per node.
            settings={"connections": {"maxPerSource": 4 * plan.agents + 100}},
        ) as cluster:
            with trio.fail_after(DEADLINE_S):
                await cluster.wait_workers(2)
                _say(f"{replicas} replica(s): a burst of {plan.burst} tasks")
                # One task first, so each worker has the image and its first container made.
                await measure_placement(cluster, image, 2, 1)
                placement = await measure_placement(cluster, image, plan.burst, plan.rounds)
                if replicas > 1:
                    more = await with_agents(cluster, workdir, plan, seed)
    finally:
        running.stop()
    return placement, more


async def with_agents(
    cluster: ReplicatedCluster, workdir: Path, plan: Plan, seed: str
) -> dict[str, float]:
    processes = replica_processes(cluster)
    rss_before = rss_bytes(processes)
    env = {
        **os.environ,
        SEED_ENV: seed,
        "LEVERS9_BENCH_HA_URL": cluster.url,
        "LEVERS9_BENCH_HA_CA": str(cluster.pki.ca_file),
    }
    children = []
    _say(f"{plan.agents} simulated agents in {-(-plan.agents // AGENTS_PER_PROCESS)} processes")
    log = (workdir / "agents.log").open("ab")
    try:
        for first in range(0, plan.agents, AGENTS_PER_PROCESS):
            count = min(AGENTS_PER_PROCESS, plan.agents - first)
            children.append(
                await trio.lowlevel.open_process(
                    [sys.executable, "-m", "bench.ha", "--agents-process", f"{first}:{count}"],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
        try:
            started = time.monotonic()
            held = await wait_agents(cluster, plan.agents)
            _say(f"all {plan.agents} tunnels up in {time.monotonic() - started:.1f} s")
            # Settled, as on a cluster whose agents have run a while: every tunnel up for the
            # agents' stable period, so a reconnect starts from the first backoff step (one
            # that took a few tries in the start-up rush would otherwise wait its grown
            # backoff out).
            await trio.sleep(TunnelConfig().backoff_stable_s + 1)
            rss = (rss_bytes(processes) - rss_before) / plan.agents / 1024
            by_replica: dict[str, list[str]] = {}
            for worker, replica in held.items():
                if worker.startswith("sim-") and replica:
                    by_replica.setdefault(replica, []).append(worker)
            _say("tunnels per replica: " + ", ".join(f"{len(v)}" for v in by_replica.values()))
            victim, victims = max(by_replica.items(), key=lambda item: len(item[1]))
            owner = index_of(victim)
            other = next(i for i in range(len(cluster.ports)) if i != owner)
            worker = victims[0]
            _say(f"worker calls through its owner and forwarded, {plan.rtt_calls} each")
            owner_s = await call_p50_s(cluster, owner, worker, plan.rtt_calls)
            forwarded_s = await call_p50_s(cluster, other, worker, plan.rtt_calls)
            _say(f"killing replica {victim} with its {len(victims)} tunnels")
            killed = time.monotonic()
            await cluster.kill(owner)
            back_at: dict[str, float] = {}
            while len(back_at) < len(victims):
                await trio.sleep(FAILOVER_POLL_S)
                now_held = await holders(cluster, other)
                for w in victims:
                    if w not in back_at and now_held.get(w) not in (None, victim):
                        back_at[w] = time.monotonic() - killed
            failover = max(back_at.values())
            _say(
                f"all {len(victims)} back on the others in {failover:.1f} s (polled every "
                f"{FAILOVER_POLL_S:g} s: each time back is late by up to that plus one listing)"
            )
        finally:
            for child in children:
                child.send_signal(signal.SIGTERM)
            for child in children:
                with trio.move_on_after(30):
                    await child.wait()
                if child.poll() is None:
                    child.kill()
                    await child.wait()
    finally:
        log.close()
    return {
        "rss_per_tunnel_kb": rss,
        "failover_s": failover,
        "failover_p50_s": statistics.median(back_at.values()),
        "failover_tunnels": float(len(victims)),
        "rtt_owner_ms": owner_s * 1000,
        "rtt_forwarded_ms": forwarded_s * 1000,
    }


async def run_benchmark(workdir: Path, plan: Plan) -> tuple[Results, dict[str, float]]:
    seed = secrets.token_hex(16)
    with running_postgres() as server, running_registry(workdir / "registry") as registry:
        push(registry.url, "busybox", "latest", busybox_image())
        image = f"{registry.host}/busybox:latest"
        one, _ = await one_installation(workdir, server, image, 1, plan, seed)
        three, more = await one_installation(workdir, server, image, 3, plan, seed)
    figures = {
        "tasks_placed_per_s": three.per_s,
        "tasks_placed_per_s_1": one.per_s,
        "placed_p50_s": three.p50_s,
        "placed_p50_s_1": one.p50_s,
        "cpu_ms_per_placed_task": three.cpu_ms_per_task,
        "cpu_ms_per_placed_task_1": one.cpu_ms_per_task,
        **more,
    }
    ratios = {
        "placed_3_vs_1": three.per_s / one.per_s,
        "cpu_per_task_3_vs_1": three.cpu_ms_per_task / one.cpu_ms_per_task,
        "rtt_forwarded_vs_owner": more["rtt_forwarded_ms"] / more["rtt_owner_ms"],
    }
    inputs = {
        "agents": float(plan.agents),
        "burst": float(plan.burst),
        "rounds": float(plan.rounds),
        "rtt_calls": float(plan.rtt_calls),
        "replicas": 3.0,
        "failover_poll_s": FAILOVER_POLL_S,
    }
    return Results(figures=figures, anchors={}, ratios=ratios), inputs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ha",
        description="Several controlplane replicas over PostgreSQL: task placement with one "
        "replica against three, memory per tunnel, a forwarded call against the owner's, and "
        "the failover of a killed replica's tunnels, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="200 agents, a burst of 20")
    parser.add_argument("--agents", type=int, metavar="N", help="simulated agents (1000)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    parser.add_argument("--agents-process", metavar="FIRST:COUNT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agents_process:
        agents_main(args.agents_process)
        return
    plan = QUICK if args.quick else FULL
    if args.agents is not None:
        if args.agents < 10:
            parser.error(f"--agents must be 10 or more, not {args.agents}")
        plan = attrs.evolve(plan, agents=args.agents)
    with tempfile.TemporaryDirectory(prefix="levers9-bench-ha-") as tmp:
        results, inputs = trio.run(run_until_sigterm, lambda: run_benchmark(Path(tmp), plan))
    publish(results, inputs, args.json, target=TARGET)


if __name__ == "__main__":
    main()
