"""The node-local, content-addressed object store: image layers, snapshots and blobs by sha256.

An object lives at `<root>/objects/sha256/<hex>` and its name is the digest of its content,
so a reader never needs to trust a writer: what is there is either right or detectably
wrong. Ingest writes into a temp file of its own (`<root>/objects/tmp/`), hashes what it
writes, checks the digest, fsyncs, hard-links the file into place and fsyncs the directory.
A link, unlike a rename, never replaces an object that is already there, so two writers of
one digest (tasks here, or another worker on the node sharing the directory) both succeed
and readers and pins keep the file they have. Killed mid-write, an ingest leaves only its
temp file, whose name records the writer (pid namespace, pid, process start time) so the
next store opened on the directory can tell that the writer is gone and remove it.

Ingest is a pipeline so that the source, the hash and the disk overlap: the caller's task
fills the next batch buffer while one worker thread hashes the batches already filled and
another writes them (hashlib and os.write release the GIL on large buffers). Each lane is one
long-lived worker thread fed through a queue, buffers are reused, and writeback of each
written range starts at once so the final fsync has little left to wait for. On this kind of
machine that made ingest as fast as `cp` + fsync of the same file (bench/ingest.py).

Eviction is least-recently-used by the time of last use, kept in each file's mtime (set with
os.utime on use: relatime makes the kernel's atime useless) so the order survives restarts.
Which objects go is decided by the pure `plan_eviction`; the thin layer here scans, plans and
removes. Pins are in memory, by owner (a container, a pull, the snapshots), and an owner drops
all of its pins at once; a pinned object also holds a shared flock so that another worker's store
on the same directory will not evict it either.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import math
import os
import queue
import re
import secrets
import stat
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Callable,
    Collection,
    Iterable,
)
from pathlib import Path
from typing import Any

import attrs
import trio

from wire.errors import ApiError, ErrorCode
from workerapi.digests import DIGEST_PREFIX, DigestMismatch, StoredObject, parse_digest

log = logging.getLogger("levers9.objects")
DEFAULT_ROOT = Path("/var/lib/levers9")
BATCH_BYTES = 8 * 1024 * 1024
"""Bytes the lanes of an ingest take at a time (measured: 8 MiB beat 2, 4 and 16 MiB)."""
PIPELINE_BATCHES = 3
"""Batch buffers per ingest (24 MiB): one being filled while the lanes work on the others."""
SPARE_BUFFERS = 4
"""Batch buffers a store keeps between ingests (32 MiB): fresh memory costs a page fault per
4 KiB, which showed as a tenth of an ingest's time."""
MAX_CONCURRENT_INGESTS = 8
"""Ingests of one store that run at once (two lane threads and 24 MiB of buffers each); the
rest wait their turn. More would not go faster: they share one disk."""
STALE_TEMP_IDLE_S = 15 * 60.0
"""A temp file nobody wrote to for this long is abandoned, whoever its writer was."""
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_TEMP_RE = re.compile(r"(\d+)-(\d+)-(\d+)-[0-9a-f]+\.tmp")
_OBJECT_MODE = 0o444
_SYNC_FILE_RANGE_WRITE = 2


@attrs.frozen
class StoreStatistics:
    objects: int
    bytes: int
    pinned: int
    budget_bytes: int
    free_bytes: int
    evicted_objects: int = 0
    """Objects this store evicted since it was opened (a counter: it only grows)."""
    evicted_bytes: int = 0


@attrs.frozen
class ObjectEntry:
    """One stored object as eviction sees it; `last_used_ns` is its mtime."""

    digest: str
    size: int
    last_used_ns: int


class ObjectCorrupt(ApiError):
    """A stored object's content no longer matches its digest; it has been removed, so the
    caller should fetch it again (hence NOT_FOUND)."""

    def __init__(self, digest: str, actual: str) -> None:
        super().__init__(
            ErrorCode.NOT_FOUND,
            f"object {digest} was corrupt on this node's disk (its content hashes to {actual}) "
            "and has been removed; fetch it again",
            field="digest",
        )
        self.digest = digest
        self.actual = actual


