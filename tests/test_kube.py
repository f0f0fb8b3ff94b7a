"""The Kubernetes adapter: tokens by flavor, error translation, retries, private temp files.

Nothing here leaves loopback: the EKS token is only signed (never sent), the GKE token
exchange goes to a token endpoint this test serves on 127.0.0.1, and objects by kind are read
and written on the Kubernetes API stand-in.
"""

from __future__ import annotations

import base64
import json
import stat
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import botocore.exceptions
import google.auth.exceptions
import pytest
import requests
import trio
import urllib3
from google.auth.transport.requests import Request
from kubernetes.client.exceptions import ApiException

from control.kube.adapter import (
    RETRY,
    RETRY_ATTEMPTS,
    EksTokenSource,
    GkeTokenSource,
    KubeAlreadyExists,
    KubeAuthError,
    KubeClient,
    KubeconfigError,
    KubeError,
    KubeNotFound,
    KubeTlsError,
    KubeUnavailable,
    KubeUnreachable,
    NotAKubeconfig,
    Operation,
    build_api_client,
    call_with_retry,
    eks_token,
    kubeconfig_contexts,
    open_kube_client,
    open_kubeconfig_client,
    retry_delay,
    translate_api_exception,
)
from control.kube.pools import EksCredentials, GkeCredentials, PoolConfig, load_pools
from sim.kubeapi.store import KubeStandin
from tests.test_pools import EKS_CREDS, ca_pem, gke_block, rsa_pem, sa_key
from wire.backoff import BackoffState
from wire.errors import ErrorCode

pytest_plugins = ["tests.kube_fixtures"]

FAKE_EKS = EksCredentials(
    access_key_id="AKIAFAKEFAKEFAKE",
    secret_access_key="fake-secret-key-never-sent",
    session_token="fake-session-token",
    region="eu-west-1",
    cluster_name="gpu-cluster",
)


def _decode_eks(token: str) -> str:
    assert token.startswith("k8s-aws-v1.")
    body = token.removeprefix("k8s-aws-v1.")
    assert "=" not in body
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()


def test_eks_token_is_a_presigned_get_caller_identity_url() -> None:
    url = urlsplit(_decode_eks(eks_token(FAKE_EKS)))
    query = parse_qs(url.query)
    assert url.scheme == "https"
    assert url.hostname == "sts.eu-west-1.amazonaws.com"
    assert query["Action"] == ["GetCallerIdentity"]
    assert query["X-Amz-Expires"] == ["60"]
    assert "x-k8s-aws-id" in query["X-Amz-SignedHeaders"][0].split(";")
    assert query["X-Amz-Credential"][0].startswith("AKIAFAKEFAKEFAKE/")
    assert "/eu-west-1/sts/aws4_request" in query["X-Amz-Credential"][0]
    assert query["X-Amz-Security-Token"] == ["fake-session-token"]
    assert "fake-secret-key-never-sent" not in url.geturl()


def test_eks_token_is_signed_again_after_fourteen_minutes() -> None:
    now = [1000.0]
    signed: list[EksCredentials] = []

    def sign(creds: EksCredentials) -> str:
        signed.append(creds)
        return f"k8s-aws-v1.token-{len(signed)}"

    source = EksTokenSource(FAKE_EKS, clock=lambda: now[0], sign=sign)
    assert source.bearer() == "k8s-aws-v1.token-1"
    now[0] += 13 * 60
    assert source.bearer() == "k8s-aws-v1.token-1"
    now[0] += 60
    assert source.bearer() == "k8s-aws-v1.token-2"
    assert "fake-secret" not in repr(source)


class TokenEndpoint:
    """A loopback OAuth token endpoint answering each JWT-bearer grant with a new token."""

    def __init__(self, expires_in: int = 3600) -> None:
        self.expires_in = expires_in
        self.grants: list[dict[str, list[str]]] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += await stream.receive_some(65536)
        self.grants.append(parse_qs(body.decode()))
        answer = json.dumps(
            {
                "access_token": f"ya29.token-{len(self.grants)}",
                "expires_in": self.expires_in,
                "token_type": "Bearer",
            }
        ).encode()
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n".encode()
            + answer
        )
        await stream.aclose()


