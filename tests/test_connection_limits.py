"""Connection-level limits on both listeners: the controlplane's public endpoint and a direct
agent's. A flood of idle or half-open connections must not stop a normal request from being
answered; a source over its limit has the extra connections closed at once; a connection that
finished TLS and says nothing is closed after `first_request_timeout_s`; memory stays flat
when connections come and go by the thousand.

The admission core and `Http2Connection`'s timers are tested without sockets (the latter on
memory streams with the autojump clock); the listeners with raw TCP and TLS clients on
loopback, from several 127.0.0.x source addresses (all of 127/8 is loopback on Linux).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import resource
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import attrs
import psutil
import pytest
import trio
import trio.testing

from agent.daemon.config import AgentConfig, load_config
from agent.daemon.direct import serve_direct
from agent.daemon.routes import WorkerState
from agent.daemon.run import build_service, run_agent
from control.api.server import Controlplane, connection_limits
from control.config import ConfigError, ConnectionSettings, parse
from control.models import WorkerList
from sim.configs import API_TOKEN, WORKER_TOKENS, Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config
from wire.admission import (
    MANY_SOURCES,
    Admission,
    Admissions,
    ConnectionLimits,
    Refusal,
    ReportThrottle,
    plan_open_files,
    source_address,
)
from wire.client import ApiClient, open_api_client
from wire.connection import H2Stream, Http2Connection, KeepaliveConfig
from wire.http2 import PREFACE
from wire.tls import TLSStream, make_self_signed, pinned_client_context
from workerapi.client import WorkerClient

FLOOD_SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
GOAWAY = 0x7
SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.fixture(autouse=True, scope="module")
def _open_files() -> Iterator[None]:
    """The flood needs two descriptors per connection in this process (client and server)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- the admission core: pure -------------------------------------------------------------


def test_admit_counts_per_source_and_in_total() -> None:
    gate = Admissions(ConnectionLimits(max_per_source=2, max_total=3))
    a1, a2 = gate.admit("10.0.0.1"), gate.admit("10.0.0.1")
    assert isinstance(a1, Admission) and isinstance(a2, Admission)
    assert gate.admit("10.0.0.1") == Refusal("10.0.0.1", "max_per_source", 2)
    b1 = gate.admit("10.0.0.2")
    assert isinstance(b1, Admission)
    assert gate.admit("10.0.0.3") == Refusal("10.0.0.3", "max_total", 3)
    stats = gate.statistics()
    assert (stats.open_total, stats.sources, stats.refused_total) == (3, 2, 2)

    gate.release(a1)
    gate.release(a1)  # a second release of the same connection changes nothing
    assert gate.held_by("10.0.0.1") == 1
    assert isinstance(gate.admit("10.0.0.3"), Admission)
    gate.release(b1)
    # A source with nothing open leaves no entry behind.
    assert gate.held_by("10.0.0.2") == 0
    assert gate.statistics().sources == 2


def test_a_vouched_connection_counts_only_against_the_total() -> None:
    """Workers behind one NAT address: their tunnels, once their tokens are checked, leave
    the address's places to connections nobody vouched for."""
    gate = Admissions(ConnectionLimits(max_per_source=1, max_total=3))
    tunnel = gate.admit("10.0.0.1")
    assert isinstance(tunnel, Admission)
    gate.vouch(tunnel)
    gate.vouch(tunnel)  # twice changes nothing
    assert gate.held_by("10.0.0.1") == 0
    second = gate.admit("10.0.0.1")
    assert isinstance(second, Admission)
    assert isinstance(gate.admit("10.0.0.1"), Refusal)
    gate.release(tunnel)
    assert gate.held_by("10.0.0.1") == 1
    assert gate.statistics().open_total == 1


def test_refusals_are_reported_once_per_interval_with_the_count_between() -> None:
    throttle = ReportThrottle(interval_s=60.0)
    reports = [throttle.note("10.0.0.1", now) for now in (0.0, 1.0, 2.0, 59.0)]
    assert [r.count if r else None for r in reports] == [1, None, None, None]
    later = throttle.note("10.0.0.1", 60.0)
    assert later is not None and later.count == 4  # the three held back, and this one
    other = throttle.note("10.0.0.2", 61.0)
    assert other is not None and other.count == 1


