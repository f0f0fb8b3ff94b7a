"""Container start and object ingest, each side by side with its anchor in the same run.

- Start with the image cached: our create (API model in, container running out: rootfs mount,
  network namespace with veth, bundle, runc through the shim) against a bare `runc run -d` of
  an equivalent bundle (the same config, with a plain copy of the rootfs and a network
  namespace runc makes itself). Runs alternate, so both see the same machine.
- A cold start (nothing cached), broken down by phase.
- Object ingest (hash, write, fsync, rename) against `cp` of the same file to the same disk.

    python -m bench.containers [--quick] --json FILE

Needs root, runc and docker-registry (`make deps`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from agent.host.cgroups import remove_cgroup
from agent.runtime.config import ContainerConfig
from agent.runtime.manager import ContainerManager, open_container_manager
from agent.runtime.ocispec import write_bundle
from bench.ingest import measure_ingest_vs_cp
from bench.report import Results, publish, ratios_of
from sim.registry import busybox_image, push, running_registry
from workerapi.models import ContainerSpec, ContainerState

QUICK = {"starts": 5, "ingest_bytes": 64 << 20, "ingest_repeats": 2}
FULL = {"starts": 20, "ingest_bytes": 256 << 20, "ingest_repeats": 3}
RATIOS = {
    "start_cached_vs_runc": ("start_cached_ms_p50", "start_runc_ms_p50"),
    "start_cached_min_vs_runc": ("start_cached_ms_min", "start_runc_ms_min"),
}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _start_ours(
    manager: ContainerManager, image: str, n: int, phases: dict[str, list[float]]
) -> float:
    began = time.perf_counter()
    container = await manager.wait_settled(
        await manager.create(ContainerSpec(image=image, id=f"bench-{n}", command=("sleep", "600")))
    )
    elapsed = time.perf_counter() - began
    assert container.state is ContainerState.RUNNING
    for phase, seconds in container.timings.items():
        phases.setdefault(phase, []).append(seconds)
    await manager.delete(container.id)
    return elapsed


def _start_bare(runc_root: Path, bundle: Path, n: int) -> float:
    container_id = f"bare-{n}"
    began = time.perf_counter()
    subprocess.run(
        ["runc", "--root", str(runc_root), "run", "-d", "--bundle", str(bundle), container_id],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )
    elapsed = time.perf_counter() - began
    subprocess.run(
        ["runc", "--root", str(runc_root), "delete", "-f", container_id],
        check=False,
        capture_output=True,
    )
    remove_cgroup(f"/levers9/{container_id}")
    return elapsed


def _bare_bundle(manager: ContainerManager, source_id: str, workdir: Path) -> Path:
    """An equivalent bundle for bare runc: our container's config, a plain rootfs copy, and a
    network namespace of runc's own (runc makes an empty one)."""
    container = manager.get(source_id)
    runtime = container.record.runtime
    assert runtime is not None
    bundle = workdir / "bare-bundle"
    rootfs = bundle / "rootfs"
    shutil.copytree(container.directory / "rootfs", rootfs, symlinks=True)
    write_bundle(
        bundle,
        attrs.evolve(
            runtime,
            container_id="bare",
            rootfs=str(rootfs),
            netns_path=None,
            hosts_file=None,
            resolv_conf=None,
            hostname_file=None,
        ),
    )
    # Each bare run gets its own cgroup, as ours do.
    config_path = bundle / "config.json"
    config = json.loads(config_path.read_text())
    config["linux"].pop("cgroupsPath", None)
    config_path.write_text(json.dumps(config))
    return bundle


async def measure_starts(workdir: Path, starts: int) -> Results:
    """Cached starts of ours (figures, with the phases of a cold start and of cached ones)
    against bare runc (anchors), and their ratios."""
    with running_registry(workdir / "registry") as registry:
        push(registry.url, "busybox", "latest", busybox_image())
        image = f"{registry.host}/busybox:latest"
        config = ContainerConfig(
            state_dir=workdir / "state", free_floor_bytes=0, allow_local_registries=True
        )
        async with open_container_manager(config) as manager:
            began = time.perf_counter()
            cold = await manager.wait_settled(
                await manager.create(
                    ContainerSpec(image=image, id="cold", command=("sleep", "600"))
                )
            )
            cold_s = time.perf_counter() - began
            phases = dict(cold.timings)
            bundle = _bare_bundle(manager, "cold", workdir)
            await manager.delete("cold")
            runc_root = workdir / "bare-runc"
            ours: list[float] = []
            bare: list[float] = []
            # One of each first, not counted: page cache, shim build, first netns.
            cached: dict[str, list[float]] = {}
            await _start_ours(manager, image, -1, {})
            _start_bare(runc_root, bundle, -1)
            for n in range(starts):
                ours.append(await _start_ours(manager, image, n, cached))
                bare.append(await trio.to_thread.run_sync(_start_bare, runc_root, bundle, n))
    figures = {
        "start_cached_ms_p50": statistics.median(ours) * 1000,
        "start_cached_ms_min": min(ours) * 1000,
        "cold_total_ms": cold_s * 1000,
    }
    anchors = {
        "start_runc_ms_p50": statistics.median(bare) * 1000,
        "start_runc_ms_min": min(bare) * 1000,
    }
    figures.update({f"cold_phase_{phase}_ms": seconds * 1000 for phase, seconds in phases.items()})
    figures.update(
        {
            f"cached_phase_{phase}_ms_p50": statistics.median(seconds) * 1000
            for phase, seconds in cached.items()
        }
    )
    return Results(figures=figures, anchors=anchors, ratios=ratios_of(RATIOS, figures, anchors))


async def run(workdir: Path, plan: dict[str, int]) -> Results:
    _say(f"container starts: {plan['starts']} of ours and of bare runc, alternating")
    starts = await measure_starts(workdir, plan["starts"])
    _say(
        f"object ingest: {plan['ingest_bytes'] >> 20} MiB against cp, best of "
        f"{plan['ingest_repeats']}"
    )
    ingest = await trio.to_thread.run_sync(
        lambda: measure_ingest_vs_cp(
            workdir / "ingest", size_bytes=plan["ingest_bytes"], repeats=plan["ingest_repeats"]
        )
    )
    return starts.merged(ingest)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.containers",
        description="Container start against bare runc, object ingest against cp, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer starts, a smaller file")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="levers9-bench-containers-", dir="/var/tmp") as tmp:
        workdir = Path(tmp)
        (workdir / "ingest").mkdir()
        results = trio.run(run, workdir, plan)
    inputs = {
        "starts": float(plan["starts"]),
        "ingest_mib": float(plan["ingest_bytes"] >> 20),
        "ingest_repeats": float(plan["ingest_repeats"]),
    }
    publish(
        results,
        inputs,
        args.json,
        target="targets: start_cached_vs_runc <= 1.5, ingest_vs_cp >= 0.7",
    )


if __name__ == "__main__":
    main()
