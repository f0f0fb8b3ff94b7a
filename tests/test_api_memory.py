"""The worker API over in-memory streams: requests, errors, auth, CONNECT, WebSocket."""

from __future__ import annotations

import email.utils
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing

from agent.daemon.routes import WorkerState, build_router
from wire.connection import Http2Connection
from wire.errors import ApiError, ErrorCode
from wire.service import ConnectPolicy, Request, Router, Service, bearer_auth
from workerapi.client import WorkerClient, open_worker_client

TOKEN = "s3cr3t-token"


@pytest.fixture
async def client(nursery: trio.Nursery) -> AsyncIterator[WorkerClient]:
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(
        build_router(WorkerState("w-1", "direct")),
        program="worker",
        authenticate=bearer_auth(TOKEN),
        connect_policy=ConnectPolicy(loopback=True),
    )
    conn = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token=TOKEN) as c:
        yield c


async def test_health_and_worker(client: WorkerClient) -> None:
    health = await client.health()
    assert health.status == "ok"
    assert health.worker_id == "w-1"
    info = await client.worker()
    assert info.worker_id == "w-1"
    assert info.mode == "direct"
    assert info.uptime_s >= 0


class _WallClock:
    """Stands in for the `time` module in `wire.service`: a wall clock the test sets."""

    monotonic = staticmethod(time.monotonic)  # the request log's durations: the real one

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


async def test_answers_carry_the_current_date(
    client: WorkerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each answer's Date is the server's clock to the second (the self-check compares it
    with its own), also when answers a second apart share no formatting work."""
    clock = _WallClock(1_700_000_000.0)
    monkeypatch.setattr("wire.service.time", clock)
    for now in (1_700_000_000.2, 1_700_000_000.9, 1_700_000_001.5, 1_700_000_003.0):
        clock.now = now
        response = await client.open("GET", "/v1/health")
        await response.read()
        await response.aclose()
        sent = email.utils.parsedate_to_datetime(response.headers["date"]).timestamp()
        assert sent == int(now)


async def test_unknown_route_is_not_found(client: WorkerClient) -> None:
    with pytest.raises(ApiError) as err:
        await client.call("GET", "/v1/nope")
    assert err.value.code is ErrorCode.NOT_FOUND


def test_the_router_picks_the_first_route_added_that_matches() -> None:
    """Routes are looked up among those that fit the path's length; the order they were added
    in still decides, a `{rest...}` route takes deeper paths, a route added after a lookup is
    found, and a path served under other methods names them."""

    def handler(name: str) -> Callable[[Request], Awaitable[str]]:
        async def serve(request: Request) -> str:
            return name

        return serve

    router = Router()
    router.add("GET", "/v1/tasks/{id}/ports/{port}/{rest...}", handler("endpoint"))
    router.add("GET", "/v1/tasks/{id}", handler("task"))
    router.add("GET", "/v1/tasks/special", handler("never: added after {id}"))
    router.add("POST", "/v1/tasks/{id}/cancel", handler("cancel"))

    def found(method: str, path: str) -> tuple[str, dict[str, str]]:
        route, params = router.find(method, path)
        return route.pattern, params

    assert found("GET", "/v1/tasks/t-1") == ("/v1/tasks/{id}", {"id": "t-1"})
    assert found("GET", "/v1/tasks/special") == ("/v1/tasks/{id}", {"id": "special"})
    assert found("GET", "/v1/tasks/t-1/ports/80/a/b/c.html") == (
        "/v1/tasks/{id}/ports/{port}/{rest...}",
        {"id": "t-1", "port": "80", "rest": "a/b/c.html"},
    )
    assert found("GET", "/v1/tasks/t-1/ports/80")[1]["rest"] == ""
    with pytest.raises(ApiError) as err:
        router.find("GET", "/v1/tasks/t-1/cancel")
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert "use POST" in err.value.message
    with pytest.raises(ApiError) as err:
        router.find("GET", "/v1/tasks/t-1/logs")
    assert err.value.code is ErrorCode.NOT_FOUND
    router.add("GET", "/v1/tasks/{id}/logs", handler("logs"))
    assert found("GET", "/v1/tasks/t-1/logs")[0] == "/v1/tasks/{id}/logs"


async def test_wrong_token_is_refused_before_routing(nursery: trio.Nursery) -> None:
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(
        build_router(WorkerState("w-1", "direct")),
        program="worker",
        authenticate=bearer_auth(TOKEN),
        connect_policy=ConnectPolicy(),
    )
    conn = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token="wrong") as c:
        with pytest.raises(ApiError) as err:
            await c.health()
        assert err.value.code is ErrorCode.UNAUTHENTICATED
        with pytest.raises(ApiError) as err:
            await c.call("GET", "/v1/nope")
        assert err.value.code is ErrorCode.UNAUTHENTICATED


async def test_connect_carries_bytes_both_ways(client: WorkerClient, nursery: trio.Nursery) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(data)

    nursery.start_soon(trio.serve_listeners, echo, listeners)
    payload = bytes(range(256)) * 40_000
    stream = await client.connect_tcp("127.0.0.1", port)
    received = hashlib.sha256()
    count = 0

    async def reader() -> None:
        nonlocal count
        while data := await stream.receive_some():
            received.update(data)
            count += len(data)

    async with trio.open_nursery() as inner:
        inner.start_soon(reader)
        await stream.send_all(payload)
        await stream.send_eof()
    await stream.aclose()
    assert count == len(payload)
    assert received.hexdigest() == hashlib.sha256(payload).hexdigest()


async def test_connect_outside_policy_is_denied(client: WorkerClient) -> None:
    with pytest.raises(ApiError) as err:
        await client.connect_tcp("10.1.2.3", 80)
    assert err.value.code is ErrorCode.PERMISSION_DENIED
    assert "10.1.2.3:80" in err.value.message


async def test_websocket_echo(client: WorkerClient) -> None:
    ws = await client.open_websocket("/v1/echo")
    await ws.send_message(b"hello")
    assert await ws.receive_message() == b"hello"
    await ws.send_message("text")
    assert await ws.receive_message() == "text"
    await ws.aclose()


async def test_early_answer_to_a_large_body_is_returned(nursery: trio.Nursery) -> None:
    # A wrong token is refused before the body is read; the client still gets the 401,
    # not "worker unavailable", even though the server resets the rest of the upload.
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(
        build_router(WorkerState("w-1", "direct")),
        program="worker",
        authenticate=bearer_auth(TOKEN),
    )
    conn = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token="wrong") as c:
        with pytest.raises(ApiError) as err:
            await c.call("POST", "/v1/health", {"data": "x" * (20 * 1024 * 1024)})
        assert err.value.code is ErrorCode.UNAUTHENTICATED
