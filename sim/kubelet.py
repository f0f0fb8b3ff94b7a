"""A simulated kubelet for the Kubernetes API stand-in: worker Jobs run as local agent processes.

The controlplane's reconcile creates worker Jobs; in a real cluster the scheduler binds their
pods, the device plugin hands out cards and the kubelet starts the container. Tests of the whole
loop (a Job is created, an agent registers, a killed or deleted worker is noticed) need that
part too, without a cluster or a GPU. `SimulatedKubelet` plays it for a few simulated nodes on
this machine: each node has its own stand-in NVML description, /dev directory with real device
nodes, driver directory, state directory and container network names, and each Job pinned to one
of them runs `python -m agent.daemon.cli run` with the environment the real kubelet would give it.

Design choices:
- It polls the stand-in's Python API (every `POLL_S`) from trio rather than hooking Job creation:
  a Job's token Secret is created only after the Job, a Job may have to wait for cards, and Job
  deletion has no hook; one loop sees all of it in the order a kubelet would.
- What to do is decided by pure functions (`place_neighbours`, `free_cards`, `resolve_env`, the
  status builders); the loop only reads the stand-in, applies them and writes the results back
  with `KubeStandin.patch`, which never re-creates an object someone deleted meanwhile.
- Cards are handed out as a device plugin does: a pod's cards are fixed when it is admitted and
  stay its own until it ends. Neighbour pods (not ours) bound to a node hold the lowest free
  indexes, in the stand-in's pod order, from the moment the kubelet first sees them.
- Every agent is a child of a task in the nursery `run` owns; when `run` is cancelled each one
  gets SIGTERM and, after its pod's grace period, SIGKILL, all at once, and `run` returns once
  all have exited.
- `runtime="image"` runs the Job's container from the image it names instead (`sim.pods`:
  pulled, unpacked and run with runc, privileged, with the Job's hostPath volumes resolved on the
  simulated node by `host_source`). The node then looks like a real one from inside: the driver
  directory holds the stand-in libnvidia-ml.so.1 in lib64, /dev has the basic devices, and only
  what the Job asks for is given (no LEVERS9_* of this process).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets
import shutil
import stat
import subprocess
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

import attrs
import trio

from nvml.standin import ENV_VAR as NVML_ENV
from nvml.standin import (
    build_standin,
    make_device_nodes,
    nvlinked_node,
    standin_device,
    standin_environ,
    write_node,
)
from sim import pods
from sim.kubeapi.model import KubeError, Obj
from sim.kubeapi.objects import job_node, make_node
from sim.kubeapi.store import KubeStandin
from sim.pods import (
    BASIC_DEVICES,
    Mount,
    PodRuntimeError,
    container_argv,
    container_env,
    pod_config,
    runc_id,
)

log = logging.getLogger("levers9.sim.kubelet")

GPU_RESOURCE = "nvidia.com/gpu"
_TERMINAL_PHASES = ("Succeeded", "Failed")


def _container_gpus(container: Mapping[str, Any]) -> int:
    """The cards the device manager allocates to one container: its `nvidia.com/gpu` limit
    (an extended resource's request, when given, must equal it)."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(GPU_RESOURCE)
    if value is None:
        value = (resources.get("requests") or {}).get(GPU_RESOURCE, 0)
    return int(value)


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """The cards a pod holds on its node, as the kubelet's device manager allocates them.

    Written from the kubelet's rules, not taken from the controlplane's planner, so that the
    planner's arithmetic is checked against another reading of Kubernetes: regular init
    containers run one at a time and hand their cards on (the pod needs the largest), sidecar
    init containers (`restartPolicy: Always`) keep theirs for the pod's life, and app
    containers hold theirs side by side.
    """
    spec = pod.get("spec") or {}
    sidecars = 0
    init_peak = 0
    for container in spec.get("initContainers") or ():
        if container.get("restartPolicy") == "Always":
            sidecars += _container_gpus(container)
        else:
            init_peak = max(init_peak, sidecars + _container_gpus(container))
    running = sidecars + sum(_container_gpus(c) for c in spec.get("containers") or ())
    return max(running, init_peak)


REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.1
"""How often the stand-in is looked at."""
CREATE_RETRY_S = 0.5
CREATE_RETRY_CAP_S = 5.0
"""A refused pod is created again after these, doubling, as the Job controller backs off
(from 1 s to 1 min there; shorter here, for tests)."""
GRACE_S = 30.0
"""How long an agent has between SIGTERM and SIGKILL when its pod does not say
(`terminationGracePeriodSeconds`, whose default this is, as in Kubernetes)."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
MAX_NODES = 8
"""Each node gets a /20 of 169.254.128.0/17 for its container network; eight of them fit."""
HOST_IP = "127.0.0.1"
_PASSED_OVER = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "POD_NAME", "POD_NAMESPACE")
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
DRIVER_DIRS = ("/home/kubernetes/bin/nvidia", "/usr/local/nvidia")
"""Where GKE and the NVIDIA operator put the driver on a node; both are the node's driver dir."""
STATE_DIR = "/var/lib/levers9"
NVML_DESCRIPTION = "/etc/levers9-sim/nvml.json"
"""Where an image-run pod sees its node's stand-in NVML description (the stand-in's own knob,
standing in for the hardware; a real node has none)."""
Runtime = Literal["process", "image"]


class KubeletSetupError(Exception):
    """A simulated node cannot be laid out; the message says what to do."""


class ContainerConfigError(Exception):
    """The container's environment cannot be resolved yet (the kubelet's
    CreateContainerConfigError): a Secret or key is missing, or a field is not supported."""


@attrs.frozen
class SimNode:
    """A simulated node: `cards` stand-in A100s (all on one NVLink fabric), and what the
    Node object reports. `labels` are extra node labels (the selectors of pools)."""

    name: str
    cards: int
    cpu: str = "8"
    memory: str = "32Gi"
    labels: Mapping[str, str] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class AgentPod:
    """An agent the kubelet started. `cards` are card indexes on the node, `uuids` the same
    cards as NVIDIA_VISIBLE_DEVICES named them. `returncode` is None while it runs, negative
    (the signal) when a signal ended it, as `subprocess` reports it."""

    job_name: str
    namespace: str
    node: str
    pod_name: str
    pid: int
    cards: tuple[int, ...]
    uuids: tuple[str, ...]
    log_path: Path
    returncode: int | None


# -- pure decisions ------------------------------------------------------------------------------


def place_neighbours(
    cards: int,
    ours: Collection[int],
    held: Mapping[str, tuple[int, ...]],
    neighbours: Sequence[tuple[str, int]],
) -> dict[str, tuple[int, ...]]:
    """Which cards each neighbour pod holds. `neighbours` are (pod uid, nvidia.com/gpu limit) in
    pod order; one that `held` cards before keeps them, a new one gets the lowest indexes that
    neither `ours` nor another neighbour holds (fewer when the node is overcommitted)."""
    result = {uid: held[uid] for uid, _ in neighbours if uid in held}
    taken = set(ours).union(*result.values())
    for uid, count in neighbours:
        if uid in result:
            continue
        given = free_cards(cards, taken)[:count]
        result[uid] = given
        taken.update(given)
    return result


def free_cards(cards: int, taken: Iterable[int]) -> tuple[int, ...]:
    """The indexes of a node's `cards` that nobody holds, lowest first."""
    held = set(taken)
    return tuple(i for i in range(cards) if i not in held)


def secret_names(container: Mapping[str, Any]) -> set[str]:
    """The Secrets the container's env refers to."""
    names = set()
    for entry in container.get("env") or ():
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        if ref and ref.get("name"):
            names.add(str(ref["name"]))
    return names


def resolve_env(
    container: Mapping[str, Any],
    namespace: str,
    found_secrets: Mapping[str, Obj | None],
    fields: Mapping[str, str],
) -> dict[str, str]:
    """The container's env as the kubelet resolves it: `value`, `valueFrom.secretKeyRef` (from
    `found_secrets`, by name; None: missing) and `valueFrom.fieldRef` (from `fields`, by field
    path). Later entries win. `$(VAR)` references are not expanded. Raises
    ContainerConfigError with the kubelet's wording when something is missing."""
    env: dict[str, str] = {}
    for entry in container.get("env") or ():
        name = str(entry["name"])
        if "valueFrom" not in entry:
            env[name] = str(entry.get("value", ""))
            continue
        source = entry["valueFrom"] or {}
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = found_secrets.get(ref["name"])
            optional = bool(ref.get("optional"))
            if secret is None:
                if optional:
                    continue
                raise ContainerConfigError(f'secret "{ref["name"]}" not found')
            data = secret.get("data") or {}
            if ref["key"] not in data:
                if optional:
                    continue
                raise ContainerConfigError(
                    f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}"
                )
            try:
                env[name] = base64.b64decode(data[ref["key"]], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise ContainerConfigError(
                    f"key {ref['key']} of Secret {namespace}/{ref['name']} is not base64 of "
                    "UTF-8 text; store it under data base64-encoded (or under stringData)"
                ) from None
        elif "fieldRef" in source:
            path = source["fieldRef"].get("fieldPath", "")
            if path not in fields:
                raise ContainerConfigError(
                    f"env {name}: fieldRef {path!r} is not supported by the simulated kubelet; "
                    f"use one of {', '.join(sorted(fields))}"
                )
            env[name] = fields[path]
        else:
            kinds = ", ".join(sorted(source)) or "nothing"
            raise ContainerConfigError(
                f"env {name}: valueFrom {kinds} is not supported by the simulated kubelet; use "
                "value, secretKeyRef or fieldRef"
            )
    return env


def job_is_finished(job: Mapping[str, Any]) -> bool:
    """Whether the Job controller has marked the Job Complete or Failed."""
    status = job.get("status") or {}
    for condition in status.get("conditions") or ():
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return True
    return bool(status.get("succeeded") or status.get("failed"))


def exit_code(returncode: int) -> int:
    """A container's exit code as Kubernetes reports it: 128 + the signal that ended it."""
    return 128 - returncode if returncode < 0 else returncode


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unschedulable_status(wanted: int) -> Obj:
    """A pod the scheduler cannot place: too few free cards on the node it is pinned to."""
    return {
        "phase": "Pending",
        "qosClass": "BestEffort",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": f"0/1 nodes are available: 1 Insufficient nvidia.com/gpu (wants "
                f"{wanted}).",
                "lastTransitionTime": _now(),
            }
        ],
    }


