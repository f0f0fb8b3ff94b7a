"""The object routes through the real worker API service, over in-memory streams."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from agent.daemon.routes import WorkerState, build_router
from agent.store.objects import ObjectStore
from agent.store.routes import add_object_routes
from wire.client import WorkerUnavailable
from wire.connection import Http2Connection, StreamError
from wire.errors import ApiError, ErrorCode
from wire.service import Service, bearer_auth
from workerapi.client import WorkerClient, open_worker_client
from workerapi.digests import DIGEST_PREFIX

TOKEN = "objects-token-0123456789"
MIB = 1 << 20


def digest_of(data: bytes) -> str:
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


async def chunks_of(data: bytes, size: int = 100_000) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset : offset + size]


def flip_byte(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(tmp_path / "worker", budget_bytes=1 << 40, free_floor_bytes=0)


@pytest.fixture
async def client(store: ObjectStore, nursery: trio.Nursery) -> AsyncIterator[WorkerClient]:
    router = build_router(WorkerState("w-1", "direct"))
    add_object_routes(router, store)
    server_side, client_side = trio.testing.memory_stream_pair()
    conn = Http2Connection(
        server_side,
        client_side=False,
        handler=Service(router, program="worker", authenticate=bearer_auth(TOKEN)),
    )
    nursery.start_soon(conn.run)
    async with open_worker_client(client_side, token=TOKEN) as c:
        yield c


async def test_put_head_get_and_fetch(
    client: WorkerClient, store: ObjectStore, tmp_path: Path
) -> None:
    data = os.urandom(3 * MIB + 17)
    digest = digest_of(data)
    assert await client.has_object(digest) is None
    stored = await client.put_object(digest, chunks_of(data), size=len(data))
    assert (stored.digest, stored.size) == (digest, len(data))
    assert store.path_of(digest).read_bytes() == data
    assert await client.has_object(digest) == len(data)
    received = [chunk async for chunk in client.get_object(digest)]
    assert b"".join(received) == data
    local = ObjectStore(tmp_path / "local", budget_bytes=1 << 40, free_floor_bytes=0)
    fetched = await client.fetch_object(digest, local)
    assert fetched.size == len(data)
    assert local.path_of(digest).read_bytes() == data
    # Putting it again is answered at once with the object already there.
    again = await client.put_object(digest, chunks_of(data), size=len(data))
    assert again == stored


async def test_missing_object_is_not_found(client: WorkerClient) -> None:
    digest = digest_of(b"never stored")
    assert await client.has_object(digest) is None
    with pytest.raises(ApiError) as err:
        async for _ in client.get_object(digest):
            pass
    assert err.value.code is ErrorCode.NOT_FOUND
    assert digest in err.value.message
    # A bad digest in the path is refused, naming it.
    with pytest.raises(ApiError) as bad:
        await client.call("GET", "/v1/objects/sha256:XYZ")
    assert bad.value.code is ErrorCode.INVALID_ARGUMENT
    assert bad.value.field == "digest"
    assert (await client.health()).status == "ok"


async def test_put_with_the_wrong_digest_is_400_and_stores_nothing(
    client: WorkerClient, store: ObjectStore
) -> None:
    data = os.urandom(2 * MIB)
    claimed = digest_of(b"what the caller thought it had")
    with pytest.raises(ApiError) as err:
        await client.put_object(claimed, chunks_of(data), size=len(data))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert claimed in err.value.message
    assert digest_of(data) in err.value.message
    assert not store.contains(claimed)
    assert not store.contains(digest_of(data))
    assert list((store.root / "objects" / "tmp").iterdir()) == []
    assert await client.has_object(claimed) is None


@pytest.mark.parametrize("size", [50_000, 3 * MIB])
async def test_get_of_a_corrupt_object_fails_the_client(
    client: WorkerClient, store: ObjectStore, size: int
) -> None:
    data = os.urandom(size)
    digest = digest_of(data)
    await store.ingest(chunks_of(data), digest=digest)
    flip_byte(store.path_of(digest), size // 2)
    # On the wire: the body never ends cleanly, whatever the client checks itself.
    response = await client.open("GET", f"/v1/objects/{digest}")
    assert response.status == 200
    received = b""
    with pytest.raises(StreamError):
        while chunk := await response.stream.receive_some():
            received += chunk
    assert len(received) < size
    assert not store.contains(digest)
    assert await client.has_object(digest) is None
    # Through the typed client, without its own check, the worker's reset still fails it.
    await store.ingest(chunks_of(data), digest=digest)
    flip_byte(store.path_of(digest), size // 2)
    with pytest.raises(WorkerUnavailable) as err:
        async for _ in client.get_object(digest, verify=False):
            pass
    assert digest in err.value.message
    assert (await client.health()).status == "ok"


async def test_a_64_mib_put_streams_to_disk_as_it_arrives(
    client: WorkerClient, store: ObjectStore
) -> None:
    total = 64 * MIB
    hasher = hashlib.sha256()
    for index in range(total // MIB):
        hasher.update(bytes([index]) * MIB)
    digest = DIGEST_PREFIX + hasher.hexdigest()
    temp_dir = store.root / "objects" / "tmp"
    on_disk_midway: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for index in range(total // MIB):
            if index == 48:
                on_disk_midway.append(sum(p.stat().st_size for p in temp_dir.iterdir()))
            yield bytes([index]) * MIB

    stored = await client.put_object(digest, body(), size=total)
    assert stored.size == total
    # With 48 MiB sent, most of it was already in the worker's temp file: nothing
    # waited for the whole body.
    assert on_disk_midway[0] >= 8 * MIB
    assert await client.has_object(digest) == total
    assert list(temp_dir.iterdir()) == []
