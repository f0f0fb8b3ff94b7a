"""The one adapter between the controlplane and a Kubernetes API server.

Everything that touches the official `kubernetes` client lives here: building an `ApiClient`
from a `PoolConfig` (the cluster CA always verified) or from an operator's kubeconfig context
(`levers9 cluster join`), authenticating by flavor with tokens refreshed before they expire,
running the client's blocking calls in a worker thread, and translating its exceptions into
ours. Callers above this module see plain JSON-shaped dicts (the API's own wire shape) and
`KubeError`s; they never see `ApiException`, urllib3, google-auth or botocore errors, so this
module is the seam a unit test of the reconciler or of the join replaces.

Errors are sorted by what the caller can do, by status and by exception type (never by
message text): `KubeAuthError` (fix the credentials or RBAC; the message says which verb on
which resource in which namespace is missing), `KubeNotFound` / `KubeAlreadyExists` /
`KubeConflict` (expected races, handled by the caller; a conflict is an update whose
resourceVersion is no longer the object's), `KubeUnavailable` (try again next pass; 429 and 5xx
were already retried here with capped backoff honouring Retry-After) and its
`KubeUnreachable` (no answer at all), `KubeTlsError` (the CA is not the endpoint's),
`KubeconfigError` (an operator's kubeconfig cannot be used), and `KubeError` for the rest.
Each carries the HTTP `status` or the `failure` behind it, so a caller with its own words
never reads the message.

Lists are read with `_preload_content=False` and parsed as JSON: this skips the client's
model classes (slow for thousands of pods) and its debug logging of response bodies, which
for a Secret would hold the worker token. For the caches (`control.kube.informer`) a page is
parsed and cut down to its facts in the worker thread (`list_page`), and a watch is an open
response whose bytes the caller reads in a thread of its own (`watch`, `WatchResponse`); a
410 Gone, the answer to a version older than the server keeps, is `KubeExpired`.

Every request, each retry and each watch included, first takes a token from the client's
budget (`qps`, `burst`: a `TokenBucket`, as client-go's clients have one), so a storm of
creates never floods a cluster other people share.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio
import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from control.kube.podsecurity import PRIVILEGED_LABELS, refusal_advice
from control.kube.pools import (
    DEFAULT_BURST,
    DEFAULT_QPS,
    GKE_SCOPES,
    ClientCertificateCredentials,
    Credentials,
    EksCredentials,
    GkeCredentials,
    KubeconfigCredentials,
    PoolConfig,
    TokenCredentials,
    read_credentials,
)
from control.kube.ratelimit import TokenBucket
from wire.backoff import Backoff, BackoffState, next_delay, record_failure
from wire.errors import ApiError, ErrorCode

__all__ = [
    "KINDS",
    "RETRY",
    "Collection",
    "EksTokenSource",
    "GkeTokenSource",
    "Kind",
    "KubeAlreadyExists",
    "KubeApi",
    "KubeAuthError",
    "KubeClient",
    "KubeConflict",
    "KubeError",
    "KubeExpired",
    "KubeNotFound",
    "KubeObjects",
    "KubeRefused",
    "KubeTlsError",
    "KubeUnavailable",
    "KubeUnreachable",
    "KubeconfigCluster",
    "KubeconfigContexts",
    "KubeconfigError",
    "NotAKubeconfig",
    "Operation",
    "Page",
    "StaticToken",
    "TokenSource",
    "WatchResponse",
    "build_api_client",
    "build_kubeconfig_client",
    "call_with_retry",
    "eks_token",
    "kubeconfig_contexts",
    "open_kube_client",
    "open_kubeconfig_client",
    "retry_delay",
    "secret_value",
    "translate_api_exception",
]

log = logging.getLogger("levers9.kube")
T = TypeVar("T")

RETRY = Backoff(initial_s=0.5, factor=2.0, cap_s=10.0, stable_s=0.0, jitter=0.5)
RETRY_ATTEMPTS = 5
# A server asking for a longer pause than this is treated as down for this pass.
MAX_RETRY_AFTER_S = 60.0
GKE_REFRESH_BEFORE_S = 5 * 60.0
# EKS accepts a presigned token for 15 minutes after it was signed.
EKS_REFRESH_EVERY_S = 14 * 60.0
LIST_PAGE = 500


# --- errors ------------------------------------------------------------------------------


class KubeError(ApiError):
    """A pool's Kubernetes API refused or failed a call; the message names pool and action.

    `status` is the HTTP status the API server answered (None when none came back) and
    `failure` the kind of failure when no answer came (the underlying exception's class name),
    so a caller with its own words (`levers9 cluster join`) needs no look at the message.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        field: str | None = None,
        status: int | None = None,
        failure: str | None = None,
    ) -> None:
        super().__init__(code, message, field=field)
        self.status = status
        self.failure = failure


class KubeAuthError(KubeError):
    """The credentials were refused (401) or lack a permission (403); fix config or RBAC."""


class KubeRefused(KubeError):
    """403 from the cluster's admission, not from RBAC: Pod Security or a policy webhook (GKE
    Autopilot's) refused the object itself. `server_message` holds the cluster's words;
    asking again does not help until the namespace or the cluster changes."""

    def __init__(self, message: str, *, server_message: str) -> None:
        super().__init__(ErrorCode.FAILED_PRECONDITION, message, status=403)
        self.server_message = server_message


class KubeNotFound(KubeError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.NOT_FOUND, message, status=404)


class KubeAlreadyExists(KubeError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ALREADY_EXISTS, message, status=409)


