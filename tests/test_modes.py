"""The worker API reached both ways, for real: TLS on loopback, direct and through the tunnel."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from agent.daemon.config import AgentConfig
from agent.daemon.register import failure_reason, register_once
from agent.daemon.run import run_agent
from control.api.server import Controlplane
from sim.configs import WORKER_TOKENS, Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config
from tests.hash_service import check_through_hash_service, open_hash_service
from wire.client import WorkerUnavailable
from wire.errors import ApiError, ErrorCode
from wire.tls import PinMismatchError, TLSStream, make_self_signed, server_context
from wire.wsstream import WebSocketStream
from workerapi.client import WorkerClient
from workerapi.models import Registration

MODES = ["direct", "tunnel"]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
async def control(pki: Pki, nursery: trio.Nursery) -> Controlplane:
    cp: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    return cp


async def start_agent(
    nursery: trio.Nursery, pki: Pki, control: Controlplane, mode: str, **kw: object
) -> trio.CancelScope:
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await run_agent(agent_config(pki, control.port, mode=mode, **kw))  # type: ignore[arg-type]

    nursery.start_soon(run)
    return scope


async def client(control: Controlplane, worker_id: str) -> WorkerClient:
    with trio.fail_after(10):
        return await control.registry.client_for(worker_id)


async def wait_next_tunnel(
    control: Controlplane, worker_id: str, old: WorkerClient
) -> WorkerClient:
    """The worker's next tunnel, once it has landed (the registry's listeners say when)."""
    landed = trio.Event()
    tunnel: list[WorkerClient] = []

    def check() -> None:
        entry = control.registry.entry(worker_id)
        new = entry.tunnel if entry is not None else None
        if not landed.is_set() and new is not None and new is not old:
            tunnel.append(new)
            landed.set()

    control.registry.listeners.append(check)
    try:
        check()
        await landed.wait()
    finally:
        control.registry.listeners.remove(check)
    return tunnel[0]


@contextlib.contextmanager
def log_sentinel(text: str) -> Iterator[trio.Event]:
    """An event set once a log record containing `text` is emitted, from any thread."""
    seen = trio.Event()
    token = trio.lowlevel.current_trio_token()

    class Sentinel(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                token.run_sync_soon(seen.set)

    handler = Sentinel()
    logging.getLogger().addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger().removeHandler(handler)


@pytest.fixture(params=MODES)
async def worker(
    request: pytest.FixtureRequest, pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> AsyncIterator[tuple[Controlplane, str]]:
    mode = request.param
    # The CONNECT tests reach a service of their own on the worker's loopback.
    await start_agent(nursery, pki, control, mode, loopback_connect=True)
    yield control, f"w-{mode}"


async def test_request_both_modes(worker: tuple[Controlplane, str]) -> None:
    control, worker_id = worker
    c = await client(control, worker_id)
    health = await c.health()
    assert health.worker_id == worker_id
    info = await c.worker()
    assert info.mode == worker_id.removeprefix("w-")


@pytest.mark.slow
async def test_one_gib_connect_transfer(
    worker: tuple[Controlplane, str], nursery: trio.Nursery
) -> None:
    control, worker_id = worker
    port = await open_hash_service(nursery)
    c = await client(control, worker_id)
    stream = await c.connect_tcp("127.0.0.1", port)
    with trio.fail_after(120):
        assert await check_through_hash_service(stream, 1 << 30)


async def test_thousand_concurrent_requests(worker: tuple[Controlplane, str]) -> None:
    control, worker_id = worker
    c = await client(control, worker_id)
    answers: list[str] = []

    async def one() -> None:
        answers.append((await c.health()).status)

    with trio.fail_after(60):
        async with trio.open_nursery() as inner:
            for _ in range(1000):
                inner.start_soon(one)
    assert answers == ["ok"] * 1000


async def test_streamed_response_is_read_as_it_comes(worker: tuple[Controlplane, str]) -> None:
    control, worker_id = worker
    c = await client(control, worker_id)
    ws = await c.open_websocket("/v1/echo")
    for i in range(50):
        await ws.send_message(f"line {i}")
        assert await ws.receive_message() == f"line {i}"
    await ws.aclose()


async def test_tunnel_cut_reconnects(
    pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> None:
    await start_agent(nursery, pki, control, "tunnel")
    first = await client(control, "w-tunnel")
    await first.health()
    # The network drops the tunnel: its TCP connection is shut down under both ends.
    ws_stream = first.conn.transport
    assert isinstance(ws_stream, WebSocketStream)
    tls = ws_stream.transport
    assert isinstance(tls, TLSStream)
    tcp = tls.transport_stream
    assert isinstance(tcp, trio.SocketStream)
    tcp.socket.shutdown(socket.SHUT_RDWR)
    with trio.fail_after(10):
        second = await wait_next_tunnel(control, "w-tunnel", first)
    with trio.fail_after(5):
        assert (await second.health()).status == "ok"


async def test_controlplane_restart(pki: Pki, nursery: trio.Nursery) -> None:
    scope = trio.CancelScope()
    started: list[Controlplane] = []

    async def run_control(port: int, *, task_status: trio.TaskStatus[None]) -> None:
        with scope:
            cp = await nursery.start(run_controlplane, control_config(pki, port=port))
            started.append(cp)
            task_status.started()
            await trio.sleep_forever()

    first_scope = trio.CancelScope()
    first_gone = trio.Event()

    async def first(*, task_status: trio.TaskStatus[Controlplane]) -> None:
        try:
            with first_scope:
                async with trio.open_nursery() as inner:
                    cp = await inner.start(run_controlplane, control_config(pki))
                    task_status.started(cp)
        finally:
            first_gone.set()

    cp1: Controlplane = await nursery.start(first)
    port = cp1.port
    for mode in MODES:
        await start_agent(nursery, pki, cp1, mode)
        assert (await (await client(cp1, f"w-{mode}")).health()).status == "ok"
    first_scope.cancel()  # the controlplane goes away...
    with trio.fail_after(10):
        await first_gone.wait()
    async with trio.open_nursery() as n2:
        cp2: Controlplane = await n2.start(run_controlplane, control_config(pki, port=port))
        # ...and comes back on the same address: every agent is back without intervention.
        for mode in MODES:
            assert (await (await client(cp2, f"w-{mode}")).health()).status == "ok"
        n2.cancel_scope.cancel()


async def test_wrong_token_tunnel_is_refused(
    pki: Pki, control: Controlplane, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    with log_sentinel("refused") as refused:
        await start_agent(nursery, pki, control, "tunnel", token="not-the-token")
        with trio.fail_after(10):
            await refused.wait()
    entry = control.registry.entry("w-tunnel")
    assert entry is None or entry.tunnel is None, "a tunnel with a wrong token was accepted"
    assert any("refused" in r.getMessage() for r in caplog.records)
    assert not any("not-the-token" in r.getMessage() for r in caplog.records)


async def test_wrong_token_direct_is_unauthenticated(
    pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> None:
    await start_agent(nursery, pki, control, "direct")
    good = await client(control, "w-direct")
    imposter = WorkerClient(good.conn, token="wrong", authority="w-direct")
    with pytest.raises(ApiError) as err:
        await imposter.health()
    assert err.value.code is ErrorCode.UNAUTHENTICATED


async def test_wrong_pinned_fingerprint_is_refused(
    pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> None:
    await start_agent(nursery, pki, control, "direct")
    good = await client(control, "w-direct")
    entry = control.registry._entries["w-direct"]
    address = entry.address
    await good.aclose()
    # Someone else answers at the registered address with another certificate.
    await control.registry.register(
        Registration(
            worker_id="w-direct",
            version="x",
            mode="direct",
            address=address,
            fingerprint="00" * 32,
        )
    )
    with pytest.raises(WorkerUnavailable if False else ApiError) as err:
        with trio.fail_after(5):
            await control.registry.client_for("w-direct")
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert "certificate" in err.value.message


async def test_malformed_frames_close_only_that_connection(
    pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> None:
    await start_agent(nursery, pki, control, "direct")
    good = await client(control, "w-direct")
    host, _, port = (control.registry._entries["w-direct"].address or "").rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    tcp = await trio.open_tcp_stream(host, int(port))
    raw = trio.SSLStream(tcp, context, server_hostname=host)
    await raw.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x04\x99\xff" * 20)
    received = b""
    with trio.fail_after(5):
        try:
            while data := await raw.receive_some():
                received += data
        except trio.BrokenResourceError:
            pass
    assert b"\x07" in received  # a GOAWAY frame came back before the close
    assert (await good.health()).status == "ok"  # the agent still serves everyone else


async def test_tunnel_max_age_drains_in_flight_streams(
    pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> None:
    await start_agent(nursery, pki, control, "tunnel", max_age_s=1.0, loopback_connect=True)
    port = await open_hash_service(nursery)
    first = await client(control, "w-tunnel")
    stream = await first.connect_tcp("127.0.0.1", port)
    block = os.urandom(1 << 16)
    expected = hashlib.sha256()
    await stream.send_all(block)
    expected.update(block)
    with trio.fail_after(10):
        second = await wait_next_tunnel(control, "w-tunnel", first)
    assert first.conn.draining  # the old tunnel got GOAWAY; new requests take the new one
    assert (await second.health()).status == "ok"
    # The stream opened before the roll-over finishes on the old tunnel.
    await stream.send_all(block)
    expected.update(block)
    await stream.send_eof()
    answer = b""
    with trio.fail_after(10):
        while data := await stream.receive_some():
            answer += data
    assert answer.decode() == expected.hexdigest()


async def test_cli_lists_workers_and_asks_one(
    pki: Pki, control: Controlplane, nursery: trio.Nursery
) -> None:
    import json
    import sys

    from sim.configs import API_TOKEN

    for mode in MODES:
        await start_agent(nursery, pki, control, mode)
        await client(control, f"w-{mode}")
    env = dict(
        os.environ,
        LEVERS9_CONTROLPLANE=f"https://127.0.0.1:{control.port}",
        LEVERS9_TOKEN=API_TOKEN,
        LEVERS9_CA=str(pki.ca_file),
    )
    listed = await trio.run_process(
        [sys.executable, "-m", "control.cli", "worker", "list", "--json"],
        env=env,
        capture_stdout=True,
    )
    workers = {w["workerId"]: w for w in json.loads(listed.stdout)}
    assert workers["w-direct"]["mode"] == "direct"
    assert workers["w-tunnel"]["mode"] == "tunnel"
    assert workers["w-tunnel"]["connected"] is True
    table = await trio.run_process(
        [sys.executable, "-m", "control.cli", "worker", "list"], env=env, capture_stdout=True
    )
    header, *rows = table.stdout.decode().splitlines()
    assert header.split() == [
        "WORKER",
        "MODE",
        "CONNECTED",
        "NODE",
        "CARDS",
        "ADDRESS",
        "VERSION",
        "AGE",
        "REPLICA",
    ]
    assert sorted(row.split()[0] for row in rows) == ["w-direct", "w-tunnel"]
    # Each is held by this, the one replica (its directory name).
    assert {row.split()[-1] for row in rows} == {control.identity}
    assert workers["w-tunnel"]["replica"] == control.identity
    got = await trio.run_process(
        [sys.executable, "-m", "control.cli", "worker", "get", "w-tunnel"],
        env=env,
        capture_stdout=True,
    )
    assert b"w-tunnel" in got.stdout
    refused = await trio.run_process(
        [sys.executable, "-m", "control.cli", "--token", "wrong", "worker", "list"],
        env=env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert refused.returncode == 1
    assert b"UNAUTHENTICATED" in refused.stderr


async def test_streamed_response_follows_the_agent_log(
    worker: tuple[Controlplane, str], caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import logging

    caplog.set_level(logging.INFO, logger="levers9")
    control, worker_id = worker
    c = await client(control, worker_id)
    seen = b""
    async with c.stream("GET", "/v1/agent/logs?follow=true") as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        # Answered requests are debug lines: a busy port forward does not crowd out the
        # worker's events. One that fails is logged while the log is being followed.
        for _ in range(20):
            await c.health()
        with pytest.raises(ApiError) as missing:
            await c.container("missing")
        assert missing.value.code is ErrorCode.NOT_FOUND
        with trio.fail_after(10):
            async for chunk in response.iter_chunks():
                seen += chunk
                if b"/v1/containers/missing" in seen:
                    break
    records = [json.loads(line) for line in seen.splitlines() if line]
    assert any(r["msg"].startswith("GET /v1/containers/missing 404") for r in records)
    assert not any("/v1/health" in r["msg"] for r in records)
    assert all(WORKER_TOKENS[worker_id] not in line for line in seen.decode().splitlines())


# -- what a failed call to the controlplane is, by type ------------------------------------------


def test_failure_reason_sorts_by_type_and_cause_not_by_message() -> None:
    verify = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] unknown issuer")
    try:
        raise trio.BrokenResourceError("TLS handshake failed") from verify
    except trio.BrokenResourceError as exc:
        wrapped = exc
    assert failure_reason(wrapped).startswith("the controlplane's certificate did not verify")
    assert "unknown issuer" in failure_reason(wrapped)
    # The same words without that cause are someone else's message, not a certificate failure.
    lookalike = trio.BrokenResourceError("peer said CERTIFICATE_VERIFY_FAILED")
    assert failure_reason(lookalike) == "peer said CERTIFICATE_VERIFY_FAILED"
    pin = PinMismatchError("a" * 64, "b" * 64)
    assert "re-register the worker" in failure_reason(pin)
    assert failure_reason(trio.TooSlowError()) == "timed out"


async def test_registering_with_a_wrong_ca_says_the_certificate_did_not_verify(
    tmp_path: Path, control: Controlplane
) -> None:
    (tmp_path / "other").mkdir()
    config = agent_config(make_pki(tmp_path / "other"), control.port, mode="tunnel")
    with pytest.raises(trio.BrokenResourceError) as err:  # the error itself, not a group
        await register_once(config, Registration(worker_id="w-tunnel", version="0", mode="tunnel"))
    assert failure_reason(err.value).startswith("the controlplane's certificate did not verify")


async def test_a_connection_lost_mid_registration_is_one_error_not_a_group(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # A "controlplane" that finishes TLS with h2, reads the client's first bytes and hangs up.
    cert_key = make_self_signed("cp", ["127.0.0.1"])
    (tmp_path / "ca.pem").write_bytes(cert_key.cert_pem)
    context = server_context(cert_key, alpn=("h2",))

    async def hang_up(tcp: trio.SocketStream) -> None:
        tls = TLSStream(tcp, context, server_side=True)
        with contextlib.suppress(trio.BrokenResourceError):
            await tls.receive_some()
        await trio.aclose_forcefully(tls)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    config = AgentConfig(
        worker_id="w-1",
        token="t",
        mode="tunnel",
        controlplane_url=f"https://127.0.0.1:{port}",
        controlplane_ca_file=str(tmp_path / "ca.pem"),
    )
    # The heartbeat loop retries on these; inside a group they would end the agent instead.
    with pytest.raises((ApiError, trio.BrokenResourceError, OSError)) as err:
        await register_once(config, Registration(worker_id="w-1", version="0", mode="tunnel"))
    assert not isinstance(err.value, BaseExceptionGroup)


async def test_a_request_posing_as_another_replicas_is_refused(
    worker: tuple[Controlplane, str], pki: Pki
) -> None:
    """A request naming a worker as one replica forwards it to another reaches the worker only
    with the replica secret: an operator's token, the worker's own, or any token at all on a
    controlplane that has no replica secret, is refused before the worker is asked."""
    from control.cli.client import open_control_client
    from control.workers.forward import WORKER_HEADER
    from sim.configs import API_TOKEN

    control, worker_id = worker
    await client(control, worker_id)  # connected
    url = f"https://127.0.0.1:{control.port}"
    for token in (API_TOKEN, WORKER_TOKENS[worker_id], "x" * 64):
        async with open_control_client(url, token, str(pki.ca_file)) as api:
            posing = WorkerClient(
                api.conn,
                token=token,
                authority=worker_id,
                extra_headers=[(WORKER_HEADER, worker_id.encode())],
            )
            with pytest.raises(ApiError) as refused:
                await posing.health()
            assert refused.value.code is ErrorCode.UNAUTHENTICATED
            assert refused.value.message == "wrong replica secret"


async def test_a_tunnel_that_closes_before_http2_starts_leaves_the_controlplane_serving(
    control: Controlplane, pki: Pki
) -> None:
    """The WebSocket upgrade is sent, then the connection is reset before HTTP/2 inside it can
    start (an agent that gave up, a load balancer that cut it): that one connection ends; the
    controlplane goes on and the same worker's next tunnel is taken."""
    import base64
    import struct

    from wire.tls import verifying_client_context

    context = verifying_client_context(cafile=str(pki.ca_file), alpn=("http/1.1",))
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = (
        "GET /v1/workers/w-tunnel/tunnel HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: {key}\r\nAuthorization: Bearer {WORKER_TOKENS['w-tunnel']}\r\n\r\n"
    ).encode()
    for _ in range(20):
        tcp = await trio.open_tcp_stream("127.0.0.1", control.port)
        tls = TLSStream(tcp, context, server_side=False, server_hostname="127.0.0.1")
        await tls.do_handshake()
        await tls.send_all(upgrade)
        # RST, not FIN: the controlplane's answer and its HTTP/2 preface meet a dead socket.
        tcp.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tcp.socket.close()
    async with trio.open_nursery() as nursery:
        await start_agent(nursery, pki, control, "tunnel")
        assert (await (await client(control, "w-tunnel")).health()).worker_id == "w-tunnel"
        nursery.cancel_scope.cancel()