def _jwt_claims(assertion: str) -> dict[str, Any]:
    payload = assertion.split(".")[1]
    claims: dict[str, Any] = json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    )
    return claims


def _local_request() -> Request:
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment: the endpoint is on loopback
    return Request(session=session)


async def test_gke_bearer_comes_from_the_token_endpoint_and_is_refreshed_early() -> None:
    endpoint = TokenEndpoint(expires_in=3600)
    async with trio.open_nursery() as nursery:
        serve = partial(trio.serve_tcp, endpoint.handle, 0, host="127.0.0.1")
        (listener,) = await nursery.start(serve)
        port = listener.socket.getsockname()[1]
        token_uri = f"http://127.0.0.1:{port}/token"
        now = [time.time()]
        source = GkeTokenSource(
            GkeCredentials(info=sa_key(token_uri)), clock=lambda: now[0], request=_local_request()
        )

        assert await trio.to_thread.run_sync(source.bearer) == "ya29.token-1"
        (grant,) = endpoint.grants
        assert grant["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
        claims = _jwt_claims(grant["assertion"][0])
        assert claims["iss"] == "levers9@proj.iam.gserviceaccount.com"
        assert claims["scope"] == "https://www.googleapis.com/auth/cloud-platform"

        now[0] += 3600 - 6 * 60  # six minutes left: still used as is
        assert await trio.to_thread.run_sync(source.bearer) == "ya29.token-1"
        assert len(endpoint.grants) == 1
        now[0] += 2 * 60  # four minutes left: refreshed before it expires
        assert await trio.to_thread.run_sync(source.bearer) == "ya29.token-2"
        assert len(endpoint.grants) == 2

        # The client built for a GKE pool sends exactly that bearer (the clock is put back to
        # when token-2 was issued, so it has its whole hour left).
        now[0] = time.time()
        (pool,) = load_pools([gke_block(credentials=sa_key(token_uri))]).pools
        api_client, temp_dir = await trio.to_thread.run_sync(
            lambda: build_api_client(pool, token_source=source)
        )
        try:
            auth = await trio.to_thread.run_sync(api_client.configuration.auth_settings)
            assert auth["BearerToken"]["value"] == "Bearer ya29.token-2"
        finally:
            await KubeClient(api_client, pool=pool.name, temp_dir=temp_dir).aclose()
        nursery.cancel_scope.cancel()


def _api_exception(status: int, body: dict[str, Any] | None = None, **headers: str) -> ApiException:
    exc = ApiException(status=status, reason="reason")
    exc.body = json.dumps(body).encode() if body is not None else None
    exc.headers = dict(headers)
    return exc


FORBIDDEN = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "message": 'jobs.batch is forbidden: User "system:serviceaccount:levers9:levers9" cannot '
    'create resource "jobs" in API group "batch" in the namespace "levers9"',
    "reason": "Forbidden",
    "details": {"group": "batch", "kind": "jobs"},
    "code": 403,
}
CREATE_JOB = Operation("create", "jobs", "batch", "levers9", "levers9-gke-a100-n1-1")


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        (401, KubeAuthError, ErrorCode.UNAUTHENTICATED),
        (403, KubeAuthError, ErrorCode.PERMISSION_DENIED),
        (404, KubeNotFound, ErrorCode.NOT_FOUND),
        (409, KubeAlreadyExists, ErrorCode.ALREADY_EXISTS),
        (429, KubeUnavailable, ErrorCode.UNAVAILABLE),
        (500, KubeUnavailable, ErrorCode.UNAVAILABLE),
        (503, KubeUnavailable, ErrorCode.UNAVAILABLE),
        (422, KubeError, ErrorCode.INVALID_ARGUMENT),
    ],
)
def test_api_exceptions_become_our_errors(
    status: int, kind: type[KubeError], code: ErrorCode
) -> None:
    body = dict(FORBIDDEN, code=status) if status == 403 else {"kind": "Status", "code": status}
    error = translate_api_exception(_api_exception(status, body), CREATE_JOB, pool="gke-a100")
    assert type(error) is kind
    assert error.code is code
    assert "pool gke-a100" in error.message
    assert "create jobs.batch 'levers9-gke-a100-n1-1' in namespace levers9" in error.message


