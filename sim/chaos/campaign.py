"""`python -m sim chaos --seed N --minutes M`: a seeded fault campaign over the whole loopback
installation, and the invariants that must hold through it.

Why this module exists: "survives faults" is a claim until it is a number. As FoundationDB's
simulation and Jepsen do for their systems, the campaign runs the real thing (three controlplane
replicas over PostgreSQL, nodes in both modes with real agents, runc, the registry, an S3 server
and rclone), keeps a stream of every kind of task under way (`sim.chaos.workload`), and injects
the faults the seed draws (`sim.chaos.schedule`, `sim.chaos.faults`), one after another: each is
done, undone, waited out until the installation serves again (every node has a connected
worker, and a probe task succeeds: the fault's recovery time), and the invariants that can be
checked while it runs are checked. At the end, with the workload stopped and every task ended,
the rest are: nothing a record does not own is left on any node, every task ended with a reason
that names its cause and none vanished, every follower saw each line once, what was written is
there. Every violation is printed with the seed, the time and the fault it followed.

The table it prints (and `--json FILE`, shaped as the benchmarks' reports) counts faults by kind
with their recovery times (p50 / p99), tasks by end state, and violations (which must be 0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from control.models import TaskState, TaskView
from proc.signals import run_until_signalled
from sim.chaos.faults import Injected, Installation, NodeInfo, inject
from sim.chaos.invariants import (
    TaskEnd,
    Violation,
    jobs_per_node,
    lines_once,
    node_leftovers,
    ran_twice,
    replicas_agree,
    store_violations,
    task_ends,
)
from sim.chaos.schedule import KINDS, PlannedFault, draw
from sim.chaos.workload import TERMINAL, Images, TaskTrack, Workload
from sim.cluster import PoolSpec
from sim.faultproxy import FaultProxy
from sim.kubeapi.http import start_kube_standin
from sim.kubeapi.objects import job_node
from sim.kubelet import SimNode, job_is_finished
from sim.postgres import PostgresServer, running_postgres
from sim.registry import build_image, busybox_image, push, running_registry
from sim.replicas import open_replicated_cluster
from sim.s3 import S3Server, running_s3_server

__all__ = ["Campaign", "Found", "Outcome", "main", "run_campaign"]

log = logging.getLogger("levers9.chaos")

NAMESPACE = "levers9"
FAULT_BOUND_S = 240.0
"""The longest one fault may take to be done and undone before the campaign calls it stuck."""
RECOVERY_BOUND_S = 180.0
"""The longest the installation may take to serve again after a fault."""
END_BOUND_S = 420.0
"""How long the end waits for every task to end and every container to be cleaned up."""
SAMPLE_JOBS_S = 0.5
SAMPLE_RUNNING_S = 1.0


@attrs.frozen
class Campaign:
    """What to run: the seed, how long the faults go on, where to keep everything, and which
    kinds of fault (all by default)."""

    seed: int
    minutes: float
    workdir: Path
    kinds: tuple[str, ...] = ()
    replicas: int = 3
    nodes_per_mode: int = 2


@attrs.frozen
class Found:
    """A violation, with when it was found (seconds into the campaign) and after which fault."""

    violation: Violation
    at_s: float
    after: str

    def line(self, seed: int) -> str:
        v = self.violation
        return f"seed {seed} t={self.at_s:.1f}s after {self.after}: {v.invariant}: {v.detail}"


@attrs.define
class Outcome:
    seed: int
    minutes: float
    injected: list[Injected] = attrs.Factory(list)
    recovery_s: dict[str, list[float]] = attrs.Factory(dict)
    found: list[Found] = attrs.Factory(list)
    tasks_by_state: Counter[str] = attrs.Factory(Counter)
    tasks_by_kind: Counter[str] = attrs.Factory(Counter)
    reasons: Counter[str] = attrs.Factory(Counter)
    """Why the tasks that did not succeed ended, their reasons with ids and numbers blanked."""
    lost_creates: int = 0
    duration_s: float = 0.0

    def faults_by_kind(self) -> Counter[str]:
        return Counter(i.fault.kind for i in self.injected)


# -- the installation ----------------------------------------------------------------------------


def _nodes(root: Path, per_mode: int) -> tuple[list[tuple[SimNode, str]], tuple[NodeInfo, ...]]:
    """Nodes of a tunnel pool and of a direct pool, and where the kubelet lays each out
    (`SimulatedKubelet`: root/nodes/<node>/state, container networks `k<index>`)."""
    specs: list[tuple[SimNode, str]] = []
    infos = []
    for index in range(2 * per_mode):
        mode = "tunnel" if index < per_mode else "direct"
        name = f"node-{index + 1}"
        specs.append((SimNode(name, 2), mode))
        infos.append(NodeInfo(name, mode, root / "nodes" / name / "state", f"k{index}"))
    return specs, tuple(infos)


def _bucket(s3: S3Server) -> dict[str, Any]:
    user = s3.users["a"]
    return {
        "name": "data",
        "url": f"s3://{user.bucket}/",
        "s3": {
            "accessKeyId": user.access_key_id,
            "secretAccessKey": user.secret_access_key,
            "endpoint": s3.endpoint,
        },
    }


@contextlib.asynccontextmanager
async def open_installation(
    campaign: Campaign, say: Callable[[str], None]
) -> AsyncIterator[tuple[Installation, S3Server]]:
    """The whole loopback installation, up with a worker on every node."""
    workdir = campaign.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        say("starting PostgreSQL, the registry, the S3 server and the Kubernetes API stand-in")
        postgres: PostgresServer = stack.enter_context(running_postgres())
        registry = stack.enter_context(running_registry(workdir / "registry"))
        s3 = stack.enter_context(running_s3_server(workdir / "s3"))
        kube_running = start_kube_standin(workdir / "kube")
        stack.callback(kube_running.stop)
        kube = kube_running.kube
        name = f"chaos_{campaign.seed}_{os.getpid()}"
        with postgres.admin() as conn:
            conn.execute(f"CREATE DATABASE {name}")
        await trio.to_thread.run_sync(push, registry.url, "busybox", "latest", busybox_image())
        registry_port = int(registry.url.rsplit(":", 1)[1])
        specs, infos = _nodes(workdir / "cluster" / "kubelet", campaign.nodes_per_mode)
        async with trio.open_nursery() as nursery:
            proxy = FaultProxy([registry_port])
            await proxy.start(nursery)
            host = f"127.0.0.1:{proxy.port}"
            layers = random.Random(f"levers9-chaos-images-{campaign.seed}")

            async def fresh(number: int) -> str:
                image = build_image(
                    [{f"fresh/{number}.bin": layers.randbytes(1 << 20)}], base=busybox_image()
                )
                repository = f"chaos/fresh-{number}"
                await trio.to_thread.run_sync(push, registry.url, repository, "latest", image)
                return f"{host}/{repository}:latest"

            say(f"starting {campaign.replicas} controlplane replicas and {len(specs)} nodes")
            async with open_replicated_cluster(
                workdir / "cluster",
                kube,
                nodes=specs,
                pools=[PoolSpec("tunnel", tunnel=True), PoolSpec("direct")],
                database={"url": postgres.url(name), "password": postgres.password},
                replicas=campaign.replicas,
                agent_env={"LEVERS9_BUCKET_CA": str(s3.ca_file)},
                buckets={"team-a": [_bucket(s3)]},
            ) as cluster:
                workload = Workload(
                    cluster.client,
                    Images(f"{host}/busybox:latest", fresh),
                    seed=campaign.seed,
                    replicas=campaign.replicas,
                )
                inst = Installation(cluster, kube, postgres, proxy, infos, workload)
                with trio.fail_after(RECOVERY_BOUND_S):
                    await _workers_on_every_node(inst)
                yield inst, s3
            nursery.cancel_scope.cancel()


# -- watching while it runs ----------------------------------------------------------------------


@attrs.define
class Samples:
    """What the samplers saw: active Jobs per node, running containers per node."""

    jobs: list[tuple[float, dict[str, int]]] = attrs.Factory(list)
    running: list[tuple[float, dict[str, set[str]]]] = attrs.Factory(list)


async def _sample_jobs(inst: Installation, samples: Samples, started: float) -> None:
    while True:
        counts: Counter[str] = Counter()
        for job in inst.kube.objects("jobs", NAMESPACE):
            node = job_node(job)
            # Read as Kubernetes shows it (not by the planner's rule, which this checks):
            # neither finished nor being deleted.
            deleting = bool(job.get("metadata", {}).get("deletionTimestamp"))
            if node is not None and not job_is_finished(job) and not deleting:
                counts[node] += 1
        samples.jobs.append((trio.current_time() - started, dict(counts)))
        await trio.sleep(SAMPLE_JOBS_S)


def _runc_containers(state_dir: Path) -> dict[str, str]:
    """The node's runc containers (id → status), as `runc list` shows them."""
    root = state_dir / "runc"
    if not root.exists():
        return {}
    result = subprocess.run(
        ["runc", "--root", str(root), "list", "--format", "json"],
        capture_output=True,
        check=False,
        timeout=30,
    )
    if result.returncode != 0 or not result.stdout.strip():
        return {}
    listed = json.loads(result.stdout) or []
    return {str(c["id"]): str(c.get("status", "")) for c in listed}


