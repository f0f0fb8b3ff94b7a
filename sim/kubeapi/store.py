"""`KubeStandin`: the stand-in's objects (plain dicts, never mutated: each change stores a new
dict with its JSON bytes), resourceVersions and the history of changes watches are served from,
paging, owner-reference cascading, the token controller, and the faults and hooks tests arm.

Faults come in two kinds, as they do in front of a real apiserver. Request faults (`Fault`,
armed with `inject_fault`) answer matching requests instead of the server: 429, 500, a delay,
or any Status a test names (a 422 Invalid, a 403 exceeded quota) for objects whose name starts
with a prefix. Watch faults (`WatchFaults`, set with `set_watch_faults`) change what open
streams are sent: a lag behind the store, streams ended at once, streams that stall. Both are
state under the store's lock, read by each request's own thread; nothing runs on a timer.
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
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any

import attrs
import yaml

from sim.kubeapi.deployments import (
    DeploymentController,
    prepare_deployment,
    scale_of,
    scale_replicas,
)
from sim.kubeapi.model import (
    ADMIN_USER,
    BY_PATH,
    DISCOVERY_PATHS,
    LIMITED_USER,
    RESOURCES,
    SA_NAME_ANNOTATION,
    SA_TOKEN_TYPE,
    SA_UID_ANNOTATION,
    Key,
    KubeError,
    Obj,
    Resource,
    Route,
    b64,
    bad_request,
    json_body,
    new_uid,
    not_found,
    resource_of,
)
from sim.kubeapi.objects import (
    check_event,
    check_lease,
    default_claim,
    default_job,
    default_secret,
    default_service,
    job_node,
    make_node,
    make_pod,
    owner_reference,
    timestamp_now,
)
from sim.kubeapi.patches import strategic_merge_patch
from sim.kubeapi.podsecurity import Policy, autopilot_refusal, namespace_policy, refusal
from sim.kubeapi.rbac import Want, binds, check_role_ref, forbidden, token_owner
from sim.kubeapi.selectors import parse_field_selector, parse_label_selector, selected
from sim.kubeapi.tables import table_of
from sim.kubeapi.watch import (
    ADDED,
    Event,
    History,
    Selection,
    Watcher,
    WatchFaults,
    delete_change,
    put_change,
)

__all__ = [
    "Fault",
    "JobHook",
    "KubeStandin",
    "RequestRecord",
    "WatchFaults",
    "seed_jobs",
    "synthetic_cluster",
]

log = logging.getLogger(__name__)


@attrs.frozen
class RequestRecord:
    """One request as the server saw it (no headers: they carry the token); `resource` is the
    plural it addressed ("" for discovery and reviews). A watch is recorded when it ends."""

    method: str
    verb: str
    path: str
    query: str
    status: int
    resource: str = ""
    at: float = attrs.field(factory=time.monotonic)
    """When the server recorded it (`time.monotonic`)."""


@attrs.define
class Fault:
    """Answers the next `remaining` matching requests (every one while `remaining` is None)
    with `kind`: 429, 500, delay, or status (the Status `status`, `reason`, `message`)."""

    kind: str
    remaining: int | None
    path_prefix: str | None = None
    verb: str | None = None
    name_prefix: str | None = None
    retry_after_s: int = 1
    delay_s: float = 0.0
    status: int = 0
    reason: str = ""
    message: str = ""

    def matches(self, verb: str, path: str, name: str) -> bool:
        """Whether it answers a request of `verb` on `path` (no query) addressing the object
        `name` ("" when the request names none)."""
        if self.verb is not None and self.verb != verb:
            return False
        if self.name_prefix is not None and not (name and name.startswith(self.name_prefix)):
            return False
        return self.path_prefix is None or path.startswith(self.path_prefix)

    def error(self, res: Resource | None, name: str) -> KubeError | None:
        """What the server answers instead, for a request addressing `name` of `res`; None for
        a delay, after which it answers normally."""
        if self.kind == "429":
            return KubeError(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.",
                {"retryAfterSeconds": self.retry_after_s},
                {"Retry-After": str(self.retry_after_s)},
            )
        if self.kind == "500":
            return KubeError(
                500,
                "InternalError",
                "Internal error occurred: injected fault",
                {"causes": [{"message": "injected fault"}]},
            )
        if self.kind != "status":
            return None
        details: dict[str, str] = {}
        if res is not None and name:
            # The apiserver's validation names the kind ("Job"); its other answers (quota,
            # conflicts, not found) name the resource ("jobs").
            kind = res.kind if self.reason == "Invalid" else res.plural
            details = {"name": name, "group": res.group, "kind": kind}
            if not res.group:
                del details["group"]
        return KubeError(self.status, self.reason, self.message, details)


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

    Watches are served from the last `history_limit` changes (of all resources together); a
    watch with `allowWatchBookmarks` gets a BOOKMARK every `bookmark_interval_s` (a real
    apiserver: about a minute; tests set it small).

    Tests make it misbehave as a loaded apiserver does: `inject_fault` arms request faults
    (429 with Retry-After, 500, a delay, or a chosen Status such as 422 Invalid or a 403
    exceeded quota, per path, verb and object name; `clear_faults` removes them),
    `set_watch_faults` makes watches lag, end at once or stall, `drop_watches` cuts every
    stream and `expire_history` compacts the history (410 Expired).
    """

    def __init__(
        self,
        directory: Path,
        token: str | None = None,
        *,
        history_limit: int = 10_000,
        bookmark_interval_s: float = 60.0,
    ) -> None:
        if history_limit < 1:
            raise ValueError(f"history_limit must be at least 1 change, not {history_limit!r}")
        self.directory = directory
        self.token = token or secrets.token_urlsafe(24)
        self._tokens: dict[str, frozenset[str]] = {self.token: frozenset()}
        # Tokens the token controller issued -> the Secret holding each; a token is valid only
        # while that Secret still holds it and its ServiceAccount (same uid) still exists.
        self._sa_tokens: dict[str, Key] = {}
        self._pod_logs: dict[Key, str] = {}
        self._lock = threading.RLock()
        # Notified, with the lock held, on every change and whenever a watch opens or closes.
        self._changed = threading.Condition(self._lock)
        self._rv = 0
        self._history = History(history_limit)
        self._watchers: set[Watcher] = set()
        self.bookmark_interval_s = bookmark_interval_s
        self._store: dict[str, dict[Key, _Stored]] = {r.plural: {} for r in RESOURCES}
        self._pods_by_node: dict[str, dict[Key, None]] = {}
        self._key_cache: dict[str, tuple[int, list[Key]]] = {}
        self._faults: list[Fault] = []
        self._watch_faults = WatchFaults()
        self._job_hooks: list[JobHook] = []
        self._deployments = DeploymentController()
        self._pod_security = Policy()
        self._autopilot = False
        # (Job uid, reason) -> the Event the Job controller recorded, bumped on a repeat.
        self._job_events: dict[tuple[str, str], Key] = {}
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
        count: int | None = 1,
        *,
        path_prefix: str | None = None,
        verb: str | None = None,
        name_prefix: str | None = None,
        retry_after_s: int = 1,
        delay_s: float = 0.0,
        status: int | None = None,
        reason: str = "",
        message: str = "",
    ) -> Fault:
        """Arms a fault for the next `count` matching requests (every one until `clear_faults`
        when None): `kind` is "429" (TooManyRequests with Retry-After), "500", "delay" (then
        answers normally after `delay_s`) or "status" (a Status with code `status`, `reason`
        and `message`, e.g. 422 "Invalid" or 403 "Forbidden", its details naming the object).
        A request matches when it starts with `path_prefix`, has `verb` (a Kubernetes verb:
        list, watch, get, create, update, patch, delete) and addresses an object whose name
        starts with `name_prefix` (the name in its path, or a create's `metadata.name`). The
        first armed fault that matches answers. Faults are checked after authentication."""
        if kind not in ("429", "500", "delay", "status"):
            raise ValueError(f"fault kind must be 429, 500, delay or status, not {kind!r}")
        if kind == "status":
            if status not in {s.value for s in HTTPStatus if s >= 400}:
                raise ValueError(
                    f"a status fault needs status=, an HTTP error code (400-599), not {status!r}"
                )
            if not reason:
                raise ValueError('a status fault needs reason=, e.g. "Invalid" or "Forbidden"')
        elif status is not None or reason or message:
            raise ValueError(f'status=, reason= and message= are for kind="status", not {kind!r}')
        fault = Fault(
            kind,
            count,
            path_prefix=path_prefix,
            verb=verb,
            name_prefix=name_prefix,
            retry_after_s=retry_after_s,
            delay_s=delay_s,
            status=status or 0,
            reason=reason,
            message=message,
        )
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        """Removes every armed request fault, spent or not (watch faults are set apart:
        `set_watch_faults(WatchFaults())` clears those)."""
        with self._lock:
            self._faults.clear()

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

    def list_count(self, plural: str) -> int:
        """How many LIST requests (whatever their answer) addressed `plural`, in any namespace;
        every page of a paged list counts."""
        with self._lock:
            return sum(1 for r in self.requests if r.verb == "list" and r.resource == plural)

    # -- watches, for tests

    def watch_count(self) -> int:
        """How many watch streams are open now."""
        with self._lock:
            return len(self._watchers)

    def wait_watches(self, count: int, timeout_s: float = 10.0) -> bool:
        """Blocks until exactly `count` watch streams are open; False when `timeout_s` passed
        first. A test calls it before changing what a client that lists then watches must see
        as an event rather than in its list."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._watchers) == count, timeout_s)

    @property
    def watch_faults(self) -> WatchFaults:
        """The watch faults in force (`WatchFaults()` when none)."""
        with self._lock:
            return self._watch_faults

    def set_watch_faults(self, faults: WatchFaults) -> None:
        """Makes every watch, open or new, misbehave as `faults` says from now on; pass
        `WatchFaults()` to stop. Open watches wake up to apply them at once."""
        with self._changed:
            self._watch_faults = faults
            self._changed.notify_all()

    def drop_watches(self) -> int:
        """Ends every open watch stream abruptly, as a load balancer or a restarting apiserver
        does: the connection is closed without the stream's final chunk. Returns how many."""
        with self._changed:
            dropped = list(self._watchers)
            self._watchers.clear()
            for watcher in dropped:
                watcher.dropped = True
                if watcher.sock is not None:
                    try:
                        # The plain socket's shutdown: the handler's thread may be writing
                        # through the TLS layer, which SSLSocket.shutdown would tear down.
                        socket.socket.shutdown(watcher.sock, socket.SHUT_RDWR)
                    except OSError:
                        pass
            self._changed.notify_all()
        return len(dropped)

    def expire_history(self) -> None:
        """Compacts the history: a watch from any resourceVersion older than the current one
        (and a paged list continued from before now) gets 410 Expired."""
        with self._changed:
            self._history.expire(self._rv)
            self._changed.notify_all()

    # -- state for tests

    @property
    def resource_version(self) -> int:
        return self._rv

    def add_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> Obj:
        """Adds or replaces a namespace (with `labels`, such as Pod Security's)."""
        meta: Obj = {"name": name}
        if labels:
            meta["labels"] = dict(labels)
        return self._put(
            "namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}, create=False
        )

    def set_pod_security_default(self, level: str, version: str = "latest") -> None:
        """The enforce level for namespaces without a `pod-security.kubernetes.io/enforce`
        label, as an AdmissionConfiguration's `defaults.enforce` sets it (privileged until
        set); ValueError for a level other than privileged, baseline or restricted."""
        policy = Policy(level, version)
        with self._lock:
            self._pod_security = policy

    def set_autopilot(self, enabled: bool = True) -> None:
        """Makes the cluster a GKE Autopilot one: its admission (GKE Warden) refuses a pod, or
        a Job whose pod template, that is privileged, uses a host namespace or writes to a
        hostPath volume, in any namespace, with Warden's 403 (`sim.kubeapi.podsecurity`)."""
        with self._lock:
            self._autopilot = enabled

    def add_node(self, node: Obj) -> Obj:
        """Adds or replaces a node (see `make_node`)."""
        return self._put("nodes", node, create=False)

    def add_nodes(self, nodes: Iterable[Obj]) -> None:
        with self._lock:
            for node in nodes:
                self._put("nodes", node, create=False)

    def remove_node(self, name: str) -> None:
        self._delete(BY_PATH["", "v1", "nodes"], "", name, "Orphan")

    def set_node_ready(self, name: str, ready: bool) -> Obj:
        """Writes the node's Ready condition as its kubelet does (heartbeat now; transition
        time now only when the status changes), as a status update watches see as MODIFIED;
        returns the stored node. `KubeError` 404 for an unknown node."""
        res = BY_PATH["", "v1", "nodes"]
        with self._lock:
            node = self.get("nodes", name)
            if node is None:
                raise not_found(res, name)
            status = node.get("status") or {}
            conditions = list(status.get("conditions") or [])
            found = [i for i, c in enumerate(conditions) if c.get("type") == "Ready"]
            old = conditions[found[0]] if found else {}
            wanted = "True" if ready else "False"
            now = timestamp_now()
            condition = {
                "type": "Ready",
                "status": wanted,
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": "kubelet is posting ready status"
                if ready
                else "PLEG is not healthy: pleg was last seen active 3m0s ago; threshold is 3m0s",
                "lastHeartbeatTime": now,
                "lastTransitionTime": old.get("lastTransitionTime", now)
                if old.get("status") == wanted
                else now,
            }
            if found:
                conditions[found[0]] = condition
            else:
                conditions.append(condition)
            return self._replace(
                res, "", name, {"status": {**status, "conditions": conditions}}, "status"
            )

    def add_pod(self, pod: Obj) -> Obj:
        """Adds or replaces a pod (see `make_pod`); its namespace must exist."""
        return self._put("pods", pod, create=False)

    def add_pods(self, pods: Iterable[Obj]) -> None:
        with self._lock:
            for pod in pods:
                self._put("pods", pod, create=False)

    def remove_pod(self, name: str, namespace: str = "default") -> None:
        self._delete(BY_PATH["", "v1", "pods"], namespace, name, "Background")

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
        res = resource_of(plural)
        body = {**obj, "metadata": dict(obj.get("metadata") or {})}
        namespace = (body["metadata"].get("namespace") or "default") if res.namespaced else ""
        return self._create(res, namespace, body)

    def patch(self, plural: str, name: str, patch: Obj, namespace: str = "default") -> Obj | None:
        """Applies a JSON merge patch (RFC 7386) to the stored object in one step, as a
        controller's status or binding write does; None when the object is gone (it is never
        re-created, unlike `update`). `namespace` is ignored for cluster-scoped resources."""
        res = resource_of(plural)
        with self._lock:
            try:
                return self._patch(res, namespace if res.namespaced else "", name, patch, "")
            except KubeError as err:
                if err.code == 404:
                    return None
                raise

    def get(self, plural: str, name: str, namespace: str = "") -> Obj | None:
        res = resource_of(plural)
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
        active. Meant to be called from an `on_job_created` hook. A pod Pod Security refuses
        is not made: the Job gets its `FailedCreate` Event (`create_job_pod`) and the 403
        `KubeError` is raised."""
        meta = job["metadata"]
        template = job["spec"]["template"]
        spec = {**template.get("spec", {}), "nodeName": node or job_node(job) or ""}
        pod = make_pod(f"{meta['name']}-{secrets.token_hex(3)[:5]}", None, phase=phase)
        pod["metadata"] = {
            "name": pod["metadata"]["name"],
            "namespace": meta["namespace"],
            "labels": dict(template.get("metadata", {}).get("labels", {})),
            "ownerReferences": [owner_reference(job)],
        }
        pod["spec"] = spec
        with self._lock:
            self._admit_job_pod(job, pod)
            stored = self._put("pods", pod, create=False)
            current = self.get("jobs", meta["name"], meta["namespace"])
            # The Job controller counts a pod active until it ends, pending or running.
            if current is not None and phase not in ("Succeeded", "Failed"):
                status = {**current.get("status", {}), "active": 1, "startTime": timestamp_now()}
                self._put("jobs", {**current, "status": status}, create=False)
        return stored

    def create_job_pod(self, job: Obj, pod: Obj) -> Obj:
        """Creates `pod` for `job` as the Job controller does: through admission, as `create`
        does; a pod refused (403: Pod Security) gets the Job the Warning Event `FailedCreate`
        with `Error creating: <the apiserver's message>` (a repeat counts one more on that
        Event, as client-go's correlator does, rather than adding Events), then the
        `KubeError` is raised."""
        with self._lock:
            self._admit_job_pod(job, pod)
        return self.create("pods", pod)

    def _admit_job_pod(self, job: Obj, pod: Obj) -> None:
        meta = pod.setdefault("metadata", {})
        namespace = meta.get("namespace") or job["metadata"]["namespace"]
        try:
            self._admit_pod(namespace, pod)
        except KubeError as err:
            self._job_controller_event(job, "FailedCreate", f"Error creating: {err.message}")
            raise

    def _admit_pod(self, namespace: str, pod: Obj) -> None:
        """Pod Security admission of a pod created in `namespace` (named here when it has only
        a `generateName`): `KubeError` 403 with the plugin's message when its level refuses it."""
        meta = pod.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
        with self._lock:
            found = self.get("namespaces", namespace)
            if found is None:
                return  # the write itself answers 404, as the apiserver's NamespaceLifecycle
            policy = namespace_policy(found, self._pod_security)
            autopilot = self._autopilot
        refused = autopilot_refusal("pods", pod) if autopilot else None
        refused = refused or refusal(policy, pod)
        if refused is not None:
            raise refused

    def _job_controller_event(self, job: Obj, reason: str, message: str) -> None:
        """A Warning Event on `job` from the Job controller, or one more on its last one of
        the same reason (count, lastTimestamp and the newest message)."""
        meta = job["metadata"]
        namespace, uid = meta["namespace"], str(meta.get("uid") or "")
        now = timestamp_now()
        with self._lock:
            key = self._job_events.get((uid, reason))
            current = self.get("events", key[1], key[0]) if key is not None else None
            if current is not None:
                count = int(current.get("count") or 1) + 1
                repeat = {**current, "message": message, "count": count, "lastTimestamp": now}
                self._put("events", repeat, create=False)
                return
            name = f"{meta['name']}.{time.time_ns():016x}"
            event: Obj = {
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": {
                    "kind": "Job",
                    "apiVersion": "batch/v1",
                    "name": meta["name"],
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": str(meta.get("resourceVersion") or ""),
                },
                "reason": reason,
                "message": message,
                "type": "Warning",
                "source": {"component": "job-controller"},
                "reportingComponent": "job-controller",
                "reportingInstance": "",
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            self._put("events", event, create=True)
            self._job_events[(uid, reason)] = (namespace, name)

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

    def _record_put(self, plural: str, key: Key, stored: _Stored, prev: Obj | None) -> None:
        """Records a create or update stored at the current resourceVersion (call with the lock)."""
        self._history.record(put_change(self._rv, plural, key, stored.obj, stored.raw, prev))
        self._changed.notify_all()

    def _record_delete(self, plural: str, key: Key, prev: Obj) -> None:
        """Records a deletion at the current resourceVersion (call with the lock)."""
        self._history.record(delete_change(self._rv, plural, key, prev))
        self._changed.notify_all()

    def _sorted_keys(self, plural: str) -> list[Key]:
        """The resource's keys in order, rebuilt only after a change (call with the lock)."""
        cached = self._key_cache.get(plural)
        if cached is None or cached[0] != self._rv:
            cached = (self._rv, sorted(self._store[plural]))
            self._key_cache[plural] = cached
        return cached[1]

    def _put(self, plural: str, obj: Obj, create: bool) -> Obj:
        """Stores a new version of `obj`; `create` refuses an existing name (409)."""
        res = resource_of(plural)
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
                meta["uid"] = meta.get("uid") if not create and meta.get("uid") else new_uid()
                meta["creationTimestamp"] = meta.get("creationTimestamp") or timestamp_now()
            else:
                meta["uid"] = old.obj["metadata"]["uid"]
                meta["creationTimestamp"] = old.obj["metadata"]["creationTimestamp"]
            meta["resourceVersion"] = self._bump()
            new = {**obj, "apiVersion": res.api_version, "kind": res.kind, "metadata": meta}
            if plural == "secrets":
                new = default_secret(new)
                if new["type"] == SA_TOKEN_TYPE:
                    filled = self._token_controller(key, new)
                    if filled is None:
                        # The token controller deletes a token Secret whose ServiceAccount is
                        # missing; the write itself succeeded, so the writer sees the object.
                        if old is not None:
                            del table[key]
                            self._forget_token(key, old.obj)
                            self._record_delete(plural, key, old.obj)
                        return new
                    new = filled
            elif plural in ("rolebindings", "clusterrolebindings"):
                check_role_ref(res, new, old.obj if old is not None else None)
            elif plural == "jobs" and old is None:
                new = default_job(new)
            elif plural == "events":
                check_event(new)
            elif plural == "leases":
                check_lease(new)
            elif plural == "namespaces":
                new.setdefault("spec", {"finalizers": ["kubernetes"]})
                # Helm sends `status: {}`; the phase is the apiserver's to fill.
                new["status"] = {"phase": "Active", **(new.get("status") or {})}
            elif plural == "deployments":
                new = prepare_deployment(new, old.obj if old is not None else None)
            elif plural == "services":
                new = default_service(new, old.obj if old is not None else None, self._rv)
            elif plural == "persistentvolumeclaims":
                new = default_claim(new)
            stored = table[key] = _Stored(new, json.dumps(new, separators=(",", ":")).encode())
            if plural == "pods":
                self._index_pod(key, old.obj if old else None, new)
            self._record_put(plural, key, stored, old.obj if old else None)
            if plural in ("deployments", "pods", "nodes"):
                self._deployments.sync(self)
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
                raise not_found(res, name)
            self._bump()
            self._record_delete(res.plural, key, stored.obj)
            if res.plural == "pods":
                self._index_pod(key, stored.obj, None)
                self._pod_logs.pop(key, None)
            elif res.plural == "secrets":
                self._forget_token(key, stored.obj)
            elif res.plural == "serviceaccounts":
                # The token controller removes the ServiceAccount's token Secrets (and so
                # invalidates their tokens).
                for secret_key, secret in list(self._store["secrets"].items()):
                    if secret_key[0] == ns and token_owner(secret.obj) == name:
                        self._delete(resource_of("secrets"), ns, secret_key[1], "Background")
            uid = stored.obj["metadata"]["uid"]
            if policy in ("Background", "Foreground"):
                self._collect(uid)
            if res.plural == "namespaces":
                for plural, table in self._store.items():
                    for dep_key in [k for k in table if k[0] == name]:
                        self._delete(resource_of(plural), dep_key[0], dep_key[1], "Background")
            if res.plural in ("pods", "nodes"):
                # A Deployment replaces its pod; a pod left waiting may fit where this one was.
                self._deployments.sync(self)
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
                self._delete(resource_of(plural), ns, name, "Background")

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
            data["token"] = b64(token.encode())
            self._sa_tokens[token] = key
        if not data.get("ca.crt"):
            data["ca.crt"] = b64(self.ca_pem)
        if not data.get("namespace"):
            data["namespace"] = b64(key[0].encode())
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
        if (secret.get("data") or {}).get("token") != b64(token.encode()):
            return None
        sa_name = token_owner(secret)
        sa = self._store["serviceaccounts"].get((key[0], sa_name or ""))
        annotations = secret["metadata"].get("annotations") or {}
        if sa is None or sa.obj["metadata"]["uid"] != annotations.get(SA_UID_ANNOTATION):
            return None
        return f"system:serviceaccount:{key[0]}:{sa_name}"

    def _rbac_allows(
        self, user: str, verb: str, group: str, resource: str, sub: str, ns: str, name: str
    ) -> str | None:
        """Why RBAC lets `user` do this (the binding and role that grant it), or None."""
        want = Want(verb, group, f"{resource}/{sub}" if sub else resource, name)
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
            if role is None or not binds(binding, b_ns, user):
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
                raise forbidden(user, verb, res, ns, name, sub)
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

    def _pod_log(self, method: str, route: Route) -> bytes:
        if method != "GET":
            raise KubeError(405, "MethodNotAllowed", f"{method} is not supported on pods/log")
        with self._lock:
            if (route.namespace, route.name) not in self._store["pods"]:
                raise not_found(route.res, route.name)
            return self._pod_logs.get((route.namespace, route.name), "").encode()

    def _access_review(self, user: str, denied: frozenset[str] | None, body: bytes) -> Obj:
        """Answers a SelfSubjectAccessReview (what `kubectl auth can-i` sends); `denied` as
        `_authenticate` returns it."""
        review = json_body(body)
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
                and str(non_resource.get("path") or "").startswith(DISCOVERY_PATHS)
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

    def _take_fault(self, verb: str, path: str, name: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.remaining != 0 and fault.matches(verb, path, name):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    return fault
        return None

    def _list(
        self, res: Resource, ns: str, query: Mapping[str, str], as_table: bool = False
    ) -> bytes:
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""), res.plural)
        limit = int(query.get("limit") or 0)
        after, snapshot_rv = (
            _decode_continue(query["continue"]) if query.get("continue") else (None, None)
        )
        items: list[_Stored] = []
        next_key: Key | None = None
        last: Key | None = None
        with self._lock:
            table = self._store[res.plural]
            if snapshot_rv is not None and snapshot_rv < self._history.compacted_rv:
                raise KubeError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.",
                )
            # Every page of a paged list names the version its first page was read at, as a
            # real one does, so a watch from it misses nothing that changed while paging
            # (later pages here show the current state, which the watch then repeats).
            rv = str(self._rv if snapshot_rv is None else snapshot_rv)
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
                if not selected(stored.obj, labels, fields):
                    continue
                if limit and len(items) == limit:
                    next_key = last
                    break
                items.append(stored)
                last = key
        list_meta: Obj = {"resourceVersion": rv}
        if next_key is not None:
            list_meta["continue"] = _encode_continue(next_key, int(rv))
        if as_table:
            return json.dumps(table_of(res, [s.obj for s in items], list_meta)).encode()
        raw = [s.raw for s in items]
        head = json.dumps(
            {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": list_meta}
        )
        return b"".join((head[:-1].encode(), b',"items":[', b",".join(raw), b"]}"))

    def _open_watch(
        self, res: Resource, ns: str, query: Mapping[str, str], sock: socket.socket | None
    ) -> Watcher:
        """Registers a watch. Its first events are a synthetic ADDED for every matching object
        when `resourceVersion` is absent or "0" (as a real apiserver does; `sendInitialEvents`
        is ignored), else none: the history supplies those after it."""
        selection = Selection(
            res,
            ns,
            tuple(parse_label_selector(query.get("labelSelector", ""))),
            tuple(parse_field_selector(query.get("fieldSelector", ""), res.plural)),
        )
        rv_text = query.get("resourceVersion", "")
        with self._changed:
            first: list[Event] = []
            if rv_text in ("", "0"):
                table = self._store[res.plural]
                for key in self._sorted_keys(res.plural):
                    stored = table[key]
                    if selection.matches(key, stored.obj):
                        first.append(Event(ADDED, stored.obj, stored.raw))
                cursor = self._rv
            else:
                cursor = _resource_version(rv_text)
            watcher = Watcher(selection, cursor, sock, first=first)
            if rv_text in ("", "0"):
                # The snapshot shows every change kept so far: a lagging watch sends it once
                # the newest of them may be sent.
                watcher.first_at = self._history.newest_at
            self._watchers.add(watcher)
            self._changed.notify_all()
        return watcher

    def _next_events(self, watcher: Watcher, until: float) -> list[Event] | None:
        """The watcher's events after its cursor that the watch faults let through, waiting
        for some until `until` (a `time.monotonic()` instant; then []); [] at once while
        `end_at_once` is set; None once `drop_watches` ended it. Raises `Expired` when the
        changes after its cursor are no longer kept."""
        with self._changed:
            while not watcher.dropped:
                faults = self._watch_faults
                if faults.end_at_once:
                    return []
                now = time.monotonic()
                events: list[Event] = []
                wake = until
                if not faults.stall:
                    events, held_at = watcher.take(self._history, self._rv, now - faults.lag_s)
                    # Woken by a change or a new fault, or when the oldest held back is due.
                    wake = min(until, held_at + faults.lag_s)
                if events or now >= until:
                    return events
                self._changed.wait(wake - now)
            return None

    def _bookmark_rv(self, watcher: Watcher) -> int | None:
        """What a BOOKMARK to `watcher` names now: everything it was sent; None while watches
        stall or before its first events are sent."""
        with self._lock:
            if self._watch_faults.stall or watcher.first_at is not None:
                return None
            return watcher.cursor

    def _close_watch(self, watcher: Watcher) -> None:
        with self._changed:
            self._watchers.discard(watcher)
            self._changed.notify_all()

    def _create(self, res: Resource, ns: str, body: Obj, *, dry_run: bool = False) -> Obj:
        """A POST; with `dry_run` (`?dryRun=All`) it goes through admission and is answered
        as created, but nothing is stored and no hook runs."""
        meta = body.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if res.namespaced:
            if meta.get("namespace") not in (None, "", ns):
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request"
                )
            meta["namespace"] = ns
        for field in ("uid", "resourceVersion", "creationTimestamp"):
            meta.pop(field, None)
        if res.plural == "pods":
            self._admit_pod(ns, body)
        elif res.plural == "jobs" and self._autopilot:
            refused = autopilot_refusal("jobs", body)
            if refused is not None:
                raise refused
        if dry_run:
            if res.namespaced and self.get("namespaces", ns) is None:
                raise KubeError(
                    404,
                    "NotFound",
                    f'namespaces "{ns}" not found',
                    {"name": ns, "kind": "namespaces"},
                )
            return {**body, "apiVersion": res.api_version, "kind": res.kind}
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
                raise not_found(res, name)
            meta = body.get("metadata") or {}
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                details = {"name": name, "group": res.group, "kind": res.plural}
                raise KubeError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    {k: v for k, v in details.items() if v},
                )
            if sub == "status":
                new = {**current, "status": body.get("status", {})}
            else:
                new = {**body, "metadata": {**meta, "name": name, "namespace": ns}}
                if "status" in current:
                    new["status"] = current["status"]
            return self._put(res.plural, new, create=False)

    def _patch(
        self, res: Resource, ns: str, name: str, patch: Obj, sub: str, *, strategic: bool = False
    ) -> Obj:
        """A PATCH: a JSON merge patch, or with `strategic` a strategic merge patch."""
        with self._lock:
            current = self.get(res.plural, name, ns)
            if current is None:
                raise not_found(res, name)
            if sub == "status":
                patch = {"status": patch.get("status", {})}
            merged = (strategic_merge_patch if strategic else _merge_patch)(current, patch)
            merged["metadata"] = {
                **merged.get("metadata", {}),
                "resourceVersion": current["metadata"]["resourceVersion"],
            }
            return self._put(res.plural, merged, create=False)

    def _scale(self, method: str, res: Resource, ns: str, name: str, body: Obj) -> Obj:
        """The `scale` subresource of a Deployment: GET answers its Scale; PUT (which may name
        the resourceVersion it read: 409 if stale) and PATCH (merge or strategic: the same on a
        Scale) set `spec.replicas` and answer the Scale after the controller's pass."""
        with self._lock:
            current = self.get(res.plural, name, ns)
            if current is None:
                raise not_found(res, name)
            if method == "GET":
                return scale_of(current)
            scale = scale_of(current)
            if method == "PATCH":
                wanted = _merge_patch(scale, body)
            else:
                wanted = {**body, "metadata": body.get("metadata") or {}}
            replicas = scale_replicas(wanted, name)
            sent_rv = wanted["metadata"].get("resourceVersion")
            meta = {**current["metadata"]}
            if sent_rv and method == "PUT":
                meta["resourceVersion"] = sent_rv
            spec = {**current["spec"], "replicas": replicas}
            self._replace(res, ns, name, {**current, "metadata": meta, "spec": spec}, "")
            updated = self.get(res.plural, name, ns)
            assert updated is not None
            return scale_of(updated)


