"""The one hop between replicas (`control.workers.forward`), over in-memory HTTP/2
connections: a client (the replica that got the request) → the owner (`serve_forwarded`) → the
worker's API (a real `Service`). Whatever the worker API answers arrives unchanged: JSON,
errors, a streamed body as it is written, a request body, plain CONNECT, and resets both ways;
the owner swaps the replica secret for the worker's token and refuses a wrong secret."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing

from control.workers.forward import WORKER_HEADER, is_forwarded, serve_forwarded
from wire.connection import H2Stream, Http2Connection
from wire.errors import ApiError, ErrorCode
from wire.service import (
    JsonResponse,
    Request,
    Router,
    Service,
    StreamResponse,
    bearer_auth,
)
from workerapi.client import WorkerClient

SECRET = "replica-secret-0123456789abcdef"
WORKER_TOKEN = "worker-token-0123456789"


@attrs.define
class Hop:
    via_owner: WorkerClient
    """Requests for worker `w-1` sent to the owner, as another replica sends them."""
    seen: list[str]
    """The bearer tokens the worker API saw."""
    released: trio.Event
    """Set when a test's streaming route may go on."""
    worker_conn: Http2Connection
    """The owner's connection to the worker."""
    late: list[bytes]
    """What the half-closing port received after it ended its side."""


async def connected(
    nursery: trio.Nursery, handler: object | None = None
) -> tuple[Http2Connection, Http2Connection]:
    server_end, client_end = trio.testing.memory_stream_pair()
    server = Http2Connection(server_end, client_side=False, handler=handler)  # type: ignore[arg-type]
    client = Http2Connection(client_end, client_side=True)
    await nursery.start(server.run)
    await nursery.start(client.run)
    return client, server