async def _sample_running(inst: Installation, samples: Samples, started: float) -> None:
    while True:
        seen: dict[str, set[str]] = {}
        for node in inst.nodes:
            containers = await trio.to_thread.run_sync(_runc_containers, node.state_dir)
            seen[node.name] = {cid for cid, status in containers.items() if status == "running"}
        samples.running.append((trio.current_time() - started, seen))
        await trio.sleep(SAMPLE_RUNNING_S)


# -- recovery ------------------------------------------------------------------------------------


async def _workers_on_every_node(inst: Installation, killed: Collection[str] = ()) -> None:
    """Until every node has a worker that registered, is connected, and whose agent runs (a
    killed agent's worker may be listed until the controlplane notices: never one of
    `killed`)."""
    wanted = {node.name for node in inst.nodes}
    while True:
        alive = {
            a.job_name
            for a in inst.cluster.kubelet.agents()
            if a.returncode is None and a.job_name not in killed
        }
        with contextlib.suppress(Exception):
            async with inst.cluster.client("operator") as client:
                listed = (await client.workers()).workers
            ready = {
                w.node
                for w in listed
                if w.connected and w.registered_at and w.node and w.worker_id in alive
            }
            if wanted <= ready:
                return
        await trio.sleep(0.25)


async def _recover(inst: Installation, killed: Collection[str]) -> float | None:
    """Seconds from now until the installation serves again: a worker connected on every node
    (none of those `killed`) and a probe task through the Service succeeded; None past
    `RECOVERY_BOUND_S`."""
    began = trio.current_time()
    with trio.move_on_after(RECOVERY_BOUND_S):
        await _workers_on_every_node(inst, killed)
        while True:
            if (await inst.workload.probe()).state == TaskState.SUCCEEDED:
                return trio.current_time() - began
            await trio.sleep(0.5)
    return None