def test_the_throttle_keeps_a_bounded_number_of_keys() -> None:
    throttle = ReportThrottle(interval_s=60.0, max_keys=2)
    assert throttle.note("a", 0.0) is not None
    assert throttle.note("b", 0.0) is not None
    crowd = throttle.note("c", 1.0)
    assert crowd is not None and crowd.key == MANY_SOURCES
    assert throttle.note("d", 2.0) is None  # counted under MANY_SOURCES
    # Once the interval is over, old keys are forgotten and new ones tracked again.
    fresh = throttle.note("e", 61.0)
    assert fresh is not None and fresh.key == "e"


@pytest.mark.parametrize(
    ("peername", "source"),
    [
        (("10.1.2.3", 5555), "10.1.2.3"),
        (("::ffff:10.1.2.3", 5555, 0, 0), "10.1.2.3"),
        (("2001:db8::1", 443, 0, 0), "2001:db8::1"),
        (("fe80::1%eth0", 443, 0, 2), "fe80::1"),
        ("/run/sock", "/run/sock"),
        ((), "unknown"),
    ],
)
def test_source_address_is_the_host(peername: object, source: str) -> None:
    assert source_address(peername) == source


def test_the_open_files_limit_is_raised_to_the_hard_one() -> None:
    assert plan_open_files(1024, 1048576, 4096).soft == 1048576
    assert plan_open_files(1024, 1048576, 4096).enough
    assert plan_open_files(65536, 65536, 4096).soft is None
    low = plan_open_files(1024, 2048, 4096)
    assert low.soft == 2048 and not low.enough
    assert plan_open_files(1024, resource.RLIM_INFINITY, 4096).soft == 1 << 20


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_per_source"):
        ConnectionLimits(max_per_source=0)
    with pytest.raises(ValueError, match="first_request_timeout_s"):
        ConnectionLimits(first_request_timeout_s=0)
    assert ConnectionLimits(idle_timeout_s=None).idle_timeout_s is None


# -- the settings -------------------------------------------------------------------------


def test_agent_limits_come_from_the_environment() -> None:
    env = {
        "LEVERS9_WORKER_ID": "w-1",
        "LEVERS9_WORKER_TOKEN": "agent-secret-token",
        "LEVERS9_CONTROLPLANE_URL": "https://cp.example.com:8443",
    }
    assert load_config(dict(env)).connections == ConnectionLimits()
    config = load_config(
        {
            **env,
            "LEVERS9_MAX_CONNECTIONS_PER_SOURCE": "8",
            "LEVERS9_MAX_CONNECTIONS": "64",
            "LEVERS9_FIRST_REQUEST_TIMEOUT_S": "2.5",
            "LEVERS9_CONNECTION_IDLE_TIMEOUT_S": "90",
        }
    )
    assert config.connections == ConnectionLimits(
        max_per_source=8, max_total=64, first_request_timeout_s=2.5, idle_timeout_s=90.0
    )
    with pytest.raises(ValueError, match="LEVERS9_MAX_CONNECTIONS must be a whole number"):
        load_config({**env, "LEVERS9_MAX_CONNECTIONS": "many"})
    # The handshake timeout the agent always had still sets the listener's.
    made = AgentConfig(
        worker_id="w",
        token="t",
        mode="direct",
        controlplane_url="https://cp",
        handshake_timeout_s=3,
    )
    assert made.connections.handshake_timeout_s == 3


