"""Pools reconciled against the Kubernetes API stand-in, through the official client: machines
from nodes, worker Jobs where cards are free, Jobs removed where a node or a worker is gone.

The reconciler runs as in the controlplane, from caches fed by list + watch: a test changes the
cluster and waits for the pass that sees it (`until`), as a user waits for `machine list`."""

from __future__ import annotations

import base64
import functools
import itertools
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from control.api.server import Controlplane
from control.cli.main import main as cli_main
from control.kube.caches import open_clusters
from control.kube.loop import PoolReconciler
from control.kube.pools import load_pools
from control.workers.registry import open_worker_registry
from sim.configs import API_TOKEN, Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.kubeapi.objects import make_node, make_pod
from sim.kubeapi.store import KubeStandin
from sim.pools import gpu_node, jobs_created, pool_block

pytest_plugins = ["tests.kube_fixtures"]

CONTROLPLANE_URL = "https://levers9.example.test:8443"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def reconciler(
    kube: KubeStandin,
    clock: Callable[[], float] | None = None,
    *,
    block: dict[str, Any] | None = None,
    **kubernetes: Any,
) -> AsyncIterator[PoolReconciler]:
    """A pool's reconciler running its loop, as the controlplane runs it."""
    pool = load_pools([block or pool_block(kube, **kubernetes)]).pools[0]
    async with (
        open_worker_registry({}) as registry,
        open_clusters() as clusters,
        trio.open_nursery() as nursery,
    ):
        async with clusters.use(pool) as cluster:
            r = PoolReconciler(
                pool, cluster, registry, controlplane_url=CONTROLPLANE_URL, clock=clock or Clock()
            )
            await nursery.start(r.run)
            yield r
        nursery.cancel_scope.cancel()