# -- invariants ----------------------------------------------------------------------------------


async def _ends_by_replica(
    inst: Installation, ids: Sequence[str], replicas: int
) -> dict[str, dict[str, TaskEnd]]:
    """What each live replica answers for the ended tasks `ids`."""
    views: dict[str, dict[str, TaskEnd]] = {}
    for index in range(replicas):
        if inst.cluster.processes[index] is None:
            continue
        answers: dict[str, TaskEnd] = {}
        with contextlib.suppress(Exception):
            async with inst.cluster.client(replica=index) as client:
                for task_id in ids:
                    answers[task_id] = _end(await client.task(task_id))
        views[f"replica-{index}"] = answers
    return views


def _end(view: TaskView) -> TaskEnd:
    return TaskEnd(state=view.state.value, reason=view.reason, exit_code=view.exit_code)


async def _check_now(
    inst: Installation, samples: Samples, checked: dict[str, int], campaign: Campaign
) -> list[Violation]:
    """The invariants checked while the campaign runs, over what is new since last time."""
    found = jobs_per_node(samples.jobs[checked.get("jobs", 0) :])
    found += ran_twice(samples.running[checked.get("running", 0) :])
    checked["jobs"], checked["running"] = len(samples.jobs), len(samples.running)
    for node in inst.nodes:
        found += await trio.to_thread.run_sync(store_violations, node.name, node.state_dir)
    ended = [t.id for t in inst.workload.tracks.values() if t.end is not None]
    fresh = ended[checked.get("ended", 0) :][-20:]
    checked["ended"] = len(ended)
    found += replicas_agree(await _ends_by_replica(inst, fresh, campaign.replicas))
    return found


async def _all_tasks(inst: Installation) -> dict[str, TaskView]:
    """Every task of the workspace, as the records say (all pages)."""
    out: dict[str, TaskView] = {}
    before: str | None = None
    async with inst.cluster.client() as client:
        while True:
            page = await client.tasks(limit=500, before=before)
            out.update((view.id, view) for view in page)
            if len(page) < 500:
                return out
            before = page[-1].id


