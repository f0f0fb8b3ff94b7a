"""Several controlplane replicas on loopback, as a Deployment behind a Service runs them.

Each replica is its own `levers9-control serve` process (so a test can kill one with SIGKILL,
as a node failure would), all of them over one PostgreSQL database, with leader election for
the pools and a replica secret, as the chart renders them for `replicaCount` above 1. In front
of them a `LoopbackService` hands each new TCP connection to the next replica that accepts it,
round robin, as kube-proxy spreads connections over a Service's ready endpoints; a replica that
stopped listening (drained, or killed) is passed over. Workers (the simulated kubelet's agent
processes) reach the controlplane only through the Service; a test reaches any one replica
directly with `client(replica=i)`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from control.cli.client import ControlClient, open_control_client
from sim.cluster import (
    OWN_NAMESPACE,
    POOL_LABEL,
    PoolSpec,
    agent_environment,
    cli_environment,
    control_values,
    controlplane_pod,
    free_port,
    grant_leases,
    run_cli,
)
from sim.configs import Pki, make_pki
from sim.faultproxy import FaultProxy
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode, SimulatedKubelet

REPO = Path(__file__).resolve().parents[1]

__all__ = ["LoopbackService", "ReplicatedCluster", "open_replicated_cluster"]


@attrs.define(eq=False)
class LoopbackService(FaultProxy):
    """A Service in front of the replicas: a TCP port whose connections go to its backends in
    turn, skipping one that refuses. A `FaultProxy`, so a fault campaign can cut or stall the
    path between the workers and the replicas."""


@attrs.define(eq=False)
class ReplicatedCluster:
    root: Path
    kube: KubeStandin
    kubelet: SimulatedKubelet
    pki: Pki
    service: LoopbackService
    ports: list[int]
    """Each replica's own port."""
    tokens: dict[str, str]
    operator_token: str
    nursery: trio.Nursery
    env: dict[str, str]
    processes: list[trio.Process | None] = attrs.field(factory=list)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.service.port}"

    def values_files(self, index: int) -> list[str]:
        directory = self.root / "values"
        return [
            str(directory / "values.yaml"),
            str(directory / "private.yaml"),
            str(directory / f"replica-{index}.yaml"),
        ]

    async def start(self, index: int) -> None:
        """Start replica `index` and wait until it serves."""
        log = (self.root / f"replica-{index}.log").open("ab")
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "control.main", "serve"]
                + [arg for path in self.values_files(index) for arg in ("--config", path)],
                cwd=REPO,
                env={**self.env, "HOSTNAME": f"replica-{index}"},
                stdout=log,
                stderr=log,
            )
        finally:
            log.close()
        self.processes[index] = process
        with trio.fail_after(30):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"replica {index} exited with {process.returncode}; see "
                        f"{self.root / f'replica-{index}.log'}"
                    )
                try:
                    probe = await trio.open_tcp_stream("127.0.0.1", self.ports[index])
                except OSError:
                    await trio.sleep(0.05)
                    continue
                await probe.aclose()
                return

    async def kill(self, index: int) -> None:
        """SIGKILL: no drain, no GOAWAY, no claims handed back, as a node that died."""
        process = self.processes[index]
        assert process is not None
        process.send_signal(signal.SIGKILL)
        await process.wait()
        self.processes[index] = None

    async def stop(self, index: int) -> int:
        """SIGTERM, as Kubernetes stops a pod: the replica drains, then exits."""
        process = self.processes[index]
        assert process is not None
        process.send_signal(signal.SIGTERM)
        code = await process.wait()
        self.processes[index] = None
        return code

    def cli_env(self, workspace: str = "team-a") -> dict[str, str]:
        token = self.tokens[workspace] if workspace != "operator" else self.operator_token
        return cli_environment(self.url, token, self.pki)

    async def cli(
        self, *args: str, workspace: str = "team-a", check: bool = False
    ) -> subprocess.CompletedProcess[bytes]:
        """`levers9 ARGS` through the Service, as a user runs it; output captured."""
        return await run_cli(self.cli_env(workspace), args, check=check)

    def client(
        self, workspace: str = "team-a", *, replica: int | None = None
    ) -> AbstractAsyncContextManager[ControlClient]:
        """A client through the Service, or straight to replica `replica`."""
        token = self.tokens[workspace] if workspace != "operator" else self.operator_token
        url = self.url if replica is None else f"https://127.0.0.1:{self.ports[replica]}"
        return open_control_client(url, token, str(self.pki.ca_file))

    async def wait_workers(self, count: int, *, replica: int | None = None) -> list[str]:
        """Until `count` workers are connected (as the replicas' directory says)."""
        while True:
            with contextlib.suppress(Exception):
                async with self.client("operator", replica=replica) as client:
                    listed = (await client.workers()).workers
                ready = [w.worker_id for w in listed if w.connected and w.registered_at]
                if len(ready) >= count:
                    return sorted(ready)
            await trio.sleep(0.2)

    async def aclose(self) -> None:
        for index, process in enumerate(self.processes):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(15):
                    await process.wait()
                if process.poll() is None:
                    process.kill()
                    await process.wait()
            self.processes[index] = None


