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
thread of a trio program), not from inside a running trio task. `bench.containers` reports it
beside container start; alone:

    python -m bench.ingest [--quick] --json FILE
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import trio

from agent.store.objects import ObjectStore
from bench.report import Results, publish, ratios_of
from workerapi.digests import DIGEST_PREFIX

STREAM_CHUNK_BYTES = 1024 * 1024
"""The chunks `ingest()` is fed: the size of the worker API's HTTP/2 frames."""
WRITE_BLOCK_BYTES = 4 * 1024 * 1024
QUICK = {"bytes": 64 << 20, "repeats": 2}
FULL = {"bytes": 256 << 20, "repeats": 3}
RATIOS = {
    "ingest_vs_cp": ("ingest_mb_s", "cp_mb_s"),
    "ingest_stream_vs_cp": ("ingest_stream_mb_s", "cp_mb_s"),
}


def measure_ingest_vs_cp(directory: Path, *, size_bytes: int, repeats: int) -> Results:
    """Throughput (MB/s, 10^6 bytes) of ingest (figures) and of `cp` (the anchor) for one
    random file of `size_bytes` made under `directory`, best of `repeats` each, and their
    ratios. Everything it writes under `directory` is removed before it returns."""
    if size_bytes <= 0 or repeats <= 0:
        raise ValueError("size_bytes and repeats must be positive")
    work = directory / f"ingest-bench-{os.getpid()}"
    work.mkdir(parents=True)
    try:
        return trio.run(_measure, work, size_bytes, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _measure(work: Path, size_bytes: int, repeats: int) -> Results:
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
    figures = {"ingest_mb_s": mb_s["ingest"], "ingest_stream_mb_s": mb_s["ingest_stream"]}
    anchors = {"cp_mb_s": mb_s["cp"]}
    return Results(figures=figures, anchors=anchors, ratios=ratios_of(RATIOS, figures, anchors))


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ingest",
        description="Object store ingest against cp of the same file to the same disk.",
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 256 MiB")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    # /var/tmp: the disk the object store lives on, where /tmp may be memory.
    with tempfile.TemporaryDirectory(prefix="levers9-bench-ingest-", dir="/var/tmp") as tmp:
        results = measure_ingest_vs_cp(Path(tmp), size_bytes=plan["bytes"], repeats=plan["repeats"])
    inputs = {"file_mib": float(plan["bytes"] >> 20), "repeats": float(plan["repeats"])}
    publish(results, inputs, args.json, target="target: ingest_vs_cp >= 0.7")


if __name__ == "__main__":
    main()