async def _tell_ending(
    workload: Workload, now_s: Callable[[], float], say: Callable[[str], None]
) -> None:
    """While the end is waited for: what is still under way, every half minute."""
    while True:
        await trio.sleep(30)
        driving = ", ".join(f"{k} {n}" for k, n in sorted(workload.driving.items()) if n)
        say(f"t={now_s():.0f}s: still under way: {driving or 'no task driver'}")


async def _wait_all_ended(inst: Installation) -> dict[str, TaskView]:
    while True:
        with contextlib.suppress(Exception):
            views = await _all_tasks(inst)
            if all(view.state in TERMINAL for view in views.values()):
                return views
        await trio.sleep(1.0)


async def _wait_cleaned_up(inst: Installation) -> None:
    """Until no node has a container (every task has ended)."""
    while True:
        left = 0
        for node in inst.nodes:
            left += len(await trio.to_thread.run_sync(_runc_containers, node.state_dir))
        if not left:
            return
        await trio.sleep(1.0)


def _follow_violations(tracks: Sequence[TaskTrack]) -> list[Violation]:
    found: list[Violation] = []
    for track in tracks:
        if not track.expected_lines or track.end is None or track.kind != "long_follow":
            continue
        succeeded = track.end.state == TaskState.SUCCEEDED
        for follower, streams in track.streams.items():
            whole = track.complete_streams.get(follower)
            for index, lines in enumerate(streams):
                found += lines_once(
                    follower,
                    track.id,
                    lines,
                    track.expected_lines,
                    complete=succeeded and index == whole,
                )
    return found


async def _content_violations(
    inst: Installation, tracks: Sequence[TaskTrack], s3: S3Server
) -> list[Violation]:
    """A restore that succeeded printed what its snapshot held; a bucket write that succeeded
    printed what it wrote, and it is in the bucket."""
    found: list[Violation] = []
    bucket = s3.users["a"].bucket
    for track in tracks:
        if track.end is None or track.end.state != TaskState.SUCCEEDED:
            continue
        if track.kind not in ("snapshot_restore", "bucket_write"):
            continue
        lines = await inst.workload.log_lines(track.id)
        if lines != list(track.expected_lines):
            found.append(
                Violation(
                    "content_kept",
                    f"task {track.id} ({track.kind}) succeeded but printed {lines[:3]!r}, "
                    f"not {list(track.expected_lines)!r}",
                )
            )
        if track.kind == "bucket_write":
            key = track.expected_lines[0].removeprefix("written-by-") + ".txt"
            try:
                body = await trio.to_thread.run_sync(_s3_object, s3, bucket, key)
            except Exception as exc:
                body = f"<{exc.__class__.__name__}>".encode()
            if body != track.expected_lines[0].encode() + b"\n":
                found.append(
                    Violation(
                        "content_kept",
                        f"task {track.id} wrote {key} to bucket {bucket} and succeeded, but the "
                        f"bucket holds {body[:60]!r}",
                    )
                )
    return found


def _s3_object(s3: S3Server, bucket: str, key: str) -> bytes:
    answer = s3.client(user=s3.users["a"]).get_object(Bucket=bucket, Key=key)
    return bytes(answer["Body"].read())


async def _check_end(
    inst: Installation, s3: S3Server, campaign: Campaign, views: Mapping[str, TaskView]
) -> list[Violation]:
    tracks = list(inst.workload.tracks.values())
    found = task_ends([t.id for t in tracks], {i: _end(v) for i, v in views.items()})
    owned = {i for i, v in views.items() if v.state not in TERMINAL}
    for node in inst.nodes:
        found += await trio.to_thread.run_sync(
            node_leftovers, node.name, node.state_dir, node.network_prefix, owned
        )
        found += await trio.to_thread.run_sync(store_violations, node.name, node.state_dir)
    found += _follow_violations(tracks)
    found += await _content_violations(inst, tracks, s3)
    ended = [i for i, v in views.items() if v.state in TERMINAL]
    sample = random.Random(campaign.seed).sample(ended, min(len(ended), 100))
    found += replicas_agree(await _ends_by_replica(inst, sample, campaign.replicas))
    return found


# -- the campaign --------------------------------------------------------------------------------


