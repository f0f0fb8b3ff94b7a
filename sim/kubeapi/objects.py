"""Objects as a cluster makes them: GPU nodes, pods with requests and limits, the defaults the
apiserver fills into a Secret, a Job or a Service (and a provisioner into a claim), and its
checks of a core/v1 Event and a Lease.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from sim.kubeapi.model import GPU, KubeError, Obj


def timestamp_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_node(
    name: str,
    gpus: int = 4,
    cpu: str = "8",
    memory: str = "32Gi",
    labels: Mapping[str, str] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
    *,
    gpu_product: str | None = "NVIDIA-A100-SXM4-80GB",
    allocatable: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
) -> Obj:
    """A Node as a kubelet with the NVIDIA device plugin reports it (allocatable = capacity
    unless `allocatable` overrides some of it)."""
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
    }
    if gpus and gpu_product:
        node_labels["nvidia.com/gpu.product"] = gpu_product
        node_labels["nvidia.com/gpu.count"] = str(gpus)
    node_labels.update(labels or {})
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
    if gpus:
        capacity[GPU] = str(gpus)
    spec: Obj = {"podCIDR": "10.244.0.0/24"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    now = timestamp_now()
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": node_labels},
        "spec": spec,
        "status": {
            "capacity": capacity,
            "allocatable": {**capacity, **(allocatable or {})},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": "KubeletReady" if ready else "KubeletNotReady",
                    "message": "kubelet is posting ready status"
                    if ready
                    else "PLEG is not healthy",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [
                {"type": "InternalIP", "address": "10.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.30.0",
                "kubeProxyVersion": "v1.30.0",
                "containerRuntimeVersion": "containerd://1.7.15",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "osImage": "Ubuntu 22.04.4 LTS",
                "kernelVersion": "6.5.0",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def _container(name: str, requests: Mapping[str, str], gpu_limit: int = 0) -> Obj:
    resources: Obj = {}
    reqs = {k: v for k, v in requests.items() if k != "gpu"}
    gpus = gpu_limit or int(requests.get("gpu", "0"))
    if reqs:
        resources["requests"] = reqs
    if gpus:
        resources["limits"] = {GPU: str(gpus)}
        resources.setdefault("requests", {})[GPU] = str(gpus)
    return {"name": name, "image": "busybox:latest", "resources": resources}


def make_pod(
    name: str,
    node: str | None,
    gpu_limit: int = 0,
    cpu: str = "1",
    memory: str = "1Gi",
    phase: str = "Running",
    init_containers: Sequence[Mapping[str, str]] = (),
    overhead: Mapping[str, str] | None = None,
    *,
    namespace: str = "default",
    labels: Mapping[str, str] | None = None,
    containers: Sequence[Mapping[str, str]] | None = None,
    owner: Obj | None = None,
) -> Obj:
    """A Pod bound to `node` (None: still unscheduled). `init_containers` and `containers`
    are resource maps like `{"cpu": "2", "memory": "1Gi", "gpu": "1"}`; without `containers`
    there is one app container requesting `cpu`/`memory` with `gpu_limit` cards. `owner`
    (a stored object) becomes the controller ownerReference."""
    if containers is None:
        app = [_container("main", {"cpu": cpu, "memory": memory}, gpu_limit)]
    else:
        app = [_container(f"c{i}", c) for i, c in enumerate(containers)]
    spec: Obj = {
        "containers": app,
        "restartPolicy": "Always",
        "schedulerName": "default-scheduler",
        "terminationGracePeriodSeconds": 30,
    }
    if node is not None:
        spec["nodeName"] = node
    if init_containers:
        spec["initContainers"] = [_container(f"init{i}", c) for i, c in enumerate(init_containers)]
    if overhead:
        spec["overhead"] = dict(overhead)
    metadata: Obj = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if owner is not None:
        metadata["ownerReferences"] = [owner_reference(owner)]
    status: Obj = {"phase": phase, "qosClass": "Burstable"}
    if phase == "Running":
        status["conditions"] = [{"type": "Ready", "status": "True"}]
        status["startTime"] = timestamp_now()
        status["containerStatuses"] = [
            {
                "name": c["name"],
                "ready": True,
                "started": True,
                "restartCount": 0,
                "image": c["image"],
                "imageID": "docker.io/library/busybox@sha256:" + "0" * 64,
                "state": {"running": {"startedAt": status["startTime"]}},
            }
            for c in app
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def owner_reference(owner: Obj) -> Obj:
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_node(job: Obj) -> str | None:
    """The node a Job's pod template pins it to (nodeName, hostname nodeSelector or a required
    node affinity on the hostname label or `metadata.name`), or None."""
    spec = job.get("spec", {}).get("template", {}).get("spec", {})
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    selector = spec.get("nodeSelector") or {}
    if "kubernetes.io/hostname" in selector:
        return str(selector["kubernetes.io/hostname"])
    required = (
        spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    for term in required.get("nodeSelectorTerms", []):
        for expr in term.get("matchFields", []) + term.get("matchExpressions", []):
            if (
                expr.get("key") in ("metadata.name", "kubernetes.io/hostname")
                and expr.get("operator") == "In"
                and expr.get("values")
            ):
                return str(expr["values"][0])
    return None


def default_secret(secret: Obj) -> Obj:
    data = dict(secret.get("data") or {})
    for key, value in (secret.get("stringData") or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    new = {k: v for k, v in secret.items() if k != "stringData"}
    new["data"] = data
    new.setdefault("type", "Opaque")
    return new


def default_job(job: Obj) -> Obj:
    """What the apiserver's defaulting adds to a batch/v1 Job on create."""
    meta = job["metadata"]
    spec = dict(job.get("spec") or {})
    template = dict(spec.get("template") or {})
    tmeta = dict(template.get("metadata") or {})
    ids = {
        "batch.kubernetes.io/controller-uid": meta["uid"],
        "batch.kubernetes.io/job-name": meta["name"],
        "controller-uid": meta["uid"],
        "job-name": meta["name"],
    }
    tmeta["labels"] = {**(tmeta.get("labels") or {}), **ids}
    template["metadata"] = tmeta
    spec["template"] = template
    spec.setdefault(
        "selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": meta["uid"]}}
    )
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completions", 1)
    spec.setdefault("parallelism", 1)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    if not meta.get("labels"):
        meta["labels"] = dict(tmeta["labels"])
    return {**job, "spec": spec, "status": job.get("status") or {}}