def waiting_status(container: str, reason: str, message: str = "") -> Obj:
    """A bound pod whose container has not started: `reason` is ContainerCreating or
    CreateContainerConfigError (then `message` says what is missing)."""
    waiting: Obj = {"reason": reason}
    if message:
        waiting["message"] = message
    return {
        "phase": "Pending",
        "qosClass": "BestEffort",
        "hostIP": HOST_IP,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()},
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
        ],
        "containerStatuses": [
            {
                "name": container,
                "ready": False,
                "started": False,
                "restartCount": 0,
                "image": "",
                "imageID": "",
                "state": {"waiting": waiting},
            }
        ],
    }


def running_status(container: str, image: str, started_at: str, host_network: bool) -> Obj:
    status: Obj = {
        "phase": "Running",
        "qosClass": "BestEffort",
        "hostIP": HOST_IP,
        "startTime": started_at,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": started_at},
            {"type": "Initialized", "status": "True", "lastTransitionTime": started_at},
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": started_at},
            {"type": "Ready", "status": "True", "lastTransitionTime": started_at},
        ],
        "containerStatuses": [
            {
                "name": container,
                "ready": True,
                "started": True,
                "restartCount": 0,
                "image": image,
                "imageID": "",
                "state": {"running": {"startedAt": started_at}},
            }
        ],
    }
    if host_network:
        status["podIP"] = HOST_IP
        status["podIPs"] = [{"ip": HOST_IP}]
    return status