async def run_campaign(campaign: Campaign, say: Callable[[str], None] = print) -> Outcome:
    """Run `campaign` and return what it found (the caller prints it: `report`)."""
    outcome = Outcome(seed=campaign.seed, minutes=campaign.minutes)
    async with open_installation(campaign, say) as (inst, s3):
        started = trio.current_time()

        def now_s() -> float:
            return trio.current_time() - started

        samples = Samples()
        checked: dict[str, int] = {}
        faults = draw(
            campaign.seed,
            nodes=[n.name for n in inst.nodes],
            replicas=campaign.replicas,
            kinds=campaign.kinds or None,
        )
        async with trio.open_nursery() as watchers:
            watchers.start_soon(_sample_jobs, inst, samples, started)
            watchers.start_soon(_sample_running, inst, samples, started)
            async with inst.workload.drive() as workload:
                async with trio.open_nursery() as submitting:
                    await submitting.start(workload.run)
                    deadline = started + campaign.minutes * 60
                    for fault in faults:
                        if trio.current_time() + fault.pause_s >= deadline:
                            break
                        await trio.sleep(fault.pause_s)
                        await _one_fault(
                            inst, fault, outcome, samples, checked, campaign, now_s, say
                        )
                    submitting.cancel_scope.cancel()
                say(f"t={now_s():.0f}s: faults over; waiting for every task to end")
                watchers.start_soon(_tell_ending, inst.workload, now_s, say)
            say(f"t={now_s():.0f}s: every driver done; waiting for the records and the nodes")
            with trio.move_on_after(END_BOUND_S) as ending:
                views = await _wait_all_ended(inst)
                await _wait_cleaned_up(inst)
            if ending.cancelled_caught:
                views = await _all_tasks(inst)
            say(f"t={now_s():.0f}s: checking the invariants")
            found = await _check_now(inst, samples, checked, campaign)
            found += await _check_end(inst, s3, campaign, views)
            outcome.found += [Found(v, now_s(), "the end") for v in found]
            watchers.cancel_scope.cancel()
        outcome.tasks_by_state = Counter(v.state.value for v in views.values())
        outcome.reasons = Counter(
            f"{v.state.value}: {_shape(v.reason or '')}"
            for v in views.values()
            if v.state != TaskState.SUCCEEDED
        )
        outcome.tasks_by_kind = Counter(t.kind for t in inst.workload.tracks.values())
        outcome.lost_creates = inst.workload.lost_creates
        outcome.duration_s = now_s()
    return outcome


async def _one_fault(
    inst: Installation,
    fault: PlannedFault,
    outcome: Outcome,
    samples: Samples,
    checked: dict[str, int],
    campaign: Campaign,
    now_s: Callable[[], float],
    say: Callable[[str], None],
) -> None:
    label = fault.describe()
    say(f"t={now_s():.0f}s: {label}")
    with trio.move_on_after(FAULT_BOUND_S) as bound:
        injected = await inject(inst, fault)
    if bound.cancelled_caught:
        outcome.found.append(
            Found(
                Violation("fault_undone", f"{label} was not over in {FAULT_BOUND_S:g} s"),
                now_s(),
                label,
            )
        )
        return
    outcome.injected.append(injected)
    recovery = await _recover(inst, injected.killed)
    if recovery is None:
        outcome.found.append(
            Found(
                Violation(
                    "recovered",
                    f"the installation did not serve again within {RECOVERY_BOUND_S:g} s "
                    f"after {label} ({injected.hit})",
                ),
                now_s(),
                label,
            )
        )
    else:
        outcome.recovery_s.setdefault(fault.kind, []).append(recovery)
        say(f"t={now_s():.0f}s:   {injected.hit or 'done'}; serving again {recovery:.1f} s after")
    for violation in await _check_now(inst, samples, checked, campaign):
        found = Found(violation, now_s(), label)
        outcome.found.append(found)
        say("VIOLATION " + found.line(campaign.seed))


# -- the report ----------------------------------------------------------------------------------


