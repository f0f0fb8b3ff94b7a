"""The object store: eviction planning, ingest and read, crashes, corruption, LRU, pins.

Everything runs on real files under pytest's tmp_path; the cross-process tests run real
`python -c` processes on the same directory, as two workers on one node do.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from agent.store.objects import (
    BATCH_BYTES,
    ObjectCorrupt,
    ObjectEntry,
    ObjectStore,
    TempWriter,
    parse_temp_name,
    plan_eviction,
    temp_is_stale,
)
from wire.errors import ApiError, ErrorCode
from workerapi.digests import DIGEST_PREFIX, DigestMismatch, parse_digest

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def digest_of(data: bytes) -> str:
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


async def chunks_of(data: bytes, size: int = 256 * 1024) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset : offset + size]


def open_store(root: Path, budget_bytes: int = 1 << 40) -> ObjectStore:
    return ObjectStore(root, budget_bytes=budget_bytes, free_floor_bytes=0)


def temp_files(root: Path) -> list[Path]:
    return sorted((root / "objects" / "tmp").iterdir())


def object_files(root: Path) -> list[Path]:
    return sorted((root / "objects" / "sha256").iterdir())


def flip_byte(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def entry(name: str, size: int, used: int) -> ObjectEntry:
    return ObjectEntry(DIGEST_PREFIX + name * 64, size, used)


# -- digests and pure decisions -----------------------------------------------------------------


def test_parse_digest_takes_only_canonical_sha256() -> None:
    good = "sha256:" + "ab" * 32
    assert parse_digest(good) == good
    for bad in ("sha256:" + "AB" * 32, "sha512:" + "ab" * 32, "sha256:abc", "ab" * 32):
        with pytest.raises(ApiError) as err:
            parse_digest(bad, field="layers[0].digest")
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
        assert err.value.field == "layers[0].digest"
        assert "layers[0].digest" in err.value.message


def test_plan_evicts_nothing_under_budget_and_above_the_floor() -> None:
    entries = [entry("a", 100, 1), entry("b", 100, 2)]
    assert (
        plan_eviction(entries, budget_bytes=200, free_bytes=500, free_floor_bytes=500, pinned=())
        == []
    )
    assert plan_eviction(
        entries, budget_bytes=199, free_bytes=500, free_floor_bytes=500, pinned=()
    ) == [entry("a", 100, 1).digest]


def test_plan_evicts_least_recently_used_first_until_under_budget() -> None:
    a, b, c, d = entry("a", 100, 40), entry("b", 100, 10), entry("c", 100, 30), entry("d", 100, 20)
    plan = plan_eviction(
        [a, b, c, d], budget_bytes=250, free_bytes=1, free_floor_bytes=0, pinned=()
    )
    assert plan == [b.digest, d.digest]


def test_plan_never_takes_pinned_objects() -> None:
    a, b, c = entry("a", 100, 1), entry("b", 100, 2), entry("c", 100, 3)
    plan = plan_eviction(
        [a, b, c], budget_bytes=150, free_bytes=1, free_floor_bytes=0, pinned={a.digest}
    )
    assert plan == [b.digest, c.digest]
    # Pinned objects alone over budget: every unpinned one goes, and no more.
    assert plan_eviction(
        [a, b, c], budget_bytes=0, free_bytes=1, free_floor_bytes=0, pinned={a.digest, c.digest}
    ) == [b.digest]


def test_plan_frees_disk_below_the_free_floor_even_under_budget() -> None:
    a, b, c = entry("a", 100, 1), entry("b", 300, 2), entry("c", 100, 3)
    plan = plan_eviction(
        [a, b, c], budget_bytes=10_000, free_bytes=900, free_floor_bytes=1_200, pinned=()
    )
    assert plan == [a.digest, b.digest]


def test_temp_of_a_dead_writer_is_stale_and_a_live_ones_is_not() -> None:
    writer = parse_temp_name("4026531836-4242-9000-00ff.tmp")
    assert writer == TempWriter(4026531836, 4242, 9000)
    ns = 4026531836
    assert temp_is_stale(writer, writer_start_ticks=None, idle_s=0.0, own_pid_namespace=ns)
    assert temp_is_stale(writer, writer_start_ticks=1234, idle_s=0.0, own_pid_namespace=ns)
    # Its writer alive, a file stays however long it has been idle.
    assert not temp_is_stale(writer, writer_start_ticks=9000, idle_s=86_400.0, own_pid_namespace=ns)
    # Another pod's writer can't be looked up: only a long silence condemns its file.
    assert not temp_is_stale(writer, writer_start_ticks=None, idle_s=60.0, own_pid_namespace=1)
    assert temp_is_stale(writer, writer_start_ticks=None, idle_s=3600.0, own_pid_namespace=1)
    assert temp_is_stale(None, writer_start_ticks=None, idle_s=3600.0, own_pid_namespace=1)


# -- ingest and read ------------------------------------------------------------------------------


async def test_ingest_and_read_round_trip(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = os.urandom(2 * BATCH_BYTES + 12345)
    progress: list[int] = []
    stored = await store.ingest(
        chunks_of(data, 300_000),
        digest=digest_of(data),
        size=len(data),
        on_progress=progress.append,
    )
    assert stored.digest == digest_of(data)
    assert stored.size == len(data)
    assert sum(progress) == len(data)
    assert store.contains(stored.digest)
    assert store.size_of(stored.digest) == len(data)
    assert store.path_of(stored.digest).read_bytes() == data
    received = [chunk async for chunk in store.read(stored.digest, chunk_bytes=MIB)]
    assert b"".join(received) == data
    assert max(len(chunk) for chunk in received) <= MIB
    assert temp_files(tmp_path) == []
    await store.verify(stored.digest)
    statistics = store.statistics()
    assert (statistics.objects, statistics.bytes) == (1, len(data))


async def test_ingest_without_a_digest_names_the_content(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    stored = await store.ingest(chunks_of(b"hello, store"))
    assert stored.digest == digest_of(b"hello, store")
    empty = await store.ingest(chunks_of(b""))
    assert empty == (await store.ingest(chunks_of(b""), digest=digest_of(b"")))
    assert store.size_of(empty.digest) == 0


async def test_ingest_file_stores_a_copy(tmp_path: Path) -> None:
    source = tmp_path / "layer.tar"
    data = os.urandom(BATCH_BYTES + 7)
    source.write_bytes(data)
    store = open_store(tmp_path / "store")
    stored = await store.ingest_file(source, digest=digest_of(data))
    assert stored.size == len(data)
    assert store.path_of(stored.digest).read_bytes() == data
    with pytest.raises(ApiError) as err:
        await store.ingest_file(tmp_path / "missing.tar")
    assert err.value.code is ErrorCode.NOT_FOUND
    assert "missing.tar" in err.value.message


async def test_wrong_digest_is_rejected_and_leaves_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = os.urandom(BATCH_BYTES + 1000)
    claimed = digest_of(b"something else")
    with pytest.raises(DigestMismatch) as err:
        await store.ingest(chunks_of(data), digest=claimed)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert claimed in err.value.message
    assert digest_of(data) in err.value.message
    assert object_files(tmp_path) == []
    assert temp_files(tmp_path) == []
    assert not store.contains(digest_of(data))


@pytest.mark.parametrize("declared", [999, 1001])
async def test_declared_size_is_enforced(tmp_path: Path, declared: int) -> None:
    store = open_store(tmp_path)
    data = os.urandom(1000)
    with pytest.raises(ApiError) as err:
        await store.ingest(chunks_of(data, 100), size=declared)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert err.value.field == "size"
    assert str(declared) in err.value.message
    assert object_files(tmp_path) == []
    assert temp_files(tmp_path) == []


async def test_a_failing_source_fails_the_ingest_with_its_own_error(tmp_path: Path) -> None:
    store = open_store(tmp_path)

    class SourceBroke(Exception):
        pass

    async def broken() -> AsyncIterator[bytes]:
        yield os.urandom(BATCH_BYTES + 5)
        raise SourceBroke("registry hung up")

    with pytest.raises(SourceBroke):
        await store.ingest(broken())
    assert object_files(tmp_path) == []
    assert temp_files(tmp_path) == []


async def test_concurrent_ingests_of_one_digest_share_the_work(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = os.urandom(3 * MIB)
    digest = digest_of(data)
    consumed = [0] * 5

    async def source(index: int) -> AsyncIterator[bytes]:
        for offset in range(0, len(data), 64 * 1024):
            consumed[index] += 64 * 1024
            await trio.lowlevel.checkpoint()
            yield data[offset : offset + 64 * 1024]

    results = []

    async def ingest(index: int) -> None:
        results.append(await store.ingest(source(index), digest=digest))

    async with trio.open_nursery() as nursery:
        for index in range(5):
            nursery.start_soon(ingest, index)
    assert {(r.digest, r.size) for r in results} == {(digest, len(data))}
    assert sum(consumed) == len(data)  # one source was read; the others waited for it
    assert [p.name for p in object_files(tmp_path)] == [digest.removeprefix(DIGEST_PREFIX)]
    assert store.path_of(digest).read_bytes() == data
    assert temp_files(tmp_path) == []


async def test_a_cancelled_ingest_leaves_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    written = trio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield os.urandom(BATCH_BYTES + 1)
        await trio.sleep_forever()

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: store.ingest(stalls(), on_progress=lambda added: written.set())
            )
            await written.wait()
            assert len(temp_files(tmp_path)) == 1
            scope.cancel()
    assert temp_files(tmp_path) == []
    assert object_files(tmp_path) == []


async def test_many_concurrent_file_ingests_all_finish(tmp_path: Path) -> None:
    # More ingests at once than trio has worker threads by default (40), each holding
    # threads for its lanes while it reads its file on yet another.
    store = open_store(tmp_path / "store")
    sources = []
    for index in range(30):
        source = tmp_path / f"file-{index}"
        source.write_bytes(os.urandom(1000) + bytes([index]))
        sources.append(source)
    results = []

    async def ingest(source: Path) -> None:
        results.append(await store.ingest_file(source))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for source in sources:
                nursery.start_soon(ingest, source)
    assert len({stored.digest for stored in results}) == 30
    assert len(object_files(tmp_path / "store")) == 30


# Each writer streams half the content, waits until the test says go (so both temp files
# exist at once), then streams the rest.
WRITER = """
import hashlib, pathlib, sys, trio
from agent.store.objects import ObjectStore
root, flags, name = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
data = bytes(range(256)) * 4096 * 20
async def chunks():
    half = len(data) // 2
    for i in range(0, half, 1 << 20):
        yield data[i : i + (1 << 20)]
    (flags / name).touch()
    while not (flags / "go").exists():
        await trio.sleep(0.01)
    for i in range(half, len(data), 1 << 20):
        yield data[i : i + (1 << 20)]
