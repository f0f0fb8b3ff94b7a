"""Reconcile at scale, from watch-fed caches: how long the caches take to fill and plan, what a
pass costs once they have, how soon a change shows, what the caches hold in memory and read
from the API server in steady state; and the planner's CPU time. One run, beside `kubectl get`
of every pod from the same API server.

- Cluster: the Kubernetes stand-in (`python -m sim.kubeapi`, its own process, TLS) serves 5,000
  8-card nodes with 20 pods each, a card held by every fourth, and a running worker of ours on
  every node holding 3 (1,000 nodes with `--quick`): the steady state after the first pass.
- `initial_sync_s`: from entering `Clusters.use` (client, node, pod, Job and Secret informers:
  paged lists, then watches) and starting `PoolReconciler.run`, to its first pass's status
  (`passed_at`). A fresh cache and reconciler each turn; the median of the turns.
- `cache_rss_mb`: this process's RSS growth over the first turn's sync (the first, before
  anything large was freed whose room would hide it). It includes the facts the four caches
  keep, the official client with its connection pool and TLS context, the worker threads the
  lists and watches read in, and whatever of the lists' transient JSON the allocator keeps
  rather than returns.
- `pass_wall_s`, `pass_cpu_s`: one steady-state `reconcile_once` from the filled caches (plan,
  nothing to apply), wall time and this process's CPU; the median of `passes`.
- `steady_bytes_per_min`: the watch bytes the informers read (`Informer.bytes_read`) over a quiet
  window of `--steady-s` seconds, per minute. Nothing changes then, so what comes is bookmarks:
  the stand-in sends one per watch every ``min(60, steady_s / 2)`` s (an apiserver: about a
  minute), so the window sees a few and the figure is at most twice an apiserver's.
  `full_list_bytes` is what one full list of the pods moves: the bodies of the pod cache's own
  paged list (500 a page), fetched raw through the official client.
- `change_to_plan_s`: a neighbour's one-card pod deleted through the API (the official client),
  from the delete's return to the first pass whose status shows the freed card on its node; a
  different node each time, each after a quiet `MIN_GAP_S` (as a change in steady state comes),
  the median of `changes`. It includes the watch's delivery, the loop's `COALESCE_S` and the
  pass.
- Planner: a cluster built in memory as the API returns it (5,000 GPU nodes and 100,000 pods;
  1,000 and 20,000 with `--quick`; some nodes NotReady or cordoned, neighbours holding some or
  all cards, our workers on every third node with records, a few expired). `facts_cpu_s`
  converts its dicts to facts as the caches do, `planner_cpu_s` is `plan_pool` over them:
  `time.process_time` (median of `repeats`), so other people's load does not enter it.
- Anchor: ``kubectl get pods -A --chunk-size=500 -o json`` (the same pages, the whole objects,
  its output thrown away), kubectl's discovery cache filled first as a user's would be; ours
  and kubectl's take turns, each figure the median of its turns. `kubectl_startup_s` (``kubectl
  version --client``) is what each of its runs pays before it asks anything.

What bounds the initial sync is decoding the pod list in this process: at 1,000 nodes and
21,000 pods (20 MB in 42 pages; one thread, timed page by page) the pod list took 0.60 s of a
0.83 s sync, `json.loads` 0.35 s of it, the fetch (the stand-in serving, TLS) 0.18 s, the facts
0.07 s. kubectl is slower at the same pages for the same reason: its JSON decoding costs about
150 ms of CPU a page while the server answers each in milliseconds (``-v=6``).

    python -m bench.reconcile [--quick] [--steady-s S] --json FILE

Needs kubectl on PATH (as `tests/test_kube_standin.py` and `bench.join` use it). The sizes go
in the report's ``inputs``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio
import yaml
from kubernetes import client as k8s

from bench.report import Results, publish, ratios_of
from control.kube.adapter import LIST_PAGE, build_api_client
from control.kube.caches import BOUND_LIVE_PODS, PoolCluster, open_clusters
from control.kube.loop import MIN_GAP_S, PoolReconciler
from control.kube.manifests import (
    PoolSettings,
    job_manifest,
    job_name,
    token_secret_name,
)
from control.kube.planner import (
    JobFacts,
    NodeFacts,
    PodFacts,
    WorkerRecord,
    job_facts,
    node_facts,
    plan_pool,
    pod_facts,
)
from control.kube.pools import PoolConfig, load_pools
from control.kube.selectors import Selector
from control.models import WorkerState
from control.workers.registry import WorkerRegistry, open_worker_registry

BOOKMARK_S = 60.0
"""An apiserver's bookmark interval, about."""


