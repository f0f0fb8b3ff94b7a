"""The worker's Kubernetes objects: its Job and token Secret, their names and labels.

What a worker looks like on a cluster is decided here and only here: the Job pinned to its node
through the scheduler (so Kubernetes accounts for the cards it requests), the agent's
environment, the host paths it mounts, and the labels by which the planner later recognises the
Job and its pods as ours (`control.kube.planner.is_our_worker`, `job_facts`). Pure functions that
return dicts for the adapter to send; names are deterministic, so a retried create collides
instead of doubling a worker. `PoolSettings` is the part of a pool's config that the manifests
and the planner read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import attrs

from control.kube.selectors import Selector
from wire.errors import ApiError, ErrorCode

__all__ = [
    "DEFAULT_TOLERATIONS",
    "GENERATION_LABEL",
    "GPU_RESOURCE",
    "MANAGED_BY_LABEL",
    "MANAGER",
    "NAME_LABEL",
    "NODE_ANNOTATION",
    "NODE_LABEL",
    "POOL_LABEL",
    "TERMINATION_GRACE_S",
    "TOKEN_KEY",
    "WORKER_NAME",
    "PoolSettings",
    "WorkerManifests",
    "job_manifest",
    "job_name",
    "token_secret",
    "token_secret_name",
    "with_job_uid",
    "worker_labels",
]

GPU_RESOURCE = "nvidia.com/gpu"
NAME_LABEL = "app.kubernetes.io/name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
POOL_LABEL = "levers9.dev/pool"
NODE_LABEL = "levers9.dev/node"
GENERATION_LABEL = "levers9.dev/generation"
# The full node name: a label value is at most 63 characters, a node name up to 253.
NODE_ANNOTATION = "levers9.dev/node"
WORKER_NAME = "levers9-worker"
MANAGER = "levers9"
TOKEN_KEY = "token"
TERMINATION_GRACE_S = 60
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
MAX_NAME_CHARS = 63
DEFAULT_TOLERATIONS: tuple[Mapping[str, Any], ...] = ({"key": GPU_RESOURCE, "operator": "Exists"},)


@attrs.frozen
class PoolSettings:
    """What the planner needs of a pool's config (the integration maps `PoolConfig` onto it)."""

    name: str
    namespace: str
    image: str
    selector: Selector = Selector()
    tunnel: bool = False
    host_network: bool = True
    tolerations: tuple[Mapping[str, Any], ...] = DEFAULT_TOLERATIONS
    objects_path: str = "/var/lib/levers9"
    driver_path: str = "/home/kubernetes/bin/nvidia"
    idle_minutes: float = 5.0
    reconcile_seconds: float = 15.0
    metrics_port: int | None = None
    """The agent's `/metrics` listener (LEVERS9_METRICS_PORT/HOST); None: off."""
    metrics_host: str = "127.0.0.1"
    ttl_seconds_after_finished: int = 600
    not_ready_grace_s: float = 300.0
    """As long as Kubernetes' own pods tolerate `node.kubernetes.io/not-ready` by default."""
    allow_local_registries: bool = False
    """LEVERS9_ALLOW_LOCAL_REGISTRIES=1: the workers pull from registries on their node."""


# --- names ----------------------------------------------------------------------------------


