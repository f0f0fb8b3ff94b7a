"""`make demo`: the product's main job end to end on this one machine. Users run GPU tasks
with the `levers9` CLI on machines the controlplane found in two pools, and reach a task's
HTTP port through the controlplane.

Everything in the path of a task is real: a docker-registry holding busybox, the controlplane
reconciling its pools through the official Kubernetes client against the API stand-in, worker
Jobs whose agents the simulated kubelet runs as local processes on stand-in GPU nodes (one pool
direct, one through its tunnel), runc containers, and the CLI run as a user runs it. It is the
cluster the end-to-end tests run on (`sim.cluster`), so the demo shows what they check.

The direct pool is a block in the controlplane's config; the tunnel pool is attached the keyless
way, with `levers9 cluster join` and an operator's kubeconfig: the join makes a ServiceAccount
with least-privilege RBAC on the stand-in (which enforces it) and hands its token to the
controlplane, which keeps the pool as a Secret in its own namespace.

One node shares its cards with a neighbour: a model server outside levers9 (a Deployment of one
replica) holds two of its four cards before the controlplane's first reconcile, so the machine
list shows them as held by others and the worker there never takes them. At the end the model
server is scaled down with `kubectl scale`, as the product page tells an operator to borrow its
cards, and a 4-card task runs on that node: the idle 2-card worker is retired for it and the next
one takes every card. The demo exits 0 only if every step worked, else it says which step failed
and exits 1; it stops everything it started either way.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import trio

from control.cli.client import ControlClient
from proc.logs import setup_logging
from sim.cluster import POOL_LABEL, Cluster, PoolSpec, controlplane_pod, open_cluster
from sim.kubeapi.http import start_kube_standin
from sim.kubelet import SimNode
from sim.registry import busybox_image, running_registry
from wire.errors import ApiError, exception_leaves

DIRECT_NODE = "gpu-node-a"
TUNNEL_NODE = "gpu-node-b"
# One card on the direct pool's node, four on the tunnel pool's (two held by a neighbour): best
# fit sends the 1-card task and the HTTP task to the direct worker, the 2-card task through the
# tunnel, so both ways of reaching a worker carry tasks.
DIRECT_CARDS = 1
TUNNEL_CARDS = 4
NEIGHBOUR = "model-server"
NEIGHBOUR_CARDS = 2
WORKSPACE = "team-a"
WORKER_IMAGE = "registry.example.test/levers9/worker:latest"
GPU_COMMAND = ("sh", "-c", "echo cards: $NVIDIA_VISIBLE_DEVICES; ls /dev | grep nvidia")
HTTP_PORT = 8080
HTTP_COMMAND = (
    "sh",
    "-c",
    "mkdir -p /www && echo hello from levers9 > /www/index.html && "
    f"exec httpd -f -p {HTTP_PORT} -h /www",
)
WORKERS_READY_S = 60.0
TASK_S = 60.0
CLEANUP_S = 40.0
CALL_S = 20.0
_CARD_DEVICE = re.compile(r"nvidia\d+")


class DemoFailed(Exception):
    """A step of the demo did not do what it should; the message says which and what it saw."""


def say(text: str) -> None:
    print(text, flush=True)


@contextmanager
def deadline(what: str, seconds: float) -> Iterator[None]:
    """`trio.fail_after`, failing the demo with a message that names the step."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        raise DemoFailed(f"{what}: not done within {seconds:g} s") from None


async def _levers9(
    cluster: Cluster, *args: str, workspace: str = WORKSPACE
) -> subprocess.CompletedProcess[bytes]:
    """`levers9 ARGS` as a user of the demo's workspace (or the operator) runs it, shown with
    its output."""
    say(f"\n$ levers9 {shlex.join(args)}")
    with deadline(f"levers9 {args[0]}", TASK_S):
        result: subprocess.CompletedProcess[bytes] = await cluster.cli(
            *args, workspace=workspace, check=False
        )
    # Progress (stderr) came before the task's output (stdout); errors are shown either way.
    for stream in (result.stderr, result.stdout):
        if text := stream.decode(errors="replace").rstrip():
            say(text)
    return result