def plan_eviction(
    entries: Iterable[ObjectEntry],
    *,
    budget_bytes: int,
    free_bytes: int,
    free_floor_bytes: int,
    pinned: Collection[str],
) -> list[str]:
    """The digests to remove, least recently used first, so that the store fits its budget
    and the disk keeps `free_floor_bytes` free. Pinned objects are never chosen; when they
    alone are too much, every unpinned object goes and that is the best that can be done."""
    entries = list(entries)
    excess = max(
        sum(entry.size for entry in entries) - budget_bytes, free_floor_bytes - free_bytes, 0
    )
    plan: list[str] = []
    candidates = sorted(
        (entry for entry in entries if entry.digest not in pinned),
        key=lambda entry: (entry.last_used_ns, entry.digest),
    )
    for entry in candidates:
        if excess <= 0:
            break
        plan.append(entry.digest)
        excess -= entry.size
    return plan


@attrs.frozen
class TempWriter:
    """Who wrote a temp file, as recorded in its name."""

    pid_namespace: int
    pid: int
    start_ticks: int

    def temp_prefix(self) -> str:
        return f"{self.pid_namespace}-{self.pid}-{self.start_ticks}"


def parse_temp_name(name: str) -> TempWriter | None:
    match = _TEMP_RE.fullmatch(name)
    if match is None:
        return None
    return TempWriter(int(match[1]), int(match[2]), int(match[3]))


def temp_is_stale(
    writer: TempWriter | None,
    *,
    idle_s: float,
    own_pid_namespace: int,
    writer_start_ticks: int | None,
    stale_after_s: float = STALE_TEMP_IDLE_S,
) -> bool:
    """Whether a temp file is abandoned. `writer_start_ticks` is the start time of the
    process now holding the writer's pid in our pid namespace (None: no such process): the
    writer is gone when that differs from the one in the name. A writer in another pid
    namespace (another worker's pod) cannot be looked up, so only a long silence (`idle_s`,
    time since the file was last written) condemns its file."""
    if writer is not None and writer.pid_namespace == own_pid_namespace:
        return writer_start_ticks != writer.start_ticks
    return idle_s >= stale_after_s


def _process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _load_sync_file_range() -> Callable[[int, int, int], None]:
    """Start writeback of a written range now (Linux `sync_file_range(WRITE)`), so the final
    fsync has little left to wait for; where it does not exist, a no-op."""
    try:
        function: Any = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, length: None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, length: int) -> None:
        # Only a hint: a failure here costs speed, never correctness (fsync follows).
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    return start_writeback


_start_writeback = _load_sync_file_range()


def _write_at(fd: int, offset: int, data: memoryview) -> None:
    view = data
    while view:
        view = view[os.write(fd, view) :]
    _start_writeback(fd, offset, len(data))


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


class _ChunkSource:
    """Fills batch buffers from an async iterable of chunks of any size (HTTP/2 frames)."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self._chunks = chunks.__aiter__()
        self._left = memoryview(b"")
        self._ended = False

    async def fill(self, buffer: bytearray) -> int:
        view = memoryview(buffer)
        filled = 0
        while filled < len(view):
            if not self._left:
                if self._ended:
                    break
                try:
                    self._left = memoryview(await self._chunks.__anext__())
                except StopAsyncIteration:
                    self._ended = True
                    break
            step = min(len(self._left), len(view) - filled)
            view[filled : filled + step] = self._left[:step]
            self._left = self._left[step:]
            filled += step
        return filled

    def close(self) -> None:
        """The chunks belong to the caller, who closes them."""


class _FileSource:
    """Fills batch buffers from a local file, read on a worker thread."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file: Any = None

    async def fill(self, buffer: bytearray) -> int:
        if self._file is None:
            try:
                self._file = await trio.to_thread.run_sync(open, self._path, "rb", 0)
            except FileNotFoundError:
                raise ApiError(
                    ErrorCode.NOT_FOUND, f"cannot store {self._path}: no such file", field="path"
                ) from None
        filled: int = await trio.to_thread.run_sync(self._file.readinto, buffer)
        return filled

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


_Source = _ChunkSource | _FileSource


