"""A whole levers9 installation on loopback: what the end-to-end tests, `make demo` and
`bench.e2e` run tasks on.

A Kubernetes API stand-in with simulated GPU nodes (their kubelet runs each worker Job's agent
as a local process, on the stand-in NVML library), a registry holding the images, and the
controlplane with its pools (each pool's nodes are picked by a label, so one pool can be direct
and another tunnel), SQLite task records and two workspaces. Nothing in the path of a task is
simulated: the controlplane reconciles the pools through the official Kubernetes client,
creates the worker Jobs, the agents register or open their tunnels, and tasks run in runc
containers; users reach it through the `levers9` CLI or `control.cli.client`.

The controlplane runs in this process under its own cancel scope so that a test can restart it
on the same port and database (`restart_controlplane`) while the workers keep running.
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from control.api.server import Controlplane, open_controlplane
from control.cli.client import ControlClient, open_control_client
from control.config import ControlConfig, parse
from sim.configs import Pki, make_pki
from sim.kubeapi.store import KubeStandin
from sim.kubelet import Runtime, SimNode, SimulatedKubelet
from wire.errors import ApiError

REPO = Path(__file__).resolve().parents[1]
POOL_LABEL = "levers9.dev/demo-pool"
WORKER_IMAGE = "registry.example.test/levers9/worker:latest"


@attrs.frozen
class PoolSpec:
    """A pool of the nodes labelled `POOL_LABEL=<name>`."""

    name: str
    tunnel: bool = False
    in_cluster: bool = False
    """The controlplane's own cluster, reached with its pod's ServiceAccount."""
    image: str = WORKER_IMAGE
    """The worker image its Jobs run (pulled only by a kubelet with `runtime="image"`)."""

    def block(self, kube: KubeStandin) -> dict[str, Any]:
        if self.in_cluster:
            return {
                "name": self.name,
                "provider": "kubernetes",
                "kubernetes": {
                    "inCluster": True,
                    "flavor": "generic",
                    "namespace": "levers9",
                    "image": self.image,
                    "selector": {POOL_LABEL: self.name},
                    "tunnel": self.tunnel,
                    "hostNetwork": not self.tunnel,
                    "reconcileSeconds": 1.0,
                },
            }
        return {
            "name": self.name,
            "provider": "kubernetes",
            "kubernetes": {
                "flavor": "generic",
                "endpoint": kube.url,
                "caData": base64.b64encode(kube.ca_pem).decode(),
                "credentials": {"token": kube.token},
                "namespace": "levers9",
                "image": self.image,
                "selector": {POOL_LABEL: self.name},
                "tunnel": self.tunnel,
                "hostNetwork": not self.tunnel,
                "reconcileSeconds": 1.0,
            },
        }


OWN_NAMESPACE = "levers9-control"


def controlplane_pod(kube: KubeStandin, directory: Path) -> dict[str, str]:
    """Make the controlplane run as if in a pod of the stand-in cluster: its ServiceAccount as
    the Helm chart makes it (a Role on Secrets in its namespace, for joined pools; nothing
    else), mounted into `directory` the way the kubelet mounts it. Returns the environment a
    pod gets (set it in this process before the controlplane starts)."""
    meta = {"name": "levers9-control", "namespace": OWN_NAMESPACE}
    rules = [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "verbs": ["get", "list", "watch", "create", "update", "delete"],
        }
    ]
    kube.add_namespace(OWN_NAMESPACE)
    kube.create("serviceaccounts", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta})
    _bind_role(kube, meta["name"], rules)
    return pod_environment(kube, OWN_NAMESPACE, meta["name"], directory)


def _bind_role(kube: KubeStandin, name: str, rules: list[dict[str, Any]]) -> None:
    """A Role `name` with `rules` in the controlplane's namespace, bound to its
    ServiceAccount."""
    meta = {"name": name, "namespace": OWN_NAMESPACE}
    account = {"kind": "ServiceAccount", "name": "levers9-control", "namespace": OWN_NAMESPACE}
    kube.create("roles", {"metadata": meta, "rules": rules})
    kube.create(
        "rolebindings",
        {
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [account],
        },
    )


def pod_environment(
    kube: KubeStandin, namespace: str, service_account: str, directory: Path
) -> dict[str, str]:
    """A token for an existing ServiceAccount, mounted into `directory` as the kubelet mounts
    it into a pod, and the environment that pod gets."""
    secret = f"{service_account}-token"
    kube.create(
        "secrets",
        {
            "type": "kubernetes.io/service-account-token",
            "metadata": {
                "name": secret,
                "namespace": namespace,
                "annotations": {"kubernetes.io/service-account.name": service_account},
            },
        },
    )
    token = kube.service_account_token(secret, namespace)
    assert token, f"no token for ServiceAccount {namespace}/{service_account}"
    directory.mkdir(parents=True)
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_bytes(kube.ca_pem)
    (directory / "namespace").write_text(namespace)
    return {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": kube.url.rsplit(":", 1)[1],
        "LEVERS9_SERVICEACCOUNT_DIR": str(directory),
    }


def agent_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the simulated kubelet adds to every agent's environment: quick registrations and
    pings, no disk floor, pulls from the registries on loopback, then `extra`."""
    return {
        "LEVERS9_LOG_LEVEL": "INFO",
        "LEVERS9_ALLOW_LOCAL_REGISTRIES": "1",
        "LEVERS9_FREE_FLOOR_BYTES": "0",
        "LEVERS9_OBJECT_BUDGET_BYTES": str(4 << 30),
        "LEVERS9_REGISTER_INTERVAL_S": "2",
        "LEVERS9_PING_INTERVAL_S": "2",
        "LEVERS9_PING_TIMEOUT_S": "4",
        **(extra or {}),
    }


