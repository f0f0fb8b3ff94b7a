"""A Kubernetes API server stand-in: real REST shapes over TLS, objects kept as plain dicts.

No kube-apiserver can be installed here, yet the controlplane's Kubernetes adapter must be
tested against something that the official `kubernetes` client and `kubectl` both accept. This
module serves core/v1 nodes, pods (with their `log` subresource), secrets, namespaces and
serviceaccounts, batch/v1 jobs and rbac.authorization.k8s.io/v1 roles, clusterroles and their
bindings with the apiserver's paths, List and Status shapes, discovery documents, label and field
selectors, `limit`/`continue` paging, bearer-token authentication and owner-reference cascading
on delete.

ServiceAccounts are modelled as far as `levers9 cluster join` needs them: the token controller
fills a `kubernetes.io/service-account-token` Secret with a token, the CA and the namespace; a
request bearing that token is `system:serviceaccount:<ns>:<sa>` and is authorized by RBAC
(Roles, ClusterRoles and their bindings, wildcards and resourceNames as the real authorizer
reads them), with the apiserver's 403 wording; `kubectl auth can-i` and `kubectl auth whoami`
get their review answers. The admin token and `add_token` tokens bypass RBAC, as before.

Design choices:
- It is a `http.server.ThreadingHTTPServer` on its own threads, so the same object serves trio
  tests (the official client is blocking and runs in `trio.to_thread`), kubectl subprocesses and
  a benchmark process alike; `python -m sim.kubeapi` serves a synthetic cluster from a
  process of its own.
- Stored objects are never mutated: every change stores a new dict together with its JSON bytes,
  so a list of 100,000 pods is one `b",".join` and handlers serialise nothing under the lock.
- Tests arrange state through the Python API (`add_node`, `add_pod`, `set_pod_phase`, ...) rather
  than through status subresources; faults (429, 500, delays) and a "kubelet" callback run when a
  Job is created are armed the same way.
- Only what the controlplane needs is modelled: no watch, no admission, no scheduler, no RBAC
  escalation checks or bootstrap roles, and the garbage collector and the token controller run
  synchronously inside the request that triggers them.
"""

from __future__ import annotations

import base64
import bisect
import itertools
import json
import logging
import secrets
import socket
import ssl
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import trustme
import yaml

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]
"""(namespace, name); the namespace is "" for cluster-scoped resources."""

RBAC = "rbac.authorization.k8s.io"