def test_controlplane_limits_come_from_the_values(tmp_path: Path) -> None:
    block = {
        "publicUrl": "https://cp.example.com",
        "tls": {"certFile": "/c", "keyFile": "/k"},
        "tunnel": {"handshakeTimeoutS": 4},
    }
    assert parse({"config": block}).connections == ConnectionSettings()
    config = parse(
        {
            "config": {
                **block,
                "connections": {
                    "maxPerSource": 8,
                    "maxTotal": 64,
                    "firstRequestTimeoutS": 0.5,
                    "idleTimeoutS": None,
                },
            }
        }
    )
    assert connection_limits(config) == ConnectionLimits(
        max_per_source=8,
        max_total=64,
        handshake_timeout_s=4,
        first_request_timeout_s=0.5,
        idle_timeout_s=None,
    )
    with pytest.raises(ConfigError, match=r"config\.connections\.maxTotal must be 1 or more"):
        parse({"config": {**block, "connections": {"maxTotal": 0}}})
    with pytest.raises(
        ConfigError, match=r"config\.connections: extra fields found \(maxPerSorce\)"
    ):
        parse({"config": {**block, "connections": {"maxPerSorce": 1}}})


# -- Http2Connection's timers: memory streams, virtual time --------------------------------


async def _answer(stream: H2Stream) -> None:
    await stream.send_headers([(b":status", b"200")], end_stream=True)


async def _get(client: Http2Connection) -> None:
    stream = await client.open_stream(
        [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"w"), (b":path", b"/")],
        end_stream=True,
    )
    assert dict(await stream.wait_headers())[b":status"] == b"200"
    client.forget(stream)


@contextlib.asynccontextmanager
async def _pair(
    handler: Callable[[H2Stream], Awaitable[None]] = _answer,
    *,
    keepalive: KeepaliveConfig | None = None,
) -> AsyncIterator[tuple[Http2Connection, Http2Connection]]:
    near, far = trio.testing.memory_stream_pair()
    server = Http2Connection(
        far, client_side=False, handler=handler, first_request_timeout_s=10, idle_timeout_s=60
    )
    client = Http2Connection(near, client_side=True, keepalive=keepalive)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        yield server, client
        nursery.cancel_scope.cancel()


async def test_a_connection_without_a_request_gets_goaway_and_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The client's PINGs are no request: they do not keep it.
    async with _pair(keepalive=KeepaliveConfig(ping_interval_s=1, ping_timeout_s=1)) as (
        server,
        client,
    ):
        start = trio.current_time()
        await server.wait_closed()
        assert trio.current_time() - start == pytest.approx(10)
        assert server.close_reason == "no request within 10 s"
        await client.wait_closed()
        assert client.draining and client.closed_by_peer  # GOAWAY, then end of stream


async def test_a_connection_idle_after_its_request_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with _pair() as (server, client):
        await _get(client)
        answered = trio.current_time()
        await server.wait_closed()
        # Idle from the end of the first-request wait at the latest: 60 to 70 s later.
        assert 60 <= trio.current_time() - answered <= 70 + 1e-6
        assert server.close_reason == "idle for 60 s"