def terminated_status(
    container: str, image: str, started_at: str, returncode: int, host_network: bool
) -> Obj:
    """The pod after its one container (restartPolicy Never) ended with `returncode`."""
    finished_at = _now()
    code = exit_code(returncode)
    status = running_status(container, image, started_at, host_network)
    status["phase"] = "Succeeded" if code == 0 else "Failed"
    for condition in status["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition.update(status="False", reason="PodCompleted" if code == 0 else "PodFailed")
            condition["lastTransitionTime"] = finished_at
    (container_status,) = status["containerStatuses"]
    container_status.update(ready=False, started=False)
    container_status["state"] = {
        "terminated": {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": started_at,
            "finishedAt": finished_at,
        }
    }
    return status


def job_finished_status(succeeded: bool) -> Obj:
    """The merge patch the Job controller writes when a Job's one pod (backoffLimit 0) ended:
    the count, the condition and, for a success only, completionTime (as Kubernetes does)."""
    now = _now()
    patch: Obj = {"active": None, "ready": 0, "uncountedTerminatedPods": {}}
    if succeeded:
        patch["succeeded"] = 1
        patch["completionTime"] = now
        condition: Obj = {"type": "Complete", "status": "True"}
    else:
        patch["failed"] = 1
        condition = {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": "Job has reached the specified backoff limit",
        }
    condition.update(lastProbeTime=now, lastTransitionTime=now)
    patch["conditions"] = [condition]
    return patch


# -- the nodes on disk ---------------------------------------------------------------------------


@attrs.frozen
class _Node:
    spec: SimNode
    index: int
    description: Path
    dev_dir: Path
    driver_dir: Path
    state_dir: Path
    podresources_socket: Path

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(standin_device(i).uuid for i in range(self.spec.cards))

    @property
    def root(self) -> Path:
        """The node's own file system, for hostPaths it has no directory of ours for."""
        return self.state_dir.parent / "root"

    def host_source(self, path: str) -> Path:
        """Where the node's `path` (a hostPath volume's) is on this machine."""
        if path == "/dev":
            return self.dev_dir
        if path == POD_RESOURCES_DIR:
            return self.podresources_socket.parent
        if path in DRIVER_DIRS:
            return self.driver_dir
        if path == STATE_DIR:
            return self.state_dir
        return self.root / path.lstrip("/")

    def network_environ(self) -> dict[str, str]:
        """Names and addresses of this node's container networks, apart from the others'."""
        return {
            "LEVERS9_NETWORK_PREFIX": f"k{self.index}",
            "LEVERS9_NETWORK_TABLE": f"levers9_k{self.index}",
            "LEVERS9_NETWORK_POOL": f"169.254.{128 + 16 * self.index}.0/20",
        }

    def environ(self, library: Path) -> dict[str, str]:
        """What makes an agent on this machine see this node and only this node."""
        return {
            **standin_environ(library, self.description),
            "LEVERS9_GPU_DEV_DIR": str(self.dev_dir),
            "LEVERS9_GPU_DRIVER_DIR": str(self.driver_dir),
            "LEVERS9_PODRESOURCES_SOCKET": str(self.podresources_socket),
            "LEVERS9_STATE_DIR": str(self.state_dir),
            **self.network_environ(),
        }


def node_devices(dev: Path, minors: Iterable[int]) -> Path:
    """The node's /dev: the stand-in's device nodes, or why the kubelet cannot make them."""
    try:
        return make_device_nodes(dev, minors)
    except PermissionError:
        raise KubeletSetupError(
            f"cannot create device nodes in {dev}: the simulated kubelet needs root (mknod); "
            "run the test as root or skip it"
        ) from None


def add_basic_devices(dev: Path) -> Path:
    """The devices every node's /dev has (null, zero, urandom, tty, fuse, ...), for pods that
    bind the node's /dev over their own."""
    for name, (major, minor) in BASIC_DEVICES.items():
        if not (dev / name).exists():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return dev


def make_driver_dir(driver: Path) -> Path:
    """A driver directory laid out like GKE's /home/kubernetes/bin/nvidia."""
    (driver / "bin").mkdir(parents=True, exist_ok=True)
    (driver / "lib64").mkdir(exist_ok=True)
    (driver / "bin" / "nvidia-smi").write_text("#!/bin/sh\n")
    (driver / "lib64" / "libcuda.so.1").write_text("")
    return driver


# -- the kubelet ---------------------------------------------------------------------------------

_State = Literal["unscheduled", "bound", "starting", "running", "stopping", "exited", "gone"]
_HOLDS_CARDS = frozenset({"bound", "starting", "running", "stopping"})


@attrs.define(eq=False)
class _Worker:
    """One Job's pod on one of our nodes, from first sight until its agent has exited."""

    job: Obj
    node: _Node
    wanted: int
    pod_name: str
    state: _State = "unscheduled"
    pod_created: bool = False
    pod_uid: str = ""
    pending_note: str = ""
    create_failures: int = 0
    create_after: float = 0.0
    """When (trio's clock) the pod may be created again after a refusal."""
    cards: tuple[int, ...] = ()
    started_at: str = ""
    process: trio.Process | None = None
    container_id: str = ""
    returncode: int | None = None
    job_deleted: bool = False
    stop_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.job["metadata"]["namespace"])

    @property
    def grace_s(self) -> float:
        spec = ((self.job.get("spec") or {}).get("template") or {}).get("spec") or {}
        return float(spec.get("terminationGracePeriodSeconds", GRACE_S))

    @property
    def uid(self) -> str:
        return str(self.job["metadata"]["uid"])

    @property
    def pod_spec(self) -> Obj:
        spec: Obj = self.job["spec"]["template"].get("spec") or {}
        return spec

    @property
    def container(self) -> Obj:
        containers = self.pod_spec.get("containers") or [{}]
        first: Obj = containers[0]
        return first