KUBE_VERSION = {
    "major": "1",
    "minor": "30",
    "gitVersion": "v1.30.0-levers9-standin",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-04-17T00:00:00Z",
    "goVersion": "go1.22.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}


@attrs.frozen
class Resource:
    """One served resource type: where it lives and what discovery says about it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    singular: str = ""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How the apiserver names the resource in messages: `pods`, `jobs.batch`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "namespaces", "Namespace", False, ("ns",), "namespace"),
    Resource("", "v1", "nodes", "Node", False, ("no",), "node"),
    Resource("", "v1", "pods", "Pod", True, ("po",), "pod"),
    Resource("", "v1", "secrets", "Secret", True, (), "secret"),
    Resource("batch", "v1", "jobs", "Job", True, (), "job"),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True, ("sa",), "serviceaccount"),
    Resource(RBAC, "v1", "clusterroles", "ClusterRole", False, (), "clusterrole"),
    Resource(
        RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False, (), "clusterrolebinding"
    ),
    Resource(RBAC, "v1", "roles", "Role", True, (), "role"),
    Resource(RBAC, "v1", "rolebindings", "RoleBinding", True, (), "rolebinding"),
)
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
_VERBS = ["create", "delete", "get", "list", "patch", "update"]
SA_TOKEN_TYPE = "kubernetes.io/service-account-token"
SA_NAME_ANNOTATION = "kubernetes.io/service-account.name"
SA_UID_ANNOTATION = "kubernetes.io/service-account.uid"
ADMIN_USER = "kubernetes-admin"
LIMITED_USER = "system:serviceaccount:standin:limited"
"""Who an `add_token` token is, in its 403 messages and reviews."""
_ACCESS_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
_SUBJECT_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
_DISCOVERY_PATHS = ("/api", "/apis", "/version", "/openapi")
_FIELDS = {"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"}
_GPU = "nvidia.com/gpu"


class KubeError(Exception):
    """An answer the apiserver gives as a `Status` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    def status(self) -> Obj:
        status: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            status["details"] = self.details
        return status


def _not_found(res: Resource, name: str) -> KubeError:
    details = {"name": name, "group": res.group, "kind": res.plural}
    if not res.group:
        del details["group"]
    return KubeError(404, "NotFound", f'{res.qualified} "{name}" not found', details)


def _bad_request(message: str) -> KubeError:
    return KubeError(400, "BadRequest", message)


# ---------------------------------------------------------------- selectors


@attrs.frozen
class Requirement:
    """One label-selector term: `op` is one of =, !=, in, notin, exists, !exists."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        if self.op in ("=", "in"):
            return self.key in labels and labels[self.key] in self.values
        # `!=` and `notin` match objects that lack the label, as the apiserver's do.
        return labels.get(self.key) not in self.values


def _split_terms(selector: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t.strip() for t in terms if t.strip()]


def parse_label_selector(selector: str) -> list[Requirement]:
    """Parses the apiserver's label-selector syntax; raises `KubeError` 400 when malformed."""
    reqs = []
    for term in _split_terms(selector):
        words = term.split(None, 1)
        if len(words) == 2 and words[1].split(None, 1)[0] in ("in", "notin"):
            op, rest = words[1].split(None, 1) if " " in words[1] else (words[1], "")
            rest = rest.strip()
            if not (rest.startswith("(") and rest.endswith(")")):
                raise _bad_request(f"unable to parse requirement: {term!r}: expected (values)")
            values = frozenset(v.strip() for v in rest[1:-1].split(",") if v.strip())
            reqs.append(Requirement(words[0], op, values))
        elif "!=" in term:
            key, value = term.split("!=", 1)
            reqs.append(Requirement(key.strip(), "!=", frozenset({value.strip()})))
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            reqs.append(Requirement(key.strip(), "=", frozenset({value.strip()})))
        elif term.startswith("!"):
            reqs.append(Requirement(term[1:].strip(), "!exists"))
        elif " " in term or "(" in term:
            raise _bad_request(f"unable to parse requirement: {term!r}")
        else:
            reqs.append(Requirement(term, "exists"))
    return reqs


@attrs.frozen
class FieldTerm:
    field: str
    value: str
    negate: bool


def parse_field_selector(selector: str) -> list[FieldTerm]:
    """Parses `field=value`, `field==value`, `field!=value` terms over the supported fields."""
    terms = []
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            field, value = term.split("!=", 1)
            negate = True
        elif "=" in term:
            field, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            negate = False
        else:
            raise _bad_request(f"invalid selector: {selector!r}; can't understand {term!r}")
        field = field.strip()
        if field not in _FIELDS:
            raise _bad_request(f'field label not supported: "{field}"')
        terms.append(FieldTerm(field, value.strip(), negate))
    return terms


def _field_value(obj: Obj, field: str) -> str:
    section, name = field.split(".", 1)
    value = obj.get(section, {}).get(name)
    return "" if value is None else str(value)


# ---------------------------------------------------------------- object builders


def _now() -> str:
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
        capacity[_GPU] = str(gpus)
    spec: Obj = {"podCIDR": "10.244.0.0/24"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    now = _now()
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
        resources["limits"] = {_GPU: str(gpus)}
        resources.setdefault("requests", {})[_GPU] = str(gpus)
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
        metadata["ownerReferences"] = [_owner_reference(owner)]
    status: Obj = {"phase": phase, "qosClass": "Burstable"}
    if phase == "Running":
        status["conditions"] = [{"type": "Ready", "status": "True"}]
        status["startTime"] = _now()
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


def _owner_reference(owner: Obj) -> Obj:
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


# ---------------------------------------------------------------- server state


@attrs.frozen
class RequestRecord:
    """One request as the server saw it (no headers: they carry the token)."""

    method: str
    verb: str
    path: str
    query: str
    status: int


@attrs.define
class Fault:
    """Answers the next `remaining` matching requests with `kind` (429, 500 or delay)."""

    kind: str
    remaining: int
    path_prefix: str | None = None
    verb: str | None = None
    retry_after_s: int = 1
    delay_s: float = 0.0

    def matches(self, verb: str, path: str) -> bool:
        if self.verb is not None and self.verb != verb:
            return False
        return self.path_prefix is None or path.startswith(self.path_prefix)


@attrs.frozen
class _Stored:
    obj: Obj
    raw: bytes


JobHook = Callable[["KubeStandin", Obj], object]
"""Called with the server and the stored Job; what it returns is ignored."""


class KubeStandin:
    """The stand-in's state and its Python API; `start_kube_standin` puts it on the network.

    All methods are thread-safe. Objects passed in are owned by the server afterwards (it stores
    shallow copies with fresh metadata and never mutates them); objects handed out are the
    stored dicts themselves and must not be mutated either.
    """

    def __init__(self, directory: Path, token: str | None = None) -> None:
        self.directory = directory
        self.token = token or secrets.token_urlsafe(24)
        self._tokens: dict[str, frozenset[str]] = {self.token: frozenset()}
        # Tokens the token controller issued -> the Secret holding each; a token is valid only
        # while that Secret still holds it and its ServiceAccount (same uid) still exists.
        self._sa_tokens: dict[str, Key] = {}
        self._pod_logs: dict[Key, str] = {}
        self._lock = threading.RLock()
        self._rv = 0
        self._store: dict[str, dict[Key, _Stored]] = {r.plural: {} for r in RESOURCES}
        self._pods_by_node: dict[str, dict[Key, None]] = {}
        self._key_cache: dict[str, tuple[int, list[Key]]] = {}
        self._faults: list[Fault] = []
        self._job_hooks: list[JobHook] = []
        self.hook_errors: list[BaseException] = []
        self.requests: list[RequestRecord] = []
        self.url = ""
        self.ca_pem = b""
        self.ca_path = directory / "ca.pem"
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.add_namespace(ns)

    def __repr__(self) -> str:
        return f"KubeStandin(url={self.url!r})"

    # -- authentication and faults

    def add_token(self, token: str, denied_verbs: Iterable[str] = ()) -> None:
        """Accepts `token`; requests whose verb is in `denied_verbs` get 403 Forbidden."""
        with self._lock:
            self._tokens[token] = frozenset(denied_verbs)

    def who_am_i(self, token: str) -> str | None:
        """The user `token` authenticates as (`system:serviceaccount:<ns>:<sa>` for a
        ServiceAccount token), or None when the server would answer 401."""
        with self._lock:
            if token == self.token:
                return ADMIN_USER
            if token in self._tokens:
                return LIMITED_USER
            return self._sa_user(token)

    def authorized(
        self,
        token: str,
        verb: str,
        resource: str,
        namespace: str = "",
        group: str = "",
        *,
        name: str = "",
        subresource: str = "",
    ) -> bool:
        """Whether a request with `token` may `verb` `resource` (a plural such as "pods") of
        API `group` in `namespace` ("" for cluster scope), as the server would decide it."""
        with self._lock:
            if token in self._tokens:
                return verb not in self._tokens[token]
            user = self._sa_user(token)
            if user is None:
                return False
            return (
                self._rbac_allows(user, verb, group, resource, subresource, namespace, name)
                is not None
            )

    def inject_fault(
        self,
        kind: str,
        count: int = 1,
        *,
        path_prefix: str | None = None,
        verb: str | None = None,
        retry_after_s: int = 1,
        delay_s: float = 0.0,
    ) -> Fault:
        """Arms a fault: `kind` is "429" (TooManyRequests with Retry-After), "500" or "delay"
        (then answers normally after `delay_s`). `verb` is a Kubernetes verb (list, get, create,
        update, patch, delete)."""
        if kind not in ("429", "500", "delay"):
            raise ValueError(f"fault kind must be 429, 500 or delay, not {kind!r}")
        fault = Fault(kind, count, path_prefix, verb, retry_after_s, delay_s)
        with self._lock:
            self._faults.append(fault)
        return fault

    def on_job_created(self, hook: JobHook) -> None:
        """Calls `hook(server, job)` on the request's thread after each Job create has been
        stored, as a kubelet would start the pod; exceptions land in `hook_errors`."""
        with self._lock:
            self._job_hooks.append(hook)

    def request_count(
        self, verb: str | None = None, path_prefix: str = "", method: str | None = None
    ) -> int:
        """How many requests matched (verb as Kubernetes names it, path without the query)."""
        with self._lock:
            return sum(
                1
                for r in self.requests
                if (verb is None or r.verb == verb)
                and (method is None or r.method == method)
                and r.path.startswith(path_prefix)
            )

    def request_counts(self) -> Counter[tuple[str, str]]:
        """(verb, path) -> number of requests."""
        with self._lock:
            return Counter((r.verb, r.path) for r in self.requests)

    # -- state for tests

    @property
    def resource_version(self) -> int:
        return self._rv

    def add_namespace(self, name: str) -> Obj:
        return self._put(
            "namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            create=False,
        )

    def add_node(self, node: Obj) -> Obj:
        """Adds or replaces a node (see `make_node`)."""
        return self._put("nodes", node, create=False)

    def add_nodes(self, nodes: Iterable[Obj]) -> None:
        with self._lock:
            for node in nodes:
                self._put("nodes", node, create=False)

    def remove_node(self, name: str) -> None:
        self._delete(_BY_PATH["", "v1", "nodes"], "", name, "Orphan")

    def add_pod(self, pod: Obj) -> Obj:
        """Adds or replaces a pod (see `make_pod`); its namespace must exist."""
        return self._put("pods", pod, create=False)

    def add_pods(self, pods: Iterable[Obj]) -> None:
        with self._lock:
            for pod in pods:
                self._put("pods", pod, create=False)

    def remove_pod(self, name: str, namespace: str = "default") -> None:
        self._delete(_BY_PATH["", "v1", "pods"], namespace, name, "Background")

    def set_pod_phase(self, name: str, phase: str, namespace: str = "default") -> Obj:
        pod = self.get("pods", name, namespace)
        if pod is None:
            raise KeyError(f"pod {namespace}/{name}")
        return self._put("pods", {**pod, "status": {**pod["status"], "phase": phase}}, False)

    def set_pod_log(self, name: str, namespace: str, text: str) -> None:
        """What `GET .../pods/<name>/log` answers from now on (empty until set); KeyError when
        the pod does not exist."""
        with self._lock:
            if self.get("pods", name, namespace) is None:
                raise KeyError(f"pod {namespace}/{name}")
            self._pod_logs[namespace, name] = text

    def service_account_token(self, secret: str, namespace: str) -> str | None:
        """The token the token controller put into Secret `namespace/secret`, decoded; None
        when there is no such Secret or it holds no token."""
        stored = self.get("secrets", secret, namespace)
        encoded = (stored or {}).get("data", {}).get("token")
        return base64.b64decode(encoded).decode() if encoded else None

    def update(self, plural: str, obj: Obj) -> Obj:
        """Stores `obj` (any served resource) as it is, bumping its resourceVersion."""
        return self._put(plural, obj, create=False)

    def create(self, plural: str, obj: Obj) -> Obj:
        """Creates `obj` as a POST does: `KubeError` 409 when the name is taken, the apiserver's
        defaulting applied and, for a Job, the `on_job_created` hooks run. Returns the stored
        object (its `metadata.uid` is what an owner reference needs)."""
        res = _resource(plural)
        body = {**obj, "metadata": dict(obj.get("metadata") or {})}
        namespace = (body["metadata"].get("namespace") or "default") if res.namespaced else ""
        return self._create(res, namespace, body)

    def patch(self, plural: str, name: str, patch: Obj, namespace: str = "default") -> Obj | None:
        """Applies a JSON merge patch (RFC 7386) to the stored object in one step, as a
        controller's status or binding write does; None when the object is gone (it is never
        re-created, unlike `update`). `namespace` is ignored for cluster-scoped resources."""
        res = _resource(plural)
        with self._lock:
            try:
                return self._patch(res, namespace if res.namespaced else "", name, patch, "")
            except KubeError as err:
                if err.code == 404:
                    return None
                raise

    def get(self, plural: str, name: str, namespace: str = "") -> Obj | None:
        res = _resource(plural)
        stored = self._store[plural].get((namespace if res.namespaced else "", name))
        return None if stored is None else stored.obj

    def objects(self, plural: str, namespace: str | None = None) -> list[Obj]:
        """The stored objects of a resource (all namespaces when `namespace` is None)."""
        with self._lock:
            return [
                s.obj
                for (ns, _), s in sorted(self._store[plural].items())
                if namespace is None or ns == namespace
            ]

    def jobs(self, namespace: str | None = None) -> list[Obj]:
        return self.objects("jobs", namespace)

    def secrets(self, namespace: str | None = None) -> list[Obj]:
        return self.objects("secrets", namespace)

    def pods(self, namespace: str | None = None) -> list[Obj]:
        return self.objects("pods", namespace)

    def run_job_pod(self, job: Obj, node: str | None = None, phase: str = "Running") -> Obj:
        """Creates the pod the Job controller and kubelet would: named `<job>-<suffix>`, owned
        by the Job, bound to `node` (default: the node the template pins), and marks the Job
        active. Meant to be called from an `on_job_created` hook."""
        meta = job["metadata"]
        template = job["spec"]["template"]
        spec = {**template.get("spec", {}), "nodeName": node or job_node(job) or ""}
        pod = make_pod(f"{meta['name']}-{secrets.token_hex(3)[:5]}", None, phase=phase)
        pod["metadata"] = {
            "name": pod["metadata"]["name"],
            "namespace": meta["namespace"],
            "labels": dict(template.get("metadata", {}).get("labels", {})),
            "ownerReferences": [_owner_reference(job)],
        }
        pod["spec"] = spec
        with self._lock:
            stored = self._put("pods", pod, create=False)
            current = self.get("jobs", meta["name"], meta["namespace"])
            if current is not None and phase == "Running":
                status = {**current.get("status", {}), "active": 1, "startTime": _now()}
                self._put("jobs", {**current, "status": status}, create=False)
        return stored

    # -- clients

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """Writes a kubeconfig with the CA inline and a bearer token (default: the admin's)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "standin",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(self.ca_pem).decode(),
                    },
                }
            ],
            "users": [{"name": "standin", "user": {"token": token or self.token}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
            "current-context": "standin",
            "preferences": {},
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def ssl_context(self) -> ssl.SSLContext:
        """A client context trusting this server's CA (for httpx and plain sockets)."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def api_client(self, token: str | None = None) -> Any:
        """A `kubernetes.client.ApiClient` for this server; close it after use."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        config.ssl_ca_cert = str(self.ca_path)
        config.api_key = {"BearerToken": token or self.token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return client.ApiClient(config)

    # -- the store

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _sorted_keys(self, plural: str) -> list[Key]:
        """The resource's keys in order, rebuilt only after a change (call with the lock)."""
        cached = self._key_cache.get(plural)
        if cached is None or cached[0] != self._rv:
            cached = (self._rv, sorted(self._store[plural]))
            self._key_cache[plural] = cached
        return cached[1]

    def _put(self, plural: str, obj: Obj, create: bool) -> Obj:
        """Stores a new version of `obj`; `create` refuses an existing name (409)."""
        res = _resource(plural)
        meta = dict(obj.get("metadata") or {})
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
            name = meta.get("name")
            if not name:
                raise KubeError(
                    422, "Invalid", f"{res.kind} is invalid: metadata.name: Required value"
                )
            ns = ""
            if res.namespaced:
                ns = meta.setdefault("namespace", "default")
                if ("", ns) not in self._store["namespaces"]:
                    raise KubeError(
                        404,
                        "NotFound",
                        f'namespaces "{ns}" not found',
                        {"name": ns, "kind": "namespaces"},
                    )
            else:
                meta.pop("namespace", None)
            key = (ns, name)
            table = self._store[plural]
            old = table.get(key)
            if old is not None and create:
                details = {"name": name, "group": res.group, "kind": res.plural}
                if not res.group:
                    del details["group"]
                raise KubeError(
                    409, "AlreadyExists", f'{res.qualified} "{name}" already exists', details
                )
            if old is None:
                meta["uid"] = meta.get("uid") if not create and meta.get("uid") else _uid()
                meta["creationTimestamp"] = meta.get("creationTimestamp") or _now()
            else:
                meta["uid"] = old.obj["metadata"]["uid"]
                meta["creationTimestamp"] = old.obj["metadata"]["creationTimestamp"]
            meta["resourceVersion"] = self._bump()
            new = {**obj, "apiVersion": res.api_version, "kind": res.kind, "metadata": meta}
            if plural == "secrets":
                new = _default_secret(new)
                if new["type"] == SA_TOKEN_TYPE:
                    filled = self._token_controller(key, new)
                    if filled is None:
                        # The token controller deletes a token Secret whose ServiceAccount is
                        # missing; the write itself succeeded, so the writer sees the object.
                        if old is not None:
                            del table[key]
                            self._forget_token(key, old.obj)
                        return new
                    new = filled
            elif plural in ("rolebindings", "clusterrolebindings"):
                _check_role_ref(res, new, old.obj if old is not None else None)
            elif plural == "jobs" and old is None:
                new = _default_job(new)
            elif plural == "namespaces":
                new.setdefault("spec", {"finalizers": ["kubernetes"]})
                new.setdefault("status", {"phase": "Active"})
            table[key] = _Stored(new, json.dumps(new, separators=(",", ":")).encode())
            if plural == "pods":
                self._index_pod(key, old.obj if old else None, new)
            return new

    def _index_pod(self, key: Key, old: Obj | None, new: Obj | None) -> None:
        if old is not None:
            node = old.get("spec", {}).get("nodeName") or ""
            self._pods_by_node.get(node, {}).pop(key, None)
        if new is not None:
            node = new.get("spec", {}).get("nodeName") or ""
            self._pods_by_node.setdefault(node, {})[key] = None

    def _delete(self, res: Resource, ns: str, name: str, policy: str) -> Obj:
        with self._lock:
            key = (ns if res.namespaced else "", name)
            stored = self._store[res.plural].pop(key, None)
            if stored is None:
                raise _not_found(res, name)
            self._bump()
            if res.plural == "pods":
                self._index_pod(key, stored.obj, None)
                self._pod_logs.pop(key, None)
            elif res.plural == "secrets":
                self._forget_token(key, stored.obj)
            elif res.plural == "serviceaccounts":
                # The token controller removes the ServiceAccount's token Secrets (and so
                # invalidates their tokens).
                for secret_key, secret in list(self._store["secrets"].items()):
                    if secret_key[0] == ns and _token_owner(secret.obj) == name:
                        self._delete(_resource("secrets"), ns, secret_key[1], "Background")
            uid = stored.obj["metadata"]["uid"]
            if policy in ("Background", "Foreground"):
                self._collect(uid)
            if res.plural == "namespaces":
                for plural, table in self._store.items():
                    for dep_key in [k for k in table if k[0] == name]:
                        self._delete(_resource(plural), dep_key[0], dep_key[1], "Background")
            return stored.obj

    def _collect(self, owner_uid: str) -> None:
        """The garbage collector, synchronously: deletes every dependent of `owner_uid`."""
        for plural, table in self._store.items():
            dependents = [
                key
                for key, s in table.items()
                if any(
                    ref.get("uid") == owner_uid
                    for ref in s.obj["metadata"].get("ownerReferences", ())
                )
            ]
            for ns, name in dependents:
                self._delete(_resource(plural), ns, name, "Background")

    # -- ServiceAccounts and RBAC (call with the lock)

    def _token_controller(self, key: Key, secret: Obj) -> Obj | None:
        """The token Secret as the token controller completes it, or None when its
        ServiceAccount does not exist (or is another one of the same name)."""
        meta = secret["metadata"]
        annotations = dict(meta.get("annotations") or {})
        sa_name = annotations.get(SA_NAME_ANNOTATION)
        if not sa_name:
            raise KubeError(
                422,
                "Invalid",
                f'Secret "{key[1]}" is invalid: metadata.annotations[{SA_NAME_ANNOTATION}]: '
                "Required value",
            )
        sa = self._store["serviceaccounts"].get((key[0], sa_name))
        if sa is None:
            return None
        sa_uid = sa.obj["metadata"]["uid"]
        if annotations.get(SA_UID_ANNOTATION) not in (None, "", sa_uid):
            return None
        annotations[SA_UID_ANNOTATION] = sa_uid
        data = dict(secret.get("data") or {})
        if not data.get("token"):
            token = secrets.token_urlsafe(32)
            data["token"] = _b64(token.encode())
            self._sa_tokens[token] = key
        if not data.get("ca.crt"):
            data["ca.crt"] = _b64(self.ca_pem)
        if not data.get("namespace"):
            data["namespace"] = _b64(key[0].encode())
        return {**secret, "metadata": {**meta, "annotations": annotations}, "data": data}

    def _forget_token(self, key: Key, secret: Obj) -> None:
        encoded = (secret.get("data") or {}).get("token")
        if encoded:
            token = base64.b64decode(encoded).decode(errors="replace")
            if self._sa_tokens.get(token) == key:
                del self._sa_tokens[token]

    def _sa_user(self, token: str) -> str | None:
        """`system:serviceaccount:<ns>:<sa>` for a live ServiceAccount token, else None."""
        key = self._sa_tokens.get(token)
        stored = self._store["secrets"].get(key) if key is not None else None
        if key is None or stored is None:
            return None
        secret = stored.obj
        if (secret.get("data") or {}).get("token") != _b64(token.encode()):
            return None
        sa_name = _token_owner(secret)
        sa = self._store["serviceaccounts"].get((key[0], sa_name or ""))
        annotations = secret["metadata"].get("annotations") or {}
        if sa is None or sa.obj["metadata"]["uid"] != annotations.get(SA_UID_ANNOTATION):
            return None
        return f"system:serviceaccount:{key[0]}:{sa_name}"

    def _rbac_allows(
        self, user: str, verb: str, group: str, resource: str, sub: str, ns: str, name: str
    ) -> str | None:
        """Why RBAC lets `user` do this (the binding and role that grant it), or None."""
        want = _Want(verb, group, f"{resource}/{sub}" if sub else resource, name)
        candidates = [("", s.obj) for s in self._store["clusterrolebindings"].values()]
        if ns:
            candidates += [
                (ns, s.obj) for (b_ns, _), s in self._store["rolebindings"].items() if b_ns == ns
            ]
        for b_ns, binding in candidates:
            ref = binding.get("roleRef") or {}
            if ref.get("kind") == "Role" and b_ns:
                role = self._store["roles"].get((b_ns, str(ref.get("name"))))
            elif ref.get("kind") == "ClusterRole":
                role = self._store["clusterroles"].get(("", str(ref.get("name"))))
            else:
                role = None
            if role is None or not _binds(binding, b_ns, user):
                continue
            if any(want.allowed_by(rule) for rule in role.obj.get("rules") or ()):
                kind = "RoleBinding" if b_ns else "ClusterRoleBinding"
                return (
                    f'RBAC: allowed by {kind} "{binding["metadata"]["name"]}" of '
                    f'{ref["kind"]} "{ref["name"]}" to {user}'
                )
        return None

    # -- the REST layer (called by the handler)

    def _authenticate(self, header: str | None) -> tuple[str, frozenset[str] | None]:
        """(user, denied verbs) for a bearer token; denied verbs is None for a ServiceAccount
        token, which RBAC decides for. Raises 401 for anything else."""
        token = header[7:] if header and header.startswith("Bearer ") else None
        with self._lock:
            denied = self._tokens.get(token) if token is not None else None
            if denied is not None:
                return (ADMIN_USER if token == self.token else LIMITED_USER), denied
            user = self._sa_user(token) if token is not None else None
        if user is None:
            raise KubeError(401, "Unauthorized", "Unauthorized")
        return user, None

    def _authorize(
        self,
        header: str | None,
        verb: str,
        res: Resource | None,
        ns: str,
        name: str = "",
        sub: str = "",
    ) -> tuple[str, frozenset[str] | None]:
        """Raises 401 or 403 as the apiserver would; returns what `_authenticate` does."""
        user, denied = self._authenticate(header)
        if denied is None:
            if res is None:
                # Discovery is open to every authenticated user.
                return user, None
            if res.plural == "namespaces" and name:
                ns = name  # a namespace is authorized within itself, as the apiserver does
            with self._lock:
                allowed = self._rbac_allows(user, verb, res.group, res.plural, sub, ns, name)
            if allowed is None:
                raise _forbidden(user, verb, res, ns, name, sub)
            return user, None
        if verb in denied:
            what = res.plural if res else "discovery"
            group = res.group if res else ""
            where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
            details = {"kind": what} | ({"group": group} if group else {})
            raise KubeError(
                403,
                "Forbidden",
                f'{res.qualified if res else what} is forbidden: User "{LIMITED_USER}" '
                f'cannot {verb} resource "{what}" in API group "{group}"{where}',
                details,
            )
        return user, denied

    def _pod_log(self, method: str, route: _Route) -> bytes:
        if method != "GET":
            raise KubeError(405, "MethodNotAllowed", f"{method} is not supported on pods/log")
        with self._lock:
            if (route.namespace, route.name) not in self._store["pods"]:
                raise _not_found(route.res, route.name)
            return self._pod_logs.get((route.namespace, route.name), "").encode()

    def _access_review(self, user: str, denied: frozenset[str] | None, body: bytes) -> Obj:
        """Answers a SelfSubjectAccessReview (what `kubectl auth can-i` sends); `denied` as
        `_authenticate` returns it."""
        review = _json_body(body)
        spec = review.get("spec") or {}
        attrs_ = spec.get("resourceAttributes")
        reason = ""
        if isinstance(attrs_, dict):
            verb = str(attrs_.get("verb") or "")
            if denied is not None:
                allowed = verb not in denied
            else:
                group = str(attrs_.get("group") or "")
                resource = str(attrs_.get("resource") or "")
                with self._lock:
                    why = self._rbac_allows(
                        user,
                        verb,
                        group,
                        resource,
                        str(attrs_.get("subresource") or ""),
                        str(attrs_.get("namespace") or ""),
                        str(attrs_.get("name") or ""),
                    )
                allowed, reason = why is not None, why or ""
        else:
            non_resource = spec.get("nonResourceAttributes") or {}
            allowed = denied is not None or (
                non_resource.get("verb") == "get"
                and str(non_resource.get("path") or "").startswith(_DISCOVERY_PATHS)
            )
        status: Obj = {"allowed": allowed}
        if reason:
            status["reason"] = reason
        return {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }

    def _take_fault(self, verb: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.remaining > 0 and fault.matches(verb, path):
                    fault.remaining -= 1
                    return fault
        return None

    def _list(
        self, res: Resource, ns: str, query: Mapping[str, str], as_table: bool = False
    ) -> bytes:
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""))
        limit = int(query.get("limit") or 0)
        after = _decode_continue(query["continue"]) if query.get("continue") else None
        items: list[_Stored] = []
        next_key: Key | None = None
        last: Key | None = None
        with self._lock:
            table = self._store[res.plural]
            rv = str(self._rv)
            node_terms = [f for f in fields if f.field == "spec.nodeName" and not f.negate]
            if res.plural == "pods" and node_terms:
                keys: list[Key] = sorted(self._pods_by_node.get(node_terms[0].value, {}))
            else:
                keys = self._sorted_keys(res.plural)
            # Pages resume by bisecting the sorted keys, as etcd's ranges do: a paged list
            # of N objects costs N, not N per page.
            start = bisect.bisect_right(keys, after) if after is not None else 0
            for key in itertools.islice(keys, start, None):
                if ns and key[0] != ns:
                    continue
                stored = table[key]
                obj = stored.obj
                meta = obj["metadata"]
                if labels:
                    obj_labels = meta.get("labels") or {}
                    if not all(r.matches(obj_labels) for r in labels):
                        continue
                if fields and not all(
                    (_field_value(obj, f.field) == f.value) != f.negate for f in fields
                ):
                    continue
                if limit and len(items) == limit:
                    next_key = last
                    break
                items.append(stored)
                last = key
        list_meta: Obj = {"resourceVersion": rv}
        if next_key is not None:
            list_meta["continue"] = _encode_continue(next_key)
        if as_table:
            return json.dumps(_table(res, [s.obj for s in items], list_meta)).encode()
        raw = [s.raw for s in items]
        head = json.dumps(
            {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": list_meta}
        )
        return b"".join((head[:-1].encode(), b',"items":[', b",".join(raw), b"]}"))

    def _create(self, res: Resource, ns: str, body: Obj) -> Obj:
        meta = body.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if res.namespaced:
            if meta.get("namespace") not in (None, "", ns):
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request"
                )
            meta["namespace"] = ns
        for field in ("uid", "resourceVersion", "creationTimestamp"):
            meta.pop(field, None)
        created = self._put(res.plural, body, create=True)
        if res.plural == "jobs":
            with self._lock:
                hooks = list(self._job_hooks)
            for hook in hooks:
                try:
                    hook(self, created)
                except Exception as exc:
                    log.exception("kube stand-in job hook failed")
                    self.hook_errors.append(exc)
        return created

    def _replace(self, res: Resource, ns: str, name: str, body: Obj, sub: str) -> Obj:
        with self._lock:
            current = self.get(res.plural, name, ns)
            if current is None:
                raise _not_found(res, name)
            meta = body.get("metadata") or {}
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise KubeError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    {"name": name, "kind": res.plural},
                )
            if sub == "status":
                new = {**current, "status": body.get("status", {})}
            else:
                new = {**body, "metadata": {**meta, "name": name, "namespace": ns}}
                if "status" in current:
                    new["status"] = current["status"]
            return self._put(res.plural, new, create=False)

    def _patch(self, res: Resource, ns: str, name: str, patch: Obj, sub: str) -> Obj:
        with self._lock:
            current = self.get(res.plural, name, ns)
            if current is None:
                raise _not_found(res, name)
            if sub == "status":
                patch = {"status": patch.get("status", {})}
            merged = _merge_patch(current, patch)
            merged["metadata"] = {
                **merged.get("metadata", {}),
                "resourceVersion": current["metadata"]["resourceVersion"],
            }
            return self._put(res.plural, merged, create=False)


