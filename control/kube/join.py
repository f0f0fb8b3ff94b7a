"""`levers9 cluster join`: the keyless way to attach a cluster, with the operator's kubeconfig.

The operator's own identity (their current kubeconfig context) creates what the controlplane
needs on that cluster and nothing more: a namespace for the worker Jobs, a ServiceAccount, a
ClusterRole to read nodes and pods, a Role in the namespace for Jobs, Secrets and pod logs,
the two bindings, and a long-lived token Secret that Kubernetes fills in. The token then goes
to the controlplane over its API (`PUT /v1/pools/{name}`) and nowhere else: never a file,
never argv, never the terminal. Everything is created once and brought back to the wanted
shape on a rerun (rules are replaced, the ServiceAccount and its token are kept), so joining
again is safe and repairs a hand-edited role.

The manifests are pure functions; `ClusterSide` is the one adapter over the official client,
translating its errors into `JoinError`s that say what the operator's identity lacks.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

__all__ = [
    "CLUSTER_RULES",
    "NAMESPACE_RULES",
    "SERVICE_ACCOUNT",
    "TOKEN_SECRET",
    "ClusterSide",
    "JoinError",
    "Joined",
    "cluster_role_name",
    "manifests",
    "open_cluster_side",
    "pool_block",
]

SERVICE_ACCOUNT = "levers9-controlplane"
TOKEN_SECRET = "levers9-controlplane-token"
TOKEN_WAIT_S = 30.0
MANAGED = {"app.kubernetes.io/managed-by": "levers9"}

CLUSTER_RULES: tuple[Mapping[str, Any], ...] = (
    {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
)
"""Cluster-wide: which nodes are machines, and what other pods leave free on them."""

NAMESPACE_RULES: tuple[Mapping[str, Any], ...] = (
    {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["create", "delete", "get", "list", "watch"],
    },
    {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["create", "delete", "get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
)
"""In the pool's namespace only: worker Jobs, their token Secrets, and worker logs."""


class JoinError(Exception):
    """A step of the join failed; the message says which and what to do. Never a secret."""


def cluster_role_name(namespace: str) -> str:
    return f"levers9-controlplane-{namespace}"


def manifests(namespace: str) -> list[tuple[str, dict[str, Any]]]:
    """Everything the join creates, in order, as (kind, manifest)."""
    labels = dict(MANAGED)
    role = cluster_role_name(namespace)
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}

    def meta(name: str, ns: str | None = None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "labels": labels, **extra}
        if ns is not None:
            out["namespace"] = ns
        return out

    rbac = "rbac.authorization.k8s.io/v1"
    return [
        ("Namespace", {"apiVersion": "v1", "kind": "Namespace", "metadata": meta(namespace)}),
        (
            "ServiceAccount",
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": meta(SERVICE_ACCOUNT, namespace),
            },
        ),
        (
            "ClusterRole",
            {
                "apiVersion": rbac,
                "kind": "ClusterRole",
                "metadata": meta(role),
                "rules": [dict(r) for r in CLUSTER_RULES],
            },
        ),
        (
            "ClusterRoleBinding",
            {
                "apiVersion": rbac,
                "kind": "ClusterRoleBinding",
                "metadata": meta(role),
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": [subject],
            },
        ),
        (
            "Role",
            {
                "apiVersion": rbac,
                "kind": "Role",
                "metadata": meta(SERVICE_ACCOUNT, namespace),
                "rules": [dict(r) for r in NAMESPACE_RULES],
            },
        ),
        (
            "RoleBinding",
            {
                "apiVersion": rbac,
                "kind": "RoleBinding",
                "metadata": meta(SERVICE_ACCOUNT, namespace),
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": SERVICE_ACCOUNT,
                },
                "subjects": [subject],
            },
        ),
        (
            "Secret",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "kubernetes.io/service-account-token",
                "metadata": meta(
                    TOKEN_SECRET,
                    namespace,
                    annotations={"kubernetes.io/service-account.name": SERVICE_ACCOUNT},
                ),
            },
        ),
    ]