class _Lanes:
    """The hashing and writing lanes of one ingest: two loops, each running on one worker
    thread for the whole ingest (a trip through the scheduler for every batch cost a third
    of the throughput), fed batches in order through queues. A batch buffer goes back to
    the task filling them (`free`) once both lanes are done with it; the bytes each write
    adds are reported on `progress`, which closes when the writing lane ends."""

    def __init__(self, fd: int, hasher: Any, buffers: list[bytearray]) -> None:
        self._fd = fd
        self._hasher = hasher
        self._to_hash: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._to_write: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._free_send, self.free = trio.open_memory_channel[bytearray](len(buffers))
        for buffer in buffers:
            self._free_send.send_nowait(buffer)
        # Unbounded, but one small message per batch written, read as they come.
        self._progress_send, self.progress = trio.open_memory_channel[int](math.inf)
        self._users: dict[int, int] = {}
        self._lock = threading.Lock()
        self._abandoned = False
        self.written = 0
        self.error: OSError | None = None

    def submit(self, buffer: bytearray, length: int) -> None:
        with self._lock:
            self._users[id(buffer)] = 2
        self._to_hash.put((buffer, length))
        self._to_write.put((buffer, length))

    def finish(self, *, abandon: bool) -> None:
        """No more batches; with `abandon`, the lanes skip the ones still queued."""
        self._abandoned = abandon
        self._to_hash.put(None)
        self._to_write.put(None)

    def _done_with(self, buffer: bytearray) -> None:
        with self._lock:
            self._users[id(buffer)] -= 1
            last = not self._users[id(buffer)]
        if last:
            self._token.run_sync_soon(self._free_send.send_nowait, buffer)

    def hash_loop(self) -> None:
        while (item := self._to_hash.get()) is not None:
            buffer, length = item
            if not self._abandoned:
                self._hasher.update(memoryview(buffer)[:length])
            self._done_with(buffer)

    def write_loop(self) -> None:
        try:
            while (item := self._to_write.get()) is not None:
                buffer, length = item
                if not self._abandoned and self.error is None:
                    try:
                        _write_at(self._fd, self.written, memoryview(buffer)[:length])
                        self.written += length
                        self._token.run_sync_soon(self._progress_send.send_nowait, length)
                    except OSError as exc:
                        self.error = exc
                self._done_with(buffer)
        finally:
            self._token.run_sync_soon(self._progress_send.close)