def _resource(plural: str) -> Resource:
    for res in RESOURCES:
        if res.plural == plural:
            return res
    raise KeyError(plural)


def _uid() -> str:
    return str(uuid.uuid4())


def _encode_continue(key: Key) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


def _decode_continue(token: str) -> Key:
    try:
        ns, name = json.loads(base64.urlsafe_b64decode(token.encode()))
        return (str(ns), str(name))
    except (ValueError, TypeError) as exc:
        raise _bad_request(f"invalid continue token: {exc}") from None


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used for strategic-merge patches, which it approximates)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _default_secret(secret: Obj) -> Obj:
    data = dict(secret.get("data") or {})
    for key, value in (secret.get("stringData") or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    new = {k: v for k, v in secret.items() if k != "stringData"}
    new["data"] = data
    new.setdefault("type", "Opaque")
    return new


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _token_owner(secret: Obj) -> str | None:
    """The ServiceAccount a token Secret belongs to, or None for any other Secret."""
    if secret.get("type") != SA_TOKEN_TYPE:
        return None
    name = (secret["metadata"].get("annotations") or {}).get(SA_NAME_ANNOTATION)
    return str(name) if name else None


def _check_role_ref(res: Resource, binding: Obj, old: Obj | None) -> None:
    """The apiserver's validation of a binding's roleRef (required, and immutable)."""
    ref = binding.get("roleRef")
    kinds = ("ClusterRole",) if res.plural == "clusterrolebindings" else ("Role", "ClusterRole")
    prefix = f'{res.kind}.{res.group} "{binding["metadata"]["name"]}" is invalid: roleRef'
    problem = None
    if not isinstance(ref, dict) or not ref.get("name"):
        problem = ".name: Required value"
    elif ref.get("apiGroup") != RBAC:
        problem = (
            f'.apiGroup: Unsupported value: "{ref.get("apiGroup", "")}": supported values: "{RBAC}"'
        )
    elif ref.get("kind") not in kinds:
        supported = ", ".join(f'"{k}"' for k in kinds)
        problem = (
            f'.kind: Unsupported value: "{ref.get("kind", "")}": supported values: {supported}'
        )
    elif old is not None and old.get("roleRef") != ref:
        problem = ": Invalid value: cannot change roleRef; delete the binding and create it anew"
    if problem is not None:
        raise KubeError(422, "Invalid", prefix + problem, {"name": binding["metadata"]["name"]})


def _binds(binding: Obj, namespace: str, user: str) -> bool:
    """Whether a (Cluster)RoleBinding's subjects include ServiceAccount user `user`; a
    RoleBinding's ServiceAccount subjects default to the binding's `namespace`."""
    _, _, sa_ns, sa_name = user.split(":", 3)
    groups = {"system:authenticated", "system:serviceaccounts", f"system:serviceaccounts:{sa_ns}"}
    for subject in binding.get("subjects") or ():
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "ServiceAccount":
            if name == sa_name and (subject.get("namespace") or namespace) == sa_ns:
                return True
        elif (kind == "User" and name == user) or (kind == "Group" and name in groups):
            return True
    return False


@attrs.frozen
class _Want:
    """One request as RBAC rules see it; `resource` carries the subresource (`pods/log`)."""

    verb: str
    group: str
    resource: str
    name: str

    def allowed_by(self, rule: Mapping[str, Any]) -> bool:
        verbs = rule.get("verbs") or ()
        groups = rule.get("apiGroups") or ()
        names = rule.get("resourceNames") or ()
        if not ("*" in verbs or self.verb in verbs) or not ("*" in groups or self.group in groups):
            return False
        if names and self.name not in names:
            return False
        sub = self.resource.partition("/")[2]
        # As the real authorizer: "*" is every resource and subresource, "*/log" one
        # subresource of every resource; "pods/*" is no wildcard.
        return any(
            r in ("*", self.resource) or (bool(sub) and r == f"*/{sub}")
            for r in rule.get("resources") or ()
        )


def _forbidden(user: str, verb: str, res: Resource, ns: str, name: str, sub: str) -> KubeError:
    resource = f"{res.plural}/{sub}" if sub else res.plural
    what = f'{res.qualified} "{name}"' if name else res.qualified
    where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
    details = {"name": name, "group": res.group, "kind": res.plural}
    return KubeError(
        403,
        "Forbidden",
        f'{what} is forbidden: User "{user}" cannot {verb} resource "{resource}" in API group '
        f'"{res.group}"{where}',
        {k: v for k, v in details.items() if v},
    )


def _default_job(job: Obj) -> Obj:
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


# ---------------------------------------------------------------- server-side printing


def _age(obj: Obj) -> str:
    created = obj["metadata"].get("creationTimestamp")
    if not created:
        return "<unknown>"
    then = datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    seconds = int((datetime.now(UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _row(res: Resource, obj: Obj) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    name = obj["metadata"]["name"]
    if res.plural == "nodes":
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions", ())
        )
        state = "Ready" if ready else "NotReady"
        if spec.get("unschedulable"):
            state += ",SchedulingDisabled"
        version = status.get("nodeInfo", {}).get("kubeletVersion", "")
        return [name, state, "<none>", _age(obj), version]
    if res.plural == "pods":
        containers = status.get("containerStatuses") or []
        ready_count = sum(1 for c in containers if c.get("ready"))
        restarts = sum(int(c.get("restartCount", 0)) for c in containers)
        total = len(spec.get("containers", ()))
        return [name, f"{ready_count}/{total}", status.get("phase", ""), restarts, _age(obj)]
    if res.plural == "jobs":
        done = f"{status.get('succeeded', 0)}/{spec.get('completions', 1)}"
        state = "Running" if status.get("active") else "Complete" if status.get("succeeded") else ""
        return [name, state, done, "", _age(obj)]
    if res.plural == "secrets":
        return [name, obj.get("type", ""), len(obj.get("data") or {}), _age(obj)]
    if res.plural == "serviceaccounts":
        return [name, len(obj.get("secrets") or ()), _age(obj)]
    if res.plural in ("roles", "clusterroles"):
        return [name, obj["metadata"].get("creationTimestamp", "")]
    if res.plural in ("rolebindings", "clusterrolebindings"):
        ref = obj.get("roleRef") or {}
        return [name, f"{ref.get('kind', '')}/{ref.get('name', '')}", _age(obj)]
    return [name, status.get("phase", ""), _age(obj)]


_COLUMNS = {
    "nodes": ["Name", "Status", "Roles", "Age", "Version"],
    "pods": ["Name", "Ready", "Status", "Restarts", "Age"],
    "jobs": ["Name", "Status", "Completions", "Duration", "Age"],
    "secrets": ["Name", "Type", "Data", "Age"],
    "namespaces": ["Name", "Status", "Age"],
    "serviceaccounts": ["Name", "Secrets", "Age"],
    "roles": ["Name", "Created At"],
    "clusterroles": ["Name", "Created At"],
    "rolebindings": ["Name", "Role", "Age"],
    "clusterrolebindings": ["Name", "Role", "Age"],
}


def _table(res: Resource, objs: Sequence[Obj], list_meta: Obj) -> Obj:
    """A meta.k8s.io/v1 Table, the shape kubectl prints from."""
    columns = [
        {
            "name": col,
            "type": "integer" if col in ("Restarts", "Data", "Secrets") else "string",
            "format": "name" if col == "Name" else "",
            "description": col,
            "priority": 0,
        }
        for col in _COLUMNS[res.plural]
    ]
    rows = [
        {
            "cells": _row(res, obj),
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            },
        }
        for obj in objs
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": columns,
        "rows": rows,
    }


# ---------------------------------------------------------------- discovery


def _subject_review(user: str) -> Obj:
    """Answers a SelfSubjectReview (what `kubectl auth whoami` sends)."""
    groups = ["system:authenticated"]
    if user.startswith("system:serviceaccount:"):
        namespace = user.split(":")[2]
        groups[:0] = ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]
    return {
        "kind": "SelfSubjectReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "status": {"userInfo": {"username": user, "groups": groups}},
    }


_GROUPS = ("batch", RBAC, "authorization.k8s.io", "authentication.k8s.io")
"""The API groups served besides core, all at version v1, in discovery's order."""

_REVIEWS = {
    "authorization.k8s.io": ("selfsubjectaccessreviews", "SelfSubjectAccessReview"),
    "authentication.k8s.io": ("selfsubjectreviews", "SelfSubjectReview"),
}
"""Create-only kinds that are answered, never stored."""

_SUBRESOURCES = {
    "pods": (("status", ["get", "patch", "update"]), ("log", ["get"])),
    "jobs": (("status", ["get", "patch", "update"]),),
    "nodes": (("status", ["get", "patch", "update"]),),
    "namespaces": (("status", ["get", "patch", "update"]),),
}


def _group_doc(group: str) -> Obj:
    version = {"groupVersion": f"{group}/v1", "version": "v1"}
    return {"name": group, "versions": [version], "preferredVersion": version}


def _resource_list(group: str) -> Obj:
    resources: list[Obj] = []
    for res in RESOURCES:
        if res.group != group:
            continue
        resources.append(
            {
                "name": res.plural,
                "singularName": res.singular,
                "namespaced": res.namespaced,
                "kind": res.kind,
                "verbs": _VERBS,
                "shortNames": list(res.short_names),
            }
        )
        for sub, verbs in _SUBRESOURCES.get(res.plural, ()):
            resources.append(
                {
                    "name": f"{res.plural}/{sub}",
                    "singularName": "",
                    "namespaced": res.namespaced,
                    "kind": res.kind,
                    "verbs": verbs,
                }
            )
    if group in _REVIEWS:
        plural, kind = _REVIEWS[group]
        resources.append(
            {
                "name": plural,
                "singularName": plural.removesuffix("s"),
                "namespaced": False,
                "kind": kind,
                "verbs": ["create"],
            }
        )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/v1" if group else "v1",
        "resources": resources,
    }