def test_forbidden_says_which_permission_is_missing() -> None:
    error = translate_api_exception(_api_exception(403, FORBIDDEN), CREATE_JOB, pool="gke-a100")
    assert "may not create jobs (API group 'batch') in namespace levers9" in error.message
    assert "Role and RoleBinding" in error.message

    # Cluster-scoped, and only the details and our own call to go by.
    body = {"kind": "Status", "code": 403, "message": "nope", "details": {"kind": "nodes"}}
    error = translate_api_exception(_api_exception(403, body), Operation("list", "nodes"), pool="p")
    assert "may not list nodes (API group 'core') cluster-wide" in error.message
    assert "ClusterRole" in error.message


def _as_the_client_raises(failure: urllib3.exceptions.SSLError) -> ApiException:
    """What the official client raises for a TLS failure: an ApiException with status 0,
    raised while handling the urllib3 error (so that error is its context)."""
    try:
        try:
            raise failure
        except urllib3.exceptions.SSLError as exc:
            raise ApiException(status=0, reason=f"{type(exc).__name__}\n{exc}")  # noqa: B904
    except ApiException as raised:
        return raised


def test_tls_failure_points_at_the_ca() -> None:
    exc = _as_the_client_raises(urllib3.exceptions.SSLError("certificate verify failed"))
    error = translate_api_exception(exc, Operation("list", "nodes"), pool="p")
    assert type(error) is KubeTlsError
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "config.worker.pools[p].kubernetes.caData" in error.message


def test_tls_is_told_by_the_exception_not_its_text() -> None:
    # A reason that merely says "SSLError", with no TLS failure behind it, is no TLS failure.
    exc = ApiException(status=0, reason="SSLError\nsomething else entirely")
    error = translate_api_exception(exc, Operation("list", "nodes"), pool="p")
    assert not isinstance(error, KubeTlsError)
    assert error.code is ErrorCode.INTERNAL
    assert error.status is None


async def test_a_ca_that_is_not_the_endpoints_is_named(kube: KubeStandin) -> None:
    import trustme

    other_ca = base64.b64encode(trustme.CA().cert_pem.bytes()).decode()
    pool = _pool(
        flavor="generic", endpoint=kube.url, caData=other_ca, credentials={"token": kube.token}
    )
    async with open_kube_client(pool, request_timeout_s=5) as client:
        with trio.fail_after(30), pytest.raises(KubeTlsError) as refused:
            await client.list_nodes()
    assert refused.value.code is ErrorCode.FAILED_PRECONDITION
    assert f"config.worker.pools[{pool.name}].kubernetes.caData" in refused.value.message


class _Raising:
    """A token source that fails as a token library does."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def bearer(self) -> str:
        raise self.exc


class RefreshError(Exception):
    """Not google-auth's: only the name is the same."""


@pytest.mark.parametrize(
    ("failure", "kind", "says"),
    [
        (
            google.auth.exceptions.RefreshError("invalid_grant"),  # type: ignore[no-untyped-call]
            KubeAuthError,
            "Google refused",
        ),
        (
            google.auth.exceptions.TransportError("timed out"),  # type: ignore[no-untyped-call]
            KubeUnavailable,
            "token endpoint",
        ),
        (botocore.exceptions.NoCredentialsError(), KubeAuthError, "cannot sign the EKS token"),
        (RefreshError("look-alike"), KubeError, "RefreshError"),
    ],
)
async def test_token_library_errors_are_told_by_their_type(
    failure: Exception, kind: type[KubeError], says: str
) -> None:
    # The token source fails before any request is sent: nothing leaves the host.
    pool = _pool()
    api_client, temp_dir = await trio.to_thread.run_sync(
        lambda: build_api_client(pool, token_source=_Raising(failure))
    )
    client = KubeClient(api_client, pool=pool.name, temp_dir=temp_dir)
    try:
        with pytest.raises(KubeError) as raised:
            await client.list_nodes()
    finally:
        await client.aclose()
    assert type(raised.value) is kind
    assert says in raised.value.message
    assert raised.value.failure == type(failure).__name__