def grant_leases(kube: KubeStandin) -> None:
    """What the chart grants the controlplane's ServiceAccount (`controlplane_pod`) for leader
    election: leases, get, create and update, in its own namespace."""
    rule = {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    }
    _bind_role(kube, "levers9-leases", [rule])


def cli_environment(url: str, token: str, pki: Pki) -> dict[str, str]:
    """The environment `levers9` reads its controlplane, token and CA from."""
    return {
        **os.environ,
        "LEVERS9_CONTROLPLANE": url,
        "LEVERS9_TOKEN": token,
        "LEVERS9_CA": str(pki.ca_file),
    }


async def run_cli(
    env: Mapping[str, str], args: Sequence[str], *, check: bool
) -> subprocess.CompletedProcess[bytes]:
    """`levers9 ARGS` as a user runs it; output captured."""
    return await trio.run_process(
        [sys.executable, "-m", "control.cli", *args],
        env=env,
        cwd=REPO,
        capture_stdout=True,
        capture_stderr=True,
        check=check,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define(eq=False)
class Cluster:
    root: Path
    kube: KubeStandin
    kubelet: SimulatedKubelet
    pki: Pki
    config: ControlConfig
    tokens: dict[str, str]
    """workspace → its token."""
    operator_token: str
    nursery: trio.Nursery
    control: Controlplane | None = None
    _scope: trio.CancelScope | None = None
    _stopped: trio.Event | None = None

    @property
    def url(self) -> str:
        return self.config.public_url

    def cli_env(self, workspace: str = "team-a") -> dict[str, str]:
        token = self.tokens[workspace] if workspace != "operator" else self.operator_token
        return cli_environment(self.url, token, self.pki)

    async def cli(
        self, *args: str, workspace: str = "team-a", check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        """`levers9 ARGS` as a user runs it; output captured."""
        return await run_cli(self.cli_env(workspace), args, check=check)

    def client(self, workspace: str = "team-a") -> AbstractAsyncContextManager[ControlClient]:
        token = self.tokens[workspace] if workspace != "operator" else self.operator_token
        return open_control_client(self.url, token, str(self.pki.ca_file))

    async def start_controlplane(self) -> Controlplane:
        scope = trio.CancelScope()
        stopped = trio.Event()
        self._scope, self._stopped = scope, stopped

        async def serve(task_status: trio.TaskStatus[Controlplane]) -> None:
            try:
                with scope:
                    async with open_controlplane(
                        self.config, pool_env={"LEVERS9_CONTROLPLANE_CA": str(self.pki.ca_file)}
                    ) as control:
                        task_status.started(control)
                        await trio.sleep_forever()
            finally:
                stopped.set()

        self.control = await self.nursery.start(serve)
        return self.control

    async def stop_controlplane(self) -> None:
        assert self._scope is not None and self._stopped is not None
        self._scope.cancel()
        await self._stopped.wait()
        self.control = None

    async def restart_controlplane(self) -> Controlplane:
        await self.stop_controlplane()
        return await self.start_controlplane()

    async def remove_containers(self) -> None:
        """Every container on every worker killed and deleted, so the agents end with nothing
        to stop (busybox `sleep` as PID 1 ignores SIGTERM and would sit out the grace)."""
        if self.control is None:
            return
        registry = self.control.registry
        for entry in registry.entries():
            if not entry.connected() and entry.mode != "direct":
                continue
            with trio.move_on_after(10):
                try:
                    client = await registry.client_for(entry.worker_id)
                    for container in await client.containers():
                        if not container.state.finished:
                            await client.stop_container(container.id, grace_s=0)
                        await client.delete_container(container.id)
                except ApiError:
                    continue

    async def wait_workers(self, count: int) -> list[str]:
        """Until `count` workers have registered and take tasks; their ids. A worker this
        replica owns takes tasks once its strays are removed (`Dispatcher.takes_tasks`): a task
        created before that goes to another worker, which is not where a test expects it."""
        from control.tasks.dispatch import is_ready

        while True:
            assert self.control is not None
            registry, dispatcher = self.control.registry, self.control.dispatcher
            owned = {e.worker_id for e in registry.owned_entries()}
            ready = [
                e.worker_id
                for e in registry.entries()
                if is_ready(e, time.time(), self.config.worker.lost_after_s)
                and (e.worker_id not in owned or dispatcher.takes_tasks(e.worker_id))
            ]
            if len(ready) >= count:
                return sorted(ready)
            await trio.sleep(0.1)


def control_values(
    pki: Pki,
    port: int,
    kube: KubeStandin,
    pools: Sequence[PoolSpec],
    database: Path,
    tokens: Mapping[str, str],
    operator_token: str,
    buckets: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    lost_after_s: float = 20.0,
    registries: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    joined_pools: Mapping[str, Any] | None = None,
    database_block: Mapping[str, Any] | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The controlplane's values; `database_block` (e.g. a PostgreSQL URL and password)
    replaces the SQLite file at `database`; `extra_config` adds blocks of `config`."""
    extra = {"joinedPools": dict(joined_pools)} if joined_pools is not None else {}
    extra.update(extra_config or {})
    return {
        "config": {
            **extra,
            "publicUrl": f"https://127.0.0.1:{port}",
            "listen": f"127.0.0.1:{port}",
            "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
            "apiTokens": [{"name": "operator", "token": operator_token}],
            "database": dict(database_block or {"path": str(database)}),
            "workspaces": [
                {
                    "name": name,
                    "tokens": [{"name": f"{name}-user", "token": token}],
                    "buckets": list((buckets or {}).get(name, ())),
                    "registries": list((registries or {}).get(name, ())),
                }
                for name, token in tokens.items()
            ],
            "worker": {
                "pools": [pool.block(kube) for pool in pools],
                "lostAfterS": lost_after_s,
                # The simulated registries listen on loopback (`agent_environment` too).
                "allowLocalRegistries": True,
            },
        }
    }


@asynccontextmanager
async def open_cluster(
    root: Path,
    kube: KubeStandin,
    *,
    nodes: Sequence[tuple[SimNode, str]],
    pools: Sequence[PoolSpec],
    agent_env: Mapping[str, str] | None = None,
    buckets: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    lost_after_s: float = 20.0,
    registries: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    joined_pools: Mapping[str, Any] | None = None,
    database: Mapping[str, Any] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    runtime: Runtime = "process",
    service_ports: Sequence[int] = (),
    host_files: Sequence[Path] = (),
) -> AsyncIterator[Cluster]:
    """Nodes are (node, pool name) pairs; `database` is the values' database block (the SQLite
    file under `root` by default); `extra_config` adds blocks of the values' `config`.
    `runtime="image"` runs each worker from its pool's image (see `SimulatedKubelet`), from a
    registry on loopback (plain HTTP), with the controlplane's CA file and `host_files` (an S3
    server's CA, say) at the same paths; a pod with a network of its own reaches the
    controlplane's port and `service_ports` (a registry's, an S3 server's) on its own 127.0.0.1,
    as through a Service. The
    kubelet starts before the controlplane so the nodes are there for its first reconcile;
    everything stops when the block ends."""
    root.mkdir(parents=True, exist_ok=True)
    pki = make_pki(root)
    tokens = {"team-a": secrets.token_urlsafe(24), "team-b": secrets.token_urlsafe(24)}
    operator_token = secrets.token_urlsafe(24)
    port = free_port()
    config = parse(
        control_values(
            pki,
            port,
            kube,
            pools,
            root / "tasks.db",
            tokens,
            operator_token,
            buckets=buckets,
            lost_after_s=lost_after_s,
            registries=registries,
            joined_pools=joined_pools,
            database_block=database,
            extra_config=extra_config,
        )
    )
    labelled = [
        attrs.evolve(node, labels={**node.labels, POOL_LABEL: pool}) for node, pool in nodes
    ]
    kubelet = SimulatedKubelet(
        kube,
        root / "kubelet",
        labelled,
        extra_env=agent_environment(agent_env),
        runtime=runtime,
        host_files=[pki.ca_file, *host_files],
        image_tls_verify=False,
        service_ports=[port, *service_ports],
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(kubelet.run)
        cluster = Cluster(
            root=root,
            kube=kube,
            kubelet=kubelet,
            pki=pki,
            config=config,
            tokens=tokens,
            operator_token=operator_token,
            nursery=nursery,
        )
        await cluster.start_controlplane()
        try:
            yield cluster
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                await cluster.remove_containers()
                # Let the task watchers finish their (shielded) clean-up while the controlplane
                # still has its connections to the workers; stopped mid-way, each would retry
                # an unreachable worker for lostAfterS.
                with trio.move_on_after(5):
                    while True:
                        if cluster.control is None or not cluster.control.dispatcher.watchers:
                            break
                        await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_node_cluster(
    root: Path, kube: KubeStandin, cards: int, *, tunnel: bool = False, **options: Any
) -> AsyncIterator[Cluster]:
    """One GPU node with `cards` cards in one pool (tunnel or direct), its worker ready."""
    async with open_cluster(
        root,
        kube,
        nodes=[(SimNode("gpu-node-1", cards), "gpu")],
        pools=[PoolSpec("gpu", tunnel=tunnel)],
        **options,
    ) as cluster:
        with trio.fail_after(60):
            await cluster.wait_workers(1)
        yield cluster