def _discovery(path: str) -> Obj | None:
    if path == "/version":
        return KUBE_VERSION
    if path == "/api":
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
        }
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group_doc(group) for group in _GROUPS],
        }
    if path == "/api/v1":
        return _resource_list("")
    for group in _GROUPS:
        if path == f"/apis/{group}":
            return {"kind": "APIGroup", "apiVersion": "v1", **_group_doc(group)}
        if path == f"/apis/{group}/v1":
            return _resource_list(group)
    return None


@attrs.frozen
class _Route:
    res: Resource
    namespace: str
    name: str
    sub: str


def _route(path: str) -> _Route | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis" and parts[1] in _GROUPS and parts[2] == "v1":
        group, rest = parts[1], parts[3:]
    else:
        return None
    ns = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    res = _BY_PATH.get((group, "v1", rest[0]))
    if res is None or (ns and not res.namespaced):
        return None
    name = rest[1] if len(rest) > 1 else ""
    sub = rest[2] if len(rest) > 2 else ""
    if sub not in ("", "status") and (res.plural, sub) != ("pods", "log"):
        return None
    return _Route(res, ns, name, sub)


# ---------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    timeout = 60

    def setup(self) -> None:
        super().setup()
        # The handshake runs here, on the connection's thread, so a slow client cannot stall
        # the accept loop.
        conn = self.connection
        if isinstance(conn, ssl.SSLSocket):
            conn.do_handshake()
        with self.server.conn_lock:
            self.server.conns.add(conn)

    def finish(self) -> None:
        with self.server.conn_lock:
            self.server.conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("kube stand-in: " + format, *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        kube = self.server.kube
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        route = _route(path)
        verb = _verb(method, route, query)
        status = 500
        content_type = "application/json"
        try:
            if path in (_ACCESS_REVIEW, _SUBJECT_REVIEW) and method == "POST":
                # Every authenticated user may ask what it may do and who it is.
                user, denied = kube._authenticate(self.headers.get("Authorization"))
            else:
                user, denied = kube._authorize(
                    self.headers.get("Authorization"),
                    verb,
                    route.res if route else None,
                    route.namespace if route else "",
                    route.name if route else "",
                    route.sub if route else "",
                )
            fault = kube._take_fault(verb, path)
            if fault is not None and fault.kind == "429":
                raise KubeError(
                    429,
                    "TooManyRequests",
                    "Too many requests, please try again later.",
                    {"retryAfterSeconds": fault.retry_after_s},
                    {"Retry-After": str(fault.retry_after_s)},
                )
            if fault is not None and fault.kind == "500":
                raise KubeError(
                    500,
                    "InternalError",
                    "Internal error occurred: injected fault",
                    {"causes": [{"message": "injected fault"}]},
                )
            if fault is not None:
                time.sleep(fault.delay_s)
            if route is None and method == "POST" and path == _ACCESS_REVIEW:
                review = kube._access_review(user, denied, body)
                status, payload = 201, json.dumps(review).encode()
            elif route is None and method == "POST" and path == _SUBJECT_REVIEW:
                status, payload = 201, json.dumps(_subject_review(user)).encode()
            elif route is not None and route.sub == "log":
                status, payload = 200, kube._pod_log(method, route)
                content_type = "text/plain"
            else:
                status, payload = self._answer(kube, method, path, route, query, body)
        except KubeError as err:
            status = err.code
            self._send(status, json.dumps(err.status()).encode(), err.headers)
        except Exception:
            log.exception("kube stand-in failed on %s %s", method, path)
            status = 500
            bug = KubeError(500, "InternalError", "Internal error occurred: stand-in bug")
            self._send(status, json.dumps(bug.status()).encode())
        else:
            self._send(status, payload, content_type=content_type)
        with kube._lock:
            kube.requests.append(RequestRecord(method, verb, path, url.query, status))

    def _answer(
        self,
        kube: KubeStandin,
        method: str,
        path: str,
        route: _Route | None,
        query: Mapping[str, str],
        body: bytes,
    ) -> tuple[int, bytes]:
        if route is None:
            doc = _discovery(path) if method == "GET" else None
            if doc is None:
                raise KubeError(404, "NotFound", "the server could not find the requested resource")
            return 200, json.dumps(doc).encode()
        res, ns, name, sub = route.res, route.namespace, route.name, route.sub
        # kubectl asks for server-side printing; without it, it would show NAME and AGE only.
        as_table = "as=Table" in (self.headers.get("Accept") or "") and not sub
        if method == "GET" and not name:
            if query.get("watch") in ("true", "1"):
                raise KubeError(405, "MethodNotAllowed", "the stand-in does not serve watch")
            return 200, kube._list(res, ns, query, as_table)
        if method == "GET":
            stored = kube._store[res.plural].get((ns, name))
            if stored is None:
                raise _not_found(res, name)
            if as_table:
                meta = {"resourceVersion": stored.obj["metadata"]["resourceVersion"]}
                return 200, json.dumps(_table(res, [stored.obj], meta)).encode()
            return 200, stored.raw
        if method == "DELETE" and name:
            policy = _delete_policy(res, query, body)
            deleted = kube._delete(res, ns, name, policy)
            done = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {
                    "name": name,
                    "kind": res.plural,
                    "uid": deleted["metadata"]["uid"],
                }
                | ({"group": res.group} if res.group else {}),
            }
            return 200, json.dumps(done).encode()
        obj = _json_body(body)
        if method == "POST" and not name:
            if res.namespaced and not ns:
                raise KubeError(405, "MethodNotAllowed", "create needs a namespace in the path")
            return 201, json.dumps(kube._create(res, ns, obj)).encode()
        if method == "PUT" and name:
            return 200, json.dumps(kube._replace(res, ns, name, obj, sub)).encode()
        if method == "PATCH" and name:
            return 200, json.dumps(kube._patch(res, ns, name, obj, sub)).encode()
        raise KubeError(405, "MethodNotAllowed", f"{method} is not supported on {path}")

    def _send(
        self,
        status: int,
        payload: bytes,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-cache, private")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)


def _verb(method: str, route: _Route | None, query: Mapping[str, str]) -> str:
    if method == "GET":
        if route is not None and not route.name:
            return "watch" if query.get("watch") in ("true", "1") else "list"
        return "get"
    if method == "DELETE" and route is not None and not route.name:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _json_body(body: bytes) -> Obj:
    try:
        obj = json.loads(body or b"{}")
    except ValueError as exc:
        raise _bad_request(f"the request body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _bad_request("the request body must be a JSON object")
    return obj


def _delete_policy(res: Resource, query: Mapping[str, str], body: bytes) -> str:
    options = _json_body(body) if body else {}
    policy = query.get("propagationPolicy") or options.get("propagationPolicy")
    if policy is None and (query.get("orphanDependents") or options.get("orphanDependents")):
        policy = "Orphan"
    if policy is None:
        # batch/v1 Jobs still default to orphaning their pods when deleted through the API.
        policy = "Orphan" if res.plural == "jobs" else "Background"
    if policy not in ("Orphan", "Background", "Foreground"):
        raise _bad_request(f"propagationPolicy {policy!r} is not Orphan, Background or Foreground")
    return str(policy)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    kube: KubeStandin
    conns: set[socket.socket]
    conn_lock: threading.Lock


@attrs.define
class RunningKubeStandin:
    """A started server; `stop()` closes the listener and every open connection."""

    kube: KubeStandin
    _httpd: _HTTPServer
    _thread: threading.Thread

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._httpd.conn_lock:
            conns = list(self._httpd.conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join()


def start_kube_standin(directory: Path, token: str | None = None) -> RunningKubeStandin:
    """Serves a fresh stand-in over TLS on 127.0.0.1, port chosen by the kernel; writes the CA
    to `directory/ca.pem`. Call `stop()` on the result."""
    directory.mkdir(parents=True, exist_ok=True)
    kube = KubeStandin(directory, token)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost", "kubernetes.default.svc")
    kube.ca_pem = ca.cert_pem.bytes()
    kube.ca_path.write_bytes(kube.ca_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
    httpd.socket = context.wrap_socket(
        httpd.socket, server_side=True, do_handshake_on_connect=False
    )
    httpd.kube = kube
    httpd.conns = set()
    httpd.conn_lock = threading.Lock()
    kube.url = f"https://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="kube-standin", daemon=True
    )
    thread.start()
    return RunningKubeStandin(kube, httpd, thread)


def synthetic_cluster(kube: KubeStandin, nodes: int, pods_per_node: int) -> None:
    """Fills `kube` with `nodes` 8-card nodes, each running `pods_per_node` one-card-or-less
    pods in namespace `work` (for benchmarks)."""
    kube.add_namespace("work")
    kube.add_nodes(
        make_node(f"node-{i:05d}", gpus=8, cpu="96", memory="1024Gi", labels={"pool": "bench"})
        for i in range(nodes)
    )
    kube.add_pods(
        make_pod(
            f"p-{i:05d}-{j:03d}",
            f"node-{i:05d}",
            gpu_limit=1 if j % 4 == 0 else 0,
            namespace="work",
        )
        for i in range(nodes)
        for j in range(pods_per_node)
    )


def synthetic_workers(kube: KubeStandin, pool: str, namespace: str = "levers9") -> None:
    """A running worker of `pool` on every node, as a reconcile pass would have left them:
    the Job (from the real manifest) and its pod holding 3 cards."""
    from control.kube.planner import PoolSettings, job_manifest, job_name, token_secret_name

    kube.add_namespace(namespace)
    settings = PoolSettings(name=pool, namespace=namespace, image="worker:bench")
    for node in kube.objects("nodes"):
        node_name = node["metadata"]["name"]
        name = job_name(pool, node_name, 0)
        manifests = job_manifest(
            settings,
            node_name,
            3,
            name,
            token_secret_name(name),
            "https://levers9.bench.test",
            token="bench",
            hostname=node_name,
        )
        job = kube._put("jobs", manifests.job, create=True)
        kube.run_job_pod(job, node_name)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m sim.kubeapi DIR [--nodes N --pods-per-node M]`: serves a synthetic
    cluster, writes DIR/kubeconfig, prints {"url", "kubeconfig"} as one JSON line and serves
    until stdin closes."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m sim.kubeapi")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--pods-per-node", type=int, default=0)
    parser.add_argument(
        "--workers-of-pool",
        metavar="POOL",
        help="also give every node a running levers9 worker of POOL (a pass's steady state)",
    )
    args = parser.parse_args(argv)
    running = start_kube_standin(args.directory)
    try:
        synthetic_cluster(running.kube, args.nodes, args.pods_per_node)
        if args.workers_of_pool:
            synthetic_workers(running.kube, args.workers_of_pool)
        kubeconfig = running.kube.write_kubeconfig(args.directory / "kubeconfig")
        print(json.dumps({"url": running.kube.url, "kubeconfig": str(kubeconfig)}), flush=True)
        sys.stdin.read()
    finally:
        running.stop()


if __name__ == "__main__":
    main()
