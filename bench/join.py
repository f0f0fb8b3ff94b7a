"""The cluster-join benchmark: what `levers9 cluster join` costs an operator, against
`kubectl apply` of the same objects measured in the same run.

A Kubernetes API stand-in (which enforces RBAC and fills in ServiceAccount tokens as the token
controller does) and a controlplane that keeps joined pools in its own namespace. Each repeat
joins a new namespace with `levers9 cluster join` as an operator runs it (the CLI as a
subprocess: its start-up, reading the kubeconfig, seven reads and creates, waiting for the
token, registering the pool) and then joins it again (every object read, the roles replaced,
the pool put again). The anchor is `kubectl apply` of the same seven manifests into another
namespace, first creating, then again; kubectl neither waits for the token nor registers a
pool, so the ratio is the price of both plus Python's start-up.

    python -m bench.join [--quick] --json FILE
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
import yaml

from bench.report import render_table, write_report
from control.kube.join import manifests
from sim.cluster import REPO, Cluster, controlplane_pod, open_cluster
from sim.kubeapi.http import start_kube_standin

QUICK = 3
FULL = 10


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _timed_join(cluster: Cluster, kubeconfig: Path, name: str) -> float:
    started = time.perf_counter()
    await cluster.cli(
        "cluster",
        "join",
        name,
        "--namespace",
        name,
        "--image",
        "registry.example.test/levers9/worker:latest",
        "--kubeconfig",
        str(kubeconfig),
        "--selector",
        f"levers9.dev/bench={name}",
        workspace="operator",
    )
    return time.perf_counter() - started


async def _timed_apply(kubeconfig: Path, manifest: Path) -> float:
    started = time.perf_counter()
    await trio.run_process(
        ["kubectl", "--kubeconfig", str(kubeconfig), "apply", "--validate=false", "-f", manifest],
        capture_stdout=True,
        capture_stderr=True,
    )
    return time.perf_counter() - started


async def run_benchmark(root: Path, repeats: int) -> dict[str, Any]:
    running = start_kube_standin(root / "kube")
    kube = running.kube
    saved = dict(os.environ)
    try:
        os.environ.update(controlplane_pod(kube, root / "serviceaccount"))
        kubeconfig = kube.write_kubeconfig(root / "kubeconfig")
        samples: dict[str, list[float]] = {k: [] for k in ("create", "rerun", "apply", "reapply")}
        async with open_cluster(
            root / "cluster", kube, nodes=[], pools=[], joined_pools={"inCluster": True}
        ) as cluster:
            started = time.perf_counter()
            await cluster.cli("--version")
            startup = time.perf_counter() - started
            for i in range(repeats):
                name = f"bench-{i}"
                samples["create"].append(await _timed_join(cluster, kubeconfig, name))
                samples["rerun"].append(await _timed_join(cluster, kubeconfig, name))
                manifest = root / f"anchor-{i}.yaml"
                manifest.write_text(yaml.safe_dump_all([m for _, m in manifests(f"anchor-{i}")]))
                samples["apply"].append(await _timed_apply(kubeconfig, manifest))
                samples["reapply"].append(await _timed_apply(kubeconfig, manifest))
                _say(f"repeat {i + 1}/{repeats} done")
    finally:
        os.environ.clear()
        os.environ.update(saved)
        running.stop()
    median = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "figures": {
            "join_create_s": median["create"],
            "join_rerun_s": median["rerun"],
            "cli_startup_s": startup,
        },
        "anchors": {
            "kubectl_apply_create_s": median["apply"],
            "kubectl_apply_rerun_s": median["reapply"],
        },
        "ratios": {
            "join_create_vs_kubectl_apply": median["create"] / median["apply"],
            "join_rerun_vs_kubectl_apply": median["rerun"] / median["reapply"],
        },
        "repeats": repeats,
    }


def render(report: dict[str, Any]) -> str:
    figures, anchors, ratios = report["figures"], report["anchors"], report["ratios"]
    rows: list[tuple[str, ...]] = [
        (
            "join, creating (median)",
            f"{figures['join_create_s']:.3f} s",
            f"{anchors['kubectl_apply_create_s']:.3f} s",
            f"{ratios['join_create_vs_kubectl_apply']:.2f}",
        ),
        (
            "join again (median)",
            f"{figures['join_rerun_s']:.3f} s",
            f"{anchors['kubectl_apply_rerun_s']:.3f} s",
            f"{ratios['join_rerun_vs_kubectl_apply']:.2f}",
        ),
        ("levers9 --version", f"{figures['cli_startup_s']:.3f} s", "", ""),
    ]
    return render_table(rows, ("", "levers9 cluster join", "kubectl apply", "ratio"))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.join",
        description="levers9 cluster join against kubectl apply of the same objects, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} repeats, not {FULL}")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    with tempfile.TemporaryDirectory(prefix="levers9-bench-join-") as tmp:
        report = trio.run(
            functools.partial(run_benchmark, Path(tmp), QUICK if args.quick else FULL)
        )
    print(render(report))
    if args.json:
        write_report(
            args.json, figures=report["figures"], ratios=report["ratios"], anchors=report["anchors"]
        )


if __name__ == "__main__":
    main()