async def main():
    store = ObjectStore(root, budget_bytes=1 << 40, free_floor_bytes=0)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    stored = await store.ingest(chunks(), digest=digest, size=len(data))
    print(stored.digest, stored.size, flush=True)
trio.run(main)
"""


async def test_two_processes_ingesting_one_digest_at_once_leave_one_object(
    tmp_path: Path,
) -> None:
    root, flags = tmp_path / "store", tmp_path / "flags"
    flags.mkdir()
    data = bytes(range(256)) * 4096 * 20
    results: dict[str, subprocess.CompletedProcess[bytes]] = {}

    async def writer(name: str) -> None:
        results[name] = await trio.run_process(
            [sys.executable, "-c", WRITER, str(root), str(flags), name],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=REPO,
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for name in ("a", "b"):
                nursery.start_soon(writer, name)
            while not ((flags / "a").exists() and (flags / "b").exists()):
                assert not results, f"a writer ended early: {results}"
                await trio.sleep(0.02)
            assert len(temp_files(root)) == 2  # both are mid-write now
            (flags / "go").touch()
    for name in ("a", "b"):
        assert results[name].returncode == 0, results[name].stderr.decode()
        assert results[name].stdout.split() == [digest_of(data).encode(), str(len(data)).encode()]
    store = open_store(root)
    assert [p.name for p in object_files(root)] == [digest_of(data).removeprefix(DIGEST_PREFIX)]
    await store.verify(digest_of(data))
    assert temp_files(root) == []


# Streams one and a half batches, so one batch reaches the temp file, then stalls for ever.
STALLER = """
import pathlib, sys, trio
from agent.store.objects import BATCH_BYTES, ObjectStore
async def main():
    store = ObjectStore(pathlib.Path(sys.argv[1]), budget_bytes=1 << 40, free_floor_bytes=0)
    def progress(added):
        print("written", added, flush=True)
    async def chunks():
        for _ in range(BATCH_BYTES * 3 // 2 // (1 << 20)):
            yield b"x" * (1 << 20)
        await trio.sleep_forever()
    await store.ingest(chunks(), on_progress=progress)
trio.run(main)
"""


async def test_a_killed_ingest_leaves_no_object_and_its_temp_goes_on_reopen(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", STALLER, str(root)], stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        assert process.stdout is not None
        output = b""
        with trio.fail_after(30):
            while b"written" not in output:
                data = await process.stdout.receive_some()
                assert data, "the ingesting process ended before writing anything"
                output += data
        (temp,) = temp_files(root)
        assert temp.stat().st_size >= BATCH_BYTES
        process.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
    assert object_files(root) == []
    assert temp_files(root) == [temp]  # nobody cleaned it yet
    open_store(root)
    assert temp_files(root) == []
    assert object_files(root) == []


async def test_a_live_writers_temp_survives_another_store_opening(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    written, release = trio.Event(), trio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"y" * (BATCH_BYTES + 1)
        await release.wait()

    async def ingest() -> None:
        await store.ingest(slow(), on_progress=lambda added: written.set())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ingest)
        await written.wait()
        open_store(tmp_path)  # a second store on the directory, the writer still alive
        assert len(temp_files(tmp_path)) == 1
        release.set()
    assert store.contains(digest_of(b"y" * (BATCH_BYTES + 1)))


# -- corruption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
async def test_a_corrupt_object_is_removed_on_read_and_never_served_whole(
    tmp_path: Path, where: str
) -> None:
    store = open_store(tmp_path)
    data = os.urandom(256 * 1024)
    stored = await store.ingest(chunks_of(data), digest=digest_of(data))
    flip_byte(store.path_of(stored.digest), 10 if where == "first chunk" else len(data) - 10)
    received: list[bytes] = []
    with pytest.raises(ObjectCorrupt) as err:
        async for chunk in store.read(stored.digest, chunk_bytes=64 * 1024):
            received.append(chunk)
    assert stored.digest in err.value.message
    assert len(b"".join(received)) < len(data)
    assert not store.contains(stored.digest)
    with pytest.raises(ApiError) as missing:
        async for _ in store.read(stored.digest):
            pass
    assert missing.value.code is ErrorCode.NOT_FOUND


async def test_verify_removes_a_corrupt_object(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = os.urandom(100_000)
    stored = await store.ingest(chunks_of(data))
    await store.verify(stored.digest)
    assert store.contains(stored.digest)
    flip_byte(store.path_of(stored.digest), 5000)
    with pytest.raises(ObjectCorrupt):
        await store.verify(stored.digest)
    assert not store.contains(stored.digest)
    # Ingested again, the good copy is served.
    await store.ingest(chunks_of(data), digest=stored.digest)
    assert b"".join([c async for c in store.read(stored.digest)]) == data


async def test_a_stored_copy_of_the_wrong_size_is_replaced_by_a_verified_one(
    tmp_path: Path,
) -> None:
    store = open_store(tmp_path)
    data = os.urandom(10_000)
    stored = await store.ingest(chunks_of(data))
    path = store.path_of(stored.digest)
    os.chmod(path, 0o644)
    os.truncate(path, 5000)
    again = await store.ingest(chunks_of(data), digest=stored.digest, size=len(data))
    assert again.size == len(data)
    assert path.read_bytes() == data


# -- LRU, pins, eviction --------------------------------------------------------------------------


async def test_eviction_takes_least_recently_used_and_keeps_pinned(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    blobs = [os.urandom(1000) for _ in range(4)]
    a, b, c, d = [(await store.ingest(chunks_of(blob))).digest for blob in blobs]
    store.pin(a, "container-1")
    store.pin(a, "container-2")
    store.touch(b)
    store.budget_bytes = 2000
    # LRU order: a (pinned), c, d, b. Two of the unpinned must go: c and d.
    assert await store.evict() == [c, d]
    assert [store.contains(x) for x in (a, b, c, d)] == [True, True, False, False]
    store.unpin_owner("container-1")
    store.budget_bytes = 0
    assert await store.evict() == [b]  # container-2 still holds a
    store.unpin_owner("container-2")
    assert await store.evict() == [a]
    assert store.statistics().objects == 0


async def test_eviction_follows_each_ingest_and_spares_the_new_object(tmp_path: Path) -> None:
    store = open_store(tmp_path, budget_bytes=2500)
    first = await store.ingest(chunks_of(os.urandom(1000)))
    second = await store.ingest(chunks_of(os.urandom(1000)))
    third = await store.ingest(chunks_of(os.urandom(1000)))
    assert not store.contains(first.digest)
    assert store.contains(second.digest)
    assert store.contains(third.digest)
    huge = await store.ingest(chunks_of(os.urandom(3000)))
    assert store.contains(huge.digest)  # over budget alone, yet just asked for
    assert not store.contains(second.digest)
    assert not store.contains(third.digest)


async def test_lru_order_survives_reopening_the_store(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    a, b, c = [(await store.ingest(chunks_of(os.urandom(1000)))).digest for _ in range(3)]
    store.touch(a)  # now the most recent: order b, c, a
    store.close()
    reopened = ObjectStore(tmp_path, budget_bytes=2000, free_floor_bytes=0)
    assert reopened.statistics().objects == 3
    assert await reopened.evict() == [b]
    reopened.budget_bytes = 1000
    assert await reopened.evict() == [c]
    assert reopened.contains(a)


async def test_a_pin_held_by_another_store_on_the_directory_blocks_eviction(
    tmp_path: Path,
) -> None:
    # Two workers on one node share the directory; pins are in memory, so a pinned
    # object also holds a shared flock that the other worker's eviction respects.
    mine = open_store(tmp_path)
    theirs = ObjectStore(tmp_path, budget_bytes=0, free_floor_bytes=0)
    held = await mine.ingest(chunks_of(os.urandom(1000)))
    loose = await mine.ingest(chunks_of(os.urandom(1000)))
    mine.pin(held.digest, "container-1")
    assert await theirs.evict() == [loose.digest]
    assert mine.contains(held.digest)
    mine.unpin_owner("container-1")
    assert await theirs.evict() == [held.digest]
