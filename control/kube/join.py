"""`levers9 cluster join`: the keyless way to attach a cluster, with the operator's kubeconfig.

The operator's own identity (their current kubeconfig context) creates what the controlplane
needs on that cluster and nothing more: a namespace for the worker Jobs (labelled for Pod
Security to admit the privileged worker pods), a ServiceAccount, a ClusterRole to read nodes
and pods, a Role in the namespace for Jobs, Secrets, pod logs and Events, the two bindings, and
a long-lived token Secret that Kubernetes fills in. The token then goes to the controlplane over
its API (`PUT /v1/pools/{name}`) and nowhere else: never a file, never argv, never the
terminal. Everything is created once and brought back to the wanted
shape on a rerun (rules are replaced, the ServiceAccount and its token are kept), so joining
again is safe and repairs a hand-edited role.

Before it creates anything, the join asks whether the cluster would admit a worker pod: an
existing namespace whose `pod-security.kubernetes.io/enforce` label is not `privileged` is
refused with the `kubectl label` command that fixes it (the join runs with the operator's
credentials, but relabelling a namespace someone else made is theirs to decide), and a
worker-shaped pod is created as a server-side dry run (`dryRun=All`: every admission check
runs, nothing is stored). That is how a GKE Autopilot cluster, which refuses privileged pods in
every namespace, is told apart through the Kubernetes API alone; a dry run that cannot tell
(no permission to create pods, a webhook without dry-run support) is passed over.

The manifests are pure functions; `ClusterSide` carries them out through the one Kubernetes
adapter (`control.kube.adapter`, with a client for the operator's kubeconfig context) and
words the adapter's errors, by their kind, as `JoinError`s that say what the operator's
identity lacks.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from http import HTTPStatus
from typing import Any

import attrs
import trio

from control.kube.adapter import (
    KubeconfigCluster,
    KubeconfigError,
    KubeError,
    KubeObjects,
    KubeRefused,
    KubeTlsError,
    KubeUnreachable,
    NotAKubeconfig,
    kubeconfig_contexts,
    open_kubeconfig_client,
)
from control.kube.manifests import POOL_LABEL
from control.kube.podsecurity import (
    AUTOPILOT_ADVICE,
    PRIVILEGED_LABELS,
    label_command,
)
from control.kube.podsecurity import namespace_refusal as pod_security_refusal
from wire.errors import ErrorCode

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
    "namespace_refusal",
    "open_cluster_side",
    "pool_block",
    "probe_pod",
    "probe_refusal",
]

SERVICE_ACCOUNT = "levers9-controlplane"
TOKEN_SECRET = "levers9-controlplane-token"
TOKEN_WAIT_S = 30.0
MANAGED = {"app.kubernetes.io/managed-by": "levers9"}
CREATED_FOR = "levers9.dev/created-for-pool"
"""On a namespace the join created: the pool it was created for. `cluster leave
--delete-namespace` deletes no other namespace."""
SHOWN_JOBS = 5

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
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list", "patch"]},
)
"""In the pool's namespace only: worker Jobs, their token Secrets, worker logs, the Events
that say why a Job was created or deleted (`control.kube.events`), and the Job controller's
Events that say the cluster refuses a worker's pods (`control.kube.podsecurity`)."""
PROBE_POD = "levers9-admission-probe"
PROBE_NAMESPACE = "default"
"""Where the dry run goes while the pool's namespace does not exist yet."""


class JoinError(Exception):
    """A step of the join failed; the message says which and what to do. Never a secret."""


def cluster_role_name(namespace: str) -> str:
    return f"levers9-controlplane-{namespace}"