def _write(path: Path, values: Mapping[str, Any]) -> None:
    path.write_text(yaml.safe_dump(dict(values)))
    path.chmod(0o600)


@asynccontextmanager
async def open_replicated_cluster(
    root: Path,
    kube: KubeStandin,
    *,
    nodes: Sequence[tuple[SimNode, str]],
    pools: Sequence[PoolSpec],
    database: Mapping[str, Any],
    replicas: int = 3,
    agent_env: Mapping[str, str] | None = None,
    lost_after_s: float = 30.0,
    lease_s: float = 3.0,
    worker_tokens: Mapping[str, str] | None = None,
    settings: Mapping[str, Any] | None = None,
    buckets: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> AsyncIterator[ReplicatedCluster]:
    """`replicas` controlplane processes over the PostgreSQL `database` block (url, password),
    behind one Service; the nodes' workers come up through it, and so may workers started
    outside any pool with `worker_tokens` (worker id → token, in the private values).
    `settings` are more of the values' `config:` (e.g. `connections`), `buckets` each
    workspace's buckets (workspace → bucket blocks). Everything stops when the block ends."""
    root.mkdir(parents=True, exist_ok=True)
    pki = make_pki(root)
    tokens = {"team-a": secrets.token_urlsafe(24), "team-b": secrets.token_urlsafe(24)}
    operator_token = secrets.token_urlsafe(24)
    ports = [free_port() for _ in range(replicas)]
    service = LoopbackService(list(ports))
    values_dir = root / "values"
    values_dir.mkdir()
    env = {
        **os.environ,
        **controlplane_pod(kube, root / "serviceaccount"),
        "LEVERS9_LOG_LEVEL": "INFO",
    }
    grant_leases(kube)
    labelled = [
        attrs.evolve(node, labels={**node.labels, POOL_LABEL: pool}) for node, pool in nodes
    ]
    agent = agent_environment(
        # A replica started as a process has no test's pool_env: the CA comes this way.
        {"LEVERS9_CONTROLPLANE_CA": str(pki.ca_file), **(agent_env or {})}
    )
    kubelet = SimulatedKubelet(kube, root / "kubelet", labelled, extra_env=agent)
    async with trio.open_nursery() as nursery:
        await service.start(nursery)
        values = control_values(
            pki,
            service.port,
            kube,
            pools,
            root / "unused.db",
            tokens,
            operator_token,
            lost_after_s=lost_after_s,
            database_block={"url": database["url"]},
            buckets=buckets,
        )
        values["config"]["leaderElection"] = {
            "enabled": True,
            "namespace": OWN_NAMESPACE,
            "leaseDurationS": 4,
            "renewDeadlineS": 3,
            "retryPeriodS": 0.5,
        }
        values["config"]["drainS"] = 5
        values["config"].update(settings or {})
        values["config"]["replication"] = {"leaseS": lease_s}
        _write(values_dir / "values.yaml", values)
        _write(
            values_dir / "private.yaml",
            {
                "config": {
                    "database": {"password": database["password"]},
                    "replication": {"secret": secrets.token_hex(32)},
                    "worker": {
                        "tokens": [
                            {"workerId": worker, "token": token}
                            for worker, token in (worker_tokens or {}).items()
                        ]
                    },
                }
            },
        )
        for index, port in enumerate(ports):
            _write(
                values_dir / f"replica-{index}.yaml", {"config": {"listen": f"127.0.0.1:{port}"}}
            )
        cluster = ReplicatedCluster(
            root=root,
            kube=kube,
            kubelet=kubelet,
            pki=pki,
            service=service,
            ports=ports,
            tokens=tokens,
            operator_token=operator_token,
            nursery=nursery,
            env=env,
            processes=[None] * replicas,
        )
        await nursery.start(kubelet.run)
        try:
            for index in range(replicas):
                await cluster.start(index)
            yield cluster
        finally:
            with trio.CancelScope(shield=True):
                await cluster.aclose()
            nursery.cancel_scope.cancel()