class ObjectStore:
    """Objects by digest under `<root>/objects/`, with pins and LRU eviction to a budget.

    Opening a store (the constructor) creates its directories, removes temp files their
    writers abandoned and reads the index of what is there; it does blocking I/O once, at
    start-up. Callers should pin an object (`pin`) before ingesting or using it: eviction
    takes any unpinned object once the store is over budget, except that the eviction run
    after an ingest spares the object just ingested.
    """

    def __init__(self, root: Path, *, budget_bytes: int, free_floor_bytes: int = 1 << 30) -> None:
        if budget_bytes < 0 or free_floor_bytes < 0:
            raise ValueError("budget_bytes and free_floor_bytes must be 0 or more")
        self.root = root
        self.budget_bytes = budget_bytes
        self.free_floor_bytes = free_floor_bytes
        self._objects_dir = root / "objects" / "sha256"
        self._temp_dir = root / "objects" / "tmp"
        self._pid_namespace = _pid_namespace()
        own_start = _process_start_ticks(os.getpid()) or 0
        self._writer = TempWriter(self._pid_namespace, os.getpid(), own_start)
        self._pins: dict[str, collections.Counter[str]] = {}
        self._holds: dict[str, int] = {}
        self._inflight: dict[str, trio.Event] = {}
        self._evict_lock = trio.Lock()
        self._last_use_ns = 0
        self._evicted_objects = 0
        self._evicted_bytes = 0
        self._buffers: list[bytearray] = []
        self._ingest_slots = trio.CapacityLimiter(MAX_CONCURRENT_INGESTS)
        try:
            self._objects_dir.mkdir(parents=True, exist_ok=True)
            self._temp_dir.mkdir(parents=True, exist_ok=True)
            self._clean_temps()
            self._index = {entry.digest: entry for entry in self._scan()}
        except OSError as exc:
            raise self._os_error(exc, "open the object store") from None

    def __repr__(self) -> str:
        return f"ObjectStore(root={str(self.root)!r}, budget_bytes={self.budget_bytes})"

    # -- where things are --

    def path_of(self, digest: str) -> Path:
        """Where the object with `digest` lives (whether or not it is there)."""
        return self._objects_dir / parse_digest(digest).removeprefix(DIGEST_PREFIX)

    def contains(self, digest: str) -> bool:
        return self.size_of(digest) is not None

    def size_of(self, digest: str) -> int | None:
        try:
            return os.stat(self.path_of(digest)).st_size
        except FileNotFoundError:
            return None

    # -- ingest --

    async def ingest(
        self,
        chunks: AsyncIterable[bytes],
        *,
        digest: str | None = None,
        size: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> StoredObject:
        """Store the content `chunks` yield; verify it against `digest` and `size` if given.

        When an object with `digest` is already here (or another task here stores it while
        this one waits), `chunks` is not read (further) and that object is returned. On any
        failure nothing is left behind. `on_progress` is called with the bytes added as they
        reach the file.
        """
        expected = parse_digest(digest) if digest is not None else None
        if size is not None and size < 0:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT, f"size must be 0 or more, not {size}", field="size"
            )
        return await self._ingest(lambda: _ChunkSource(chunks), expected, size, on_progress)

    async def ingest_file(self, path: Path, *, digest: str | None = None) -> StoredObject:
        """Store a copy of a local file, read in large blocks."""
        expected = parse_digest(digest) if digest is not None else None
        return await self._ingest(lambda: _FileSource(path), expected, None, None)

    async def _ingest(
        self,
        source: Callable[[], _Source],
        expected: str | None,
        size: int | None,
        on_progress: Callable[[int], None] | None,
    ) -> StoredObject:
        if expected is None:
            stored = await self._write(source(), None, size, on_progress)
        else:
            # One writer per digest in this process; the others wait for its result and
            # write themselves only when it failed.
            while True:
                found = self._present(expected, size)
                if found is not None:
                    return found
                pending = self._inflight.get(expected)
                if pending is None:
                    break
                await pending.wait()
            done = self._inflight[expected] = trio.Event()
            try:
                stored = await self._write(source(), expected, size, on_progress)
            finally:
                del self._inflight[expected]
                done.set()
        try:
            await self._evict(spare=stored.digest)
        except ApiError as exc:
            # The object is stored; failing its ingest now would mislead the caller.
            log.warning(
                "eviction after ingest failed: %s", exc.message, extra={"digest": stored.digest}
            )
        return stored

    def _present(self, digest: str, size: int | None) -> StoredObject | None:
        """The object if it is already stored (with the size given, if one was)."""
        found = self.size_of(digest)
        if found is None or (size is not None and found != size):
            return None
        self.touch(digest)
        self._hold_if_pinned(digest)
        return StoredObject(digest, found)

    async def _write(
        self,
        source: _Source,
        expected: str | None,
        size: int | None,
        on_progress: Callable[[int], None] | None,
    ) -> StoredObject:
        try:
            temp, fd = await trio.to_thread.run_sync(self._create_temp)
        except OSError as exc:
            raise self._os_error(exc, "create a temp file") from None
        try:
            hasher = hashlib.sha256()
            try:
                written = await self._pump(source, fd, hasher, size, on_progress)
            finally:
                source.close()
            if size is not None and written != size:
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"content ended after {written} bytes; {size} were declared",
                    field="size",
                )
            actual = DIGEST_PREFIX + hasher.hexdigest()
            if expected is not None and actual != expected:
                raise DigestMismatch(expected, actual)
            final = self.path_of(actual)
            try:
                await trio.to_thread.run_sync(self._commit, fd, temp, final, written)
            except OSError as exc:
                raise self._os_error(exc, f"store {actual}") from None
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        self.touch(actual)
        self._hold_if_pinned(actual)
        return StoredObject(actual, written)

    async def _pump(
        self,
        source: _Source,
        fd: int,
        hasher: Any,
        size: int | None,
        on_progress: Callable[[int], None] | None,
    ) -> int:
        """Fill batch buffers from `source` in this task while the hashing and writing
        lanes work through the batches already filled. Returns the bytes written."""
        async with self._ingest_slots:
            return await self._pump_in_slot(source, fd, hasher, size, on_progress)

    async def _pump_in_slot(
        self,
        source: _Source,
        fd: int,
        hasher: Any,
        size: int | None,
        on_progress: Callable[[int], None] | None,
    ) -> int:
        failure: Exception | None = None
        received = 0
        buffers = [self._take_buffer() for _ in range(PIPELINE_BATCHES)]
        lanes = _Lanes(fd, hasher, buffers)
        # The lanes' threads wait on their queues for the whole ingest: taken from trio's
        # shared limiter, enough waiting lanes would starve every other thread call, this
        # ingest's own file reads included, and nothing would move again.
        lane_threads = trio.CapacityLimiter(2)

        async def report_progress() -> None:
            nonlocal failure
            async for length in lanes.progress:
                if on_progress is None or failure is not None:
                    continue
                try:
                    on_progress(length)
                except Exception as exc:
                    failure = exc
                    nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                for loop in (lanes.hash_loop, lanes.write_loop):
                    nursery.start_soon(
                        functools.partial(trio.to_thread.run_sync, loop, limiter=lane_threads)
                    )
                nursery.start_soon(report_progress)
                # Failures are kept as values and raised after the nursery, so callers see
                # the source's own exception rather than a group.
                finished = False
                try:
                    while lanes.error is None:
                        buffer = await lanes.free.receive()
                        length = await source.fill(buffer)
                        if not length:
                            break
                        received += length
                        if size is not None and received > size:
                            raise ApiError(
                                ErrorCode.INVALID_ARGUMENT,
                                f"content is longer than the {size} bytes declared",
                                field="size",
                            )
                        lanes.submit(buffer, length)
                    finished = True
                except OSError as exc:
                    failure = self._os_error(exc, f"read {exc.filename or 'the content'}")
                except Exception as exc:
                    failure = exc
                finally:
                    lanes.finish(abandon=not finished or failure is not None)
        finally:
            # Both loops have returned (trio waits for the threads it started): the
            # buffers are free.
            for buffer in buffers:
                self._give_back_buffer(buffer)
        if failure is None and lanes.error is not None:
            failure = self._os_error(lanes.error, "write a temp file")
        if failure is not None:
            raise failure
        return lanes.written

    def _take_buffer(self) -> bytearray:
        return self._buffers.pop() if self._buffers else bytearray(BATCH_BYTES)

    def _give_back_buffer(self, buffer: bytearray) -> None:
        if len(self._buffers) < SPARE_BUFFERS:
            self._buffers.append(buffer)

    def _create_temp(self) -> tuple[Path, int]:
        name = f"{self._writer.temp_prefix()}-{secrets.token_hex(8)}.tmp"
        path = self._temp_dir / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        return path, os.open(path, flags, _OBJECT_MODE)

    def _commit(self, fd: int, temp: Path, final: Path, size: int) -> None:
        os.fsync(fd)
        try:
            os.link(temp, final)
        except FileExistsError:
            # Same digest, so the same content, unless the one there is damaged: a wrong
            # size proves that, and a verified copy replaces it.
            if os.stat(final).st_size != size:
                log.warning(
                    "replacing %s: the stored copy had the wrong size",
                    final.name,
                    extra={"digest": DIGEST_PREFIX + final.name},
                )
                os.replace(temp, final)
        _fsync_directory(final.parent)

    # -- reading --

    async def read(self, digest: str, *, chunk_bytes: int = 1 << 20) -> AsyncGenerator[bytes, None]:
        """The object's content in chunks, hashed as it goes. The last chunk is held back
        until the digest is confirmed: a corrupt object is removed and `ObjectCorrupt`
        raised instead, so a consumer that treats the stream as tentative until it ends
        never takes a wrong body. NOT_FOUND if the object is not here."""
        digest = parse_digest(digest)
        path = self.path_of(digest)
        try:
            file = await trio.to_thread.run_sync(open, path, "rb", 0)
        except FileNotFoundError:
            raise self._not_found(digest) from None
        except OSError as exc:
            raise self._os_error(exc, f"read {digest}") from None
        try:
            self.touch(digest)
            hasher = hashlib.sha256()

            def read_and_hash() -> bytes:
                data: bytes = file.read(chunk_bytes)
                hasher.update(data)
                return data

            held = b""
            try:
                while data := await trio.to_thread.run_sync(read_and_hash):
                    if held:
                        yield held
                    held = data
            except OSError as exc:
                raise self._os_error(exc, f"read {digest}") from None
            actual = DIGEST_PREFIX + hasher.hexdigest()
            if actual != digest:
                in_place = _same_file(file.fileno(), path)
                self._discard_corrupt(digest, actual, in_place=in_place)
                raise ObjectCorrupt(digest, actual)
            if held:
                yield held
        finally:
            file.close()

    async def verify(self, digest: str) -> None:
        """Hash the whole object; a corrupt one is removed and `ObjectCorrupt` raised."""
        digest = parse_digest(digest)
        path = self.path_of(digest)

        def hash_file() -> tuple[str, bool]:
            with open(path, "rb", buffering=0) as file:
                hasher = hashlib.sha256()
                while data := file.read(BATCH_BYTES):
                    hasher.update(data)
                # Whether the file read is still the one in place (not a good copy linked
                # in meanwhile), decided while it is open.
                return DIGEST_PREFIX + hasher.hexdigest(), _same_file(file.fileno(), path)

        try:
            actual, in_place = await trio.to_thread.run_sync(hash_file)
        except FileNotFoundError:
            raise self._not_found(digest) from None
        except OSError as exc:
            raise self._os_error(exc, f"verify {digest}") from None
        if actual != digest:
            self._discard_corrupt(digest, actual, in_place=in_place)
            raise ObjectCorrupt(digest, actual)
        self.touch(digest)

    def _discard_corrupt(self, digest: str, actual: str, *, in_place: bool) -> None:
        log.warning(
            "object %s is corrupt (content hashes to %s); removing it",
            digest,
            actual,
            extra={"digest": digest, "actual": actual},
        )
        if in_place:
            self.discard(digest)

    # -- use, pins, eviction --

    def discard(self, digest: str) -> None:
        """Remove the object (a consumer found it corrupt, or it is no longer wanted)."""
        self._release(digest)
        self._index.pop(digest, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(digest))

    def touch(self, digest: str) -> None:
        """Mark the object used now, for LRU eviction; a missing object is left alone."""
        now = max(time.time_ns(), self._last_use_ns + 1)
        self._last_use_ns = now
        path = self.path_of(digest)
        try:
            os.utime(path, ns=(now, now))
            size = os.stat(path).st_size
        except FileNotFoundError:
            self._index.pop(digest, None)
            return
        self._index[digest] = ObjectEntry(digest, size, now)

    def pin(self, digest: str, owner: str) -> None:
        """Keep the object from eviction until `unpin_owner(owner)`."""
        digest = parse_digest(digest)
        self._pins.setdefault(digest, collections.Counter())[owner] += 1
        self._hold_if_pinned(digest)

    def unpin_owner(self, owner: str) -> None:
        """Drop every pin `owner` holds."""
        for digest in [d for d, owners in self._pins.items() if owner in owners]:
            owners = self._pins[digest]
            del owners[owner]
            if not owners:
                del self._pins[digest]
                self._release(digest)

    def pinned(self) -> frozenset[str]:
        return frozenset(self._pins)

    def _hold_if_pinned(self, digest: str) -> None:
        """Hold a shared flock on a pinned object, so another worker's store sharing the
        directory skips it when evicting. Best effort: an object being evicted by another
        worker at this very moment cannot be held, and is then gone."""
        if digest not in self._pins:
            return
        held = self._holds.get(digest)
        path = self.path_of(digest)
        if held is not None:
            if _same_file(held, path):
                return
            os.close(self._holds.pop(digest))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return
        if not _same_file(fd, path):
            os.close(fd)
            return
        self._holds[digest] = fd

    def _release(self, digest: str) -> None:
        fd = self._holds.pop(digest, None)
        if fd is not None:
            os.close(fd)

    async def evict(self) -> list[str]:
        """Remove least-recently-used unpinned objects until the store fits its budget and
        the disk its free floor; returns the digests removed."""
        return await self._evict(spare=None)

    async def _evict(self, *, spare: str | None) -> list[str]:
        async with self._evict_lock:
            try:
                entries, free = await trio.to_thread.run_sync(self._survey)
                keep = set(self._pins)
                if spare is not None:
                    keep.add(spare)
                plan = plan_eviction(
                    entries,
                    budget_bytes=self.budget_bytes,
                    free_bytes=free,
                    free_floor_bytes=self.free_floor_bytes,
                    pinned=keep,
                )
                by_digest = {entry.digest: entry for entry in entries}
                evicted = await trio.to_thread.run_sync(self._remove, plan, by_digest, keep)
            except OSError as exc:
                raise self._os_error(exc, "evict objects") from None
            gone = set(evicted)
            self._index = {d: e for d, e in by_digest.items() if d not in gone}
        if evicted:
            evicted_bytes = sum(by_digest[d].size for d in evicted)
            self._evicted_objects += len(evicted)
            self._evicted_bytes += evicted_bytes
            log.info(
                "evicted %d object(s), %d bytes",
                len(evicted),
                evicted_bytes,
                extra={
                    "evicted": len(evicted),
                    "evicted_bytes": evicted_bytes,
                    "digests": ",".join(evicted),
                },
            )
        return evicted

    def _survey(self) -> tuple[list[ObjectEntry], int]:
        self._clean_temps()
        return self._scan(), self._free_bytes()

    def _remove(
        self, plan: list[str], entries: dict[str, ObjectEntry], keep: set[str]
    ) -> list[str]:
        removed: list[str] = []
        for digest in plan:
            if digest in self._pins or digest in keep:
                continue
            path = self.path_of(digest)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # pinned by another worker sharing the directory
                if os.fstat(fd).st_mtime_ns > entries[digest].last_used_ns:
                    continue  # used since the survey
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                removed.append(digest)
            finally:
                os.close(fd)
        return removed

    def statistics(self) -> StoreStatistics:
        """Counts as of this store's last ingest, use or eviction (other workers sharing the
        directory show up at the next eviction), and the disk's free bytes now."""
        try:
            free = self._free_bytes()
        except OSError:
            free = 0
        return StoreStatistics(
            objects=len(self._index),
            bytes=sum(entry.size for entry in self._index.values()),
            pinned=len(self._pins),
            budget_bytes=self.budget_bytes,
            free_bytes=free,
            evicted_objects=self._evicted_objects,
            evicted_bytes=self._evicted_bytes,
        )

    def close(self) -> None:
        """Release the flocks pinned objects hold (pins themselves end with the process)."""
        for digest in list(self._holds):
            self._release(digest)

    # -- the directory --

    def _scan(self) -> list[ObjectEntry]:
        entries: list[ObjectEntry] = []
        with os.scandir(self._objects_dir) as listing:
            for item in listing:
                if not _HEX_RE.fullmatch(item.name):
                    continue
                try:
                    info = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    entries.append(
                        ObjectEntry(DIGEST_PREFIX + item.name, info.st_size, info.st_mtime_ns)
                    )
        return entries

    def _clean_temps(self) -> None:
        now = time.time()
        with os.scandir(self._temp_dir) as listing:
            for item in listing:
                try:
                    idle_s = now - item.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                writer = parse_temp_name(item.name)
                start = None
                if writer is not None and writer.pid_namespace == self._pid_namespace:
                    start = _process_start_ticks(writer.pid)
                if temp_is_stale(
                    writer,
                    idle_s=idle_s,
                    own_pid_namespace=self._pid_namespace,
                    writer_start_ticks=start,
                ):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.path)
                    log.info("removed abandoned temp file %s", item.name, extra={"file": item.name})

    def _free_bytes(self) -> int:
        info = os.statvfs(self._objects_dir)
        return info.f_bavail * info.f_frsize

    # -- errors --

    def _not_found(self, digest: str) -> ApiError:
        return ApiError(
            ErrorCode.NOT_FOUND,
            f"object {digest} is not in this node's store; put it there first",
            field="digest",
        )

    def _os_error(self, exc: OSError, doing: str) -> ApiError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ApiError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"the object store's disk ({self.root}) is full; could not {doing}. "
                "Free space on it or lower the object budget",
            )
        return ApiError(
            ErrorCode.INTERNAL,
            f"object store at {self.root} could not {doing}: {exc.strerror or exc}",
        )