class SimulatedKubelet:
    """Runs the worker Jobs pinned to `nodes` as local `levers9-agent run` processes.

    `root` holds everything it lays out: the stand-in NVML library (root/nvml), one directory per
    node (root/nodes/<node>: nvml.json, dev/, driver/, state/) and the agents' output
    (root/logs/<job>.log). `extra_env` is applied last to every agent's environment; `python`
    runs `-m agent.daemon.cli` from the repository.

    `runtime="image"` runs each Job's container from its image instead (module docstring):
    pulled (over TLS unless `image_tls_verify` is false), unpacked under root/images and
    root/pods, run by runc with its state in root/runc. `host_files` are bound read-only at
    their own paths (the controlplane's CA, which a real installation would mount from a
    Secret); a pod without hostNetwork reaches this machine's 127.0.0.1 `service_ports` on its
    own loopback, as it would reach a Service.
    """

    def __init__(
        self,
        kube: KubeStandin,
        root: Path,
        nodes: Sequence[SimNode],
        *,
        extra_env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        runtime: Runtime = "process",
        host_files: Sequence[Path] = (),
        image_tls_verify: bool = True,
        service_ports: Sequence[int] = (),
    ) -> None:
        names = [node.name for node in nodes]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"node {name!r} is given twice; give each SimNode its own name")
        if len(nodes) > MAX_NODES:
            raise ValueError(
                f"{len(nodes)} nodes: the simulated kubelet runs at most {MAX_NODES} (each gets "
                "its own /20 of 169.254.128.0/17 for container networks)"
            )
        for node in nodes:
            if node.cards < 0:
                raise ValueError(f"node {node.name!r}: cards must be 0 or more, not {node.cards}")
        self._kube = kube
        self._root = root
        self._specs = tuple(nodes)
        self._extra_env = dict(extra_env or {})
        self._python = python
        self._runtime = runtime
        self._host_files = tuple(host_files)
        self._image_tls_verify = image_tls_verify
        self._service_ports = tuple(service_ports)
        self._library: Path | None = None
        self._nodes: dict[str, _Node] = {}
        self._workers: dict[str, _Worker] = {}
        """By Job uid, in the order the Jobs were first seen."""
        self._neighbours: dict[str, dict[str, tuple[int, ...]]] = {}
        """Node -> neighbour pod uid -> the cards it holds."""
        self._changed = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        return f"SimulatedKubelet(root={str(self._root)!r}, nodes={[s.name for s in self._specs]})"

    # -- the public surface

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Lays out the nodes, adds them to the stand-in, then runs Jobs until cancelled; on
        cancellation every agent gets SIGTERM (SIGKILL after its grace period) and is waited for."""
        self._library, self._nodes = await trio.to_thread.run_sync(self._lay_out)
        for node in self._nodes.values():
            spec = node.spec
            labels = {**spec.labels, HOSTNAME_LABEL: spec.name}
            self._kube.add_node(
                make_node(spec.name, spec.cards, spec.cpu, spec.memory, labels=labels)
            )
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._sync(nursery)
                await trio.sleep(POLL_S)

    def agents(self) -> list[AgentPod]:
        """Every agent started so far, running or exited, in the order their Jobs were seen."""
        return [
            AgentPod(
                job_name=w.name,
                namespace=w.namespace,
                node=w.node.spec.name,
                pod_name=w.pod_name,
                pid=w.process.pid,
                cards=w.cards,
                uuids=tuple(w.node.uuids[i] for i in w.cards),
                log_path=self._log_path(w),
                returncode=w.returncode,
            )
            for w in self._workers.values()
            if w.process is not None
        ]

    def nvml_description(self, node: str) -> Path:
        """The stand-in NVML description of `node`: rewrite it (`nvml.standin.write_description`)
        and the node's running agent sees its cards change (an XID, a card lost, a process)."""
        return self._nodes[node].description

    def kill(self, job_name: str) -> None:
        """SIGKILLs the running agent of Job `job_name` (a worker dying under its pod)."""
        worker = self._running(job_name)
        assert worker.process is not None
        if worker.container_id:
            pods.kill(self._runc_root, worker.container_id)
        else:
            worker.process.kill()

    async def exec(self, job_name: str, argv: Sequence[str]) -> subprocess.CompletedProcess[bytes]:
        """`kubectl exec` into the running agent's container (`runtime="image"` only): runs
        `argv` there and returns what it printed (not checked)."""
        worker = self._running(job_name)
        if not worker.container_id:
            raise LookupError(
                f"the agent of Job {job_name!r} runs as a local process, not in a container; "
                'start the kubelet with runtime="image"'
            )
        return await trio.run_process(
            pods.exec_argv(self._runc_root, worker.container_id, argv),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )

    def _running(self, job_name: str) -> _Worker:
        worker = self._latest(job_name)
        if worker is None or worker.process is None or worker.returncode is not None:
            raise LookupError(
                f"no agent of Job {job_name!r} is running; wait for it to start (agents())"
            )
        return worker

    @property
    def _runc_root(self) -> Path:
        return self._root / "runc"

    async def wait_job_finished(self, job_name: str) -> int:
        """Waits until the agent of Job `job_name` (the newest Job of that name) has exited and
        returns its returncode; the caller applies a deadline."""
        while True:
            worker = self._latest(job_name)
            if worker is not None and worker.returncode is not None:
                return worker.returncode
            await self._changed.park()

    # -- laying out the nodes

    def _lay_out(self) -> tuple[Path, dict[str, _Node]]:
        library = build_standin(self._root / "nvml")
        (self._root / "logs").mkdir(parents=True, exist_ok=True)
        image = self._runtime == "image"
        nodes = {}
        for index, spec in enumerate(self._specs):
            base = self._root / "nodes" / spec.name
            base.mkdir(parents=True, exist_ok=True)
            (base / "state").mkdir(exist_ok=True)
            nodes[spec.name] = _Node(
                spec=spec,
                index=index,
                description=write_node(base / "nvml.json", nvlinked_node(spec.cards)),
                dev_dir=node_devices(base / "dev", range(spec.cards)),
                driver_dir=make_driver_dir(base / "driver"),
                state_dir=base / "state",
                # No kubelet socket: the agent reads NVIDIA_VISIBLE_DEVICES, as on EKS.
                podresources_socket=base / "pod-resources" / "kubelet.sock",
            )
            if image:
                node = nodes[spec.name]
                add_basic_devices(node.dev_dir)
                node.podresources_socket.parent.mkdir(exist_ok=True)
                shutil.copy(library, node.driver_dir / "lib64" / "libnvidia-ml.so.1")
        return library, nodes

    # -- one look at the stand-in

    def _sync(self, nursery: trio.Nursery) -> None:
        jobs = {job["metadata"]["uid"]: job for job in self._kube.jobs()}
        pods = self._kube.pods()
        pod_keys = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods}
        for worker in list(self._workers.values()):
            if worker.state in ("exited", "gone"):
                continue
            job_gone = worker.uid not in jobs
            pod_gone = worker.pod_created and (worker.namespace, worker.pod_name) not in pod_keys
            if job_gone or pod_gone:
                self._stop(worker, job_gone=job_gone)
        self._place_neighbours(pods)
        for uid, job in jobs.items():
            if uid in self._workers or job_is_finished(job):
                continue
            if job["metadata"].get("deletionTimestamp"):
                continue
            node = self._nodes.get(job_node(job) or "")
            if node is None:
                continue
            template_spec = job["spec"]["template"].get("spec") or {}
            self._workers[uid] = _Worker(
                job=job,
                node=node,
                wanted=pod_gpus({"spec": template_spec}),
                pod_name=f"{job['metadata']['name']}-{secrets.token_hex(3)[:5]}",
            )
        for worker in list(self._workers.values()):
            if worker.state == "unscheduled":
                self._schedule(worker)
            if worker.state == "bound":
                self._try_start(worker, nursery)

    def _held_by_us(self, node: str) -> set[int]:
        return {
            card
            for w in self._workers.values()
            if w.node.spec.name == node and w.state in _HOLDS_CARDS
            for card in w.cards
        }

    def _place_neighbours(self, pods: Sequence[Obj]) -> None:
        ours = {(w.namespace, w.pod_name) for w in self._workers.values() if w.pod_created}
        by_node: dict[str, list[tuple[str, int]]] = {name: [] for name in self._nodes}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            meta = pod["metadata"]
            if node not in by_node or (meta["namespace"], meta["name"]) in ours:
                continue
            if (pod.get("status") or {}).get("phase") in _TERMINAL_PHASES:
                continue
            gpus = pod_gpus(pod)
            if gpus:
                by_node[node].append((meta["uid"], gpus))
        for name, neighbours in by_node.items():
            self._neighbours[name] = place_neighbours(
                self._nodes[name].spec.cards,
                self._held_by_us(name),
                self._neighbours.get(name, {}),
                neighbours,
            )

    def _schedule(self, worker: _Worker) -> None:
        if not worker.pod_created and trio.current_time() < worker.create_after:
            return  # refused lately: the Job controller's backoff
        node = worker.node.spec.name
        taken = self._held_by_us(node).union(*self._neighbours.get(node, {}).values())
        free = free_cards(worker.node.spec.cards, taken)
        if len(free) < worker.wanted:
            # Like the scheduler: the pod stays Pending, unbound, and is tried again.
            if not worker.pod_created:
                self._create_pod(worker, bound=False)
            return
        if not worker.pod_created:
            if not self._create_pod(worker, bound=True):
                return
        else:
            status = waiting_status(worker.container.get("name", ""), "ContainerCreating")
            binding = {"spec": {"nodeName": node}, "status": status}
            if self._kube.patch("pods", worker.pod_name, binding, worker.namespace) is None:
                return  # deleted meanwhile: the next look stops the worker
        worker.cards = free[: worker.wanted]
        worker.state = "bound"
        log.info(
            "pod %s/%s bound to %s with cards %s",
            worker.namespace,
            worker.pod_name,
            node,
            list(worker.cards),
        )

    def _create_pod(self, worker: _Worker, *, bound: bool) -> bool:
        template = worker.job["spec"]["template"]
        tmeta = template.get("metadata") or {}
        spec = dict(worker.pod_spec)
        if bound:
            spec["nodeName"] = worker.node.spec.name
            status = waiting_status(worker.container.get("name", ""), "ContainerCreating")
        else:
            status = unschedulable_status(worker.wanted)
        job_meta = worker.job["metadata"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": worker.pod_name,
                "namespace": worker.namespace,
                "labels": dict(tmeta.get("labels") or {}),
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": job_meta["name"],
                        "uid": job_meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
            "status": status,
        }
        try:
            # As the Job controller: a pod refused (Pod Security) is an Event on the Job.
            created = self._kube.create_job_pod(worker.job, pod)
        except KubeError as err:
            log.warning(
                "pod %s/%s not created (%s); trying again",
                worker.namespace,
                worker.pod_name,
                err.message,
            )
            worker.create_failures += 1
            backoff_s = CREATE_RETRY_S * 2 ** min(worker.create_failures - 1, 8)
            worker.create_after = trio.current_time() + min(backoff_s, CREATE_RETRY_CAP_S)
            return False
        worker.pod_created = True
        worker.pod_uid = created["metadata"]["uid"]
        self._patch_job(worker, {"active": 1, "ready": 0, "startTime": _now()})
        return True

    def _try_start(self, worker: _Worker, nursery: trio.Nursery) -> None:
        namespace = worker.namespace
        container = worker.container
        found = {
            name: self._kube.get("secrets", name, namespace) for name in secret_names(container)
        }
        fields = {
            "spec.nodeName": worker.node.spec.name,
            "spec.serviceAccountName": str(worker.pod_spec.get("serviceAccountName") or "default"),
            "metadata.name": worker.pod_name,
            "metadata.namespace": namespace,
            "metadata.uid": worker.pod_uid,
            "status.hostIP": HOST_IP,
        }
        host_network = bool(worker.pod_spec.get("hostNetwork"))
        if host_network:
            fields["status.podIP"] = HOST_IP
        try:
            job_env = resolve_env(container, namespace, found, fields)
        except ContainerConfigError as exc:
            # The real kubelet retries these until the Secret shows up.
            if worker.pending_note != str(exc):
                worker.pending_note = str(exc)
                status = waiting_status(
                    container.get("name", ""), "CreateContainerConfigError", str(exc)
                )
                self._kube.patch("pods", worker.pod_name, {"status": status}, namespace)
            return
        if self._runtime == "image":
            env = dict(job_env)
            env.update(worker.node.network_environ())
            env[NVML_ENV] = NVML_DESCRIPTION
        else:
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith("LEVERS9_") and k not in _PASSED_OVER
            }
            env.update(job_env)
            assert self._library is not None
            env.update(worker.node.environ(self._library))
        if worker.wanted:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(worker.node.uuids[i] for i in worker.cards)
        if host_network:
            env.update(LEVERS9_LISTEN=f"{HOST_IP}:0", LEVERS9_ADVERTISE_HOST=HOST_IP)
        env.update(self._extra_env)
        args = container.get("args") or ["run"]
        argv = [self._python, "-m", "agent.daemon.cli", *map(str, args)]
        output = self._log_path(worker).open("ab")
        worker.state = "starting"
        nursery.start_soon(self._run_agent, worker, argv, env, output)

    def _image_argv(self, worker: _Worker, env: Mapping[str, str]) -> list[str]:
        """Pulls and unpacks the Job's image and writes its pod's runtime config (blocking: run
        in a thread); the argv that runs it."""
        container = worker.container
        reference = str(container.get("image", ""))
        layout = self._root / "images"
        tag, image = pods.pull(reference, layout, tls_verify=self._image_tls_verify)
        worker.container_id = runc_id(worker.pod_uid, worker.pod_name)
        bundle = self._root / "pods" / worker.container_id
        if bundle.exists():
            shutil.rmtree(bundle)
        pods.unpack(layout, tag, bundle)
        volumes = {
            str(v["name"]): v for v in worker.pod_spec.get("volumes") or () if "hostPath" in v
        }
        mounts = []
        for mount in container.get("volumeMounts") or ():
            volume = volumes.get(str(mount["name"]))
            if volume is None:
                raise PodRuntimeError(
                    f"volume {mount['name']!r}: only hostPath volumes are supported by the "
                    "simulated kubelet's image runtime"
                )
            source = worker.node.host_source(str(volume["hostPath"]["path"]))
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                source.mkdir(parents=True, exist_ok=True)
            elif not source.exists():
                raise PodRuntimeError(
                    f"hostPath {volume['hostPath']['path']} of volume {mount['name']!r} is not "
                    f"on node {worker.node.spec.name}"
                )
            mounts.append(Mount(source, str(mount["mountPath"]), bool(mount.get("readOnly"))))
        mounts.append(Mount(worker.node.description, NVML_DESCRIPTION, read_only=True))
        mounts += [Mount(path, str(path), read_only=True) for path in self._host_files]
        argv = container_argv(
            image,
            [str(a) for a in container.get("command") or ()],
            [str(a) for a in container.get("args") or ()],
        )
        config = pod_config(
            image,
            argv=argv,
            env=container_env(image, env),
            mounts=mounts,
            host_network=bool(worker.pod_spec.get("hostNetwork")),
            hostname=worker.pod_name,
            cgroups_path=f"/levers9-sim/{worker.container_id}",
            capabilities=pods.privileged_capabilities(pods.node_bounding_mask()),
        )
        pods.write_config(bundle, config)
        return pods.run_argv(self._runc_root, bundle, worker.container_id)

    # -- an agent's life

    async def _run_agent(
        self, worker: _Worker, argv: list[str], env: dict[str, str], output: IO[bytes]
    ) -> None:
        shutting_down = True
        try:
            with worker.stop_scope:
                try:
                    if self._runtime == "image":
                        try:
                            argv = await trio.to_thread.run_sync(self._image_argv, worker, env)
                        except PodRuntimeError as exc:
                            self._not_started(worker, output, str(exc))
                            return
                    worker.process = await trio.lowlevel.open_process(
                        argv,
                        # runc takes the container's environment from its config.
                        env=None if worker.container_id else env,
                        cwd=REPO,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                    )
                finally:
                    output.close()
                worker.started_at = _now()
                log.info(
                    "agent of Job %s/%s started (pid %d)",
                    worker.namespace,
                    worker.name,
                    worker.process.pid,
                )
                if worker.state == "starting":
                    worker.state = "running"
                    self._on_running(worker)
                self._changed.unpark_all()
                if worker.container_id and not worker.pod_spec.get("hostNetwork"):
                    async with trio.open_nursery() as bridges:
                        for port in self._service_ports:
                            bridges.start_soon(
                                pods.bridge_port,
                                self._runc_root,
                                worker.container_id,
                                HOST_IP,
                                port,
                            )
                        await worker.process.wait()
                        bridges.cancel_scope.cancel()
                else:
                    await worker.process.wait()
            shutting_down = False
        finally:
            process = worker.process
            if process is not None:
                with trio.CancelScope(shield=True):
                    await _terminate(process, worker.grace_s)
                    if worker.container_id:
                        # runc run ends with the container's PID 1; anything PID 1 left behind
                        # (or a runc killed itself) goes with the container.
                        await trio.to_thread.run_sync(
                            pods.delete, self._runc_root, worker.container_id
                        )
                worker.returncode = process.returncode
            if not shutting_down:
                self._on_exit(worker)
            worker.state = "exited" if process is not None else "gone"
            self._changed.unpark_all()

    def _not_started(self, worker: _Worker, output: IO[bytes], message: str) -> None:
        """The container could not be made (the kubelet's CreateContainerError): said in the
        pod's status and the agent's log; the pod stays Pending, as it would."""
        log.error("pod %s/%s: %s", worker.namespace, worker.pod_name, message)
        output.write(f"simulated kubelet: {message}\n".encode())
        status = waiting_status(
            worker.container.get("name", ""), "CreateContainerError", message[:1000]
        )
        self._kube.patch("pods", worker.pod_name, {"status": status}, worker.namespace)

    def _stop(self, worker: _Worker, *, job_gone: bool) -> None:
        """The Job or its pod was deleted: stop the agent (if any) and clean up after it."""
        worker.job_deleted = job_gone
        if worker.state in ("starting", "running"):
            log.info(
                "stopping agent of Job %s/%s: %s deleted",
                worker.namespace,
                worker.name,
                "Job" if job_gone else "pod",
            )
            worker.state = "stopping"
            worker.stop_scope.cancel()
        elif worker.state in ("unscheduled", "bound"):
            worker.state = "gone"
            self._on_exit(worker)
            self._changed.unpark_all()

    def _on_running(self, worker: _Worker) -> None:
        image = str(worker.container.get("image", ""))
        status = running_status(
            worker.container.get("name", ""),
            image,
            worker.started_at,
            bool(worker.pod_spec.get("hostNetwork")),
        )
        self._kube.patch("pods", worker.pod_name, {"status": status}, worker.namespace)
        self._patch_job(worker, {"ready": 1})

    def _on_exit(self, worker: _Worker) -> None:
        """What the kubelet and the Job controller write once the agent has gone."""
        if worker.job_deleted:
            try:
                self._kube.remove_pod(worker.pod_name, worker.namespace)
            except KubeError as err:
                if err.code != 404:
                    raise
            return
        pod = self._kube.get("pods", worker.pod_name, worker.namespace)
        returncode = worker.returncode
        if pod is not None and returncode is not None:
            status = terminated_status(
                worker.container.get("name", ""),
                str(worker.container.get("image", "")),
                worker.started_at,
                returncode,
                bool(worker.pod_spec.get("hostNetwork")),
            )
            self._kube.patch("pods", worker.pod_name, {"status": status}, worker.namespace)
        # A pod deleted before it finished counts as failed (backoffLimit 0: the Job fails).
        succeeded = pod is not None and returncode == 0
        self._patch_job(worker, job_finished_status(succeeded))
        log.info("agent of Job %s/%s exited with %s", worker.namespace, worker.name, returncode)

    def _patch_job(self, worker: _Worker, status: Obj) -> None:
        job = self._kube.get("jobs", worker.name, worker.namespace)
        if job is None or job["metadata"]["uid"] != worker.uid:
            return
        if "startTime" in status and (job.get("status") or {}).get("startTime"):
            status = {k: v for k, v in status.items() if k != "startTime"}
        self._kube.patch("jobs", worker.name, {"status": status}, worker.namespace)

    def _log_path(self, worker: _Worker) -> Path:
        return self._root / "logs" / f"{worker.name}.log"

    def _latest(self, job_name: str) -> _Worker | None:
        found = None
        for worker in self._workers.values():
            if worker.name == job_name:
                found = worker
        return found


async def _terminate(process: trio.Process, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; returns once the process has exited."""
    if process.returncode is None:
        process.terminate()
        with trio.move_on_after(grace_s):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