def _check_exit(result: subprocess.CompletedProcess[bytes], what: str) -> None:
    if result.returncode != 0:
        raise DemoFailed(f"{what} exited {result.returncode}; its output is shown above")


async def _check_machines(client: ControlClient) -> None:
    """Both nodes are machines with a worker; the neighbour's cards count as others'."""
    with deadline("GET /v1/machines", CALL_S):
        listing = await client.machines()
    machines = {m.node: m for m in listing.machines}
    for node in (DIRECT_NODE, TUNNEL_NODE):
        if node not in machines:
            raise DemoFailed(f"machine list: node {node} is missing (it lists {sorted(machines)})")
        if machines[node].worker is None:
            raise DemoFailed(f"machine list: node {node} shows no worker")
    others = machines[TUNNEL_NODE].cards.others
    if others != NEIGHBOUR_CARDS:
        raise DemoFailed(
            f"machine list: node {TUNNEL_NODE} shows {others} cards held by others, "
            f"expected the {NEIGHBOUR_CARDS} of pod default/{NEIGHBOUR}"
        )


async def _machines_settled(client: ControlClient) -> None:
    """Until the machine list shows both workers: it is a pool's view as of its last pass,
    and a pass follows a worker's creation within `FOLLOW_UP_S`."""
    with trio.move_on_after(WORKERS_READY_S):
        while True:
            try:
                await _check_machines(client)
                return
            except DemoFailed:
                await trio.sleep(0.2)


async def _run_gpu_task(cluster: Cluster, image: str, cards: int) -> None:
    result = await _levers9(cluster, "run", "--gpus", str(cards), image, "--", *GPU_COMMAND)
    say(f"(exit code {result.returncode})")
    _check_exit(result, f"the {cards}-card task")
    lines = result.stdout.decode(errors="replace").splitlines()
    visible = [line.removeprefix("cards: ") for line in lines if line.startswith("cards: ")]
    if not visible or len(visible[0].split(",")) != cards:
        raise DemoFailed(
            f"the {cards}-card task saw NVIDIA_VISIBLE_DEVICES={visible[0] if visible else ''!r}"
            f", expected {cards} card(s)"
        )
    devices = [line for line in lines if _CARD_DEVICE.fullmatch(line)]
    if len(devices) != cards:
        raise DemoFailed(f"the {cards}-card task saw card devices {devices}, expected {cards}")


async def _get_page(client: ControlClient, path: str) -> tuple[int, bytes]:
    """GET `path` through the controlplane, again until the server in the task answers (it
    may still be starting when the task is reported running)."""
    while True:
        try:
            async with client.stream("GET", path) as response:
                return response.status, await response.read()
        except ApiError:
            await trio.sleep(0.2)


async def _serve_http(cluster: Cluster, client: ControlClient, image: str) -> None:
    result = await _levers9(
        cluster, "run", "--detach", "--port", str(HTTP_PORT), image, "--", *HTTP_COMMAND
    )
    _check_exit(result, "levers9 run --detach")
    task_id = result.stdout.decode().strip()
    say(f"(waiting for task {task_id} to run)")
    with deadline(f"task {task_id} starting", TASK_S):
        while (view := await client.task(task_id)).state != "running":
            if view.terminal:
                raise DemoFailed(
                    f"the HTTP task ended ({view.state}: {view.reason}) before it served"
                )
            await trio.sleep(0.2)
    path = f"/v1/tasks/{task_id}/ports/{HTTP_PORT}/index.html"
    say(f"\nGET {cluster.url}{path}")
    with deadline(f"GET {path}", CALL_S):
        status, body = await _get_page(client, path)
    say(f"{status} {body.decode(errors='replace').rstrip()}")
    if status != 200 or body != b"hello from levers9\n":
        raise DemoFailed(f"GET {path} answered {status} {body[:200]!r}, not the page")
    _check_exit(await _levers9(cluster, "task", "cancel", task_id), "levers9 task cancel")