def test_retry_delay_honours_retry_after_within_a_cap() -> None:
    state = BackoffState()
    assert retry_delay(RETRY, state, _api_exception(429, None, **{"Retry-After": "7"}), 0.0) == 7
    assert (
        retry_delay(RETRY, state, _api_exception(429, None, **{"Retry-After": "9999"}), 0.0) == 60
    )
    state.failures = 30
    assert retry_delay(RETRY, state, _api_exception(503), 0.99) <= RETRY.cap_s


def _flaky(failures: list[ApiException], result: str) -> tuple[Callable[[], str], list[int]]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return result

    return call, calls


async def test_429_is_retried_then_succeeds(autojump_clock: trio.testing.MockClock) -> None:
    fn, calls = _flaky(
        [_api_exception(429, None, **{"Retry-After": "2"}), _api_exception(503)], "ok"
    )
    start = trio.current_time()
    assert await call_with_retry(fn, Operation("list", "nodes"), pool="p") == "ok"
    assert len(calls) == 3
    assert trio.current_time() - start >= 2  # waited at least what the server asked


async def test_persistent_5xx_becomes_unavailable(autojump_clock: trio.testing.MockClock) -> None:
    fn, calls = _flaky([_api_exception(500) for _ in range(10)], "never")
    with pytest.raises(KubeUnavailable, match=f"after {RETRY_ATTEMPTS} tries"):
        await call_with_retry(fn, Operation("list", "nodes"), pool="p")
    assert len(calls) == RETRY_ATTEMPTS


async def test_client_errors_are_not_retried(autojump_clock: trio.testing.MockClock) -> None:
    fn, calls = _flaky([_api_exception(409, {"kind": "Status", "code": 409})], "never")
    with pytest.raises(KubeAlreadyExists):
        await call_with_retry(fn, CREATE_JOB, pool="p")
    assert len(calls) == 1


def _pool(**kube: Any) -> PoolConfig:
    (pool,) = load_pools([gke_block(**kube)]).pools
    return pool


def _private(path: str) -> bool:
    return stat.S_IMODE(Path(path).stat().st_mode) == 0o600


async def test_token_client_verifies_the_cluster_ca_and_cleans_up() -> None:
    pool = _pool(flavor="generic", credentials={"token": "generic-bearer-token"})
    api_client, temp_dir = await trio.to_thread.run_sync(build_api_client, pool)
    cfg = api_client.configuration
    assert cfg.host == "https://34.0.0.10"
    assert cfg.verify_ssl is True
    assert Path(cfg.ssl_ca_cert).read_bytes() == ca_pem()
    assert _private(cfg.ssl_ca_cert)
    assert cfg.auth_settings()["BearerToken"]["value"] == "Bearer generic-bearer-token"
    client = KubeClient(api_client, pool=pool.name, temp_dir=temp_dir)
    assert "generic-bearer-token" not in repr(client)
    await client.aclose()
    assert not temp_dir.exists()


async def test_client_certificate_is_in_private_files_removed_on_close() -> None:
    creds = {
        "clientCertificateData": base64.b64encode(ca_pem()).decode(),
        "clientKeyData": base64.b64encode(rsa_pem().encode()).decode(),
    }
    pool = _pool(flavor="generic", credentials=creds)
    api_client, temp_dir = await trio.to_thread.run_sync(build_api_client, pool)
    cfg = api_client.configuration
    assert Path(cfg.key_file).read_text() == rsa_pem()
    assert _private(cfg.key_file)
    assert stat.S_IMODE(temp_dir.stat().st_mode) == 0o700
    await KubeClient(api_client, pool=pool.name, temp_dir=temp_dir).aclose()
    assert not Path(cfg.key_file).exists()