def check_event(event: Obj) -> None:
    """The apiserver's validation of a core/v1 Event on create and update (its "legacy" rules):
    without `eventTime`, `involvedObject.namespace` must be the Event's own; with one (an Event
    in the newer shape), `reportingComponent`, `reportingInstance` and `action` are required and
    the message is at most 1024 characters. Raises `KubeError` 422."""
    meta = event["metadata"]
    involved = event.get("involvedObject") or {}
    problems = []
    if not event.get("eventTime"):
        if (involved.get("namespace") or "") not in ("", meta["namespace"]):
            problems.append(
                f'involvedObject.namespace: Invalid value: "{involved["namespace"]}": '
                "does not match event.namespace"
            )
    else:
        for field in ("reportingComponent", "reportingInstance", "action"):
            if not event.get(field):
                problems.append(f"{field}: Required value")
        if len(str(event.get("message") or "")) > 1024:
            problems.append('message: Invalid value: "": can have at most 1024 characters')
    if problems:
        listed = problems[0] if len(problems) == 1 else f"[{', '.join(problems)}]"
        raise KubeError(
            422,
            "Invalid",
            f'Event "{meta["name"]}" is invalid: {listed}',
            {"name": meta["name"], "kind": "events"},
        )


MICRO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}(Z|[+-]\d{2}:\d{2})")
"""A MicroTime as the apiserver decodes it (Go's `time.Parse` with RFC3339Micro): exactly six
fractional digits, so Python's `isoformat()` of a whole second is refused, as there."""


def check_lease(lease: Obj) -> None:
    """The apiserver's decoding and validation of a coordination.k8s.io/v1 Lease: its times are
    MicroTimes (else 400, as a body that does not decode), its duration above 0 and its
    transitions 0 or more (else 422)."""
    spec = lease.get("spec") or {}
    name = lease["metadata"]["name"]
    for field in ("acquireTime", "renewTime"):
        value = spec.get(field)
        if value is not None and not (isinstance(value, str) and MICRO_TIME.fullmatch(value)):
            raise KubeError(
                400,
                "BadRequest",
                f'Lease in version "v1" cannot be handled as a Lease: parsing time {value!r} as '
                '"2006-01-02T15:04:05.000000Z07:00": cannot parse it as RFC 3339 with microseconds',
            )
    problems = []
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        problems.append(
            f"spec.leaseDurationSeconds: Invalid value: {duration!r}: must be greater than 0"
        )
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        problems.append(
            f"spec.leaseTransitions: Invalid value: {transitions!r}: must be greater than or "
            "equal to 0"
        )
    if problems:
        listed = problems[0] if len(problems) == 1 else f"[{', '.join(problems)}]"
        raise KubeError(
            422,
            "Invalid",
            f'Lease.coordination.k8s.io "{name}" is invalid: {listed}',
            {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
        )


def default_service(service: Obj, old: Obj | None, serial: int) -> Obj:
    """What the apiserver fills into a Service: its type, a cluster IP and, for a NodePort or
    LoadBalancer one, a node port per port (`serial`, unique per write, picks them); an update
    keeps those it had."""
    spec = dict(service.get("spec") or {})
    old_spec = (old or {}).get("spec") or {}
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if not spec.get("clusterIP"):
        spec["clusterIP"] = old_spec.get("clusterIP") or (
            f"10.96.{(serial >> 8) % 256}.{serial % 254 + 1}"
        )
    spec["clusterIPs"] = [spec["clusterIP"]]
    old_ports = {p.get("port"): p.get("nodePort") for p in old_spec.get("ports") or ()}
    ports = []
    for index, given in enumerate(spec.get("ports") or ()):
        port = {"protocol": "TCP", **given}
        port.setdefault("targetPort", port.get("port"))
        if spec["type"] in ("NodePort", "LoadBalancer") and not port.get("nodePort"):
            port["nodePort"] = old_ports.get(port.get("port")) or (
                30000 + (serial * 7 + index) % 2768
            )
        ports.append(port)
    spec["ports"] = ports
    status = service.get("status") or {"loadBalancer": {}}
    return {**service, "spec": spec, "status": status}


def default_claim(claim: Obj) -> Obj:
    """A PersistentVolumeClaim as a cluster with a dynamic provisioner leaves it: Bound to a
    volume of the size it asks for."""
    spec = dict(claim.get("spec") or {})
    spec.setdefault("volumeMode", "Filesystem")
    spec.setdefault("volumeName", f"pvc-{claim['metadata']['uid']}")
    requested = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "")
    status = {
        "phase": "Bound",
        "accessModes": list(spec.get("accessModes") or ()),
        "capacity": {"storage": requested},
    }
    return {**claim, "spec": spec, "status": status}
