"""Reconcile at scale: the planner's CPU time for one pass over a large cluster.

The cluster is built in memory as the Kubernetes API returns it (node, pod and Job dicts):
5,000 GPU nodes and 100,000 pods (1,000 and 20,000 with `--quick`). Nodes vary the way real
pools do: some NotReady or cordoned, neighbours holding some or all cards, our workers on a
share of the nodes with records, a few of them expired. The figure is `time.process_time`
around `control.kube.planner.plan_pool` (median of the repeats), so other engineers' load on
the machine's cores does not enter it. Target: `planner_cpu_s` < 1 s for the full size.

    python -m bench.reconcile [--quick] --json FILE

`pass_wall_s` (a full pass: list through the stand-in API server, plan, apply) is not
measured yet; `measure_pass_wall_s` is the hook the integration fills in, and the figure is
left out of the report until it does (a report never carries an unmeasured number).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from bench.report import render_table, write_report
from control.kube.planner import (
    PoolSettings,
    Selector,
    WorkerRecord,
    job_manifest,
    job_name,
    plan_pool,
)
from control.models import WorkerState

QUICK = {"nodes": 1_000, "pods": 20_000, "repeats": 3}
FULL = {"nodes": 5_000, "pods": 100_000, "repeats": 3}
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


def measure_pass_wall_s(node_count: int, pod_count: int) -> float | None:
    """Wall seconds of one steady-state pass through the stand-in API server (in its own
    process, over TLS, through the official client): list the pool's nodes, every pod and the
    pool's Jobs, fold in heartbeats, plan. Every node already runs our worker, as after the
    first pass, so the pass is what runs every 15 s."""
    return trio.run(_measure_pass, node_count, pod_count)


async def _measure_pass(node_count: int, pod_count: int) -> float:
    import tempfile

    import yaml

    from control.kube.adapter import open_kube_client
    from control.kube.loop import PoolReconciler
    from control.kube.pools import load_pools
    from control.registry import WorkerRegistry

    with tempfile.TemporaryDirectory(prefix="levers9-bench-reconcile-") as tmp:
        pods_per_node = max(1, pod_count // node_count)
        server = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "sim.kubeapi",
                tmp,
                "--nodes",
                str(node_count),
                "--pods-per-node",
                str(pods_per_node),
                "--workers-of-pool",
                "bench",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert server.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await server.stdout.receive_some(4096)
                if not chunk:
                    raise RuntimeError("the Kubernetes stand-in did not start")
                line += chunk
            info = json.loads(line)
            kubeconfig = yaml.safe_load(await trio.Path(info["kubeconfig"]).read_text())
            cluster = kubeconfig["clusters"][0]["cluster"]
            block = {
                "name": "bench",
                "provider": "kubernetes",
                "kubernetes": {
                    "flavor": "generic",
                    "endpoint": cluster["server"],
                    "caData": cluster["certificate-authority-data"],
                    "credentials": {"token": kubeconfig["users"][0]["user"]["token"]},
                    "image": "worker:bench",
                    "selector": {"pool": "bench"},
                },
            }
            pool = load_pools([block]).pools[0]
            async with trio.open_nursery() as nursery, open_kube_client(pool) as client:
                reconciler = PoolReconciler(
                    pool, client, WorkerRegistry({}, nursery), controlplane_url="https://x"
                )
                began = time.perf_counter()
                plan = await reconciler.reconcile_once()
                elapsed = time.perf_counter() - began
                nursery.cancel_scope.cancel()
            if plan is None:
                raise RuntimeError(f"the pass failed: {reconciler.status.error}")
            _say(
                f"full pass: {len(plan.machines)} machines, {len(plan.actions)} actions, "
                f"{elapsed:.2f} s"
            )
            return elapsed
        finally:
            if server.stdin is not None:
                await server.stdin.aclose()
            with trio.move_on_after(10):
                await server.wait()
            server.kill()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reconcile",
        description="CPU time of one reconcile plan over a large in-memory cluster.",
    )
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, 20,000 pods")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    _say(f"{size['nodes']} nodes, {size['pods']} pods, {size['repeats']} repeats")
    cluster = build_cluster(size["nodes"], size["pods"])
    planner_cpu_s, machines, actions = measure_planner_cpu_s(cluster, size["repeats"])
    figures = {
        "planner_cpu_s": planner_cpu_s,
        "nodes": float(size["nodes"]),
        "pods": float(len(cluster[1])),
        "machines": float(machines),
        "actions": float(actions),
    }
    pass_wall_s = measure_pass_wall_s(size["nodes"], size["pods"])
    if pass_wall_s is not None:
        figures["pass_wall_s"] = pass_wall_s
    rows: list[tuple[str, ...]] = [(name, f"{value:.3f}") for name, value in figures.items()]
    print(render_table(rows, ("figure", "value")))
    print("target: planner_cpu_s < 1 for 5,000 nodes and 100,000 pods")
    if args.json:
        write_report(args.json, figures=figures, ratios={}, anchors={})


if __name__ == "__main__":
    main()
