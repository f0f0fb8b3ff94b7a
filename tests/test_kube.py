"""The Kubernetes adapter: tokens by flavor, error translation, retries, private temp files.

Nothing here leaves loopback: the EKS token is only signed (never sent), the GKE token
exchange goes to a token endpoint this test serves on 127.0.0.1.
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

import pytest
import requests
import trio
from google.auth.transport.requests import Request
from kubernetes.client.exceptions import ApiException

from agent.wire.backoff import BackoffState
from agent.wire.errors import ErrorCode
from control.kube.adapter import (
    RETRY,
    RETRY_ATTEMPTS,
    EksTokenSource,
    GkeTokenSource,
    KubeAlreadyExists,
    KubeAuthError,
    KubeClient,
    KubeError,
    KubeNotFound,
    KubeUnavailable,
    Operation,
    build_api_client,
    call_with_retry,
    eks_token,
    retry_delay,
    translate_api_exception,
)
from control.kube.pools import EksCredentials, GkeCredentials, PoolConfig, load_pools
from tests.test_pools import EKS_CREDS, ca_pem, gke_block, rsa_pem, sa_key

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


def test_tls_failure_points_at_the_ca() -> None:
    exc = ApiException(status=0, reason="SSLError\ncertificate verify failed")
    error = translate_api_exception(exc, Operation("list", "nodes"), pool="p")
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "config.worker.pools[p].kubernetes.caData" in error.message


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
            with pytest.raises(KubeUnavailable, match="cannot list nodes"):
                await client.list_nodes("pool=gpu")
    finally:
        await client.aclose()