async def test_pings_keep_a_connection_that_made_its_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The controlplane's pooled connections to direct workers: idle for minutes between
    calls, kept alive by PINGs, never closed under them."""
    async with _pair(keepalive=KeepaliveConfig(ping_interval_s=15, ping_timeout_s=15)) as (
        server,
        client,
    ):
        await _get(client)
        await trio.sleep(600)
        assert not server.closed and client.usable
        await _get(client)


async def test_a_stream_open_longer_than_the_idle_timeout_is_not_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()

    async def slow(stream: H2Stream) -> None:
        await release.wait()
        await _answer(stream)

    async with _pair(slow) as (server, client), trio.open_nursery() as nursery:
        nursery.start_soon(_get, client)
        await trio.sleep(200)
        assert not server.closed
        release.set()
        ended = trio.current_time()
        await server.wait_closed()
        assert trio.current_time() - ended == pytest.approx(60, abs=0.1)


def test_the_timers_are_for_servers() -> None:
    near, _ = trio.testing.memory_stream_pair()
    with pytest.raises(ValueError, match="server role"):
        Http2Connection(near, client_side=True, first_request_timeout_s=1)


# -- the real listeners on loopback --------------------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@attrs.define
class Target:
    """A listener under test: where it is, its connection counts, and a normal request."""

    port: int
    admissions: Admissions
    request: Callable[[ApiClient], Awaitable[None]]
    open_client: Callable[[], contextlib.AbstractAsyncContextManager[ApiClient]]
    control: Controlplane | None = None


def _client_context() -> ssl.SSLContext:
    """For raw TLS clients that only need the handshake done: no verification, h2."""
    return pinned_client_context(alpn=("h2",))


@contextlib.asynccontextmanager
async def open_target(
    kind: str, pki: Pki, limits: ConnectionLimits
) -> AsyncIterator[tuple[Target, trio.Nursery]]:
    async with trio.open_nursery() as nursery:
        if kind == "controlplane":
            base = control_config(pki)
            config = attrs.evolve(
                base,
                connections=ConnectionSettings(
                    max_per_source=limits.max_per_source,
                    max_total=limits.max_total,
                    first_request_timeout_s=limits.first_request_timeout_s,
                    idle_timeout_s=limits.idle_timeout_s,
                ),
                tunnel=attrs.evolve(base.tunnel, handshake_timeout_s=limits.handshake_timeout_s),
            )
            control: Controlplane = await nursery.start(run_controlplane, config)

            @contextlib.asynccontextmanager
            async def controlplane_client() -> AsyncIterator[ApiClient]:
                context = ssl.create_default_context(cafile=str(pki.ca_file))
                context.set_alpn_protocols(["h2"])
                tcp = await trio.open_tcp_stream("127.0.0.1", control.port)
                tls = TLSStream(tcp, context, server_side=False, server_hostname="127.0.0.1")
                async with open_api_client(
                    tls, ApiClient, token=API_TOKEN, authority="127.0.0.1"
                ) as client:
                    yield client

            async def list_workers(client: ApiClient) -> None:
                workers = await client.call("GET", "/v1/workers", None, WorkerList)
                assert workers is not None

            target = Target(
                control.port, control.admissions, list_workers, controlplane_client, control
            )
        else:
            agent = attrs.evolve(agent_config(pki, 1, mode="direct"), connections=limits)
            cert_key = make_self_signed("levers9-worker-w-direct", ["127.0.0.1"])
            service = build_service(agent, WorkerState(worker_id=agent.worker_id, mode="direct"))
            gate = Admissions(limits)
            port = await nursery.start(
                functools.partial(serve_direct, agent, service, cert_key, admissions=gate)
            )

            @contextlib.asynccontextmanager
            async def agent_client() -> AsyncIterator[ApiClient]:
                tcp = await trio.open_tcp_stream("127.0.0.1", port)
                tls = TLSStream(
                    tcp,
                    pinned_client_context(alpn=("h2",)),
                    server_side=False,
                    expected_fingerprint=cert_key.fingerprint,
                )
                async with open_api_client(
                    tls, WorkerClient, token=WORKER_TOKENS["w-direct"], authority="w-direct"
                ) as client:
                    yield client

            async def health(client: ApiClient) -> None:
                assert isinstance(client, WorkerClient)
                assert (await client.health()).status == "ok"

            target = Target(port, gate, health, agent_client)
        yield target, nursery
        nursery.cancel_scope.cancel()


async def connect_from(source: str, port: int) -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


def partial_client_hello() -> bytes:
    """The first half of a real ClientHello: a handshake that will never finish."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = _client_context().wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    return hello[: len(hello) // 2]


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll a condition on the server's counts (callers bound it with fail_after)."""
    while True:
        if condition():
            return
        await trio.sleep(0.01)


async def is_closed(stream: trio.SocketStream) -> bool:
    """True once the server closed the connection (end of stream, or reset)."""
    try:
        return await stream.receive_some(65536) == b""
    except trio.BrokenResourceError:
        return True


TARGETS = ["controlplane", "agent"]


