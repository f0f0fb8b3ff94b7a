"""Reconcile at scale: the planner's CPU time, and a whole pass against `kubectl get` of the
same lists from the same API server, in one run.

- Planner: the cluster is built in memory as the Kubernetes API returns it (node, pod and Job
  dicts): 5,000 GPU nodes and 100,000 pods (1,000 and 20,000 with `--quick`). Nodes vary the
  way real pools do: some NotReady or cordoned, neighbours holding some or all cards, our
  workers on a share of the nodes with records, a few of them expired. `planner_cpu_s` is
  `time.process_time` around `control.kube.planner.plan_pool` (median of the repeats), so other
  people's load on the machine's cores does not enter it. Target: < 1 s for the full size.
- Pass: the Kubernetes stand-in (`python -m sim.kubeapi`, its own process, TLS) serves as many
  nodes, each with 20 pods and a running worker of ours (the steady state after the first
  pass). `pass_wall_s` is one `PoolReconciler.reconcile_once` (list the pool's nodes, every pod
  and the pool's Jobs through the official client, plan, apply), `pass_cpu_s` the CPU it took in
  this process. The first pass after a controlplane start also reads every worker's token
  Secret back; it is timed on its own (`first_pass_wall_s`) and is not a steady-state pass.
- Anchor: the same reads by the reference client, `kubectl get` of the pool's nodes, every pod
  (``-A``) and the pool's Jobs, each in pages of `LIST_PAGE` (``--chunk-size``) as our client
  pages, one after the other as our pass lists them: wall time, and kubectl's CPU (its rusage).
  With ``-o name`` kubectl asks for the whole objects, as our client does (its default table is
  a different request, ``as=Table``, which the stand-in answers more slowly), so the server does
  the same work for both and the ratio compares the clients: kubectl decoding every object
  against our client decoding them and planning. kubectl's discovery cache is filled before
  timing, as a user's would be; each of its three runs pays its start-up, which
  `kubectl_startup_s` (``kubectl version --client``) shows. Ours and kubectl take turns; each
  figure is the median of its turns.

    python -m bench.reconcile [--quick] --json FILE

Needs kubectl on PATH (as `tests/test_kube_standin.py` and `bench.join` use it). The sizes go
in the report's ``inputs``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from bench.report import Results, publish, ratios_of
from control.kube.adapter import LIST_PAGE, open_kube_client
from control.kube.loop import PoolReconciler
from control.kube.planner import (
    POOL_LABEL,
    PoolSettings,
    Selector,
    WorkerRecord,
    job_manifest,
    job_name,
    plan_pool,
    worker_labels,
)
from control.kube.pools import load_pools
from control.models import WorkerState
from control.registry import WorkerRegistry

QUICK = {"nodes": 1_000, "pods": 20_000, "repeats": 3, "passes": 1}
FULL = {"nodes": 5_000, "pods": 100_000, "repeats": 3, "passes": 3}
POOL = "bench"
POOL_SELECTOR = {"pool": POOL}
"""The labels `sim.kubeapi`'s synthetic nodes carry."""
WORKER_NAMESPACE = "levers9"
"""Where `sim.kubeapi --workers-of-pool` puts our Jobs."""
STANDIN_START_DEADLINE_S = 600.0
"""Filling the stand-in with the full size takes a while on a small machine."""
STANDIN_STOP_GRACE_S = 10.0
RATIOS = {
    "pass_wall_vs_kubectl": ("pass_wall_s", "kubectl_wall_s"),
    "pass_cpu_vs_kubectl": ("pass_cpu_s", "kubectl_cpu_s"),
}
NOW = 1_700_000_000.0
SETTINGS = PoolSettings(
    name="bench",
    namespace="levers9",
    image="worker:latest",
    selector=Selector(labels={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}),
)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    """Nodes, pods, our Jobs and their records, as one reconcile pass would list them."""
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