def _shape(reason: str) -> str:
    """A reason with its ids, digests and numbers blanked, so that like reasons count as one."""
    reason = re.sub(r"sha256:[0-9a-f]{64}", "sha256:…", reason)
    reason = re.sub(r"\b(t|levers9)-[a-z0-9-]+", r"\1-…", reason)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", reason)[:160]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(outcome: Outcome) -> str:
    lines = [
        f"levers9 chaos campaign: seed {outcome.seed}, {outcome.duration_s / 60:.1f} min, "
        f"{len(outcome.injected)} faults",
        "",
        f"{'fault':<26}{'count':>6}{'recovery p50':>14}{'p99':>9}",
    ]
    counts = outcome.faults_by_kind()
    for kind in (k.name for k in KINDS):
        if not counts[kind]:
            continue
        times = outcome.recovery_s.get(kind, [])
        p50 = f"{_quantile(times, 0.5):.1f} s" if times else "-"
        p99 = f"{_quantile(times, 0.99):.1f} s" if times else "-"
        lines.append(f"{kind:<26}{counts[kind]:>6}{p50:>14}{p99:>9}")
    lines += [
        "",
        "tasks by end state: "
        + ", ".join(f"{s} {n}" for s, n in sorted(outcome.tasks_by_state.items())),
    ]
    lines.append(
        "tasks by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(outcome.tasks_by_kind.items()))
    )
    if outcome.lost_creates:
        lines.append(f"creates whose answer was lost: {outcome.lost_creates}")
    if outcome.reasons:
        lines.append("why the others ended:")
        lines += [f"  {n:>4} {reason}" for reason, n in outcome.reasons.most_common(12)]
    by_invariant = Counter(f.violation.invariant for f in outcome.found)
    lines += ["", f"invariant violations: {len(outcome.found)} (must be 0)"]
    lines += [f"  {name}: {n}" for name, n in sorted(by_invariant.items())]
    lines += [f"  {found.line(outcome.seed)}" for found in outcome.found]
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count() or 0,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def as_json(outcome: Outcome) -> dict[str, Any]:
    """The benchmarks' report shape: figures, ratios, anchors, machine; and the details."""
    figures: dict[str, float] = {
        "faults": float(len(outcome.injected)),
        "violations": float(len(outcome.found)),
        "tasks": float(sum(outcome.tasks_by_state.values())),
        "duration_s": outcome.duration_s,
    }
    for kind, times in sorted(outcome.recovery_s.items()):
        figures[f"recovery_p50_s.{kind}"] = _quantile(times, 0.5)
        figures[f"recovery_p99_s.{kind}"] = _quantile(times, 0.99)
    return {
        "figures": figures,
        "ratios": {},
        "anchors": {},
        "machine": _machine(),
        "seed": outcome.seed,
        "faults_by_kind": dict(outcome.faults_by_kind()),
        "tasks_by_state": dict(outcome.tasks_by_state),
        "tasks_by_kind": dict(outcome.tasks_by_kind),
        "lost_creates": outcome.lost_creates,
        "reasons": dict(outcome.reasons),
        "violations": [
            {
                "invariant": f.violation.invariant,
                "detail": f.violation.detail,
                "at_s": f.at_s,
                "after": f.after,
            }
            for f in outcome.found
        ],
        "faults": [
            {"fault": i.fault.describe(), "hit": i.hit, "lasted_s": i.healed - i.began}
            for i in outcome.injected
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sim chaos`: exits 0 when no invariant was violated, 1 otherwise."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sim chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="the seed the faults are drawn from")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long faults go on")
    parser.add_argument(
        "--json", type=Path, help="write the report here too (as the benchmarks do)"
    )
    parser.add_argument("--dir", type=Path, help="keep the installation's files here")
    parser.add_argument(
        "--kinds",
        default="",
        help="comma-separated fault kinds (default: all): " + ", ".join(k.name for k in KINDS),
    )
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in {kind.name for kind in KINDS}]
    if unknown:
        known = ", ".join(k.name for k in KINDS)
        parser.error(f"--kinds: no fault kind {', '.join(unknown)}; choose from {known}")
    if os.geteuid() != 0:
        print(
            "python -m sim chaos: runs containers with runc and PostgreSQL: run it as root",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with _workdir(args.dir) as workdir:
        campaign = Campaign(seed=args.seed, minutes=args.minutes, workdir=workdir, kinds=kinds)

        def say(text: str) -> None:
            print(text, flush=True)

        outcomes: list[Outcome] = []

        async def campaign_run() -> None:
            outcomes.append(await run_campaign(campaign, say))

        # SIGTERM or Ctrl-C stops the campaign with everything it started (replicas, agents,
        # PostgreSQL, the registry) stopped and removed, as the end of a run does.
        signum = trio.run(run_until_signalled, campaign_run)
    if not outcomes:
        print(f"python -m sim chaos: stopped by signal {signum}; nothing is left running")
        return 128 + signum
    outcome = outcomes[0]
    print(report(outcome), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(as_json(outcome), indent=2, sort_keys=True) + "\n")
    return 0 if not outcome.found else 1


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        yield given
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="levers9-chaos-") as scratch:
        yield Path(scratch)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