@attrs.frozen
class Size:
    """What one run measures on: the clusters' sizes, how many samples of each figure, and
    the steady window's length."""

    nodes: int
    pods: int
    repeats: int
    """Planner runs over the in-memory cluster."""
    turns: int
    """Initial syncs of ours, and kubectl lists, taking turns."""
    passes: int
    changes: int
    steady_s: float

    @property
    def pods_per_node(self) -> int:
        return max(1, self.pods // self.nodes)

    @property
    def bookmark_s(self) -> float:
        """How often the stand-in sends each watch a bookmark."""
        return min(BOOKMARK_S, self.steady_s / 2)


QUICK = Size(nodes=1_000, pods=20_000, repeats=3, turns=3, passes=5, changes=3, steady_s=20.0)
FULL = Size(nodes=5_000, pods=100_000, repeats=3, turns=3, passes=5, changes=5, steady_s=60.0)
POOL = "bench"
POOL_SELECTOR = {"pool": POOL}
"""The labels `sim.kubeapi`'s synthetic nodes carry."""
WORKER_NAMESPACE = "levers9"
"""Where the seeded workers' Jobs are (`worker_jobs`)."""
NEIGHBOUR_NAMESPACE = "work"
"""Where `sim.kubeapi`'s synthetic pods are; ``p-NODE-000`` holds a card."""
CONTROLPLANE_URL = "https://levers9.bench.test"
STANDIN_START_DEADLINE_S = 600.0
"""Filling the stand-in with the full size takes a while on a small machine."""
STANDIN_STOP_GRACE_S = 10.0
CHANGE_DEADLINE_S = 60.0
RATIOS = {"initial_sync_vs_kubectl": ("initial_sync_s", "kubectl_list_pods_s")}
"""Ours over an anchor."""
FIGURE_RATIOS = {"steady_bytes_vs_full_list": ("steady_bytes_per_min", "full_list_bytes")}
"""Ours over ours: a figure against what the design saves."""
TARGET = (
    "target: pass_wall_s <= 0.5 at 5,000 nodes and 100,000 pods, change_to_plan_s <= 2, "
    "initial_sync_vs_kubectl <= 1.5, steady_bytes_vs_full_list < 0.01, planner_cpu_s < 1"
)
NOW = 1_700_000_000.0
SETTINGS = PoolSettings(
    name="bench",
    namespace="levers9",
    image="worker:latest",
    selector=Selector(labels={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}),
)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the planner over an in-memory cluster ---------------------------------------------------


def _node(index: int, rng: random.Random) -> dict[str, Any]:
    roll = rng.random()
    return {
        "metadata": {
            "name": f"gke-bench-gpu-pool-{index:05d}",
            "labels": {
                "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"
                if index % 10
                else "nvidia-l4",
                "kubernetes.io/hostname": f"gke-bench-gpu-pool-{index:05d}",
            },
        },
        "spec": {
            "unschedulable": roll < 0.02,
            "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        },
        "status": {
            "allocatable": {"nvidia.com/gpu": "8", "cpu": "207400m", "memory": "1856Gi"},
            "conditions": [
                {"type": "MemoryPressure", "status": "False"},
                {"type": "Ready", "status": "False" if 0.02 <= roll < 0.04 else "True"},
            ],
        },
    }


def _pod(node: str, index: int, rng: random.Random) -> dict[str, Any]:
    gpus = rng.choice((0, 0, 0, 0, 1))
    container: dict[str, Any] = {
        "name": "main",
        "resources": {
            "requests": {
                "cpu": rng.choice(("100m", "250m", "1", "2", "1.5")),
                "memory": rng.choice(("128Mi", "1Gi", "2G", "512Mi")),
            },
            "limits": {"nvidia.com/gpu": str(gpus)} if gpus else {},
        },
    }
    spec: dict[str, Any] = {"nodeName": node, "containers": [container, dict(container)]}
    if index % 7 == 0:
        spec["initContainers"] = [
            {"name": "init", "resources": {"requests": {"cpu": "500m", "memory": "64Mi"}}}
        ]
    return {
        "metadata": {"name": f"pod-{index}", "namespace": "default", "labels": {"app": "x"}},
        "spec": spec,
        "status": {"phase": rng.choice(("Running",) * 8 + ("Pending", "Succeeded"))},
    }


def build_cluster(
    node_count: int, pod_count: int, seed: int = 9
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], list[WorkerRecord]]:
    """Nodes, pods, our Jobs (API dicts) and their records."""
    rng = random.Random(seed)
    nodes = [_node(index, rng) for index in range(node_count)]
    names = [node["metadata"]["name"] for node in nodes]
    pods = [_pod(names[index % node_count], index, rng) for index in range(pod_count)]
    jobs: list[dict[str, Any]] = []
    records: list[WorkerRecord] = []
    # Our workers on every third node, with a card each; one in fifty of them expired.
    for index in range(0, node_count, 3):
        node = names[index]
        name = job_name(SETTINGS.name, node, 0)
        manifests = job_manifest(
            SETTINGS, node, 1, name, f"{name}-token", "https://cp", token="bench"
        )
        job = manifests.job
        job["metadata"]["creationTimestamp"] = "2023-11-14T20:00:00Z"
        jobs.append(job)
        worker_pod = {
            "metadata": job["spec"]["template"]["metadata"],
            "spec": {**job["spec"]["template"]["spec"], "nodeName": node},
            "status": {"phase": "Running"},
        }
        pods.append(worker_pod)
        heartbeat = NOW - (700.0 if index % 150 == 0 else 20.0)
        records.append(WorkerRecord(name, node, WorkerState.READY, NOW - 3600.0, heartbeat))
    return nodes, pods, jobs, records


Facts = tuple[list[NodeFacts], list[PodFacts], list[JobFacts]]


def to_facts(nodes: list[Any], pods: list[Any], jobs: list[Any]) -> Facts:
    """The dicts as the caches keep them (nodes with the labels the selector reads)."""
    keep = SETTINGS.selector.labels.keys()
    return (
        [node_facts(node, keep) for node in nodes],
        [fact for fact in map(pod_facts, pods) if fact is not None],
        [fact for fact in map(job_facts, jobs) if fact is not None],
    )


@attrs.frozen
class PlannerSamples:
    facts_cpu_s: float
    planner_cpu_s: float
    machines: int
    actions: int
    pods: int


def measure_planner(size: Size) -> PlannerSamples:
    """Median CPU seconds of converting the in-memory cluster to facts, and of `plan_pool`
    over the facts."""
    nodes, pods, jobs, records = build_cluster(size.nodes, size.pods)
    facts_times: list[float] = []
    plan_times: list[float] = []
    machines = actions = 0
    for _ in range(size.repeats):
        start = time.process_time()
        node_list, pod_list, job_list = to_facts(nodes, pods, jobs)
        facts_times.append(time.process_time() - start)
        start = time.process_time()
        plan = plan_pool(SETTINGS, node_list, pod_list, job_list, records, NOW)
        plan_times.append(time.process_time() - start)
        machines, actions = len(plan.machines), len(plan.actions)
    return PlannerSamples(
        facts_cpu_s=statistics.median(facts_times),
        planner_cpu_s=statistics.median(plan_times),
        machines=machines,
        actions=actions,
        pods=len(pods),
    )


# --- the caches and the loop against the stand-in ---------------------------------------------


def worker_jobs(node_count: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """A running worker of the pool on every synthetic node (`node-00000`...), as a reconcile
    pass would have left them: the Job and token Secret from the real manifest, 3 cards each."""
    settings = PoolSettings(name=POOL, namespace=WORKER_NAMESPACE, image="worker:bench")
    for index in range(node_count):
        node = f"node-{index:05d}"
        name = job_name(POOL, node, 0)
        manifests = job_manifest(
            settings,
            node,
            3,
            name,
            token_secret_name(name),
            CONTROLPLANE_URL,
            token="bench",
            hostname=node,
        )
        yield manifests.job, manifests.secret


def write_worker_jobs(directory: Path, node_count: int) -> Path:
    """`worker_jobs` as the JSON lines file `python -m sim.kubeapi --seed-jobs` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    seed = directory / "workers.jsonl"
    seed.write_text("".join(json.dumps(pair) + "\n" for pair in worker_jobs(node_count)))
    return seed


@asynccontextmanager
async def open_kube_standin_process(
    directory: Path, node_count: int, pods_per_node: int, bookmark_s: float = BOOKMARK_S
) -> AsyncIterator[Path]:
    """``python -m sim.kubeapi`` with a synthetic cluster and our worker on every node, in its
    own process; yields its kubeconfig, stops it on exit (it also exits when its stdin closes)."""
    command = [sys.executable, "-m", "sim.kubeapi", str(directory)]
    command += ["--nodes", str(node_count), "--pods-per-node", str(pods_per_node)]
    seed = await trio.to_thread.run_sync(write_worker_jobs, directory, node_count)
    command += ["--seed-jobs", str(seed), "--bookmark-interval-s", str(bookmark_s)]
    server = await trio.lowlevel.open_process(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        line = b""
        with trio.fail_after(STANDIN_START_DEADLINE_S):
            while not line.endswith(b"\n"):
                chunk = await server.stdout.receive_some(4096)
                if not chunk:
                    raise RuntimeError(
                        f"the Kubernetes stand-in exited with {server.returncode} before it served"
                    )
                line += chunk
        yield Path(json.loads(line)["kubeconfig"])
    finally:
        with trio.CancelScope(shield=True):
            if server.stdin is not None:
                await server.stdin.aclose()
            with trio.move_on_after(STANDIN_STOP_GRACE_S):
                await server.wait()
            if server.returncode is None:
                server.kill()
                await server.wait()


def pool_block(kubeconfig: Path) -> dict[str, Any]:
    """The pool block an operator would write for the stand-in's cluster."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    return {
        "name": POOL,
        "provider": "kubernetes",
        "kubernetes": {
            "flavor": "generic",
            "endpoint": cluster["server"],
            "caData": cluster["certificate-authority-data"],
            "credentials": {"token": config["users"][0]["user"]["token"]},
            "namespace": WORKER_NAMESPACE,
            "image": "worker:bench",
            "selector": POOL_SELECTOR,
        },
    }


def kubectl_base(kubectl: str, kubeconfig: Path, cache_dir: Path) -> list[str]:
    """kubectl with the stand-in's kubeconfig and a discovery cache of its own."""
    return [kubectl, "--kubeconfig", str(kubeconfig), "--cache-dir", str(cache_dir)]


def kubectl_list_pods(base: Sequence[str]) -> list[str]:
    """The anchor: every pod, in the pages our pod cache lists in, as whole objects."""
    return [*base, "get", "pods", "-A", f"--chunk-size={LIST_PAGE}", "-o", "json"]


async def time_command(command: Sequence[str]) -> float:
    """Wall seconds of running `command`, its output thrown away (not kept in this process,
    whose memory the caches' figure reads)."""
    began = time.perf_counter()
    await trio.run_process(list(command), stdout=subprocess.DEVNULL, capture_stderr=True)
    return time.perf_counter() - began


@contextmanager
def raw_core_api(pool: PoolConfig) -> Iterator[k8s.CoreV1Api]:
    """The official client as the adapter builds it, for what the benchmark does beside the
    reconciler (blocking: call it in a thread)."""
    api_client, temp_dir = build_api_client(pool)
    try:
        yield k8s.CoreV1Api(api_client)
    finally:
        api_client.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def full_list_bytes(core: k8s.CoreV1Api) -> int:
    """The body bytes of one full paged list of the pods, as the pod cache lists them."""
    total = 0
    token: str | None = None
    while True:
        kw: dict[str, Any] = {"limit": LIST_PAGE, "field_selector": BOUND_LIVE_PODS}
        if token:
            kw["_continue"] = token
        response = core.list_pod_for_all_namespaces(_preload_content=False, **kw)
        data: bytes = response.data
        total += len(data)
        token = (json.loads(data).get("metadata") or {}).get("continue")
        if not token:
            return total


def heartbeat(registry: WorkerRegistry) -> None:
    """Every adopted worker heard from now, as a connected one is: the stand-in's Jobs run no
    agent, and a record that hears nothing for `EXPIRE_AFTER_S` would have its Job deleted in
    the middle of a full run."""
    now = time.time()
    for entry in registry.entries():
        entry.registered_at = now


async def wait_pass(reconciler: PoolReconciler, seen: Callable[[], bool] = lambda: True) -> None:
    """Until a pass has made `seen` true (checked now, then after each pass)."""
    while not (reconciler.status.passed_at is not None and seen()):
        await reconciler.passes.park()
    if reconciler.status.error is not None:
        raise RuntimeError(f"the pass failed: {reconciler.status.error}")


async def time_pass(reconciler: PoolReconciler) -> tuple[float, float, int]:
    """Wall and CPU seconds (this process) of one pass, and the machines of its plan."""
    cpu_before = time.process_time()
    began = time.perf_counter()
    plan = await reconciler.reconcile_once()
    wall_s = time.perf_counter() - began
    cpu_s = time.process_time() - cpu_before
    if plan is None:
        raise RuntimeError(f"the pass failed: {reconciler.status.error}")
    return wall_s, cpu_s, len(plan.machines)


def free_cards(reconciler: PoolReconciler, node: str) -> int | None:
    for machine in reconciler.status.machines:
        if machine.node == node:
            return machine.cards.free
    return None


def shows_free(reconciler: PoolReconciler, node: str, cards: int) -> bool:
    return free_cards(reconciler, node) == cards


@attrs.define
class WatchSamples:
    """What `measure_watch` saw: one sample per turn, pass and change."""

    sync_s: list[float] = attrs.field(factory=list)
    rss_growth_bytes: int = 0
    pass_wall_s: list[float] = attrs.field(factory=list)
    pass_cpu_s: list[float] = attrs.field(factory=list)
    change_s: list[float] = attrs.field(factory=list)
    steady_bytes_per_min: float = 0.0
    full_list_bytes: int = 0
    kubectl_s: list[float] = attrs.field(factory=list)
    kubectl_startup_s: list[float] = attrs.field(factory=list)


async def steady_state(
    reconciler: PoolReconciler,
    cluster: PoolCluster,
    registry: WorkerRegistry,
    pool: PoolConfig,
    size: Size,
    samples: WatchSamples,
) -> None:
    """Changes one by one as the loop sees them, the quiet window's bytes, a full list's, then
    passes of our own. The passes come last: a `reconcile_once` from outside the loop replaces
    the event the loop waits on for changes, so changes after it would wait for the period."""
    with raw_core_api(pool) as core:
        for change in range(size.changes):
            index = change * size.nodes // size.changes
            node = f"node-{index:05d}"
            before = free_cards(reconciler, node)
            if before is None:
                raise RuntimeError(f"{node} is no machine; the change would show nowhere")
            heartbeat(registry)
            await trio.sleep(MIN_GAP_S)
            await trio.to_thread.run_sync(
                core.delete_namespaced_pod, f"p-{index:05d}-000", NEIGHBOUR_NAMESPACE
            )
            deleted = time.perf_counter()
            freed = functools.partial(shows_free, reconciler, node, before + 1)
            with trio.fail_after(CHANGE_DEADLINE_S):
                await wait_pass(reconciler, freed)
            samples.change_s.append(time.perf_counter() - deleted)
            _say(f"change {change + 1}/{size.changes}: {node} {samples.change_s[-1]:.3f} s")

        heartbeat(registry)
        caches = cluster.caches.all()
        lists_before = [cache.lists for cache in caches]
        bytes_before = sum(cache.bytes_read for cache in caches)
        await trio.sleep(size.steady_s)
        steady_bytes = sum(cache.bytes_read for cache in caches) - bytes_before
        if [cache.lists for cache in caches] != lists_before:
            raise RuntimeError("a cache listed again in the quiet window: it was no steady state")
        samples.steady_bytes_per_min = steady_bytes * 60.0 / size.steady_s
        samples.full_list_bytes = await trio.to_thread.run_sync(full_list_bytes, core)
        _say(
            f"steady: {steady_bytes} bytes in {size.steady_s:g} s; a full list of the pods: "
            f"{samples.full_list_bytes} bytes"
        )

    heartbeat(registry)
    for _ in range(size.passes):
        wall_s, cpu_s, machines = await time_pass(reconciler)
        samples.pass_wall_s.append(wall_s)
        samples.pass_cpu_s.append(cpu_s)
    _say(
        f"passes: {machines} machines, median {statistics.median(samples.pass_wall_s):.3f} s "
        f"({statistics.median(samples.pass_cpu_s):.3f} s CPU)"
    )


async def measure_watch(workdir: Path, size: Size) -> WatchSamples:
    """Initial syncs of ours and kubectl's lists taking turns against one stand-in; in the
    last turn of ours, the steady state."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not on PATH; the reconcile benchmark's anchor needs it")
    samples = WatchSamples()
    standin = open_kube_standin_process(
        workdir / "kube", size.nodes, size.pods_per_node, size.bookmark_s
    )
    async with (
        standin as kubeconfig,
        open_worker_registry({}) as registry,
        trio.open_nursery() as nursery,
    ):
        pool = load_pools([pool_block(kubeconfig)]).pools[0]
        base = kubectl_base(kubectl, kubeconfig, workdir / "kubectl-cache")
        # Fill kubectl's discovery cache, as any earlier use of kubectl would have.
        await trio.run_process([*base, "api-resources", "-o", "name"], capture_stdout=True)
        process = psutil.Process()

        async def ours(turn: int) -> None:
            rss_before = process.memory_info().rss
            async with open_clusters() as clusters:
                began = time.perf_counter()
                async with (
                    clusters.use(pool) as cluster,
                    trio.open_nursery() as loop,
                ):
                    reconciler = PoolReconciler(
                        pool, cluster, registry, controlplane_url=CONTROLPLANE_URL
                    )
                    await loop.start(reconciler.run)
                    await wait_pass(reconciler)
                    samples.sync_s.append(time.perf_counter() - began)
                    if turn == 0:
                        samples.rss_growth_bytes = process.memory_info().rss - rss_before
                    heartbeat(registry)
                    _say(
                        f"sync {turn + 1}/{size.turns}: {len(reconciler.status.machines)} "
                        f"machines, {len(cluster.caches.pods.items)} pods cached, "
                        f"{samples.sync_s[-1]:.2f} s"
                    )
                    if turn == size.turns - 1:
                        await steady_state(reconciler, cluster, registry, pool, size, samples)
                    loop.cancel_scope.cancel()

        async def theirs(turn: int) -> None:
            samples.kubectl_s.append(await time_command(kubectl_list_pods(base)))
            samples.kubectl_startup_s.append(await time_command([kubectl, "version", "--client"]))
            _say(f"kubectl {turn + 1}/{size.turns}: {samples.kubectl_s[-1]:.2f} s")

        for turn in range(size.turns):
            # Ours first in the first turn: the caches' memory is measured in a fresh process.
            for step in (ours, theirs) if turn % 2 == 0 else (theirs, ours):
                await step(turn)
        nursery.cancel_scope.cancel()
    return samples


def run_benchmark(size: Size, workdir: Path) -> tuple[Results, dict[str, float]]:
    """The caches and the loop against kubectl, then the planner over an in-memory cluster,
    at `size`; the report's sections and its inputs."""
    _say(
        f"{size.nodes} nodes, {size.nodes * size.pods_per_node} neighbour pods in the stand-in; "
        f"{size.turns} turns of ours and kubectl's"
    )
    watch = trio.run(measure_watch, workdir, size)
    planner = measure_planner(size)
    _say(
        f"planner: {planner.machines} machines, {planner.actions} actions, "
        f"{planner.facts_cpu_s:.3f} s CPU to facts, {planner.planner_cpu_s:.3f} s CPU to plan"
    )
    figures = {
        "initial_sync_s": statistics.median(watch.sync_s),
        "pass_wall_s": statistics.median(watch.pass_wall_s),
        "pass_cpu_s": statistics.median(watch.pass_cpu_s),
        "change_to_plan_s": statistics.median(watch.change_s),
        "cache_rss_mb": watch.rss_growth_bytes / 2**20,
        "steady_bytes_per_min": watch.steady_bytes_per_min,
        "full_list_bytes": float(watch.full_list_bytes),
        "planner_cpu_s": planner.planner_cpu_s,
        "facts_cpu_s": planner.facts_cpu_s,
    }
    anchors = {
        "kubectl_list_pods_s": statistics.median(watch.kubectl_s),
        "kubectl_startup_s": statistics.median(watch.kubectl_startup_s),
    }
    ratios = {**ratios_of(RATIOS, figures, anchors), **ratios_of(FIGURE_RATIOS, figures, figures)}
    inputs = {
        "nodes": float(size.nodes),
        "pods": float(planner.pods),
        "pass_pods": float(size.nodes * (size.pods_per_node + 1)),
        "turns": float(size.turns),
        "passes": float(size.passes),
        "changes": float(size.changes),
        "steady_s": size.steady_s,
        "bookmark_s": size.bookmark_s,
    }
    return Results(figures=figures, anchors=anchors, ratios=ratios), inputs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reconcile",
        description="The pool reconciler from watch-fed caches at scale (initial sync, pass, "
        "change to plan, memory, steady-state bytes) beside kubectl get of every pod, and the "
        "planner's CPU time, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, 20,000 pods")
    parser.add_argument(
        "--steady-s",
        type=float,
        metavar="S",
        help=f"the quiet window's seconds (default {FULL.steady_s:g}, {QUICK.steady_s:g} "
        "with --quick)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.steady_s is not None:
        if not args.steady_s > 0:
            parser.error(f"--steady-s must be more than 0 seconds, not {args.steady_s:g}")
        size = attrs.evolve(size, steady_s=args.steady_s)
    with tempfile.TemporaryDirectory(prefix="levers9-bench-reconcile-") as tmp:
        results, inputs = run_benchmark(size, Path(tmp))
    publish(results, inputs, args.json, target=TARGET)


if __name__ == "__main__":
    main()