def measure_planner_cpu_s(
    cluster: tuple[list[Any], list[Any], list[Any], list[WorkerRecord]], repeats: int
) -> tuple[float, int, int]:
    """Median CPU seconds of `plan_pool` over the cluster, the machines and actions it found."""
    nodes, pods, jobs, records = cluster
    times: list[float] = []
    machines = actions = 0
    for _ in range(repeats):
        start = time.process_time()
        plan = plan_pool(SETTINGS, nodes, pods, jobs, records, NOW)
        times.append(time.process_time() - start)
        machines, actions = len(plan.machines), len(plan.actions)
    return statistics.median(times), machines, actions


@attrs.frozen
class PassSamples:
    """What `measure_passes` saw: one sample per timed pass and per kubectl run."""

    first_wall_s: float
    wall_s: list[float]
    cpu_s: list[float]
    kubectl_wall_s: list[float]
    kubectl_cpu_s: list[float]
    kubectl_startup_s: list[float]
    machines: int
    actions: int


@asynccontextmanager
async def open_kube_standin_process(
    directory: Path, node_count: int, pods_per_node: int
) -> AsyncIterator[Path]:
    """``python -m sim.kubeapi`` with a synthetic cluster and our worker on every node, in its
    own process; yields its kubeconfig, stops it on exit (it also exits when its stdin closes)."""
    command = [sys.executable, "-m", "sim.kubeapi", str(directory)]
    command += ["--nodes", str(node_count), "--pods-per-node", str(pods_per_node)]
    server = await trio.lowlevel.open_process(
        [*command, "--workers-of-pool", POOL], stdin=subprocess.PIPE, stdout=subprocess.PIPE
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


def kubectl_commands(base: Sequence[str]) -> list[list[str]]:
    """The anchor: the three lists a pass reads, in the same pages and order."""
    paged = f"--chunk-size={LIST_PAGE}"
    nodes = ",".join(f"{key}={value}" for key, value in POOL_SELECTOR.items())
    jobs = f"{POOL_LABEL}={worker_labels(POOL, '')[POOL_LABEL]}"
    return [
        [*base, "get", "nodes", "-l", nodes, paged, "-o", "name"],
        [*base, "get", "pods", "-A", paged, "-o", "name"],
        [*base, "get", "jobs", "-n", WORKER_NAMESPACE, "-l", jobs, paged, "-o", "name"],
    ]


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


async def time_kubectl(commands: Sequence[Sequence[str]]) -> tuple[float, float]:
    """Wall and CPU seconds of running `commands` one after the other. The CPU is that of the
    children reaped meanwhile: only these, as the stand-in is reaped at the very end."""
    cpu_before = _children_cpu_s()
    began = time.perf_counter()
    for command in commands:
        await trio.run_process(list(command), capture_stdout=True, capture_stderr=True)
    return time.perf_counter() - began, _children_cpu_s() - cpu_before


async def time_pass(reconciler: PoolReconciler) -> tuple[float, float, int, int]:
    """Wall and CPU seconds (this process) of one pass, and the machines and actions of its
    plan."""
    cpu_before = time.process_time()
    began = time.perf_counter()
    plan = await reconciler.reconcile_once()
    wall_s = time.perf_counter() - began
    cpu_s = time.process_time() - cpu_before
    if plan is None:
        raise RuntimeError(f"the pass failed: {reconciler.status.error}")
    return wall_s, cpu_s, len(plan.machines), len(plan.actions)


async def measure_passes(
    workdir: Path, node_count: int, pods_per_node: int, passes: int
) -> PassSamples:
    """A first pass (untimed for the figures, its wall time kept), then `passes` of ours and
    of kubectl's, taking turns, against one stand-in."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not on PATH; the reconcile benchmark's anchor needs it")
    async with open_kube_standin_process(workdir / "kube", node_count, pods_per_node) as kubeconfig:
        pool = load_pools([pool_block(kubeconfig)]).pools[0]
        base = kubectl_base(kubectl, kubeconfig, workdir / "kubectl-cache")
        commands = kubectl_commands(base)
        # Fill kubectl's discovery cache, as any earlier use of kubectl would have.
        await trio.run_process([*base, "api-resources", "-o", "name"], capture_stdout=True)
        samples: dict[str, list[float]] = {
            "wall": [],
            "cpu": [],
            "kubectl_wall": [],
            "kubectl_cpu": [],
            "kubectl_startup": [],
        }
        async with trio.open_nursery() as nursery, open_kube_client(pool) as client:
            reconciler = PoolReconciler(
                pool, client, WorkerRegistry({}, nursery), controlplane_url="https://x"
            )
            first_wall_s, _, machines, actions = await time_pass(reconciler)
            _say(f"first pass: {machines} machines, {actions} actions, {first_wall_s:.2f} s")

            async def ours() -> None:
                nonlocal machines, actions
                wall_s, cpu_s, machines, actions = await time_pass(reconciler)
                samples["wall"].append(wall_s)
                samples["cpu"].append(cpu_s)

            async def kubectl_get() -> None:
                wall_s, cpu_s = await time_kubectl(commands)
                samples["kubectl_wall"].append(wall_s)
                samples["kubectl_cpu"].append(cpu_s)
                startup_s, _ = await time_kubectl([[kubectl, "version", "--client"]])
                samples["kubectl_startup"].append(startup_s)

            for turn in range(passes):
                for step in (ours, kubectl_get) if turn % 2 == 0 else (kubectl_get, ours):
                    await step()
                _say(
                    f"pass {turn + 1}/{passes}: {machines} machines, {actions} actions, "
                    f"{samples['wall'][-1]:.2f} s ({samples['cpu'][-1]:.2f} s CPU); kubectl "
                    f"{samples['kubectl_wall'][-1]:.2f} s ({samples['kubectl_cpu'][-1]:.2f} s CPU)"
                )
            nursery.cancel_scope.cancel()
    return PassSamples(
        first_wall_s=first_wall_s,
        wall_s=samples["wall"],
        cpu_s=samples["cpu"],
        kubectl_wall_s=samples["kubectl_wall"],
        kubectl_cpu_s=samples["kubectl_cpu"],
        kubectl_startup_s=samples["kubectl_startup"],
        machines=machines,
        actions=actions,
    )


def run_benchmark(size: Mapping[str, int], workdir: Path) -> tuple[Results, dict[str, float]]:
    """The planner over an in-memory cluster, then the passes against kubectl, at `size`
    (keys as `QUICK`'s); the report's sections and its inputs."""
    pods_per_node = max(1, size["pods"] // size["nodes"])
    _say(f"{size['nodes']} nodes, {size['pods']} pods, {size['repeats']} planner repeats")
    cluster = build_cluster(size["nodes"], size["pods"])
    planner_cpu_s, machines, actions = measure_planner_cpu_s(cluster, size["repeats"])
    _say(f"planner: {machines} machines, {actions} actions, {planner_cpu_s:.3f} s CPU")
    planner_pods = len(cluster[1])
    del cluster  # not needed for the passes, and large
    _say(f"passes: {size['passes']} of ours and of kubectl's, taking turns")
    passes = trio.run(measure_passes, workdir, size["nodes"], pods_per_node, size["passes"])
    figures = {
        "planner_cpu_s": planner_cpu_s,
        "pass_wall_s": statistics.median(passes.wall_s),
        "pass_cpu_s": statistics.median(passes.cpu_s),
        "first_pass_wall_s": passes.first_wall_s,
    }
    anchors = {
        "kubectl_wall_s": statistics.median(passes.kubectl_wall_s),
        "kubectl_cpu_s": statistics.median(passes.kubectl_cpu_s),
        "kubectl_startup_s": statistics.median(passes.kubectl_startup_s),
    }
    inputs = {
        "nodes": float(size["nodes"]),
        "pods": float(planner_pods),
        "pass_pods": float(size["nodes"] * (pods_per_node + 1)),
        "passes": float(size["passes"]),
    }
    results = Results(figures=figures, anchors=anchors, ratios=ratios_of(RATIOS, figures, anchors))
    return results, inputs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reconcile",
        description="The reconcile planner's CPU time over a large in-memory cluster, and a "
        "whole pass against kubectl get of the same lists, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, 20,000 pods")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="levers9-bench-reconcile-") as tmp:
        results, inputs = run_benchmark(QUICK if args.quick else FULL, Path(tmp))
    publish(
        results,
        inputs,
        args.json,
        target="target: planner_cpu_s < 1 for 5,000 nodes and 100,000 pods",
    )


if __name__ == "__main__":
    main()