def manifests(namespace: str, pool: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Everything the join creates, in order, as (kind, manifest); the namespace, when
    created, names `pool` as the one it was created for."""
    labels = dict(MANAGED)
    role = cluster_role_name(namespace)
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}

    def meta(name: str, ns: str | None = None, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "labels": labels, **extra}
        if ns is not None:
            out["namespace"] = ns
        return out

    # Pod Security lets the privileged worker pods into a namespace the join creates.
    namespace_meta = (
        meta(namespace, annotations={CREATED_FOR: pool}) if pool is not None else meta(namespace)
    )
    namespace_meta["labels"] = {**labels, **PRIVILEGED_LABELS}

    rbac = "rbac.authorization.k8s.io/v1"
    return [
        (
            "Namespace",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": namespace_meta},
        ),
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


def probe_pod(namespace: str) -> dict[str, Any]:
    """A pod shaped as a worker's where admission looks (privileged, hostNetwork, a hostPath
    volume written to), for the join's dry run; never stored."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": PROBE_POD, "namespace": namespace, "labels": dict(MANAGED)},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "agent",
                    "image": "registry.k8s.io/pause:3.9",
                    "securityContext": {"privileged": True},
                    "volumeMounts": [{"name": "objects", "mountPath": "/var/lib/levers9"}],
                }
            ],
            "volumes": [
                {
                    "name": "objects",
                    "hostPath": {"path": "/var/lib/levers9", "type": "DirectoryOrCreate"},
                }
            ],
        },
    }


def probe_refusal(namespace: str, probed_in: str, server_message: str) -> str | None:
    """Why the join stops when a dry run of a worker-shaped pod in `probed_in` was refused
    with `server_message`, or None when that says nothing about `namespace` (Pod Security
    in another namespace: the one the join creates is labelled privileged)."""
    if "Autopilot" in server_message:
        return f"{AUTOPILOT_ADVICE}. The cluster refused a worker pod: {server_message}"
    if probed_in != namespace:
        return None
    if "violates PodSecurity" in server_message:
        return (
            f"Pod Security admission refuses levers9's worker pods in namespace {namespace} "
            f"(the cluster's default level applies to it): {server_message}. Run "
            f"`{label_command(namespace)}` (with your own kubeconfig) and join again"
        )
    return (
        f"the cluster's admission refuses levers9's privileged worker pods in namespace "
        f"{namespace}: {server_message}. Ask its administrator to admit them there, or join "
        "with another --namespace"
    )


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