async def _wait_containers_removed(cluster: Cluster, workers: list[str]) -> None:
    """Until no worker holds a container: a task's container is stopped and removed after the
    task ended, and workers stopped earlier would leave it (and its mounts) behind. httpd as
    PID 1 ignores SIGTERM, so the cancelled task's container takes its stop grace period."""
    say("\n(waiting for the workers to stop and remove the tasks' containers)")
    assert cluster.control is not None
    registry = cluster.control.registry
    with deadline("removing the tasks' containers", CLEANUP_S):
        for worker_id in workers:
            client = await registry.client_for(worker_id)
            while True:
                held = await client.containers()
                if not held:
                    break
                await trio.sleep(0.2)


async def _join_tunnel_pool(cluster: Cluster, kubeconfig: Path) -> None:
    result = await _levers9(
        cluster,
        "cluster",
        "join",
        "tunnel-pool",
        "--kubeconfig",
        str(kubeconfig),
        "--image",
        WORKER_IMAGE,
        "--selector",
        f"{POOL_LABEL}=tunnel-pool",
        "--tunnel",
        "--no-host-network",
        workspace="operator",
    )
    _check_exit(result, "levers9 cluster join")
    _check_exit(
        await _levers9(cluster, "cluster", "list", workspace="operator"), "levers9 cluster list"
    )


def model_server(node: str, cards: int) -> dict[str, object]:
    """The neighbour: a Deployment of one replica pinned to `node`, holding `cards` cards."""
    labels = {"app": NEIGHBOUR}
    container = {
        "name": "server",
        "image": "registry.example.test/model-server:latest",
        "resources": {"limits": {"nvidia.com/gpu": str(cards)}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NEIGHBOUR, "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [container],
                },
            },
        },
    }