def _dns_part(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def job_name(pool: str, node: str, generation: int) -> str:
    """`levers9-<pool>-<node>-<hash>-<generation>`: a DNS-1123 label of at most 63 characters,
    the same for the same inputs (a retried create collides instead of doubling a worker).
    The hash covers the full pool and node names, so truncation never merges two nodes."""
    digest = hashlib.sha256(f"{pool}\0{node}".encode()).hexdigest()[:8]
    pool_part = _dns_part(pool)[:16].strip("-")
    tail = f"{digest}-{generation}"
    head = f"levers9-{pool_part}-" if pool_part else "levers9-"
    room = MAX_NAME_CHARS - len(head) - len(tail) - 1
    node_part = _dns_part(node)[: max(room, 0)].strip("-")
    return f"{head}{node_part}-{tail}" if node_part else f"{head}{tail}"


def token_secret_name(job: str) -> str:
    return f"{job}-token"


def _label_value(text: str) -> str:
    """`text` when it is a valid label value, else a shortened form with a hash."""
    if re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?", text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', text)[:50].strip('-_.')}-{digest}".strip("-")


# --- the worker Job -------------------------------------------------------------------------


@attrs.frozen
class WorkerManifests:
    """The Job and its token Secret. Create the Job, then the Secret via `with_job_uid`."""

    job: dict[str, Any]
    secret: dict[str, Any] = attrs.field(repr=False)


def worker_labels(pool: str, node: str) -> dict[str, str]:
    return {
        NAME_LABEL: WORKER_NAME,
        MANAGED_BY_LABEL: MANAGER,
        POOL_LABEL: _label_value(pool),
        NODE_LABEL: _label_value(node),
    }


def job_manifest(
    settings: PoolSettings,
    node: str,
    cards: int,
    name: str,
    token_secret_name: str,
    controlplane_url: str,
    *,
    token: str,
    generation: int = 0,
    hostname: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> WorkerManifests:
    """The worker Job pinned to `node` (through the scheduler, so Kubernetes accounts for the
    `cards` it requests) and the Secret holding its token, owned by the Job once created."""
    _check_job_request(settings, node, cards)
    job_labels = {**worker_labels(settings.name, node), GENERATION_LABEL: str(generation)}
    env = _agent_env(settings, name, token_secret_name, controlplane_url, extra_env)
    pod_spec = _pod_spec(settings, node, hostname, _agent_container(settings, cards, env))
    annotations = {NODE_ANNOTATION: node}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": job_labels,
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
            "template": {
                "metadata": {"labels": job_labels, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }
    return WorkerManifests(job, token_secret(settings, node, name, token_secret_name, token))


def _check_job_request(settings: PoolSettings, node: str, cards: int) -> None:
    if cards <= 0:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"a worker Job for node {node!r} needs at least one card, not {cards}",
            field="cards",
        )
    if settings.tunnel is False and settings.host_network is False:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"pool {settings.name!r}: hostNetwork false needs tunnel true (the controlplane "
            "dials a direct worker at its node's address)",
            field="hostNetwork",
        )


def _agent_env(
    settings: PoolSettings,
    name: str,
    token_secret_name: str,
    controlplane_url: str,
    extra_env: Mapping[str, str] | None,
) -> list[dict[str, Any]]:
    """The agent's environment: its identity, mode, paths and token (from the Secret)."""
    env: list[dict[str, Any]] = [
        {"name": "LEVERS9_WORKER_ID", "value": name},
        {"name": "LEVERS9_MODE", "value": "tunnel" if settings.tunnel else "direct"},
        {"name": "LEVERS9_CONTROLPLANE_URL", "value": controlplane_url},
        {
            "name": "LEVERS9_NODE_NAME",
            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
        },
        {"name": "LEVERS9_STATE_DIR", "value": settings.objects_path},
        {"name": "LEVERS9_GPU_DRIVER_DIR", "value": settings.driver_path},
        {"name": "LEVERS9_IDLE_S", "value": str(int(settings.idle_minutes * 60))},
        # Said explicitly: with hostNetwork the worker's loopback is the node's (kubelet, sshd).
        {"name": "LEVERS9_LOOPBACK_CONNECT", "value": "off"},
        {
            "name": "LEVERS9_WORKER_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": token_secret_name, "key": TOKEN_KEY}},
        },
    ]
    if settings.allow_local_registries:
        env.append({"name": "LEVERS9_ALLOW_LOCAL_REGISTRIES", "value": "1"})
    if settings.metrics_port is not None:
        env += [
            {"name": "LEVERS9_METRICS_PORT", "value": str(settings.metrics_port)},
            {"name": "LEVERS9_METRICS_HOST", "value": settings.metrics_host},
        ]
    env += [{"name": key, "value": value} for key, value in sorted((extra_env or {}).items())]
    return env


def _host_mounts(settings: PoolSettings) -> list[tuple[str, str, str]]:
    """(volume, host path, hostPath type) of each node directory the agent works in."""
    return [
        ("objects", settings.objects_path, "DirectoryOrCreate"),
        ("dev", "/dev", "Directory"),
        ("driver", settings.driver_path, "Directory"),
        ("pod-resources", POD_RESOURCES_DIR, "Directory"),
    ]


def _agent_container(
    settings: PoolSettings, cards: int, env: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "name": "agent",
        "image": settings.image,
        "args": ["run"],
        "securityContext": {"privileged": True},
        "env": env,
        "resources": {
            "limits": {GPU_RESOURCE: str(cards)},
            "requests": {GPU_RESOURCE: str(cards)},
        },
        "volumeMounts": [
            {"name": volume, "mountPath": path} for volume, path, _ in _host_mounts(settings)
        ],
    }


def _pod_spec(
    settings: PoolSettings, node: str, hostname: str | None, container: dict[str, Any]
) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # A stopping agent stops its containers first, each with its own grace (10 s unless the
        # task says otherwise); Kubernetes' default of 30 s would cut a slow one short.
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "nodeSelector": {"kubernetes.io/hostname": hostname or node},
        "hostNetwork": settings.host_network,
        "tolerations": [dict(t) for t in settings.tolerations],
        "containers": [container],
        "volumes": [
            {"name": volume, "hostPath": {"path": path, "type": kind}}
            for volume, path, kind in _host_mounts(settings)
        ],
    }
    if settings.host_network:
        # Without it a hostNetwork pod resolves through the node's resolv.conf, not the cluster.
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return pod_spec


def token_secret(
    settings: PoolSettings, node: str, job: str, secret_name: str, token: str
) -> dict[str, Any]:
    """The Secret holding a worker's token, to be owned by its Job (`with_job_uid`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name,
            "namespace": settings.namespace,
            "labels": worker_labels(settings.name, node),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job,
                    "uid": "",
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def with_job_uid(secret: Mapping[str, Any], uid: str) -> dict[str, Any]:
    """`secret` owned by the created Job (`uid` from the create response), so deleting the Job
    deletes the token too."""
    metadata = dict(secret["metadata"])
    metadata["ownerReferences"] = [{**ref, "uid": uid} for ref in metadata["ownerReferences"]]
    return {**secret, "metadata": metadata}