@pytest.mark.parametrize("kind", TARGETS)
async def test_a_request_is_answered_through_a_slowloris(kind: str, pki: Pki) -> None:
    """500 idle TCP connections and 500 TLS handshakes stopped halfway, all admitted (spread
    over four sources, 250 each, under the default 256 per source), then a normal request."""
    hello = partial_client_hello()
    flood: list[trio.SocketStream] = []
    async with open_target(kind, pki, ConnectionLimits()) as (target, _):
        try:
            for i in range(1000):
                stream = await connect_from(FLOOD_SOURCES[i % 4], target.port)
                flood.append(stream)
                if i % 2:
                    await stream.send_all(hello)
            with trio.fail_after(10):
                await wait_until(lambda: target.admissions.statistics().open_total == 1000)
            started = trio.current_time()
            with trio.fail_after(5):
                async with target.open_client() as client:
                    await target.request(client)
            print(
                f"\n{kind}: request answered in {trio.current_time() - started:.3f} s "
                f"with {target.admissions.statistics().open_total - 1} flood connections open"
            )
        finally:
            for stream in flood:
                await stream.aclose()


@pytest.mark.parametrize("kind", TARGETS)
async def test_a_source_over_its_limit_has_the_extra_connections_closed(
    kind: str, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="levers9.connections")
    limits = ConnectionLimits(max_per_source=8, handshake_timeout_s=30)
    async with open_target(kind, pki, limits) as (target, _):
        streams = [await connect_from("127.0.0.2", target.port) for _ in range(12)]
        closed: list[trio.SocketStream] = []

        async def watch(stream: trio.SocketStream) -> None:
            if await is_closed(stream):
                closed.append(stream)

        async with trio.open_nursery() as watchers:
            for stream in streams:
                watchers.start_soon(watch, stream)
            with trio.fail_after(5):
                await wait_until(lambda: len(closed) == 4)
            assert target.admissions.held_by("127.0.0.2") == 8
            watchers.cancel_scope.cancel()
        # The eight admitted are served: their TLS handshakes complete.
        for stream in streams:
            if stream not in closed:
                tls = trio.SSLStream(stream, _client_context(), server_hostname="127.0.0.1")
                with trio.fail_after(5):
                    await tls.do_handshake()
                assert tls.selected_alpn_protocol() == "h2"
        # Other sources are not affected.
        with trio.fail_after(5):
            async with target.open_client() as client:
                await target.request(client)
        refused = [r for r in caplog.records if getattr(r, "limit", None) == "max_per_source"]
        assert len(refused) == 1  # four refusals, one line
        assert getattr(refused[0], "peer", None) == "127.0.0.2"
        for stream in streams:
            await stream.aclose()
        # Their places are given back.
        with trio.fail_after(5):
            await wait_until(lambda: target.admissions.held_by("127.0.0.2") == 0)
        again = await connect_from("127.0.0.2", target.port)
        with trio.fail_after(5):
            await wait_until(lambda: target.admissions.held_by("127.0.0.2") == 1)
        await again.aclose()


async def read_frames_until_closed(tls: trio.SSLStream[trio.SocketStream]) -> list[int]:
    """The types of the HTTP/2 frames received until the server closes."""
    received = b""
    with contextlib.suppress(trio.BrokenResourceError):
        while chunk := await tls.receive_some(65536):
            received += chunk
    types = []
    at = 0
    while at + 9 <= len(received):
        length = int.from_bytes(received[at : at + 3], "big")
        types.append(received[at + 3])
        at += 9 + length
    return types


def _no_request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "levers9.connections" and getattr(r, "reason", "") == "no request within 0.5 s"
    ]