async def _borrow_from_model_server(cluster: Cluster, kubeconfig: Path, image: str) -> None:
    """Scale the model server down as the product page says, and run a task on every card of
    its node: the idle worker there held 2 and is retired for the task."""
    scale = ["scale", "deployment", NEIGHBOUR, "--replicas=0", "-n", "default"]
    say(f"\n$ kubectl {shlex.join(scale)}")
    with deadline("kubectl scale", CALL_S):
        result = await trio.run_process(
            ["kubectl", "--kubeconfig", str(kubeconfig), *scale],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    if text := (result.stdout + result.stderr).decode(errors="replace").rstrip():
        say(text)
    _check_exit(result, "kubectl scale")
    await _run_gpu_task(cluster, image, TUNNEL_CARDS)


def sign_in_lines(url: str, ca_file: Path, tokens: Sequence[tuple[str, str, Path]]) -> list[str]:
    """How to sign in to the dashboard and log the CLI in, for each (who, context, token
    file): the token stays in its file, read by `cat` or on the CLI's stdin."""
    lines = [f"\ndashboard: {url}/ui/ (on this machine; the certificate is the demo's own, from "
             f"the CA in {ca_file})"]  # fmt: skip
    lines += [f"  sign in as {who}: the token is in {path} (cat it)" for who, _, path in tokens]
    lines.append("the CLI, logged in as each (`levers9 context use NAME` switches):")
    lines += [
        f"  levers9 login {url} --ca {ca_file} --context {context} < {path}"
        for _, context, path in tokens
    ]
    return lines


async def _show_dashboard(cluster: Cluster, workdir: Path, keep: bool) -> None:
    """The dashboard's address, and where the workspace's and the operator's tokens are for
    signing in (files only the user can read, removed with the demo's directory; never
    printed)."""
    tokens = []
    for who, context, token in (
        (f"workspace {WORKSPACE} (Apps)", f"demo-{WORKSPACE}", cluster.tokens[WORKSPACE]),
        ("the operator (Machines, Workers)", "demo-operator", cluster.operator_token),
    ):
        path = workdir / f"{context}-token"
        path.touch(mode=0o600)
        path.write_text(token + "\n")
        tokens.append((who, context, path))
    for line in sign_in_lines(cluster.url, cluster.pki.ca_file, tokens):
        say(line)
    if not keep:
        say("  (all of this stops with the demo now: `make demo KEEP=1` keeps it up, until Ctrl-C)")
        return
    say("  up until Ctrl-C ...")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            say("stopping ...")
            return


async def run_demo(workdir: Path, keep: bool = False) -> None:
    say("starting a registry, the Kubernetes API stand-in and the controlplane ...")
    with running_registry(workdir / "registry") as registry:
        registry.push("busybox", "latest", busybox_image())
        image = registry.ref("busybox:latest")
        kube = start_kube_standin(workdir / "kube")
        try:
            # The controlplane runs as if in a pod of that cluster: joined pools are kept as
            # Secrets in its namespace, reached with its own ServiceAccount.
            os.environ.update(controlplane_pod(kube.kube, workdir / "serviceaccount"))
            kubeconfig = kube.kube.write_kubeconfig(workdir / "operator-kubeconfig")
            # Before the nodes exist, so the first reconcile and the kubelet already see it.
            # Its pod is bound once the kubelet adds the node.
            kube.kube.create("deployments", model_server(TUNNEL_NODE, NEIGHBOUR_CARDS))
            async with open_cluster(
                workdir / "cluster",
                kube.kube,
                nodes=[
                    (SimNode(DIRECT_NODE, DIRECT_CARDS), "direct-pool"),
                    (SimNode(TUNNEL_NODE, TUNNEL_CARDS), "tunnel-pool"),
                ],
                pools=[PoolSpec("direct-pool")],
                agent_env={"LEVERS9_LOG_LEVEL": "WARNING"},
                joined_pools={"inCluster": True},
            ) as cluster:
                say(
                    f"controlplane {cluster.url}; pool direct-pool ({DIRECT_NODE}, direct) from "
                    f"its config; deployment default/{NEIGHBOUR} holds {NEIGHBOUR_CARDS} cards "
                    f"of {TUNNEL_NODE}, which joins as tunnel-pool"
                )
                await _join_tunnel_pool(cluster, kubeconfig)
                with deadline("both workers registering", WORKERS_READY_S):
                    workers = await cluster.wait_workers(2)
                say(f"workers ready: {', '.join(workers)}")
                async with cluster.client(WORKSPACE) as client:
                    await _machines_settled(client)
                    _check_exit(await _levers9(cluster, "machine", "list"), "levers9 machine list")
                    await _check_machines(client)
                    await _run_gpu_task(cluster, image, 1)
                    await _run_gpu_task(cluster, image, 2)
                    await _serve_http(cluster, client, image)
                    _check_exit(await _levers9(cluster, "task", "list"), "levers9 task list")
                    await _borrow_from_model_server(cluster, kubeconfig, image)
                # The tunnel node's worker is a new one since the model server scaled down.
                with deadline("both workers registering", WORKERS_READY_S):
                    workers = await cluster.wait_workers(2)
                await _wait_containers_removed(cluster, workers)
                say(
                    "\ndemo finished: a cluster joined with no key, a 1-card and a 2-card task "
                    "ran on their cards, a task's HTTP port answered through the controlplane, "
                    f"and the {TUNNEL_CARDS} cards of {TUNNEL_NODE} took a task once the model "
                    "server scaled down"
                )
                say(
                    f"\nthe cluster, as its operator: kubectl --kubeconfig {kubeconfig} get "
                    f"deploy,jobs,pods -A (kubectl ... scale deployment {NEIGHBOUR} --replicas=1 "
                    "brings the model server back once a card is free)"
                )
                await _show_dashboard(cluster, workdir, keep)
        finally:
            kube.stop()


def main(keep: bool = False) -> int:
    return run_demo_main(functools.partial(run_demo, keep=keep), "levers9-demo-")


def run_demo_main(run: Callable[[Path], Awaitable[None]], prefix: str) -> int:
    """A demo's `main`: `run` in a scratch directory; 0 when every step worked, else what
    failed is said and 1 (130 when interrupted)."""
    setup_logging("WARNING")
    code = 1
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        try:
            trio.run(run, Path(workdir))
            code = 0
        except* DemoFailed as group:
            for exc in exception_leaves(group):
                say(f"\ndemo failed: {exc}")
        except* KeyboardInterrupt:
            say("\ndemo interrupted; everything it started was stopped")
            code = 130
        except* Exception as group:
            traceback.print_exception(group)
            say("\ndemo failed: an unexpected error, shown above")
    return code


if __name__ == "__main__":
    sys.exit(main())