class KubeConflict(KubeError):
    """409 on an update: the object changed since the resourceVersion the update carries was
    read (optimistic concurrency); read it again and decide anew."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.FAILED_PRECONDITION, message, status=409)


class KubeExpired(KubeError):
    """410 Gone: the resourceVersion (or a list's continue token) is older than the server
    keeps; the caller lists again from scratch."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message, status=410)


class KubeUnavailable(KubeError):
    """The API server could not be reached, timed out or stayed overloaded; try later."""

    def __init__(
        self, message: str, *, status: int | None = None, failure: str | None = None
    ) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message, status=status, failure=failure)


class KubeUnreachable(KubeUnavailable):
    """No answer at all: the connection was refused, reset or timed out, or the name did not
    resolve. `failure` names the client's exception."""

    def __init__(self, message: str, *, failure: str) -> None:
        super().__init__(message, failure=failure)


class KubeTlsError(KubeError):
    """TLS with the API server failed: the CA configured is not the endpoint's, or the
    endpoint does not speak TLS. Retrying does not help; fix the CA or the endpoint."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.FAILED_PRECONDITION, message, failure="SSLError")


class KubeconfigError(KubeError):
    """An operator's kubeconfig cannot be used (missing, its credentials plugin failed, a
    context without a cluster); the message names the file."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_ARGUMENT, message)


class NotAKubeconfig(KubeconfigError):
    """The file is not a kubeconfig at all (not YAML, or no clusters, users and contexts)."""


@attrs.frozen
class Operation:
    """What a call was doing, in RBAC's words, so errors can say what permission is missing."""

    verb: str
    resource: str
    group: str = ""
    namespace: str | None = None
    name: str | None = None

    def describe(self) -> str:
        what = f"{self.resource}.{self.group}" if self.group else self.resource
        if self.name:
            what += f" {self.name!r}"
        where = f" in namespace {self.namespace}" if self.namespace else ""
        return f"{self.verb} {what}{where}"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and everything behind it: its cause or context chain, and the reason a urllib3
    `MaxRetryError` carries (the client raises those after its own retries)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, urllib3.exceptions.MaxRetryError) and isinstance(
            current.reason, BaseException
        ):
            todo.append(current.reason)
        behind = current.__cause__ or current.__context__
        if behind is not None:
            todo.append(behind)


def _tls_failed(exc: BaseException) -> bool:
    """Whether TLS with the server failed somewhere behind `exc`: the official client turns a
    urllib3 `SSLError` into an `ApiException` with status 0 (the SSLError its context), and
    urllib3 wraps one in `MaxRetryError` when its retries run out."""
    return any(isinstance(e, urllib3.exceptions.SSLError | ssl.SSLError) for e in _causes(exc))


def _status_body(exc: ApiException) -> Mapping[str, Any]:
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str) or not body:
        return {}
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, Mapping) else {}


def translate_api_exception(exc: ApiException, op: Operation, *, pool: str) -> KubeError:
    """Our error for a failed call, sorted by the status and, where no answer came, by the
    exception behind it; the Status body's `details` refine what the message names."""
    status = int(exc.status or 0)
    body = _status_body(exc)
    server_says = str(body.get("message") or exc.reason or "").strip()
    prefix = f"pool {pool}: cannot {op.describe()}"
    if status == 0:
        # The client raised before any answer: it sends nothing it cannot encode, and turns
        # a urllib3 SSLError into this (the SSLError is the exception's context).
        if _tls_failed(exc):
            return KubeTlsError(f"{prefix}: {_TLS_ADVICE.format(pool)}")
        return KubeError(
            ErrorCode.INTERNAL,
            f"{prefix}: the client did not send the request ({server_says or 'no detail'})",
            failure=type(exc).__name__,
        )
    if status == 401:
        return KubeAuthError(
            ErrorCode.UNAUTHENTICATED,
            f"{prefix}: the cluster did not accept the pool's credentials (401 Unauthorized); "
            f"check config.worker.pools[{pool}].kubernetes.credentials (expired or revoked "
            "token, wrong key, or an identity the cluster does not map)",
            field=f"worker.pools[{pool}].kubernetes.credentials",
            status=status,
        )
    if status == 403 and _ADMISSION_REFUSAL.search(server_says):
        advice = refusal_advice(server_says, op.namespace or "")
        return KubeRefused(
            f"{prefix}: the cluster refused it: {server_says}{'; ' + advice if advice else ''}",
            server_message=server_says,
        )
    if status == 403:
        # RBAC refuses the request itself: its verb and namespace are ours; the Status
        # details say the resource and group in the server's words.
        details = body.get("details")
        details = details if isinstance(details, Mapping) else {}
        resource = str(details.get("kind") or op.resource)
        group = str(details["group"]) if "group" in details else op.group
        scope = f"in namespace {op.namespace}" if op.namespace else "cluster-wide"
        role = "a Role and RoleBinding" if op.namespace else "a ClusterRole and ClusterRoleBinding"
        return KubeAuthError(
            ErrorCode.PERMISSION_DENIED,
            f"{prefix}: the pool's identity may not {op.verb} {resource} "
            f"(API group {group or 'core'!r}) {scope}; grant verb {op.verb!r} on {resource!r} "
            f"with {role} (`levers9 cluster join` sets these up). Cluster said: {server_says}",
            field=f"worker.pools[{pool}].kubernetes.credentials",
            status=status,
        )
    if status == 404:
        return KubeNotFound(f"{prefix}: not found ({server_says or '404'})")
    if status == 409 and op.verb == "update":
        return KubeConflict(f"{prefix}: it was changed meanwhile ({server_says or '409'})")
    if status == 409:
        return KubeAlreadyExists(f"{prefix}: already exists ({server_says or '409'})")
    if status == 410:
        return KubeExpired(f"{prefix}: its version has expired ({server_says or '410'})")
    if _retryable(exc):
        return KubeUnavailable(
            f"{prefix}: the API server answered {status} after {RETRY_ATTEMPTS} tries "
            f"({server_says or 'no detail'}); the next pass tries again",
            status=status,
        )
    if status in (400, 422):
        return KubeError(
            ErrorCode.INVALID_ARGUMENT,
            f"{prefix}: the API server refused it: {server_says}",
            status=status,
        )
    return KubeError(
        ErrorCode.INTERNAL,
        f"{prefix}: the API server answered {status}: {server_says}",
        status=status,
    )