@pytest.mark.parametrize("kind", TARGETS)
async def test_a_silent_connection_is_closed_after_the_first_request_timeout(
    kind: str, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """TLS done, then nothing but the HTTP/2 preface: GOAWAY and a close once
    first_request_timeout_s is over. A connection that made its request before is not
    affected, nor (controlplane) a worker's tunnel, whose request came at once."""
    caplog.set_level(logging.INFO, logger="levers9.connections")
    async with open_target(kind, pki, ConnectionLimits(first_request_timeout_s=0.5)) as (
        target,
        nursery,
    ):
        tunnel = None
        if target.control is not None:
            nursery.start_soon(run_agent, agent_config(pki, target.port, mode="tunnel"))
            with trio.fail_after(10):
                tunnel = await target.control.registry.client_for("w-tunnel")
        async with target.open_client() as legit:
            await target.request(legit)
            silent = trio.SSLStream(
                await connect_from("127.0.0.2", target.port),
                _client_context(),
                server_hostname="127.0.0.1",
            )
            with trio.fail_after(5):
                await silent.do_handshake()
                await silent.send_all(PREFACE + SETTINGS_FRAME)
                types = await read_frames_until_closed(silent)
            assert GOAWAY in types
            with trio.fail_after(5):  # logged once the server is done with the connection
                await wait_until(lambda: bool(_no_request_lines(caplog)))
            [line] = _no_request_lines(caplog)
            assert line.peer.startswith("127.0.0.2:")  # type: ignore[attr-defined]
            with trio.fail_after(5):
                await target.request(legit)
        if target.control is not None and tunnel is not None:
            assert await target.control.registry.client_for("w-tunnel") is tunnel
            with trio.fail_after(5):
                assert (await tunnel.health()).status == "ok"
            # The tunnel's route (http/1.1): TLS, then no upgrade request.
            context = _client_context()
            context.set_alpn_protocols(["http/1.1"])
            quiet = trio.SSLStream(
                await connect_from("127.0.0.3", target.port), context, server_hostname="x"
            )
            with trio.fail_after(5):
                await quiet.do_handshake()
                assert quiet.selected_alpn_protocol() == "http/1.1"
                with contextlib.suppress(trio.BrokenResourceError):
                    while await quiet.receive_some(65536):
                        pass
                await wait_until(lambda: len(_no_request_lines(caplog)) == 2)


async def test_memory_plateaus_while_connections_come_and_go(pki: Pki) -> None:
    """10 cycles of 500 connections opened and closed against the controlplane: 450 that
    stop halfway through the TLS handshake and 50 that complete it and start HTTP/2."""
    hello = partial_client_hello()
    process = psutil.Process()
    rss: list[int] = []
    async with open_target("controlplane", pki, ConnectionLimits()) as (target, _):

        async def full(source: str) -> trio.SSLStream[trio.SocketStream]:
            tls = trio.SSLStream(
                await connect_from(source, target.port),
                _client_context(),
                server_hostname="127.0.0.1",
            )
            await tls.do_handshake()
            await tls.send_all(PREFACE + SETTINGS_FRAME)
            return tls

        with trio.fail_after(50):
            for _ in range(10):
                streams: list[trio.abc.AsyncResource] = []
                for i in range(450):
                    stream = await connect_from(FLOOD_SOURCES[i % 2], target.port)
                    await stream.send_all(hello)
                    streams.append(stream)
                for i in range(50):
                    streams.append(await full(FLOOD_SOURCES[2 + i % 2]))
                await wait_until(lambda: target.admissions.statistics().open_total == 500)
                for resource_ in streams:
                    await trio.aclose_forcefully(resource_)
                await wait_until(lambda: target.admissions.statistics().open_total == 0)
                gc.collect()
                rss.append(process.memory_info().rss)
    mib = [round(r / 2**20, 1) for r in rss]
    growth = rss[-1] - rss[2]
    print(f"\nRSS per cycle (MiB): {mib}; cycle 3 to 10: {growth / 2**20:+.1f} MiB")
    assert growth < 10 * 2**20


async def test_tunnels_from_one_address_are_not_held_to_its_limit(pki: Pki) -> None:
    """Two workers behind one address (a NAT gateway), a per-source limit of 1: both tunnels
    come up, and the address still has its one place for a connection not yet vouched for."""
    limits = ConnectionLimits(max_per_source=1)
    async with open_target("controlplane", pki, limits) as (target, nursery):
        control = target.control
        assert control is not None
        for worker_id in ("w-tunnel", "w-direct"):
            config = agent_config(pki, control.port, mode="tunnel", worker_id=worker_id)
            nursery.start_soon(run_agent, config)
            with trio.fail_after(10):
                client = await control.registry.client_for(worker_id)
                assert (await client.health()).status == "ok"
        assert control.admissions.held_by("127.0.0.1") == 0
        with trio.fail_after(5):
            async with target.open_client() as api:
                await target.request(api)