def pool_block(
    *,
    name: str,
    flavor: str,
    endpoint: str,
    ca_pem: bytes,
    token: str,
    namespace: str,
    selector: Mapping[str, str],
    tunnel: bool,
    host_network: bool,
    image: str,
    driver_path: str | None = None,
) -> dict[str, Any]:
    """The pool block the controlplane keeps for a joined cluster (`config.worker.pools`'
    shape), with the ServiceAccount token as its credentials."""
    kube: dict[str, Any] = {
        "flavor": flavor,
        "endpoint": endpoint,
        "caData": base64.b64encode(ca_pem).decode(),
        "credentials": {"token": token},
        "namespace": namespace,
        "selector": dict(selector),
        "tunnel": tunnel,
        "hostNetwork": host_network,
        "image": image,
    }
    if driver_path is not None:
        kube["driverPath"] = driver_path
    return {"name": name, "provider": "kubernetes", "kubernetes": kube}


@attrs.frozen
class Joined:
    """What the cluster side gave: where the API is, its CA and the token (never shown)."""

    endpoint: str
    ca_pem: bytes = attrs.field(repr=False)
    token: str = attrs.field(repr=False)
    steps: tuple[str, ...] = ()


class ClusterSide:
    """The operator's cluster, through the official client and their kubeconfig context."""

    def __init__(self, api: k8s.ApiClient, endpoint: str, ca_pem: bytes, context: str) -> None:
        self.api = api
        self.endpoint = endpoint
        self.ca_pem = ca_pem
        self.context = context
        self.core = k8s.CoreV1Api(api)
        self.rbac = k8s.RbacAuthorizationV1Api(api)

    def close(self) -> None:
        self.api.close()

    def _fail(self, what: str, exc: BaseException) -> JoinError:
        if isinstance(exc, ApiException):
            status = int(exc.status or 0)
            if status == 401:
                return JoinError(
                    f"cannot {what}: the cluster did not accept the credentials of kubeconfig "
                    f"context {self.context!r} (401); log in again (e.g. `gcloud container "
                    "clusters get-credentials` or `aws eks update-kubeconfig`)"
                )
            if status == 403:
                return JoinError(
                    f"cannot {what}: kubeconfig context {self.context!r} is not allowed to "
                    "(403); cluster join needs an identity that may create namespaces, "
                    "ServiceAccounts, Secrets and RBAC roles and bindings (cluster-admin)"
                )
            return JoinError(f"cannot {what}: the cluster answered {status} {exc.reason}")
        return JoinError(
            f"cannot {what}: the cluster's API at {self.endpoint} cannot be reached "
            f"({type(exc).__name__}); check kubeconfig context {self.context!r}"
        )

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._fail(what, exc) from None

    def _exists(self, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise self._fail(what, exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._fail(what, exc) from None

    def apply(self, namespace: str, *, token_wait_s: float = TOKEN_WAIT_S) -> Joined:
        """Create what is missing, bring the roles and bindings back to shape, and read the
        token (waiting for Kubernetes to fill it in)."""
        steps: list[str] = []
        ns = namespace
        for kind, manifest in manifests(namespace):
            name = manifest["metadata"]["name"]
            label = (
                f"{kind.lower()} {name}"
                if kind in ("Namespace", "ClusterRole", "ClusterRoleBinding")
                else f"{kind.lower()} {ns}/{name}"
            )
            read, create, replace = self._verbs(kind, ns)
            if not self._exists(f"read {label}", read, name):
                self._call(f"create {label}", create, manifest)
                steps.append(f"{label}: created")
            elif replace is not None:
                self._call(f"update {label}", replace, name, manifest)
                steps.append(f"{label}: updated")
            else:
                steps.append(f"{label}: exists, kept")
        token, ca = self._token(ns, token_wait_s)
        return Joined(
            endpoint=self.endpoint, ca_pem=ca or self.ca_pem, token=token, steps=tuple(steps)
        )

    def _verbs(
        self, kind: str, ns: str
    ) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None]:
        core, rbac = self.core, self.rbac
        table: dict[
            str, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None]
        ] = {
            "Namespace": (core.read_namespace, core.create_namespace, None),
            "ServiceAccount": (
                lambda n: core.read_namespaced_service_account(n, ns),
                lambda m: core.create_namespaced_service_account(ns, m),
                None,
            ),
            "ClusterRole": (
                rbac.read_cluster_role,
                rbac.create_cluster_role,
                rbac.replace_cluster_role,
            ),
            "ClusterRoleBinding": (
                rbac.read_cluster_role_binding,
                rbac.create_cluster_role_binding,
                rbac.replace_cluster_role_binding,
            ),
            "Role": (
                lambda n: rbac.read_namespaced_role(n, ns),
                lambda m: rbac.create_namespaced_role(ns, m),
                lambda n, m: rbac.replace_namespaced_role(n, ns, m),
            ),
            "RoleBinding": (
                lambda n: rbac.read_namespaced_role_binding(n, ns),
                lambda m: rbac.create_namespaced_role_binding(ns, m),
                lambda n, m: rbac.replace_namespaced_role_binding(n, ns, m),
            ),
            "Secret": (
                lambda n: core.read_namespaced_secret(n, ns),
                lambda m: core.create_namespaced_secret(ns, m),
                None,
            ),
        }
        return table[kind]

    def _token(self, ns: str, wait_s: float) -> tuple[str, bytes | None]:
        deadline = time.monotonic() + wait_s
        what = f"read secret {ns}/{TOKEN_SECRET}"
        while True:
            secret = self._call(what, self.core.read_namespaced_secret, TOKEN_SECRET, ns)
            data = secret.data or {}
            if data.get("token"):
                token = base64.b64decode(data["token"]).decode()
                ca = base64.b64decode(data["ca.crt"]) if data.get("ca.crt") else None
                return token, ca
            if time.monotonic() >= deadline:
                raise JoinError(
                    f"secret {ns}/{TOKEN_SECRET} got no token within {wait_s:g} s; is the "
                    "cluster's token controller running? (kubectl -n "
                    f"{ns} describe secret {TOKEN_SECRET})"
                )
            time.sleep(0.2)

    def remove(self, namespace: str, *, delete_namespace: bool) -> list[str]:
        """Undo the join: the cluster-wide role and binding, then the namespace (with the
        ServiceAccount, its token, the Role and what workers left) or those objects alone."""
        steps: list[str] = []
        role = cluster_role_name(namespace)
        ns = namespace
        deletions: list[tuple[str, Callable[[], Any]]] = [
            (f"clusterrolebinding {role}", lambda: self.rbac.delete_cluster_role_binding(role)),
            (f"clusterrole {role}", lambda: self.rbac.delete_cluster_role(role)),
        ]
        if delete_namespace:
            deletions.append((f"namespace {ns}", lambda: self.core.delete_namespace(ns)))
        else:
            deletions += [
                (
                    f"rolebinding {ns}/{SERVICE_ACCOUNT}",
                    lambda: self.rbac.delete_namespaced_role_binding(SERVICE_ACCOUNT, ns),
                ),
                (
                    f"role {ns}/{SERVICE_ACCOUNT}",
                    lambda: self.rbac.delete_namespaced_role(SERVICE_ACCOUNT, ns),
                ),
                (
                    f"secret {ns}/{TOKEN_SECRET}",
                    lambda: self.core.delete_namespaced_secret(TOKEN_SECRET, ns),
                ),
                (
                    f"serviceaccount {ns}/{SERVICE_ACCOUNT}",
                    lambda: self.core.delete_namespaced_service_account(SERVICE_ACCOUNT, ns),
                ),
            ]
        for label, delete in deletions:
            try:
                delete()
                steps.append(f"{label}: deleted")
            except ApiException as exc:
                if exc.status != 404:
                    raise self._fail(f"delete {label}", exc) from None
                steps.append(f"{label}: already gone")
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise self._fail(f"delete {label}", exc) from None
        return steps


