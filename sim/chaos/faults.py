"""How each kind of fault is done to the loopback installation, and undone.

Why this module exists: the schedule (`sim.chaos.schedule`) says what to break; this is where it
is broken, with the same means a real fault has: SIGKILL for a replica or an agent (no drain,
nothing handed back), PostgreSQL restarted in immediate mode, every connection through the
Service cut or held (`sim.faultproxy`), the API server answering 500, 429 or slowly, dropping
or delaying its watches, a node's kubelet reporting NotReady, the registry stalling in the
middle of a blob. Each injector returns once the fault is over (healed); the campaign then
waits for the installation to recover and checks the invariants.

An agent is killed in the phase its kind names (pulling, taking in a snapshot, starting a
container, writing a bucket): the injector asks the workload for a task that goes through that
phase and kills the agent of the node it landed on while it is there. Which node that is, is
the run's, not the seed's; the injector reports what it hit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from control.cli.client import ControlClient
from control.models import TaskState
from sim.chaos.schedule import PlannedFault
from sim.chaos.workload import Workload
from sim.faultproxy import FaultProxy
from sim.kubeapi.store import KubeStandin, WatchFaults
from sim.postgres import PostgresServer
from sim.replicas import ReplicatedCluster

__all__ = ["Injected", "Installation", "NodeInfo", "inject"]

log = logging.getLogger("levers9.chaos")

PHASE_WAIT_S = 45.0
"""How long an agent kill waits for a task to reach its phase before it kills anyway."""
POLL_S = 0.05
PULL_HELD_AFTER_BYTES = 200_000


@attrs.frozen
class NodeInfo:
    """A simulated node: its name, its pool's mode, where its agent keeps its state, and the
    prefix of its container networks."""

    name: str
    mode: str
    state_dir: Path
    network_prefix: str


@attrs.define(eq=False)
class Installation:
    """Everything the campaign acts on."""

    cluster: ReplicatedCluster
    kube: KubeStandin
    postgres: PostgresServer
    registry_proxy: FaultProxy
    nodes: tuple[NodeInfo, ...]
    workload: Workload


@attrs.frozen
class Injected:
    """What was done: the fault, what it hit (for an agent kill, the node and whether the
    phase was met), and when it began and ended (trio's clock)."""

    fault: PlannedFault
    hit: str
    began: float
    healed: float
    killed: tuple[str, ...] = ()
    """The workers (Jobs) whose agents it killed: recovery waits for their successors."""


async def inject(inst: Installation, fault: PlannedFault) -> Injected:
    """Do `fault` and undo it; returns once it is over."""
    began = trio.current_time()
    killed: tuple[str, ...] = ()
    kind = fault.kind
    hit = fault.target
    kube = inst.kube
    if kind == "replica_kill":
        index = int(fault.target.rsplit("-", 1)[1])
        if inst.cluster.processes[index] is not None:
            await inst.cluster.kill(index)
        await trio.sleep(fault.lasts_s)
        await inst.cluster.start(index)
    elif kind.startswith("agent_kill_"):
        hit, job = await _kill_agent_in_phase(inst, kind.removeprefix("agent_kill_"))
        killed = (job,) if job else ()
    elif kind == "postgres_restart":
        await trio.to_thread.run_sync(inst.postgres.restart)
    elif kind == "tunnel_cut":
        hit = f"{inst.cluster.service.cut()} connection(s)"
    elif kind == "tunnel_stall":
        inst.cluster.service.stall()
        try:
            await trio.sleep(fault.lasts_s)
        finally:
            inst.cluster.service.resume()
    elif kind in ("api_5xx", "api_429", "api_slow"):
        if kind == "api_5xx":
            kube.inject_fault("500", count=None)
        elif kind == "api_429":
            kube.inject_fault("429", count=None, retry_after_s=1)
        else:
            kube.inject_fault("delay", count=None, delay_s=1.5)
        try:
            await trio.sleep(fault.lasts_s)
        finally:
            kube.clear_faults()
    elif kind == "watch_drop":
        hit = f"{kube.drop_watches()} watch(es)"
    elif kind == "watch_lag":
        kube.set_watch_faults(WatchFaults(lag_s=fault.amount))
        hit = f"{fault.amount:g} s of lag"
        try:
            await trio.sleep(fault.lasts_s)
        finally:
            kube.set_watch_faults(WatchFaults())
    elif kind == "node_not_ready":
        kube.set_node_ready(fault.target, False)
        try:
            await trio.sleep(fault.lasts_s)
        finally:
            kube.set_node_ready(fault.target, True)
    elif kind == "registry_stall":
        await inst.workload.start_kind("fresh_pull")
        inst.registry_proxy.stall_after(int(fault.amount))
        hit = f"after {int(fault.amount)} bytes"
        try:
            await trio.sleep(fault.lasts_s)
        finally:
            inst.registry_proxy.resume()
    else:
        raise ValueError(f"no injector for fault kind {kind!r}")
    return Injected(fault, hit, began, trio.current_time(), killed)


# -- agents killed mid-phase ---------------------------------------------------------------------

_STARTS = {
    "pull": "fresh_pull",
    "ingest": "snapshot_restore",
    "start": "short",
    "bucket_write": "bucket_write",
}


async def _kill_agent_in_phase(inst: Installation, phase: str) -> tuple[str, str | None]:
    """Start a task that goes through `phase`, and SIGKILL the agent of its node while the
    task is there; when none gets there in time, the agent of the node a task last started
    on. Returns the node with whether the phase was met, and the killed worker's Job."""
    if phase == "pull":
        # The pull is held in the middle of its blob until the agent is gone: a pull of a
        # small image is otherwise over before it can be seen.
        inst.registry_proxy.stall_after(PULL_HELD_AFTER_BYTES)
    try:
        await inst.workload.start_kind(_STARTS[phase])
        found: str | None = None
        with trio.move_on_after(PHASE_WAIT_S):
            found = await _node_in_phase(inst, phase)
        node = found or _fallback_node(inst)
        job = _running_job(inst, node)
        if job is None:
            return f"{node} (no agent running)", None
        inst.cluster.kubelet.kill(job)
    finally:
        if phase == "pull":
            inst.registry_proxy.resume()
    log.info("chaos: killed agent %s on %s (%s)", job, node, phase)
    return f"{node} ({'in phase' if found else 'phase not met'})", job


async def _node_in_phase(inst: Installation, phase: str) -> str:
    watch = _PHASES[phase]
    while True:
        async with inst.cluster.client() as client:
            while True:
                node = watch(await _starting_and_running(client))
                if node is not None:
                    return node
                await trio.sleep(POLL_S)


async def _starting_and_running(client: ControlClient) -> Sequence[_Seen]:
    views = await client.tasks(states=[TaskState.STARTING, TaskState.RUNNING], limit=50)
    return [
        _Seen(
            node=v.node,
            state=v.state.value,
            container=v.container_state,
            pulled=(v.pull.done_bytes if v.pull is not None else None),
            snapshot=v.snapshot is not None,
            fresh="/chaos/fresh-" in v.image,
            volumes=bool(v.command and "/data/" in " ".join(v.command)),
        )
        for v in views
        if v.node
    ]


@attrs.frozen
class _Seen:
    node: str | None
    state: str
    container: str | None
    pulled: int | None
    snapshot: bool
    volumes: bool
    fresh: bool
    """Its image is one no node had: while the registry is held mid-blob, it is pulling."""


def _first(seen: Sequence[_Seen], test: Callable[[_Seen], bool]) -> str | None:
    return next((s.node for s in seen if test(s)), None)


_PHASES: dict[str, Callable[[Sequence[_Seen]], str | None]] = {
    # Pull progress is known only to the replica holding the worker; a fresh image's task
    # starting while the registry holds its blob is pulling, whichever replica answers.
    "pull": lambda seen: _first(seen, lambda s: s.state == "starting" and s.fresh),
    "ingest": lambda seen: _first(
        seen, lambda s: s.state == "starting" and (s.snapshot or bool(s.pulled))
    ),
    "start": lambda seen: _first(seen, lambda s: s.state == "starting" and not s.snapshot),
    "bucket_write": lambda seen: _first(seen, lambda s: s.volumes),
}


def _running_job(inst: Installation, node: str) -> str | None:
    running = [a for a in inst.cluster.kubelet.agents() if a.node == node and a.returncode is None]
    return running[-1].job_name if running else None


def _fallback_node(inst: Installation) -> str:
    running = [a.node for a in inst.cluster.kubelet.agents() if a.returncode is None]
    return running[-1] if running else inst.nodes[0].name