async def test_kubeconfig_cannot_switch_verification_off() -> None:
    kubeconfig: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": "https://10.9.9.9", "insecure-skip-tls-verify": True},
            }
        ],
        "users": [{"name": "u", "user": {"token": "kubeconfig-token"}}],
        "contexts": [
            {"name": "ctx", "context": {"cluster": "c", "user": "u"}},
            {"name": "other", "context": {"cluster": "c", "user": "nobody"}},
        ],
        "current-context": "other",
    }
    pool = _pool(flavor="generic", credentials={"kubeconfig": kubeconfig, "context": "ctx"})
    api_client, temp_dir = await trio.to_thread.run_sync(build_api_client, pool)
    cfg = api_client.configuration
    try:
        assert cfg.verify_ssl is True
        assert cfg.host == "https://34.0.0.10"
        assert cfg.auth_settings()["BearerToken"]["value"] == "Bearer kubeconfig-token"
    finally:
        await KubeClient(api_client, pool=pool.name, temp_dir=temp_dir).aclose()


async def test_unreachable_api_server_is_unavailable() -> None:
    # A loopback port nobody listens on: the connection is refused, nothing leaves the host.
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    pool = _pool(
        endpoint=f"https://127.0.0.1:{port}",
        flavor="eks",
        credentials=EKS_CREDS,
    )
    api_client, temp_dir = await trio.to_thread.run_sync(build_api_client, pool)
    client = KubeClient(api_client, pool=pool.name, temp_dir=temp_dir, request_timeout_s=5)
    try:
        with trio.fail_after(30):
            with pytest.raises(KubeUnreachable, match="cannot list nodes") as unreachable:
                await client.list_nodes("pool=gpu")
    finally:
        await client.aclose()
    assert unreachable.value.code is ErrorCode.UNAVAILABLE
    assert unreachable.value.status is None and unreachable.value.failure


async def test_objects_by_kind_round_trip_and_secret_data_stays_behind(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    role: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "reader", "namespace": "default"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s", "namespace": "default"},
        "data": {"k": base64.b64encode(b"v4lue").decode()},
    }
    async with open_kubeconfig_client(str(kubeconfig), "standin") as cluster:
        assert cluster.endpoint == kube.url
        assert cluster.ca_pem == kube.ca_pem
        api = cluster.client
        assert await api.read_object("Role", "reader", "default") is None
        await api.create_object(role)
        with pytest.raises(KubeAlreadyExists):
            await api.create_object(role)
        role["rules"][0]["verbs"] = ["get", "list"]
        await api.replace_object(role)
        read = await api.read_object("Role", "reader", "default")
        assert read is not None and read["rules"][0]["verbs"] == ["get", "list"]

        created = await api.create_object(secret)
        assert "data" not in created
        read = await api.read_object("Secret", "s", "default")
        assert read is not None and "data" not in read
        assert await api.read_secret_value("default", "s", "k") == "v4lue"

        assert await api.delete_object("Role", "reader", "default") is True
        assert await api.delete_object("Role", "reader", "default") is False
        assert await api.read_object("Namespace", "kube-system") is not None
        with pytest.raises(ValueError, match="needs namespace"):
            await api.read_object("Role", "reader")
    assert kube.get("roles", "reader", "default") is None


async def test_a_service_account_token_is_waited_for(kube: KubeStandin, kubeconfig: Path) -> None:
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "sa", "namespace": "default"},
    }
    token_secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/service-account-token",
        "metadata": {
            "name": "sa-token",
            "namespace": "default",
            "annotations": {"kubernetes.io/service-account.name": "sa"},
        },
    }
    async with open_kubeconfig_client(str(kubeconfig), "standin") as cluster:
        await cluster.client.create_object(account)
        await cluster.client.create_object(token_secret)
        with trio.fail_after(30):
            token = await cluster.client.wait_secret_value("default", "sa-token", "token")
    assert token == kube.service_account_token("sa-token", "default")


async def test_a_kubeconfig_that_cannot_be_used_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(KubeconfigError, match=str(missing)) as refused:
        kubeconfig_contexts(str(missing))
    assert not isinstance(refused.value, NotAKubeconfig)
    (tmp_path / "list").write_text("- a\n- list\n")
    with pytest.raises(NotAKubeconfig, match="is not a kubeconfig"):
        kubeconfig_contexts(str(tmp_path / "list"))
