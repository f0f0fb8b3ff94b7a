"""A CONNECT that is usable before its answer (`ApiClient.connect_early`, `splice(opening=)`).

What a client sends while the far end is still connecting is carried; nothing comes back
before the answer; a refusal arrives as the server's own error, and ends the splice. The splice
is checked over memory streams; the client and the controlplane's dialer against the agent's
own service (`build_service`) over memory streams, reaching a listener of the test's on
loopback. Through the CLI's port forward: tests/test_cli.py; end to end: tests/test_e2e.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from agent.daemon.config import AgentConfig
from agent.daemon.routes import WorkerState
from agent.daemon.run import build_service
from tests.streams import exchange
from wire.client import ApiClient, open_api_client
from wire.connection import Http2Connection
from wire.errors import ApiError, ErrorCode
from wire.service import Router, Service, bearer_auth, splice
from workerapi.client import WorkerClient, open_worker_client

TOKEN = "early-s3cr3t-token"


class _Recorded(trio.abc.HalfCloseableStream):
    """A stream that notes, for each send, whether the far end had been opened by then."""

    def __init__(self, inner: trio.abc.HalfCloseableStream, state: dict[str, bool]) -> None:
        self.inner, self.state = inner, state
        self.sends: list[tuple[bytes, bool]] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sends.append((bytes(data), self.state["opened"]))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return bytes(await self.inner.receive_some(max_bytes))

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_splice_sends_on_at_once_and_passes_nothing_back_before_the_opening() -> None:
    client, a_inner = trio.testing.memory_stream_pair()
    b, far = trio.testing.memory_stream_pair()
    state = {"opened": False}
    a = _Recorded(a_inner, state)
    release = trio.Event()

    async def opening() -> None:
        # The client's bytes reach the far end while it is still being opened.
        assert await far.receive_some() == b"hello"
        await far.send_all(b"early answer")  # waits in b until the opening is done
        await release.wait()
        state["opened"] = True

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: splice(a, b, opening=opening))
            await client.send_all(b"hello")
            await trio.testing.wait_all_tasks_blocked()
            assert a.sends == []
            release.set()
            assert await client.receive_some() == b"early answer"
            await far.send_all(b"more")
            assert await client.receive_some() == b"more"
            await client.send_eof()
            assert await far.receive_some() == b""
            await far.send_eof()
            assert await client.receive_some() == b""
    assert a.sends == [(b"early answer", True), (b"more", True)]


async def test_a_refused_opening_ends_the_splice_with_its_own_error() -> None:
    client, a = trio.testing.memory_stream_pair()
    b, far = trio.testing.memory_stream_pair()

    async def refused() -> None:
        assert await far.receive_some() == b"hello"
        await far.send_all(b"never passed on")
        raise ApiError(ErrorCode.UNAVAILABLE, "cannot reach t-1:9000 on the worker")

    await client.send_all(b"hello")
    with trio.fail_after(5), pytest.raises(ApiError) as err:
        await splice(a, b, opening=refused)
    assert err.value.message == "cannot reach t-1:9000 on the worker"
    await client.send_eof()  # the client's side is not being read any more
    with trio.move_on_after(0.05):
        assert await client.receive_some() == b"", "nothing of b's reached a"


# -- the client, against a service whose dialer the test holds --------------------------------


@contextlib.asynccontextmanager
async def _held_service(
    nursery: trio.Nursery, far: trio.abc.HalfCloseableStream | ApiError, gate: trio.Semaphore
) -> AsyncIterator[trio.abc.Stream]:
    """A client-side stream to a Service whose CONNECT dialer waits for `gate` (one release
    lets one dial through), then returns `far` (or raises it)."""

    async def dial(host: str, port: int, principal: str) -> trio.abc.HalfCloseableStream:
        await gate.acquire()
        if isinstance(far, ApiError):
            raise far
        return far

    service = Service(
        Router(), program="controlplane", authenticate=bearer_auth(TOKEN), dial=dial, name="control"
    )
    server_side, client_side = trio.testing.memory_stream_pair()
    nursery.start_soon(Http2Connection(server_side, client_side=False, handler=service).run)
    yield client_side


async def test_an_early_connect_sends_before_the_server_answers(nursery: trio.Nursery) -> None:
    b, far = trio.testing.memory_stream_pair()
    gate = trio.Semaphore(0)
    async with (
        _held_service(nursery, b, gate) as transport,
        open_api_client(transport, ApiClient, authority="control", token=TOKEN) as client,
    ):
        with trio.fail_after(5):
            stream = await client.connect_early("t-1:9000")  # the dialer is still held
            await stream.send_all(b"ping")
            gate.release()
            await stream.wait_open()
            assert await far.receive_some() == b"ping"
            await far.send_all(b"pong")
            assert await stream.receive_some() == b"pong"
            await stream.aclose()


async def test_a_refused_early_connect_says_why(nursery: trio.Nursery) -> None:
    gate = trio.Semaphore(0)
    refusal = ApiError(ErrorCode.UNAVAILABLE, "cannot reach t-1:9000 on the worker: refused")
    async with (
        _held_service(nursery, refusal, gate) as transport,
        open_api_client(transport, ApiClient, authority="control", token=TOKEN) as client,
    ):
        with trio.fail_after(5):
            stream = await client.connect_early("t-1:9000")
            await stream.send_all(b"discarded with the refusal")
            gate.release()
            with pytest.raises(trio.BrokenResourceError) as broken:
                await stream.receive_some()
            assert "cannot reach t-1:9000 on the worker: refused" in str(broken.value)
            with pytest.raises(ApiError) as err:
                await stream.wait_open()
            assert err.value.code is ErrorCode.UNAVAILABLE
            assert err.value.message == refusal.message
            await stream.aclose()
            # The connection goes on.
            again = await client.connect_early("t-1:9000")
            gate.release()
            with pytest.raises(ApiError):
                await again.wait_open()
            await again.aclose()


# -- the controlplane's dialer: a worker's CONNECT not yet answered ----------------------------


@contextlib.asynccontextmanager
async def _worker(nursery: trio.Nursery) -> AsyncIterator[WorkerClient]:
    config = AgentConfig(
        worker_id="w-1",
        token=TOKEN,
        mode="direct",
        controlplane_url="https://cp.example.com",
        loopback_connect=True,
    )
    service = build_service(config, WorkerState(worker_id="w-1", mode="direct"))
    server_side, client_side = trio.testing.memory_stream_pair()
    nursery.start_soon(Http2Connection(server_side, client_side=False, handler=service).run)
    async with open_worker_client(client_side, token=TOKEN) as worker:
        yield worker


async def test_a_relayed_early_connect_carries_both_ways_and_relays_a_refusal(
    nursery: trio.Nursery,
) -> None:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(b"echo:" + data)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, echo, listeners)
    port = int(listeners[0].socket.getsockname()[1])
    closed = await trio.open_tcp_listeners(0, host="127.0.0.1")
    closed_port = int(closed[0].socket.getsockname()[1])
    await closed[0].aclose()

    async with _worker(nursery) as worker:

        async def dial(host: str, port: int, principal: str) -> trio.abc.HalfCloseableStream:
            return await worker.connect_tcp_early("127.0.0.1", port)

        service = Service(
            Router(),
            program="controlplane",
            authenticate=bearer_auth(TOKEN),
            dial=dial,
            name="control",
        )
        server_side, client_side = trio.testing.memory_stream_pair()
        nursery.start_soon(Http2Connection(server_side, client_side=False, handler=service).run)
        async with open_api_client(
            client_side, ApiClient, authority="control", token=TOKEN
        ) as client:
            with trio.fail_after(10):
                stream = await client.connect_early(f"t-1:{port}")
                await stream.send_all(b"one")
                assert await stream.receive_some() == b"echo:one"
                await stream.send_eof()
                assert await stream.receive_some() == b""
                await stream.aclose()

                # Bytes and the end of them, both sent before any answer.
                ended = await client.connect_early(f"t-1:{port}")
                assert await exchange(ended, b"two") == b"echo:two"

                refused = await client.connect_early(f"t-1:{closed_port}")
                await refused.send_all(b"discarded")
                with pytest.raises(ApiError) as err:
                    await refused.wait_open()
                await refused.aclose()
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert f"127.0.0.1:{closed_port}" in err.value.message