@asynccontextmanager
async def hop(*, secret: str = SECRET, worker_up: bool = True) -> AsyncIterator[Hop]:
    seen: list[str] = []
    late: list[bytes] = []
    released = trio.Event()
    router = Router()

    async def hello(request: Request) -> JsonResponse:
        seen.append(request.headers.get("authorization", ""))
        assert WORKER_HEADER.decode() not in request.headers
        return JsonResponse({"hello": request.query.get("name", "")})

    async def missing(request: Request) -> JsonResponse:
        raise ApiError(ErrorCode.NOT_FOUND, "no container 'c-9' here")

    async def echo(request: Request) -> JsonResponse:
        body = await request.body(64 << 20)
        return JsonResponse({"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)})

    async def lines(request: Request) -> StreamResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            await released.wait()
            yield b"second\n"

        return StreamResponse(chunks)  # type: ignore[arg-type]

    router.add("GET", "/v1/hello", hello)
    router.add("GET", "/v1/missing", missing)
    router.add("POST", "/v1/echo", echo)
    router.add("GET", "/v1/lines", lines)

    async def dial(host: str, port: int, principal: str) -> trio.abc.HalfCloseableStream:
        left, right = trio.testing.memory_stream_pair()

        async def echo_bytes() -> None:
            async for data in right:
                await right.send_all(data.upper())
            await right.aclose()

        async def answer_then_listen() -> None:
            await right.send_all((await right.receive_some()).upper())
            await right.send_eof()
            late.append(bytes(await right.receive_some()))

        nursery.start_soon(echo_bytes if port == 8080 else answer_then_listen)
        return left

    service = Service(
        router, program="controlplane", authenticate=bearer_auth(WORKER_TOKEN), dial=dial
    )
    async with trio.open_nursery() as nursery:
        # The worker's connection, as the owner holds it (its tunnel).
        to_worker, _ = await connected(nursery, service)
        worker = WorkerClient(to_worker, token="not-used", authority="w-1")

        async def local(worker_id: str) -> tuple[WorkerClient, str]:
            if not worker_up or worker_id != "w-1":
                raise ApiError(
                    ErrorCode.UNAVAILABLE, f"worker {worker_id} is not connected to this replica"
                )
            return worker, WORKER_TOKEN

        async def owner(stream: H2Stream) -> None:
            named = is_forwarded(stream.headers or [])
            assert named is not None
            await serve_forwarded(stream, named.decode(), SECRET, local)

        to_owner, _ = await connected(nursery, owner)
        client = WorkerClient(
            to_owner, token=secret, authority="w-1", extra_headers=[(WORKER_HEADER, b"w-1")]
        )
        yield Hop(client, seen, released, to_worker, late)
        nursery.cancel_scope.cancel()


async def test_a_call_is_answered_by_the_worker_with_its_own_token() -> None:
    async with hop() as h:
        answer = await h.via_owner.call("GET", "/v1/hello?name=ada", response_type=dict)
        assert answer == {"hello": "ada"}
        assert h.seen == [f"Bearer {WORKER_TOKEN}"]


async def test_the_workers_error_arrives_unchanged() -> None:
    async with hop() as h:
        with pytest.raises(ApiError) as caught:
            await h.via_owner.call("GET", "/v1/missing")
        assert caught.value.code is ErrorCode.NOT_FOUND
        assert caught.value.message == "no container 'c-9' here"


async def test_a_wrong_replica_secret_is_refused_before_the_worker_is_asked() -> None:
    async with hop(secret="another-secret-0123456789abcdef") as h:
        with pytest.raises(ApiError) as caught:
            await h.via_owner.call("GET", "/v1/hello")
        assert caught.value.code is ErrorCode.UNAUTHENTICATED
        assert h.seen == []


async def test_a_worker_not_connected_to_the_owner_is_unavailable() -> None:
    async with hop(worker_up=False) as h:
        with pytest.raises(ApiError) as caught:
            await h.via_owner.call("GET", "/v1/hello")
        assert caught.value.code is ErrorCode.UNAVAILABLE
        assert "not connected to this replica" in caught.value.message


async def test_a_large_request_body_arrives_whole() -> None:
    body = bytes(range(256)) * (8 << 12)  # 8 MiB: many flow-control windows on both hops
    async with hop() as h:
        response = await h.via_owner.open("POST", "/v1/echo", body)
        answer = json.loads(await response.read())
    assert answer == {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}


async def test_a_streamed_body_arrives_as_it_is_written() -> None:
    async with hop() as h:
        async with h.via_owner.stream("GET", "/v1/lines") as response:
            chunks = response.iter_chunks()
            # The first line arrives while the worker still holds the second back.
            assert await chunks.__anext__() == b"first\n"
            h.released.set()
            rest = b"".join([chunk async for chunk in chunks])
        assert rest == b"second\n"


async def test_plain_connect_is_a_two_way_stream_through_the_owner() -> None:
    async with hop() as h:
        stream = await h.via_owner.connect_tcp("t-1", 8080)
        await stream.send_all(b"ping")
        assert await stream.receive_some() == b"PING"
        await stream.send_eof()
        assert await stream.receive_some() == b""
        await stream.aclose()


async def test_a_half_closed_connect_stream_still_carries_the_other_way() -> None:
    async with hop() as h:
        stream = await h.via_owner.connect_tcp("t-1", 8081)  # closes after 4 bytes
        await stream.send_all(b"abcd")
        assert await stream.receive_some() == b"ABCD"
        assert await stream.receive_some() == b""  # the worker's side ended ...
        await stream.send_all(b"late")  # ... and what the client sends still arrives
        await trio.testing.wait_all_tasks_blocked()
        assert h.late == [b"late"]
        await stream.aclose()


async def test_a_client_that_gives_up_resets_the_workers_side_too() -> None:
    async with hop() as h:
        response = await h.via_owner.open("GET", "/v1/lines")
        assert await response.stream.receive_some() == b"first\n"
        await response.aclose()  # a reset, mid-body
        # The owner's relay ends; the worker's connection is left with no open stream.
        await trio.testing.wait_all_tasks_blocked()
        assert h.worker_conn.statistics().open_streams == 0
        answer = await h.via_owner.call("GET", "/v1/hello", response_type=dict)
        assert answer == {"hello": ""}


async def test_a_worker_connection_lost_mid_answer_resets_the_clients_stream_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's tunnel breaks while the owner relays its answer: the client's stream is
    reset, as a direct one would be, and the owner's handler does not fail."""
    async with hop() as h:
        response = await h.via_owner.open("GET", "/v1/lines")
        assert await response.stream.receive_some() == b"first\n"
        await h.worker_conn.aclose()  # the tunnel is cut
        with pytest.raises(trio.BrokenResourceError):
            await response.stream.receive_some()
        await trio.testing.wait_all_tasks_blocked()
        # The connection to the owner goes on (only that stream was reset).
        with pytest.raises(ApiError) as refused:
            await h.via_owner.call("GET", "/v1/hello", response_type=dict)
        assert refused.value.code is ErrorCode.UNAVAILABLE
    assert not [r for r in caplog.records if "handler failed" in r.getMessage()]
