"""The resources the stand-in serves (group, version, kind, namespaced), its identities, and
`KubeError`, which carries the apiserver's Status body (reason, code, message).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

Obj = dict[str, Any]
Key = tuple[str, str]
"""(namespace, name); the namespace is "" for cluster-scoped resources."""
RBAC = "rbac.authorization.k8s.io"
COORDINATION = "coordination.k8s.io"
APPS = "apps"
POLICY = "policy"
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
    categories: tuple[str, ...] = ()
    """What discovery lists it under: `kubectl get all` reads the "all" category."""

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
    Resource("", "v1", "pods", "Pod", True, ("po",), "pod", ("all",)),
    Resource("", "v1", "secrets", "Secret", True, (), "secret"),
    Resource("", "v1", "events", "Event", True, ("ev",), "event"),
    Resource("batch", "v1", "jobs", "Job", True, (), "job", ("all",)),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True, ("sa",), "serviceaccount"),
    Resource(RBAC, "v1", "clusterroles", "ClusterRole", False, (), "clusterrole"),
    Resource(
        RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False, (), "clusterrolebinding"
    ),
    Resource(RBAC, "v1", "roles", "Role", True, (), "role"),
    Resource(RBAC, "v1", "rolebindings", "RoleBinding", True, (), "rolebinding"),
    Resource(COORDINATION, "v1", "leases", "Lease", True, (), "lease"),
    Resource("", "v1", "configmaps", "ConfigMap", True, ("cm",), "configmap"),
    Resource("", "v1", "services", "Service", True, ("svc",), "service", ("all",)),
    Resource(
        "",
        "v1",
        "persistentvolumeclaims",
        "PersistentVolumeClaim",
        True,
        ("pvc",),
        "persistentvolumeclaim",
    ),
    Resource(APPS, "v1", "deployments", "Deployment", True, ("deploy",), "deployment", ("all",)),
    Resource(
        POLICY,
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        True,
        ("pdb",),
        "poddisruptionbudget",
    ),
)
BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
SA_TOKEN_TYPE = "kubernetes.io/service-account-token"
SA_NAME_ANNOTATION = "kubernetes.io/service-account.name"
SA_UID_ANNOTATION = "kubernetes.io/service-account.uid"
ADMIN_USER = "kubernetes-admin"
LIMITED_USER = "system:serviceaccount:standin:limited"
"""Who an `add_token` token is, in its 403 messages and reviews."""
ACCESS_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
SUBJECT_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
DISCOVERY_PATHS = ("/api", "/apis", "/version", "/openapi")
FIELDS = frozenset({"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase"})
"""The field labels a field selector may name, for resources without their own set below."""
EVENT_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
"""An Event's field labels, the apiserver's own set (`kubectl describe` selects a Job's events
by `involvedObject.*`); `source` is `source.component`, or `reportingComponent` without one."""
FIELDS_OF: Mapping[str, frozenset[str]] = {"events": EVENT_FIELDS}
GPU = "nvidia.com/gpu"


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


def not_found(res: Resource, name: str) -> KubeError:
    details = {"name": name, "group": res.group, "kind": res.plural}
    if not res.group:
        del details["group"]
    return KubeError(404, "NotFound", f'{res.qualified} "{name}" not found', details)


def bad_request(message: str) -> KubeError:
    return KubeError(400, "BadRequest", message)


def resource_of(plural: str) -> Resource:
    for res in RESOURCES:
        if res.plural == plural:
            return res
    raise KeyError(plural)


def new_uid() -> str:
    return str(uuid.uuid4())


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@attrs.frozen
class Route:
    res: Resource
    namespace: str
    name: str
    sub: str


def json_body(body: bytes) -> Obj:
    try:
        obj = json.loads(body or b"{}")
    except ValueError as exc:
        raise bad_request(f"the request body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    return obj