async def until(r: PoolReconciler, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Until a pass has made `condition` true (checked after each pass)."""
    with trio.fail_after(timeout_s):
        while not (r.status.passed_at is not None and condition()):
            await r.passes.park()


def cards(r: PoolReconciler) -> tuple[int, int, int]:
    """The one machine's (ours, others, free), or (-1, -1, -1) while there is none."""
    if len(r.status.machines) != 1:
        return (-1, -1, -1)
    c = r.status.machines[0].cards
    return (c.ours, c.others, c.free)


def run_pods_of_jobs(kube: KubeStandin) -> None:
    """A kubelet: every Job created gets its pod, running on the node it is pinned to."""
    kube.on_job_created(lambda server, job: server.run_job_pod(job))


def gpu_request(job: dict[str, Any]) -> str:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return str(container["resources"]["limits"]["nvidia.com/gpu"])


async def test_a_neighbour_holding_two_of_four_cards_leaves_a_two_card_machine(
    kube: KubeStandin,
) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    kube.add_pod(make_pod("neighbour", "node-1", gpu_limit=2))
    async with reconciler(kube) as r:
        await until(r, lambda: bool(kube.jobs()))
        (job,) = kube.jobs()
        assert gpu_request(job) == "2"
        (secret,) = kube.secrets()
        assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
        # Our worker (its pod now running) is counted: no second Job on later passes.
        await until(r, lambda: cards(r) == (2, 2, 0))
        await r.reconcile_once()
        await r.reconcile_once()
        assert jobs_created(kube) == 1

        # The neighbour scales down: the machine's free cards grow with the next pass.
        kube.remove_pod("neighbour")
        await until(r, lambda: cards(r) == (2, 0, 2))


async def test_a_full_node_is_no_machine_and_gets_no_worker(kube: KubeStandin) -> None:
    kube.add_node(gpu_node("node-full"))
    kube.add_pod(make_pod("hog", "node-full", gpu_limit=4))
    async with reconciler(kube) as r:
        await until(r, lambda: True)
    assert r.status.machines == ()
    assert [n.node for n in r.status.skipped] == ["node-full"]
    assert kube.jobs() == []


def pass_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The reconcile passes' canonical lines, as the fields a log pipeline filters on."""
    keys: tuple[str, ...] = ("pool", "nodes", "pods", "jobs", "machines", "skipped")
    keys += ("jobs_created", "jobs_deleted", "duration_s", "error")
    return [
        {k: getattr(r, k) for k in keys if hasattr(r, k)}
        for r in caplog.records
        if r.name == "levers9.reconcile" and hasattr(r, "jobs_created")
    ]


async def test_a_cordoned_node_stops_being_a_machine_and_loses_its_worker(
    kube: KubeStandin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="levers9.reconcile")
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-2"))
    async with reconciler(kube) as r:
        await until(r, lambda: cards(r) == (4, 0, 0))
        assert len(kube.jobs()) == 1
        kube.update("nodes", gpu_node("node-2", unschedulable=True))
        await until(r, lambda: not kube.jobs())
    assert r.status.machines == ()
    assert kube.jobs() == []
    assert kube.secrets() == []  # deleted with its Job
    # `kubectl describe job` says what levers9 did, and why.
    events = sorted(kube.objects("events", "levers9"), key=lambda e: str(e["reason"]))
    assert [(e["reason"], e["message"], e["involvedObject"]["kind"]) for e in events] == [
        ("Created", "created worker for 4 free card(s) on node-2", "Job"),
        ("Deleted", "deleted: node is cordoned (unschedulable)", "Job"),
    ]

    # One line per pass that changed something, its counts as fields.
    first, second = pass_lines(caplog)
    assert isinstance(first.pop("duration_s"), float)
    assert isinstance(second.pop("duration_s"), float)
    assert first == {
        "pool": "gpu",
        "nodes": 1,
        "pods": 0,
        "jobs": 0,
        "machines": 1,
        "skipped": 0,
        "jobs_created": 1,
        "jobs_deleted": 0,
    }
    assert second["nodes"] == 1 and second["jobs"] == 1 and second["pods"] == 1
    assert (second["machines"], second["skipped"]) == (0, 1)
    assert (second["jobs_created"], second["jobs_deleted"]) == (0, 1)


async def test_the_selector_picks_the_pools_nodes_by_gke_node_pool(kube: KubeStandin) -> None:
    kube.add_node(
        make_node("a100-1", labels={"cloud.google.com/gke-nodepool": "a100-pool"}, gpus=8)
    )
    kube.add_node(make_node("t4-1", labels={"cloud.google.com/gke-nodepool": "t4-pool"}))
    async with reconciler(kube, selector={"cloud.google.com/gke-nodepool": "a100-pool"}) as r:
        await until(r, lambda: bool(kube.jobs()))
    assert [m.node for m in r.status.machines] == ["a100-1"]
    (job,) = kube.jobs()
    assert gpu_request(job) == "8"
    # The nodes outside the selector were never read: not even into the cache.
    assert list(r.caches.nodes.items) == ["a100-1"]


async def test_a_tunnel_pool_runs_workers_off_the_host_network(kube: KubeStandin) -> None:
    kube.add_node(gpu_node("node-3"))
    async with reconciler(kube, tunnel=True, hostNetwork=False) as r:
        await until(r, lambda: bool(kube.jobs()))
    (job,) = kube.jobs()
    pod = job["spec"]["template"]["spec"]
    assert not pod.get("hostNetwork", False)
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["LEVERS9_MODE"] == "tunnel"
    assert env["LEVERS9_CONTROLPLANE_URL"] == CONTROLPLANE_URL
    assert pod["containers"][0]["securityContext"]["privileged"] is True


async def test_error_storms_create_no_duplicate_workers(kube: KubeStandin) -> None:
    kube.add_node(gpu_node("node-4"))
    kube.inject_fault("429", count=3, verb="list", retry_after_s=0)
    kube.inject_fault("500", count=8, verb="create")
    async with reconciler(kube, reconcileSeconds=0.2) as r:
        await until(r, lambda: bool(kube.jobs()) and r.status.error is None)
        passes = r.pass_count
        await until(r, lambda: r.pass_count >= passes + 3)
    assert len(kube.jobs()) == 1
    assert len(kube.secrets()) == 1


async def test_an_expired_worker_is_replaced_by_a_fresh_one(kube: KubeStandin) -> None:
    kube.add_node(gpu_node("node-5"))
    clock = Clock()
    async with reconciler(kube, clock=clock) as r:
        await until(r, lambda: bool(kube.jobs()))
        (first,) = kube.jobs()
        clock.now += 300  # no heartbeat yet, not expired
        await r.reconcile_once()
        assert [j["metadata"]["name"] for j in kube.jobs()] == [first["metadata"]["name"]]
        clock.now += 400  # ten minutes without a word: its Job goes, a fresh worker comes
        await r.reconcile_once()
        await until(r, lambda: len(kube.jobs()) == 1 and kube.jobs()[0] != first)
    (second,) = kube.jobs()
    assert second["metadata"]["name"] != first["metadata"]["name"]


async def test_a_bad_token_fails_the_pass_with_the_reason_logged_once(
    kube: KubeStandin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="levers9.reconcile")
    kube.add_node(gpu_node("node-6"))
    block = pool_block(kube, reconcileSeconds=0.05)
    block["kubernetes"]["credentials"] = {"token": "not-the-token"}
    async with reconciler(kube, block=block) as r:
        await until(r, lambda: r.pass_count >= 4)
    assert r.status.error is not None
    assert "not-the-token" not in r.status.error
    assert r.status.error.count("pool gpu") == 1
    assert kube.jobs() == []
    # Failed passes back off (doubling from 0.05 s): far fewer than one per period.
    # The same error is logged once, however many passes fail with it.
    (line,) = pass_lines(caplog)
    assert line["pool"] == "gpu" and line["error"] == "UNAUTHENTICATED"
    assert (line["nodes"], line["jobs_created"]) == (0, 0)
    message = next(rec.getMessage() for rec in caplog.records if hasattr(rec, "error"))
    assert message.count("pool gpu") == 1


async def serve_pool(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery
) -> tuple[Controlplane, PoolReconciler, Pki]:
    """A controlplane serving the one pool of `pool_block`, once its first pass is done."""
    pki = make_pki(tmp_path)
    config = control_config(pki)
    config = attrs.evolve(config, worker=attrs.evolve(config.worker, pools=(pool_block(kube),)))
    control: Controlplane = await nursery.start(run_controlplane, config)
    (reconciling,) = control.runner.pools
    with trio.fail_after(20):
        while reconciling.status.passed_at is None:
            await reconciling.passes.park()
    return control, reconciling, pki


async def test_machine_list_through_the_controlplane_and_the_cli(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.add_node(
        gpu_node("node-7", labels={"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"})
    )
    kube.add_pod(make_pod("neighbour", "node-7", gpu_limit=1))
    control, _, pki = await serve_pool(kube, tmp_path, nursery)
    args = [
        "--controlplane",
        f"https://127.0.0.1:{control.port}",
        "--token",
        API_TOKEN,
        "--ca",
        str(pki.ca_file),
        "machine",
        "list",
    ]
    assert await trio.to_thread.run_sync(cli_main, [*args, "--json"]) == 0
    (machine,) = json.loads(capsys.readouterr().out)
    assert machine["pool"] == "gpu"
    assert machine["node"] == "node-7"
    assert machine["gpuModel"] == "nvidia-tesla-a100"
    assert machine["cards"] == {
        "total": 4,
        "ours": 0,
        "others": 1,
        "free": 3,
        "busy": 0,
        "idle": 0,
        "unhealthy": 0,
        "occupied": 0,
        "refused": 0,
    }
    assert machine["cardProblems"] == []
    assert await trio.to_thread.run_sync(cli_main, args) == 0
    table = capsys.readouterr().out
    assert "node-7" in table and "4/0/0/0/1/3" in table


async def poll_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for what another process (the stand-in's threads, a controlplane) makes true."""
    with trio.fail_after(timeout_s):
        for _ in itertools.count():
            if condition():
                return
            await trio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kubelet_environment(kube: KubeStandin, job: dict[str, Any], node: str) -> dict[str, str]:
    """What the kubelet would give the Job's container: its env, with secrets and the
    downward API resolved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERS9_")}
    namespace = job["metadata"]["namespace"]
    for entry in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = kube.get("secrets", ref["name"], namespace)
            assert secret is not None, f"the Job's Secret {ref['name']} is missing"
            env[entry["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[entry["name"]] = node
    return env


async def test_a_worker_job_runs_an_agent_that_registers_and_shows_ready(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.add_node(gpu_node("node-8"))
    pki = make_pki(tmp_path)
    port = _free_port()
    config = control_config(pki, port=port)
    config = attrs.evolve(
        config,
        worker=attrs.evolve(
            config.worker, pools=(pool_block(kube, tunnel=True, hostNetwork=False),)
        ),
    )
    control: Controlplane = await nursery.start(
        functools.partial(
            run_controlplane,
            config,
            pool_env={"LEVERS9_CONTROLPLANE_CA": str(pki.ca_file)},
        )
    )
    (reconciling,) = control.runner.pools
    with trio.fail_after(20):
        while not kube.jobs():
            await reconciling.passes.park()
    (job,) = kube.jobs()
    name = job["metadata"]["name"]
    # The kubelet's part: the Job's pod runs the agent with the Job's environment.
    kube.run_job_pod(job, "node-8")
    env = kubelet_environment(kube, job, "node-8")
    env.update(LEVERS9_CONTAINERS="off", LEVERS9_LOG_LEVEL="WARNING")
    assert env["LEVERS9_WORKER_ID"] == name
    agent = await trio.lowlevel.open_process(
        [sys.executable, "-m", "agent.daemon.cli", "run"], env=env, cwd=Path(__file__).parent.parent
    )
    try:
        with trio.fail_after(30):
            worker = await control.registry.client_for(name)
            assert (await worker.health()).worker_id == name
        # Its registration wakes a pass: the machine shows it ready, its pod holding the cards.
        await until(
            reconciling,
            lambda: (
                cards(reconciling) == (4, 0, 0)
                and reconciling.status.machines[0].worker is not None
                and reconciling.status.machines[0].worker.state == "ready"
            ),
        )
        args = ["--controlplane", f"https://127.0.0.1:{control.port}", "--token", API_TOKEN]
        args += ["--ca", str(pki.ca_file), "machine", "list", "--json"]
        assert await trio.to_thread.run_sync(cli_main, args) == 0
        (listed,) = json.loads(capsys.readouterr().out)
        assert listed["worker"]["state"] == "ready"
        assert listed["cards"]["ours"] == 4
    finally:
        agent.kill()
        with trio.CancelScope(shield=True):
            await agent.wait()


async def test_removing_a_pool_deletes_its_workers_but_not_the_namespace(
    kube: KubeStandin, tmp_path: Path, nursery: trio.Nursery
) -> None:
    kube.add_node(gpu_node("node-9"))
    kube.add_node(make_node("other-1", labels={"levers9.dev/test-pool": "other"}))
    pki = make_pki(tmp_path)
    config = control_config(pki)
    other = pool_block(kube, selector={"levers9.dev/test-pool": "other"})
    other["name"] = "other"
    config = attrs.evolve(
        config, worker=attrs.evolve(config.worker, pools=(pool_block(kube), other))
    )
    control: Controlplane = await nursery.start(run_controlplane, config)
    await poll_until(lambda: len(kube.jobs()) == 2)
    await control.runner.set_pools(load_pools([other]).pools)
    remaining = [j["metadata"]["labels"]["levers9.dev/pool"] for j in kube.jobs()]
    assert remaining == ["other"]
    assert len(kube.secrets("levers9")) == 1
    assert kube.get("namespaces", "levers9") is not None
    assert {n["metadata"]["name"] for n in kube.objects("nodes")} == {"node-9", "other-1"}
    assert [r.settings.name for r in control.runner.pools] == ["other"]


async def test_the_controlplane_process_applies_its_pools_again_on_sighup(
    kube: KubeStandin, tmp_path: Path
) -> None:
    kube.add_node(gpu_node("node-10"))
    pki = make_pki(tmp_path)
    values = tmp_path / "values.yaml"
    config = control_config(pki)
    base: dict[str, Any] = {
        "config": {
            "publicUrl": config.public_url,
            "listen": "127.0.0.1:0",
            "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
            "apiTokens": [{"name": "tests", "token": API_TOKEN}],
            "worker": {"pools": [pool_block(kube)]},
            "database": {"path": str(tmp_path / "tasks.db")},
        }
    }
    values.write_text(json.dumps(base))
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "control.main", "serve", "--config", str(values)],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "LEVERS9_LOG_LEVEL": "WARNING"},
    )
    try:
        await poll_until(lambda: bool(kube.jobs()))
        base["config"]["worker"]["pools"] = []
        values.write_text(json.dumps(base))
        process.send_signal(signal.SIGHUP)
        await poll_until(lambda: not kube.jobs())
        assert kube.secrets("levers9") == []
        assert process.returncode is None  # still serving
    finally:
        process.terminate()
        with trio.CancelScope(shield=True):
            await process.wait()