_ADMISSION_REFUSAL = re.compile(r"violates PodSecurity|admission webhook .* denied the request")
"""A 403 that admission gave (Pod Security, a policy webhook), not RBAC."""
_TLS_ADVICE = (
    "TLS verification of the API server failed; check that "
    "config.worker.pools[{0}].kubernetes.caData is the CA of that endpoint"
)


def _retry_after_s(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP-date; the backoff alone is fine


def retry_delay(policy: Backoff, state: BackoffState, exc: ApiException, rand: float) -> float:
    """Seconds before retrying a 429/5xx: the backoff, or longer when Retry-After asks."""
    delay = next_delay(policy, state, rand)
    asked = _retry_after_s(exc)
    if asked is not None:
        delay = max(delay, min(asked, MAX_RETRY_AFTER_S))
    return delay


def _retryable(exc: ApiException) -> bool:
    status = int(exc.status or 0)
    return status == 429 or 500 <= status < 600


async def call_with_retry(
    fn: Callable[[], T],
    op: Operation,
    *,
    pool: str,
    policy: Backoff = RETRY,
    attempts: int = RETRY_ATTEMPTS,
    throttle: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """Run blocking `fn` in a thread; retry 429/5xx; raise only `KubeError`s. `throttle` is
    awaited before every attempt (the client's request budget)."""
    state = BackoffState()
    for attempt in range(1, attempts + 1):
        if throttle is not None:
            await throttle()
        try:
            return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except ApiException as exc:
            if not _retryable(exc) or attempt == attempts:
                raise translate_api_exception(exc, op, pool=pool) from None
            delay = retry_delay(policy, state, exc, random.random())
            record_failure(state)
            log.info(
                "pool %s: %s answered %s; retry %d in %.1fs",
                pool,
                op.describe(),
                exc.status,
                attempt,
                delay,
                extra={
                    "pool": pool,
                    "verb": op.verb,
                    "resource": op.resource,
                    "namespace": op.namespace or "",
                    "status": int(exc.status or 0),
                    "attempt": attempt,
                    "delay_s": round(delay, 3),
                },
            )
        await trio.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


# --- authentication ------------------------------------------------------------------------


class TokenSource(Protocol):
    def bearer(self) -> str:
        """A valid bearer token; may block to refresh it (called in a worker thread)."""
        ...


@attrs.frozen
class StaticToken:
    token: str = attrs.field(repr=False)

    def bearer(self) -> str:
        return self.token


class GkeTokenSource:
    """OAuth access tokens for a GCP service account, refreshed 5 minutes before expiry."""

    def __init__(
        self,
        creds: GkeCredentials,
        *,
        clock: Callable[[], float] = time.time,
        request: Any = None,
    ) -> None:
        from google.auth.transport.requests import Request
        from google.oauth2 import service_account

        self._creds = service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
            dict(creds.info), scopes=list(GKE_SCOPES)
        )
        self._request = request if request is not None else Request()
        self._clock = clock
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GkeTokenSource({self._creds.service_account_email!r})"

    def _expires_at(self) -> float:
        expiry: datetime | None = self._creds.expiry
        if expiry is None:
            return float("-inf")
        if expiry.tzinfo is None:  # google-auth keeps naive UTC datetimes
            expiry = expiry.replace(tzinfo=UTC)
        return expiry.timestamp()

    def bearer(self) -> str:
        with self._lock:
            stale = self._expires_at() - self._clock() < GKE_REFRESH_BEFORE_S
            if self._creds.token is None or stale:
                self._creds.refresh(self._request)
            return str(self._creds.token)


def eks_token(creds: EksCredentials, *, now: datetime | None = None) -> str:
    """The `k8s-aws-v1.` bearer: a presigned STS GetCallerIdentity URL, base64url'd."""
    from botocore.auth import SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as AwsCredentials

    url = f"https://sts.{creds.region}.amazonaws.com/?Action=GetCallerIdentity&Version=2011-06-15"
    request = AWSRequest(method="GET", url=url, headers={"x-k8s-aws-id": creds.cluster_name})
    if now is not None:
        request.context["timestamp"] = now.strftime("%Y%m%dT%H%M%SZ")
    signer = SigV4QueryAuth(
        AwsCredentials(creds.access_key_id, creds.secret_access_key, creds.session_token),
        "sts",
        creds.region,
        expires=60,
    )
    signer.add_auth(request)
    encoded = base64.urlsafe_b64encode(str(request.url).encode()).decode().rstrip("=")
    return "k8s-aws-v1." + encoded


class EksTokenSource:
    """EKS tokens, signed afresh every 14 minutes (EKS accepts one for 15)."""

    def __init__(
        self,
        creds: EksCredentials,
        *,
        clock: Callable[[], float] = time.time,
        sign: Callable[[EksCredentials], str] = eks_token,
    ) -> None:
        self._creds = creds
        self._clock = clock
        self._sign = sign
        self._lock = threading.Lock()
        self._token: str | None = None
        self._made_at = float("-inf")

    def __repr__(self) -> str:
        return f"EksTokenSource(cluster={self._creds.cluster_name!r})"

    def bearer(self) -> str:
        with self._lock:
            now = self._clock()
            if self._token is None or now - self._made_at >= EKS_REFRESH_EVERY_S:
                self._token = self._sign(self._creds)
                self._made_at = now
            return self._token


def _private_file(directory: Path, name: str, data: bytes) -> str:
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return str(path)


def build_api_client(
    pool: PoolConfig, *, token_source: TokenSource | None = None
) -> tuple[k8s.ApiClient, Path]:
    """A client for the pool and the private temp dir holding its CA/key files (blocking).

    The caller removes the dir after closing the client (`KubeClient.aclose` does both).
    """
    kube = pool.kubernetes
    creds: Credentials = read_credentials(pool)
    tmp = Path(tempfile.mkdtemp(prefix=f"levers9-kube-{pool.name}-"))  # mode 0700
    try:
        cfg = k8s.Configuration()
        if isinstance(creds, KubeconfigCredentials):
            k8s_config.load_kube_config_from_dict(
                config_dict=dict(creds.kubeconfig),
                context=creds.context,
                client_configuration=cfg,
                persist_config=False,
                temp_file_path=str(tmp),
            )
        elif isinstance(creds, ClientCertificateCredentials):
            cfg.cert_file = _private_file(
                tmp, "client.crt", base64.b64decode(creds.client_certificate_data)
            )
            cfg.key_file = _private_file(tmp, "client.key", base64.b64decode(creds.client_key_data))
        else:
            source = token_source or _token_source(creds)
            _use_bearer(cfg, source)
        # The pool's endpoint and CA win over anything a kubeconfig says, and verification
        # is never off, whatever `insecure-skip-tls-verify` a kubeconfig carries.
        cfg.host = kube.endpoint.rstrip("/")
        cfg.ssl_ca_cert = _private_file(tmp, "ca.crt", kube.ca_pem)
        cfg.verify_ssl = True
        return k8s.ApiClient(configuration=cfg), tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _token_source(creds: Credentials) -> TokenSource:
    if isinstance(creds, GkeCredentials):
        return GkeTokenSource(creds)
    if isinstance(creds, EksCredentials):
        return EksTokenSource(creds)
    if isinstance(creds, TokenCredentials):
        return StaticToken(creds.token)
    raise TypeError(f"no token source for {type(creds).__name__}")


def _use_bearer(cfg: k8s.Configuration, source: TokenSource) -> None:
    # The client calls the hook before every request, in the request's thread; the source
    # caches and refreshes ahead of expiry, so a long-running controlplane never restarts.
    def refresh(configuration: k8s.Configuration) -> None:
        configuration.api_key["BearerToken"] = source.bearer()

    cfg.api_key = {"BearerToken": ""}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    cfg.refresh_api_key_hook = refresh


# --- the adapter ---------------------------------------------------------------------------


class KubeApi(Protocol):
    """What the reconciler needs from a cluster; objects are the API's JSON shapes."""

    async def list_nodes(self, label_selector: str = "") -> list[dict[str, Any]]: ...

    async def list_pods(self, field_selector: str = "") -> list[dict[str, Any]]: ...

    async def list_jobs(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]: ...

    async def create_job(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def create_secret(
        self, namespace: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None: ...

    async def delete_job(self, namespace: str, name: str) -> None: ...

    async def delete_secret(self, namespace: str, name: str) -> None: ...

    async def ensure_namespace(self, namespace: str) -> None: ...

    async def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]: ...


class KubeObjects(Protocol):
    """What `levers9 cluster join` needs: objects of the kinds in `KINDS` by name (the API's
    JSON shapes, a Secret's data left out), and a Secret's value once the cluster fills it in."""

    async def read_object(
        self, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None: ...

    async def create_object(
        self, manifest: Mapping[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]: ...

    async def replace_object(self, manifest: Mapping[str, Any]) -> dict[str, Any]: ...

    async def delete_object(self, kind: str, name: str, namespace: str | None = None) -> bool: ...

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None: ...

    async def wait_secret_value(self, namespace: str, name: str, key: str) -> str: ...

    async def list_jobs(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]: ...


@attrs.frozen
class Kind:
    """A kind `KubeObjects` handles: its resource and group in RBAC's words, and the official
    client's method suffix (`read_<suffix>`, `create_<suffix>`, ...)."""

    resource: str
    group: str
    suffix: str
    namespaced: bool


RBAC_GROUP = "rbac.authorization.k8s.io"
COORDINATION_GROUP = "coordination.k8s.io"
KINDS: Mapping[str, Kind] = {
    "Namespace": Kind("namespaces", "", "namespace", namespaced=False),
    "Pod": Kind("pods", "", "namespaced_pod", namespaced=True),
    "ServiceAccount": Kind("serviceaccounts", "", "namespaced_service_account", namespaced=True),
    "Secret": Kind("secrets", "", "namespaced_secret", namespaced=True),
    "ClusterRole": Kind("clusterroles", RBAC_GROUP, "cluster_role", namespaced=False),
    "ClusterRoleBinding": Kind(
        "clusterrolebindings", RBAC_GROUP, "cluster_role_binding", namespaced=False
    ),
    "Role": Kind("roles", RBAC_GROUP, "namespaced_role", namespaced=True),
    "RoleBinding": Kind("rolebindings", RBAC_GROUP, "namespaced_role_binding", namespaced=True),
}
# RBAC's verb → the official client's word for it.
_CLIENT_VERB = {"get": "read", "create": "create", "update": "replace", "delete": "delete"}
SECRET_POLL_S = 0.2
"""How often `wait_secret_value` reads the Secret again."""


WATCH_SLACK_S = 30.0


@attrs.frozen
class Collection:
    """What a cache lists and watches: a resource (nodes, pods, jobs, secrets), in one
    namespace or in all, narrowed by label and field selectors on the server."""

    resource: str
    namespace: str | None = None
    label_selector: str = ""
    field_selector: str = ""

    def describe(self) -> str:
        where = f" in namespace {self.namespace}" if self.namespace else ""
        chosen = ",".join(s for s in (self.label_selector, self.field_selector) if s)
        return f"{self.resource}{where}" + (f" ({chosen})" if chosen else "")


@attrs.frozen
class Page(Generic[T]):
    """One page of a list: facts by object key, the list's version, and the continue token."""

    items: dict[str, T]
    resource_version: str
    continue_token: str | None


def secret_value(secret: Mapping[str, Any], key: str) -> str | None:
    """One value of a Secret as the API returns it (base64 in `data`), decoded; None when the
    key is missing or not text."""
    encoded = (secret.get("data") or {}).get(key)
    if not isinstance(encoded, str):
        return None
    try:
        return base64.b64decode(encoded).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def object_key(obj: Mapping[str, Any]) -> str:
    """`namespace/name`, or `name` for a cluster-scoped object."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


class WatchResponse:
    """An open watch: `read` (blocking, in a thread) gives its bytes as they come, b"" at its
    end; `shutdown` (from any thread) ends a read that waits."""

    def __init__(self, response: Any, translate: Callable[[Exception], KubeError]) -> None:
        self._response = response
        self._translate = translate

    def read(self) -> bytes:
        try:
            data: bytes = self._response.read1(1 << 16)
            return data
        except Exception as exc:
            raise self._translate(exc) from None

    def shutdown(self) -> None:
        try:
            self._response.shutdown()
        except Exception:  # a connection already gone has nothing to end
            pass

    def close(self) -> None:
        try:
            self._response.release_conn()
            self._response.close()
        except Exception:  # nothing to release
            pass


class KubeClient:
    """`KubeApi` and `KubeObjects` over the official client; blocking calls run in worker
    threads."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        pool: str,
        temp_dir: Path | None = None,
        request_timeout_s: float = 30.0,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
    ) -> None:
        self._api = api_client
        self._core = k8s.CoreV1Api(api_client)
        self._batch = k8s.BatchV1Api(api_client)
        self._rbac = k8s.RbacAuthorizationV1Api(api_client)
        self._pool = pool
        self._temp_dir = temp_dir
        # Bounds each blocking call so an abandoned thread ends on its own.
        self._timeout = (min(10.0, request_timeout_s), request_timeout_s)
        self._budget = TokenBucket(rate=qps, burst=burst)
        self.throttled_s = 0.0
        """Seconds callers waited for the budget, for tests and benchmarks."""

    def relabel(self, pools: str) -> None:
        """The pool name(s) its errors and log lines name (a client shared by pools)."""
        self._pool = pools

    async def _throttle(self) -> None:
        wait_s = self._budget.reserve(trio.current_time())
        if wait_s > 0:
            self.throttled_s += wait_s
            await trio.sleep(wait_s)

    def __repr__(self) -> str:
        return f"KubeClient(pool={self._pool!r})"

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self._close)

    def _close(self) -> None:
        self._api.close()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    async def _call(
        self,
        op: Operation,
        fn: Callable[..., Any],
        *args: Any,
        parse: Callable[[Any], Any] | None = None,
        **kw: Any,
    ) -> Any:
        """`fn`'s JSON answer, or what `parse` makes of it (in the worker thread)."""

        def once() -> Any:
            try:
                response = fn(*args, _preload_content=False, _request_timeout=self._timeout, **kw)
                data = response.data
                value = json.loads(data) if data else {}
                return value if parse is None else parse(value)
            except ApiException:
                raise
            except KubeError:
                raise
            except Exception as exc:
                raise self._translate_other(exc, op) from None

        return await call_with_retry(once, op, pool=self._pool, throttle=self._throttle)

    def _translate_other(self, exc: Exception, op: Operation) -> KubeError:
        prefix = f"pool {self._pool}: cannot {op.describe()}"
        failure = type(exc).__name__
        if _tls_failed(exc):
            return KubeTlsError(f"{prefix}: {_TLS_ADVICE.format(self._pool)}")
        if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
            return KubeUnreachable(
                f"{prefix}: the API server did not answer ({failure}); the next pass tries again",
                failure=failure,
            )
        google_auth, botocore = _token_exceptions()
        if isinstance(exc, google_auth.RefreshError):
            return KubeAuthError(
                ErrorCode.UNAUTHENTICATED,
                f"{prefix}: Google refused the service-account key "
                f"({_first_arg(exc)}); check config.worker.pools[{self._pool}]"
                ".kubernetes.credentials",
                field=f"worker.pools[{self._pool}].kubernetes.credentials",
                failure=failure,
            )
        if isinstance(exc, google_auth.GoogleAuthError):
            return KubeUnavailable(
                f"{prefix}: Google's token endpoint did not answer", failure=failure
            )
        if isinstance(exc, botocore.BotoCoreError | botocore.ClientError):
            return KubeAuthError(
                ErrorCode.UNAUTHENTICATED,
                f"{prefix}: cannot sign the EKS token ({failure}); check "
                f"config.worker.pools[{self._pool}].kubernetes.credentials",
                failure=failure,
            )
        if isinstance(exc, ValueError):
            return KubeError(
                ErrorCode.INTERNAL,
                f"{prefix}: the API server's answer is not JSON",
                failure=failure,
            )
        return KubeError(ErrorCode.INTERNAL, f"{prefix}: {failure}", failure=failure)

    async def _list(
        self, op: Operation, fn: Callable[..., Any], *args: Any, **kw: Any
    ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page_kw = dict(kw, limit=LIST_PAGE)
            if token:
                page_kw["_continue"] = token
            page = await self._call(op, fn, *args, **page_kw)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    async def list_nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        op = Operation("list", "nodes")
        return await self._list(op, self._core.list_node, label_selector=label_selector)

    async def list_pods(self, field_selector: str = "") -> list[dict[str, Any]]:
        op = Operation("list", "pods")
        return await self._list(
            op, self._core.list_pod_for_all_namespaces, field_selector=field_selector
        )

    async def list_jobs(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        op = Operation("list", "jobs", "batch", namespace)
        return await self._list(
            op, self._batch.list_namespaced_job, namespace, label_selector=label_selector
        )

    # -- caches: pages of facts, watches (`control.kube.informer`) -------------------------

    def _collection(
        self, collection: Collection
    ) -> tuple[Operation, Callable[..., Any], tuple[str, ...]]:
        resource, namespace = collection.resource, collection.namespace
        group = "batch" if resource == "jobs" else ""
        op = Operation("list", resource, group, namespace)
        if resource == "nodes":
            return op, self._core.list_node, ()
        if resource == "pods" and namespace is None:
            return op, self._core.list_pod_for_all_namespaces, ()
        if namespace is None:
            raise ValueError(f"{resource} are listed in one namespace")
        methods = {
            "pods": self._core.list_namespaced_pod,
            "jobs": self._batch.list_namespaced_job,
            "secrets": self._core.list_namespaced_secret,
        }
        return op, methods[resource], (namespace,)

    async def list_page(
        self,
        collection: Collection,
        facts: Callable[[dict[str, Any]], T | None],
        *,
        continue_token: str | None = None,
        limit: int = LIST_PAGE,
    ) -> Page[T]:
        """One page of the collection, each object cut down to `facts` (None leaves it out)
        in the worker thread; `KubeExpired` when the continue token has expired."""
        op, fn, args = self._collection(collection)
        kw: dict[str, Any] = {
            "limit": limit,
            "label_selector": collection.label_selector,
            "field_selector": collection.field_selector,
        }
        if continue_token:
            kw["_continue"] = continue_token

        def parse(page: Any) -> Page[T]:
            items: dict[str, T] = {}
            for obj in page.get("items") or ():
                fact = facts(obj)
                if fact is not None:
                    items[object_key(obj)] = fact
            meta = page.get("metadata") or {}
            return Page(items, str(meta.get("resourceVersion") or ""), meta.get("continue"))

        page: Page[T] = await self._call(op, fn, *args, parse=parse, **kw)
        return page

    async def watch(
        self, collection: Collection, resource_version: str, *, timeout_s: int
    ) -> WatchResponse:
        """A watch of the collection from `resource_version` with bookmarks, ended by the
        server after `timeout_s`; the caller reads it (`WatchResponse.read`) in a thread."""
        op, fn, args = self._collection(collection)
        op = attrs.evolve(op, verb="watch")
        # A watch is quiet for at most the time between bookmarks; no byte for longer than
        # its own timeout means the connection is dead.
        timeout = (self._timeout[0], float(timeout_s) + WATCH_SLACK_S)

        def once() -> WatchResponse:
            try:
                response = fn(
                    *args,
                    watch=True,
                    resource_version=resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=timeout_s,
                    label_selector=collection.label_selector,
                    field_selector=collection.field_selector,
                    _preload_content=False,
                    _request_timeout=timeout,
                )
            except ApiException:
                raise
            except Exception as exc:
                raise self._translate_other(exc, op) from None
            return WatchResponse(response, lambda exc: self._translate_other(exc, op))

        return await call_with_retry(once, op, pool=self._pool, throttle=self._throttle)

    async def create_job(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        op = Operation("create", "jobs", "batch", namespace, _name(manifest))
        result: dict[str, Any] = await self._call(
            op, self._batch.create_namespaced_job, namespace, dict(manifest)
        )
        return result

    async def create_secret(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        op = Operation("create", "secrets", "", namespace, _name(manifest))
        result: dict[str, Any] = await self._call(
            op, self._core.create_namespaced_secret, namespace, dict(manifest)
        )
        # The answer echoes the secret's data; nobody above needs it back.
        result.pop("data", None)
        result.pop("stringData", None)
        return result

    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One value of a Secret (decoded), or None when the Secret or the key is missing."""
        op = Operation("get", "secrets", "", namespace, name)
        try:
            result: dict[str, Any] = await self._call(
                op, self._core.read_namespaced_secret, name, namespace
            )
        except KubeNotFound:
            return None
        return secret_value(result, key)

    async def delete_job(self, namespace: str, name: str) -> None:
        op = Operation("delete", "jobs", "batch", namespace, name)
        await self._call(
            op,
            self._batch.delete_namespaced_job,
            name,
            namespace,
            propagation_policy="Background",
        )

    async def delete_secret(self, namespace: str, name: str) -> None:
        op = Operation("delete", "secrets", "", namespace, name)
        await self._call(op, self._core.delete_namespaced_secret, name, namespace)

    async def create_event(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        op = Operation("create", "events", "", namespace, _name(manifest))
        result: dict[str, Any] = await self._call(
            op, self._core.create_namespaced_event, namespace, dict(manifest)
        )
        return result

    async def patch_event(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A strategic merge patch, as client-go's recorder sends (left to itself, the official
        client labels a dict body a JSON patch, which the API server refuses)."""
        op = Operation("patch", "events", "", namespace, name)
        result: dict[str, Any] = await self._call(
            op,
            self._core.patch_namespaced_event,
            name,
            namespace,
            dict(patch),
            _content_type="application/strategic-merge-patch+json",
        )
        return result

    async def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]:
        """The Events in `namespace` its field selector picks (the Job controller's
        `FailedCreate` about our Jobs: `control.kube.podsecurity`)."""
        return await self._list(
            Operation("list", "events", "", namespace),
            self._core.list_namespaced_event,
            namespace,
            field_selector=field_selector,
        )

    async def list_secrets(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The Secrets matching the selector, data included (for the joined-pool store)."""
        return await self._list(
            Operation("list", "secrets", "", namespace),
            self._core.list_namespaced_secret,
            namespace,
            label_selector=label_selector,
        )

    async def replace_secret(self, namespace: str, manifest: Mapping[str, Any]) -> None:
        name = _name(manifest) or ""
        op = Operation("update", "secrets", "", namespace, name)
        await self._call(op, self._core.replace_namespaced_secret, name, namespace, dict(manifest))

    async def ensure_namespace(self, namespace: str) -> None:
        """Create the namespace unless it exists, labelled for Pod Security to let the
        privileged worker pods in (one that exists is left as it is; a refusal then shows on
        the nodes). An identity that may not read namespaces
        (`levers9 cluster join` grants none; it creates the namespace itself) goes on: a
        missing namespace then shows as the first Job that cannot be created."""
        try:
            await self._call(
                Operation("get", "namespaces", name=namespace), self._core.read_namespace, namespace
            )
            return
        except KubeNotFound:
            pass
        except KubeAuthError as exc:
            if exc.code is not ErrorCode.PERMISSION_DENIED:
                raise
            log.debug(
                "pool %s: may not read namespace %s; assuming it exists",
                self._pool,
                namespace,
                extra={"pool": self._pool, "namespace": namespace},
            )
            return
        manifest = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": dict(PRIVILEGED_LABELS)},
        }
        try:
            await self._call(
                Operation("create", "namespaces", name=namespace),
                self._core.create_namespace,
                manifest,
            )
        except KubeAlreadyExists:
            pass

    # -- leases (`control.kube.lease`) -------------------------------------------------------

    def _leases(self) -> k8s.CoordinationV1Api:
        return k8s.CoordinationV1Api(self._api)

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Lease, or None when there is none of that name."""
        op = Operation("get", "leases", COORDINATION_GROUP, namespace, name)
        try:
            found: dict[str, Any] = await self._call(
                op, self._leases().read_namespaced_lease, name, namespace
            )
        except KubeNotFound:
            return None
        return found

    async def create_lease(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create the Lease; `KubeAlreadyExists` when another got there first."""
        op = Operation("create", "leases", COORDINATION_GROUP, namespace, _name(manifest))
        created: dict[str, Any] = await self._call(
            op, self._leases().create_namespaced_lease, namespace, dict(manifest)
        )
        return created

    async def replace_lease(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Update the Lease; with the manifest's `metadata.resourceVersion` set, `KubeConflict`
        when it changed since that version was read."""
        name = _name(manifest) or ""
        op = Operation("update", "leases", COORDINATION_GROUP, namespace, name)
        replaced: dict[str, Any] = await self._call(
            op, self._leases().replace_namespaced_lease, name, namespace, dict(manifest)
        )
        return replaced

    # -- objects by kind (`KubeObjects`) ----------------------------------------------------

    def _kind(
        self, verb: str, kind: str, name: str, namespace: str | None
    ) -> tuple[Operation, Callable[..., Any]]:
        """What the call does in RBAC's words, and the client's method that does it."""
        spec = KINDS.get(kind)
        if spec is None:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        if spec.namespaced != (namespace is not None):
            raise ValueError(f"a {kind} {'needs' if spec.namespaced else 'takes no'} namespace")
        api = self._rbac if spec.group == RBAC_GROUP else self._core
        method: Callable[..., Any] = getattr(api, f"{_CLIENT_VERB[verb]}_{spec.suffix}")
        return Operation(verb, spec.resource, spec.group, namespace, name), method

    async def read_object(
        self, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None when there is none of that name."""
        op, fn = self._kind("get", kind, name, namespace)
        scope = (namespace,) if namespace is not None else ()
        try:
            found: dict[str, Any] = await self._call(op, fn, name, *scope)
        except KubeNotFound:
            return None
        return _without_data(found)

    async def create_object(
        self, manifest: Mapping[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        """Create the object; with `dry_run` the server only admits it (`dryRun=All`: every
        admission check runs, nothing is stored), so a refusal says what it would refuse."""
        kind, name, namespace = _identity(manifest)
        op, fn = self._kind("create", kind, name, namespace)
        scope = (namespace,) if namespace is not None else ()
        extra: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
        created: dict[str, Any] = await self._call(op, fn, *scope, dict(manifest), **extra)
        return _without_data(created)

    async def replace_object(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Bring the object to the manifest's shape (an update without a resourceVersion:
        whatever was there is overwritten)."""
        kind, name, namespace = _identity(manifest)
        op, fn = self._kind("update", kind, name, namespace)
        scope = (namespace,) if namespace is not None else ()
        replaced: dict[str, Any] = await self._call(op, fn, name, *scope, dict(manifest))
        return _without_data(replaced)

    async def delete_object(self, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete the object; False when it was already gone."""
        op, fn = self._kind("delete", kind, name, namespace)
        scope = (namespace,) if namespace is not None else ()
        try:
            await self._call(op, fn, name, *scope)
        except KubeNotFound:
            return False
        return True

    async def wait_secret_value(self, namespace: str, name: str, key: str) -> str:
        """The Secret's value for `key`, once it has one (a ServiceAccount token the cluster's
        token controller fills in). Waits for as long as it takes: bound it with
        `trio.fail_after` or `trio.move_on_after`."""
        while True:
            value = await self.read_secret_value(namespace, name, key)
            if value:
                return value
            await trio.sleep(SECRET_POLL_S)


def _identity(manifest: Mapping[str, Any]) -> tuple[str, str, str | None]:
    metadata = manifest.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    namespace = metadata.get("namespace")
    return (
        str(manifest.get("kind", "")),
        str(metadata.get("name", "")),
        str(namespace) if namespace is not None else None,
    )


def _without_data(obj: dict[str, Any]) -> dict[str, Any]:
    # A Secret's answer echoes its data; values are read with `read_secret_value` only.
    if obj.get("kind") == "Secret":
        obj.pop("data", None)
        obj.pop("stringData", None)
    return obj


def _token_exceptions() -> tuple[Any, Any]:
    """google-auth's and botocore's exception modules (imported when first needed: most
    controlplanes sign no tokens with either)."""
    import botocore.exceptions
    import google.auth.exceptions

    return google.auth.exceptions, botocore.exceptions


def _name(manifest: Mapping[str, Any]) -> str | None:
    metadata = manifest.get("metadata")
    return str(metadata.get("name")) if isinstance(metadata, Mapping) else None


def _first_arg(exc: Exception) -> str:
    return str(exc.args[0])[:200] if exc.args else type(exc).__name__


@asynccontextmanager
async def open_kube_client(
    pool: PoolConfig, *, request_timeout_s: float = 30.0
) -> AsyncIterator[KubeClient]:
    """A `KubeClient` for the pool; its connections and temp files go away on exit."""
    api_client, temp_dir = await trio.to_thread.run_sync(build_api_client, pool)
    client = KubeClient(
        api_client,
        pool=pool.name,
        temp_dir=temp_dir,
        request_timeout_s=request_timeout_s,
        qps=pool.kubernetes.qps,
        burst=pool.kubernetes.burst,
    )
    try:
        yield client
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


# --- an operator's kubeconfig (`levers9 cluster join`) -----------------------------------


@attrs.frozen
class KubeconfigContexts:
    """The contexts a kubeconfig names, and its current one."""

    names: tuple[str, ...]
    current: str | None


@contextmanager
def _kubeconfig_errors(path: str | None) -> Iterator[None]:
    where = path or "the default kubeconfig"
    try:
        yield
    except ConfigException as exc:
        raise KubeconfigError(f"cannot use {where}: {exc}") from None
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        # The client's loader assumes a well-formed file and fails on anything else.
        raise NotAKubeconfig(f"{where} is not a kubeconfig (clusters, users, contexts)") from None


def kubeconfig_contexts(path: str | None) -> KubeconfigContexts:
    """The contexts of the kubeconfig at `path` (`KUBECONFIG` or ~/.kube/config when None);
    blocking. Raises `KubeconfigError`."""
    with _kubeconfig_errors(path):
        contexts, current = k8s_config.list_kube_config_contexts(config_file=path)
        name = (current or {}).get("name")
        return KubeconfigContexts(
            names=tuple(str(c.get("name")) for c in contexts),
            current=str(name) if name is not None else None,
        )


def build_kubeconfig_client(path: str | None, context: str) -> tuple[k8s.ApiClient, Path, bytes]:
    """A client as the kubeconfig's context says (its endpoint, CA and credentials, plugins
    included), the private temp dir for the files the loader writes, and the CA (blocking).

    Unlike a pool's client this is the operator's own: the kubeconfig is taken as it is."""
    tmp = Path(tempfile.mkdtemp(prefix="levers9-kubeconfig-"))  # mode 0700
    try:
        cfg = k8s.Configuration()
        with _kubeconfig_errors(path):
            k8s_config.load_kube_config(
                config_file=path,
                context=context,
                client_configuration=cfg,
                persist_config=False,
                temp_file_path=str(tmp),
            )
            ca_pem = Path(cfg.ssl_ca_cert).read_bytes() if cfg.ssl_ca_cert else b""
        return k8s.ApiClient(configuration=cfg), tmp, ca_pem
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@attrs.frozen
class KubeconfigCluster:
    """An operator's cluster: the client, where its API is and the CA the kubeconfig trusts.

    Its client's messages and log lines name the context where a pool's client names the
    pool; `levers9 cluster join` words the errors itself, by their kind."""

    client: KubeClient
    context: str
    endpoint: str
    ca_pem: bytes = attrs.field(repr=False)


@asynccontextmanager
async def open_kubeconfig_client(
    path: str | None, context: str, *, request_timeout_s: float = 30.0
) -> AsyncIterator[KubeconfigCluster]:
    """The cluster of a kubeconfig context; its connections and temp files go away on exit.
    Raises `KubeconfigError` when the kubeconfig cannot be used."""
    api_client, temp_dir, ca_pem = await trio.to_thread.run_sync(
        build_kubeconfig_client, path, context
    )
    client = KubeClient(
        api_client, pool=context, temp_dir=temp_dir, request_timeout_s=request_timeout_s
    )
    try:
        yield KubeconfigCluster(
            client=client,
            context=context,
            endpoint=str(api_client.configuration.host),
            ca_pem=ca_pem,
        )
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()