# Kinds whose shape a rerun brings back (rules, bindings); the others are kept as found, so
# the ServiceAccount and its token survive a rerun.
REPLACED_KINDS = frozenset({"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
CLUSTER_SCOPED_KINDS = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding"})


class ClusterSide:
    """The operator's cluster, through the adapter and their kubeconfig context."""

    def __init__(self, api: KubeObjects, *, endpoint: str, ca_pem: bytes, context: str) -> None:
        self.api = api
        self.endpoint = endpoint
        self.ca_pem = ca_pem
        self.context = context

    def _fail(self, what: str, exc: KubeError) -> JoinError:
        """The adapter's error in the operator's terms, chosen by its kind and status."""
        if exc.code is ErrorCode.UNAUTHENTICATED:
            return JoinError(
                f"cannot {what}: the cluster did not accept the credentials of kubeconfig "
                f"context {self.context!r} (401); log in again (e.g. `gcloud container "
                "clusters get-credentials` or `aws eks update-kubeconfig`)"
            )
        if exc.code is ErrorCode.PERMISSION_DENIED:
            return JoinError(
                f"cannot {what}: kubeconfig context {self.context!r} is not allowed to "
                "(403); cluster join needs an identity that may create namespaces, "
                "ServiceAccounts, Secrets and RBAC roles and bindings (cluster-admin)"
            )
        if isinstance(exc, KubeTlsError):
            return JoinError(
                f"cannot {what}: the cluster's API at {self.endpoint} cannot be reached "
                "(TLS verification failed); check the certificate-authority of kubeconfig "
                f"context {self.context!r}"
            )
        if isinstance(exc, KubeUnreachable):
            return JoinError(
                f"cannot {what}: the cluster's API at {self.endpoint} cannot be reached "
                f"({exc.failure}); check kubeconfig context {self.context!r}"
            )
        if exc.status is None:
            return JoinError(
                f"cannot {what}: no answer from the cluster's API at {self.endpoint} that "
                f"cluster join can use ({exc.failure or exc.code.name}); check kubeconfig "
                f"context {self.context!r}"
            )
        return JoinError(f"cannot {what}: the cluster answered {exc.status} {_phrase(exc.status)}")

    @contextmanager
    def _step(self, what: str) -> Iterator[None]:
        try:
            yield
        except KubeError as exc:
            raise self._fail(what, exc) from None

    async def apply(self, namespace: str, pool: str | None = None) -> Joined:
        """Create what is missing, bring the roles and bindings back to shape, and read the
        token (waiting up to `TOKEN_WAIT_S` for Kubernetes to fill it in). A namespace
        created here is marked as `pool`'s."""
        steps: list[str] = []
        ns = namespace
        await self._check_admission(ns)
        for kind, manifest in manifests(namespace, pool):
            name = manifest["metadata"]["name"]
            scope = None if kind in CLUSTER_SCOPED_KINDS else ns
            label = f"{kind.lower()} {name}" if scope is None else f"{kind.lower()} {ns}/{name}"
            with self._step(f"read {label}"):
                found = await self.api.read_object(kind, name, scope)
            if found is None:
                with self._step(f"create {label}"):
                    await self.api.create_object(manifest)
                steps.append(f"{label}: created")
            elif kind in REPLACED_KINDS:
                with self._step(f"update {label}"):
                    await self.api.replace_object(manifest)
                steps.append(f"{label}: updated")
            else:
                steps.append(f"{label}: exists, kept")
        token, ca = await self._token(ns)
        return Joined(
            endpoint=self.endpoint, ca_pem=ca or self.ca_pem, token=token, steps=tuple(steps)
        )

    async def _check_admission(self, ns: str) -> None:
        """Raises a JoinError when the cluster would refuse the worker pods: the namespace's
        Pod Security label, then a dry run of a worker-shaped pod."""
        with self._step(f"read namespace {ns}"):
            found = await self.api.read_object("Namespace", ns)
        if found is not None:
            refusal = pod_security_refusal(ns, found)
            if refusal is not None:
                raise JoinError(refusal)
        probed_in = ns if found is not None else PROBE_NAMESPACE
        try:
            await self.api.create_object(probe_pod(probed_in), dry_run=True)
        except KubeRefused as exc:
            refusal = probe_refusal(ns, probed_in, exc.server_message)
            if refusal is not None:
                raise JoinError(refusal) from None
        except KubeError:
            pass  # it cannot tell (no right to create pods, a webhook without dry run)

    async def _token(self, ns: str) -> tuple[str, bytes | None]:
        with self._step(f"read secret {ns}/{TOKEN_SECRET}"):
            with trio.move_on_after(TOKEN_WAIT_S):
                token = await self.api.wait_secret_value(ns, TOKEN_SECRET, "token")
                ca = await self.api.read_secret_value(ns, TOKEN_SECRET, "ca.crt")
                return token, ca.encode() if ca else None
        raise JoinError(
            f"secret {ns}/{TOKEN_SECRET} got no token within {TOKEN_WAIT_S:g} s; is the "
            "cluster's token controller running? (kubectl -n "
            f"{ns} describe secret {TOKEN_SECRET})"
        )

    async def check_namespace_removal(
        self, namespace: str, pool: str, sharing: Sequence[str]
    ) -> None:
        """Raises a JoinError saying why `namespace` may not be deleted with `pool` (see
        `namespace_refusal`); returns when it may, or when it is gone already."""
        with self._step(f"read namespace {namespace}"):
            found = await self.api.read_object("Namespace", namespace)
        if found is None:
            return
        with self._step(f"list jobs in namespace {namespace}"):
            jobs = await self.api.list_jobs(namespace)
        refusal = namespace_refusal(namespace, pool, found, sharing, jobs)
        if refusal is not None:
            raise JoinError(refusal)

    async def remove(
        self, namespace: str, *, delete_namespace: bool, shared_with: Sequence[str] = ()
    ) -> list[str]:
        """Undo the join: the cluster-wide role and binding, then the namespace (with the
        ServiceAccount, its token, the Role and what workers left) or those objects alone.
        While other joined pools (`shared_with`) use the same ServiceAccount, it is all kept."""
        role = cluster_role_name(namespace)
        ns = namespace
        if shared_with:
            return [
                f"serviceaccount {ns}/{SERVICE_ACCOUNT} and its roles: kept, joined pool"
                f"{'s' if len(shared_with) > 1 else ''} {', '.join(shared_with)} use"
                f"{'' if len(shared_with) > 1 else 's'} them"
            ]
        deletions: list[tuple[str, str, str | None]] = [
            ("ClusterRoleBinding", role, None),
            ("ClusterRole", role, None),
        ]
        if delete_namespace:
            deletions.append(("Namespace", ns, None))
        else:
            deletions += [
                ("RoleBinding", SERVICE_ACCOUNT, ns),
                ("Role", SERVICE_ACCOUNT, ns),
                ("Secret", TOKEN_SECRET, ns),
                ("ServiceAccount", SERVICE_ACCOUNT, ns),
            ]
        steps: list[str] = []
        for kind, name, scope in deletions:
            label = f"{kind.lower()} {name}" if scope is None else f"{kind.lower()} {ns}/{name}"
            with self._step(f"delete {label}"):
                deleted = await self.api.delete_object(kind, name, scope)
            steps.append(f"{label}: deleted" if deleted else f"{label}: already gone")
        return steps


def namespace_refusal(
    namespace: str,
    pool: str,
    found: Mapping[str, Any],
    sharing: Sequence[str],
    jobs: Sequence[Mapping[str, Any]],
) -> str | None:
    """Why `cluster leave POOL --delete-namespace` must keep `namespace` (as found), or None:
    it is deleted only when the join created it for `pool`, no other pool is set to it
    (`sharing`, as "name (source)"), and no Job but `pool`'s is in it."""
    reasons = []
    meta = found.get("metadata") or {}
    created_for = (meta.get("annotations") or {}).get(CREATED_FOR)
    if created_for != pool:
        made = f" (it was created for pool {created_for})" if created_for else ""
        reasons.append(f"cluster join did not create it for pool {pool}{made}")
    if sharing:
        reasons.append(f"pools {', '.join(sharing)} are set to namespace {namespace}")
    others = sorted(
        str((job.get("metadata") or {}).get("name", ""))
        for job in jobs
        if ((job.get("metadata") or {}).get("labels") or {}).get(POOL_LABEL) != pool
    )
    if others:
        more = f" and {len(others) - SHOWN_JOBS} more" if len(others) > SHOWN_JOBS else ""
        reasons.append(
            f"it holds Jobs that are not pool {pool}'s: {', '.join(others[:SHOWN_JOBS])}{more}"
        )
    if not reasons:
        return None
    return (
        f"namespace {namespace} is kept: {'; '.join(reasons)}. Nothing was changed: run "
        f"`levers9 cluster leave {pool}` without --delete-namespace"
    )


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


@asynccontextmanager
async def open_cluster_side(
    kubeconfig: str | None, context: str | None
) -> AsyncIterator[ClusterSide]:
    """The operator's cluster from their kubeconfig (`KUBECONFIG` or ~/.kube/config when
    `kubeconfig` is None) and context (the current one when None); its connections and temp
    files go away on exit."""
    async with AsyncExitStack() as stack:
        try:
            contexts = await trio.to_thread.run_sync(kubeconfig_contexts, kubeconfig)
            chosen = context or contexts.current
            if chosen is None or chosen not in contexts.names:
                raise JoinError(
                    f"the kubeconfig has no context {chosen!r}; pick one with --context "
                    f"({', '.join(contexts.names)})"
                )
            cluster: KubeconfigCluster = await stack.enter_async_context(
                open_kubeconfig_client(kubeconfig, chosen)
            )
        except KubeconfigError as exc:
            hint = "one" if isinstance(exc, NotAKubeconfig) else "a kubeconfig"
            raise JoinError(f"{exc.message}; point --kubeconfig at {hint}") from None
        yield ClusterSide(
            cluster.client, endpoint=cluster.endpoint, ca_pem=cluster.ca_pem, context=chosen
        )