def _encode_continue(key: Key, rv: int) -> str:
    return base64.urlsafe_b64encode(json.dumps([*key, rv]).encode()).decode()


def _decode_continue(token: str) -> tuple[Key, int]:
    """The last key served and the resourceVersion the list's first page was read at."""
    try:
        ns, name, rv = json.loads(base64.urlsafe_b64decode(token.encode()))
        return (str(ns), str(name)), int(rv)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"invalid continue token: {exc}") from None


def _resource_version(text: str) -> int:
    try:
        rv = int(text)
    except ValueError:
        rv = -1
    if rv < 0:
        raise bad_request(f"invalid resource version: {text!r}")
    return rv


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


def seed_jobs(kube: KubeStandin, jobs: Iterable[tuple[Obj, Obj | None]]) -> None:
    """Jobs as a controller left them: each Job created, its pod running on the node the Job
    pins, and its companion Secret (if any) created with the Job's uid in the owner references
    that name the Job, as a controller that writes the Job first and the Secret second leaves
    them. The objects are the caller's; the stand-in adds only what an apiserver would."""
    namespaces: set[str] = set()
    for job_body, secret in jobs:
        namespace = job_body["metadata"].get("namespace", "default")
        if namespace not in namespaces:
            kube.add_namespace(namespace)
            namespaces.add(namespace)
        job = kube._put("jobs", job_body, create=True)
        if secret is not None:
            name, uid = job["metadata"]["name"], job["metadata"]["uid"]
            refs = [
                {**ref, "uid": uid} if ref.get("kind") == "Job" and ref.get("name") == name else ref
                for ref in secret["metadata"].get("ownerReferences", ())
            ]
            kube.create(
                "secrets", {**secret, "metadata": {**secret["metadata"], "ownerReferences": refs}}
            )
        kube.run_job_pod(job)
