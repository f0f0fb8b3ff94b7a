"""The object store's ingest benchmark: `ObjectStore` against `cp` of the same file.

Ingest's target is at least 0.7 x the throughput of `cp` to the same disk. The anchor is `cp`
followed by an fsync of the copy and of its directory, timed together: ingest returns only
once its object is durable (file and directory fsynced), and `cp` alone stops at the page
cache, so without the fsyncs the anchor would be measuring memory, not the disk. The source
is read once before anything is timed, so every path reads it from the page cache.

Three paths, in turns (their order rotates each repeat, so none always runs on a disk still
busy with the previous one's writeback), each reported as its best repeat:
- ``cp``: the anchor;
- ``ingest``: `ObjectStore.ingest_file`, the local-file fast path;
- ``ingest_stream``: `ObjectStore.ingest` fed 1 MiB chunks from memory with the digest to
  verify, as an image pull or an upload feeds it.

`measure_ingest_vs_cp` runs its own `trio.run`: call it from plain code (or from a worker
thread of a trio program), not from inside a running trio task.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import trio

from agent.api.digests import DIGEST_PREFIX
from agent.store.objects import ObjectStore

STREAM_CHUNK_BYTES = 1024 * 1024
"""The chunks `ingest()` is fed: the size of the worker API's HTTP/2 frames."""
WRITE_BLOCK_BYTES = 4 * 1024 * 1024


def measure_ingest_vs_cp(directory: Path, *, size_bytes: int, repeats: int) -> dict[str, float]:
    """Throughput (MB/s, 10^6 bytes) of ingest and of `cp` for one random file of
    `size_bytes` made under `directory`, best of `repeats` each, and their ratios. Everything
    it writes under `directory` is removed before it returns."""
    if size_bytes <= 0 or repeats <= 0:
        raise ValueError("size_bytes and repeats must be positive")
    work = directory / f"ingest-bench-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        return trio.run(_measure, work, size_bytes, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _measure(work: Path, size_bytes: int, repeats: int) -> dict[str, float]:
    source = work / "source.bin"
    digest = await trio.to_thread.run_sync(_make_source, source, size_bytes)
    # Read once, and kept for the stream path: no path pays for reading the source from disk.
    content = await trio.to_thread.run_sync(source.read_bytes)
    store = ObjectStore(work / "store", budget_bytes=4 * size_bytes, free_floor_bytes=0)
    copy = work / "copy.bin"

    async def cp() -> None:
        await trio.run_process(["cp", "--", str(source), str(copy)])
        await trio.to_thread.run_sync(_fsync_file_and_directory, copy)

    async def ingest() -> None:
        stored = await store.ingest_file(source)
        assert stored.digest == digest

    async def ingest_stream() -> None:
        stored = await store.ingest(_chunks(content), digest=digest, size=size_bytes)
        assert stored.digest == digest

    async def reset() -> None:
        store.discard(digest)
        await trio.to_thread.run_sync(_remove, copy)

    paths: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("cp", cp),
        ("ingest", ingest),
        ("ingest_stream", ingest_stream),
    ]
    best: dict[str, float] = {}
    for repeat in range(repeats):
        turn = repeat % len(paths)
        for name, run in paths[turn:] + paths[:turn]:
            await reset()
            started = time.perf_counter()
            await run()
            elapsed = time.perf_counter() - started
            best[name] = min(best.get(name, elapsed), elapsed)
    await reset()
    store.close()
    mb_s = {name: size_bytes / seconds / 1e6 for name, seconds in best.items()}
    return {
        "ingest_mb_s": mb_s["ingest"],
        "ingest_stream_mb_s": mb_s["ingest_stream"],
        "cp_mb_s": mb_s["cp"],
        "ingest_vs_cp": mb_s["ingest"] / mb_s["cp"],
        "ingest_stream_vs_cp": mb_s["ingest_stream"] / mb_s["cp"],
    }


async def _chunks(content: bytes) -> AsyncIterator[bytes]:
    for offset in range(0, len(content), STREAM_CHUNK_BYTES):
        # A slice is a copy, as bytes received from a socket are.
        yield content[offset : offset + STREAM_CHUNK_BYTES]


def _make_source(path: Path, size_bytes: int) -> str:
    """Write `size_bytes` random bytes (nothing on the way can compress them); their digest."""
    hasher = hashlib.sha256()
    with open(path, "wb") as file:
        left = size_bytes
        while left:
            block = os.urandom(min(left, WRITE_BLOCK_BYTES))
            hasher.update(block)
            file.write(block)
            left -= len(block)
        file.flush()
        os.fsync(file.fileno())
    return DIGEST_PREFIX + hasher.hexdigest()


def _fsync_file_and_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