def open_cluster_side(kubeconfig: str | None, context: str | None) -> ClusterSide:
    """The operator's cluster from their kubeconfig (`KUBECONFIG` or ~/.kube/config when
    `kubeconfig` is None) and context (the current one when None)."""
    cfg = k8s.Configuration()
    try:
        contexts, current = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = context or (current or {}).get("name")
        if chosen not in [c.get("name") for c in contexts]:
            raise JoinError(
                f"the kubeconfig has no context {chosen!r}; pick one with --context "
                f"({', '.join(str(c.get('name')) for c in contexts)})"
            )
        k8s_config.load_kube_config(
            config_file=kubeconfig, context=chosen, client_configuration=cfg, persist_config=False
        )
    except ConfigException as exc:
        where = kubeconfig or "the default kubeconfig"
        raise JoinError(f"cannot use {where}: {exc}; point --kubeconfig at a kubeconfig") from None
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        # The client's loader assumes a well-formed file and fails on anything else.
        where = kubeconfig or "the default kubeconfig"
        raise JoinError(
            f"{where} is not a kubeconfig (clusters, users, contexts); point --kubeconfig at one"
        ) from None
    ca_pem = Path(cfg.ssl_ca_cert).read_bytes() if cfg.ssl_ca_cert else b""
    return ClusterSide(k8s.ApiClient(configuration=cfg), cfg.host, ca_pem, str(chosen))
