"""The campaign's stream of tasks: every kind a user runs, each driven as its user would drive it.

Why this module exists: faults only matter for what is running when they land. The workload
keeps tasks of every kind under way (short ones; long ones whose logs two users follow through
different replicas; ones writing a workspace bucket; an HTTP endpoint under load; a snapshot
and its restore on a fresh task; ones pulling an image no node has yet), each driven by its own
task in the workload's nursery, and records what the invariants are checked against: the ids
it was given, every line each follower saw per stream, what each task ended as.

A driver outlives the faults it meets: a replica that goes away under a request is an error of
that request only; the driver opens a new client through the Service and goes on, as the CLI's
user would run the command again. Only what a user can see is recorded.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import attrs
import trio

from control.cli.client import ControlClient, ControlClientError
from control.models import TaskRequest, TaskSnapshot, TaskView, TaskVolume
from wire.errors import ApiError, ErrorCode
from workerapi.models import ExecRequest

__all__ = ["KINDS", "Images", "TaskTrack", "Workload"]

log = logging.getLogger("levers9.chaos")
T = TypeVar("T")

KINDS = ("short", "long_follow", "bucket_write", "endpoint", "snapshot_restore", "fresh_pull")
WEIGHTS = (4, 2, 2, 1, 1, 2)
LONG_LINES = 40
TASK_TIMEOUT_S = 300.0
"""Each task's own timeout: a task a fault left hanging still ends, with a reason."""
CALL_RETRY_S = 0.5
BUCKET = "data"
HTTP_PORT = 8080
HTTP_SCRIPT = "mkdir -p /www && echo hello-from-chaos > /www/index.html && httpd -f -p 8080 -h /www"
TERMINAL = frozenset({"succeeded", "failed", "lost", "cancelled"})

Opener = Callable[..., AbstractAsyncContextManager[ControlClient]]
"""`client(replica=None)`: a client through the Service, or straight to one replica."""


@attrs.frozen
class Images:
    """The image every task starts from, and how to get a new one no node has pulled yet."""

    busybox: str
    fresh: Callable[[int], Awaitable[str]]
    """Builds and pushes image number N (a layer of its own), returns its reference."""


@attrs.define(eq=False)
class TaskTrack:
    """One task as its user saw it."""

    id: str
    kind: str
    node: str | None = None
    expected_lines: tuple[str, ...] = ()
    streams: dict[str, list[list[str]]] = attrs.Factory(dict)
    """Follower name → the lines of each follow stream it opened, in order."""
    complete_streams: dict[str, int] = attrs.Factory(dict)
    """Follower name → the index of its stream that ran until the log ended."""
    end: TaskView | None = None
    restore_of: str | None = None
    """For a restore: the task its snapshot was taken from; `expected_lines` its content."""
    endpoint_ok: int = 0
    endpoint_failed: int = 0


class Workload:
    """Submits tasks at random intervals until cancelled; `tracks` holds every task given an
    id. `lost_creates` counts creates whose answer never came (the task may exist)."""

    def __init__(self, client: Opener, images: Images, *, seed: int, replicas: int) -> None:
        self._client = client
        self._images = images
        self._rng = random.Random(f"levers9-chaos-workload-{seed}")
        self._replicas = replicas
        self.tracks: dict[str, TaskTrack] = {}
        self.lost_creates = 0
        self.submitted = 0
        self._fresh = 0
        self._busy: trio.Nursery | None = None
        self.driving: Counter[str] = Counter()
        """Drivers under way, by kind (what the end of a campaign waits for)."""

    async def run(
        self,
        *,
        every_s: tuple[float, float] = (0.5, 2.0),
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Submit tasks until cancelled; the drivers run on in `drive`'s nursery."""
        assert self._busy is not None, "open the workload with `drive` first"
        task_status.started()
        while True:
            kind = self._rng.choices(KINDS, WEIGHTS)[0]
            number = self.submitted
            self.submitted += 1
            self._busy.start_soon(self._drive, kind, number)
            await trio.sleep(self._rng.uniform(*every_s))

    @contextlib.asynccontextmanager
    async def drive(self) -> AsyncIterator[Workload]:
        """The nursery the drivers run in: on the way out, every driver is waited for (each
        task has its own timeout, so this ends)."""
        async with trio.open_nursery() as nursery:
            self._busy = nursery
            yield self

    async def start_kind(self, kind: str) -> None:
        """Submit one task of `kind` now (a fault that needs one under way asks for it)."""
        assert self._busy is not None
        number = self.submitted
        self.submitted += 1
        self._busy.start_soon(self._drive, kind, number)

    async def probe(self) -> TaskView:
        """A short task through the Service, followed to its end: whether the installation
        serves (the campaign's recovery check)."""
        while True:
            track = await self._create(
                "probe",
                TaskRequest(image=self._images.busybox, command=("true",), timeout_s=120.0),
            )
            if track is not None:
                return await self._wait_end(track)
            await trio.sleep(CALL_RETRY_S)

    # -- calls that ride out faults ------------------------------------------------------------

    async def _call(
        self, call: Callable[[ControlClient], Awaitable[T]], *, replica: int | None = None
    ) -> T:
        """`call` with a client, again with a new client while a replica or the Service fails
        under it (bounded by the caller's deadline); an answer that says the call itself
        cannot be done (the task ended, say) is raised."""
        while True:
            with _riding_out():
                async with self._client(replica=replica) as client:
                    return await call(client)
            await trio.sleep(CALL_RETRY_S)

    async def _create(self, kind: str, request: TaskRequest) -> TaskTrack | None:
        view: TaskView | None = None
        with _riding_out():
            async with self._client() as client:
                view = await client.create_task(request)
        if view is None:
            # The answer was lost: the task may exist. A user would look, not resubmit.
            self.lost_creates += 1
            return None
        track = TaskTrack(view.id, kind)
        self.tracks[view.id] = track
        return track

    async def _wait_end(self, track: TaskTrack) -> TaskView:
        while True:
            view = await self._call(lambda c: c.task(track.id))
            track.node = view.node or track.node
            if view.state in TERMINAL:
                track.end = view
                return view
            with trio.move_on_after(10):
                view = await self._call(lambda c: c.wait_task(track.id))
                if view.state in TERMINAL:
                    track.end = view
                    return view

    async def _wait_state(self, track: TaskTrack, *states: str) -> TaskView:
        while True:
            view = await self._call(lambda c: c.task(track.id))
            track.node = view.node or track.node
            if view.state in states or view.state in TERMINAL:
                return view
            await trio.sleep(0.2)

    # -- the kinds -----------------------------------------------------------------------------

    async def _drive(self, kind: str, number: int) -> None:
        self.driving[kind] += 1
        try:
            with trio.move_on_after(TASK_TIMEOUT_S + 120):
                await getattr(self, f"_{kind}")(number)
        except* ApiError as group:
            log.warning("chaos: a %s task's driver gave up: %s", kind, group.exceptions[0])
        finally:
            self.driving[kind] -= 1

    async def _short(self, number: int) -> None:
        track = await self._create(
            "short",
            TaskRequest(
                image=self._images.busybox,
                command=("sh", "-c", f"echo short-{number}"),
                timeout_s=TASK_TIMEOUT_S,
            ),
        )
        if track is not None:
            await self._wait_end(track)

    async def _fresh_pull(self, number: int) -> None:
        self._fresh += 1
        image = await self._images.fresh(self._fresh)
        track = await self._create(
            "fresh_pull",
            TaskRequest(image=image, command=("true",), timeout_s=TASK_TIMEOUT_S),
        )
        if track is not None:
            await self._wait_end(track)

    async def _long_follow(self, number: int) -> None:
        expected = tuple(f"line-{i}" for i in range(1, LONG_LINES + 1))
        script = f"for i in $(seq 1 {LONG_LINES}); do echo line-$i; sleep 0.25; done"
        track = await self._create(
            "long_follow",
            TaskRequest(
                image=self._images.busybox, command=("sh", "-c", script), timeout_s=TASK_TIMEOUT_S
            ),
        )
        if track is None:
            return
        track.expected_lines = expected
        first = self._rng.randrange(self._replicas)
        second = (first + 1 + self._rng.randrange(self._replicas - 1)) % self._replicas
        async with trio.open_nursery() as nursery:
            for replica in (first, second):
                nursery.start_soon(self._follow, track, f"replica-{replica}", replica)
            await self._wait_end(track)

    async def _follow(self, track: TaskTrack, name: str, replica: int | None) -> None:
        """Follow the task's log through `replica`, again (a new stream from the start, as a
        user runs the command again) whenever a stream breaks before the log ended."""
        streams = track.streams.setdefault(name, [])
        while True:
            lines: list[str] = []
            streams.append(lines)
            with _riding_out():
                async with self._client(replica=replica) as client:
                    async for line in client.task_logs(track.id, follow=True):
                        lines.append(line.text)
                track.complete_streams[name] = len(streams) - 1
                return
            if track.end is not None:
                return
            # The replica went away: the user follows again, through the Service.
            replica = None
            await trio.sleep(CALL_RETRY_S)

    async def _bucket_write(self, number: int) -> None:
        script = "echo written-by-$TASK > /data/$TASK.txt && sync && cat /data/$TASK.txt"
        track = await self._create(
            "bucket_write",
            TaskRequest(
                image=self._images.busybox,
                command=("sh", "-c", script.replace("$TASK", f"chaos-{number}")),
                volumes=(TaskVolume(bucket=BUCKET, mount_path="/data"),),
                timeout_s=TASK_TIMEOUT_S,
            ),
        )
        if track is not None:
            track.expected_lines = (f"written-by-chaos-{number}",)
            await self._wait_end(track)

    async def _endpoint(self, number: int) -> None:
        track = await self._create(
            "endpoint",
            TaskRequest(
                image=self._images.busybox,
                command=("sh", "-c", HTTP_SCRIPT),
                ports=(HTTP_PORT,),
                timeout_s=TASK_TIMEOUT_S,
            ),
        )
        if track is None:
            return
        view = await self._wait_state(track, "running")
        if view.state == "running":
            path = f"/v1/tasks/{track.id}/ports/{HTTP_PORT}/index.html"
            with trio.move_on_after(self._rng.uniform(3.0, 10.0)):
                async with trio.open_nursery() as nursery:
                    for _ in range(4):
                        nursery.start_soon(self._load, track, path)
            try:
                await self._call(lambda c: c.cancel_task(track.id))
            except* ApiError as group:
                # It ended first (its worker lost, say), as a user's cancel may find it.
                _, other = group.split(
                    lambda e: isinstance(e, ApiError) and e.code is ErrorCode.FAILED_PRECONDITION
                )
                if other is not None:
                    raise other from None
        await self._wait_end(track)

    async def _load(self, track: TaskTrack, path: str) -> None:
        while True:
            try:
                async with self._client() as client, client.stream("GET", path) as response:
                    body = await response.read()
                if response.status == 200 and body == b"hello-from-chaos\n":
                    track.endpoint_ok += 1
                else:
                    track.endpoint_failed += 1
            except* (ApiError, ControlClientError, OSError, trio.BrokenResourceError):
                track.endpoint_failed += 1
                await trio.sleep(0.1)

    async def _snapshot_restore(self, number: int) -> None:
        content = f"snapshot-{number}"
        script = f"echo {content} > /keep; echo ready; while [ ! -e /go ]; do sleep 0.1; done"
        source = await self._create(
            "snapshot_source",
            TaskRequest(
                image=self._images.busybox, command=("sh", "-c", script), timeout_s=TASK_TIMEOUT_S
            ),
        )
        if source is None:
            return
        view = await self._wait_state(source, "running")
        if view.state == "running":
            with trio.move_on_after(60):
                await self._until_line(source, "ready")
            snapshot: TaskSnapshot | None = None
            try:
                snapshot = await self._call(lambda c: c.snapshot_task(source.id))
            except* ApiError:
                pass  # the task ended meanwhile (its worker killed): its reason says why
            if snapshot is not None:
                restore = await self._create(
                    "snapshot_restore",
                    TaskRequest(
                        image=self._images.busybox,
                        command=("cat", "/keep"),
                        snapshot=snapshot.digest,
                        timeout_s=TASK_TIMEOUT_S,
                    ),
                )
                if restore is not None:
                    restore.restore_of = source.id
                    restore.expected_lines = (content,)
                    await self._wait_end(restore)
            try:
                await self._call(lambda c: c.exec_in_task(source.id, _GO, on_output=_ignore))
            except* ApiError:
                pass  # it ended already
        await self._wait_end(source)

    async def _until_line(self, track: TaskTrack, text: str) -> None:
        while True:
            try:
                async with self._client() as client:
                    async for line in client.task_logs(track.id, follow=True):
                        if line.text == text:
                            return
                return
            except* (ApiError, ControlClientError, OSError, trio.BrokenResourceError):
                await trio.sleep(CALL_RETRY_S)

    async def log_lines(self, task_id: str) -> list[str]:
        """The task's whole kept log, as `levers9 task logs` prints it."""

        async def read(client: ControlClient) -> list[str]:
            return [line.text async for line in client.task_logs(task_id, follow=False)]

        return await self._call(read)


_GO = ExecRequest(command=("touch", "/go"))


async def _ignore(channel: int, data: bytes) -> None:
    pass


RETRY_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED})


@contextlib.contextmanager
def _riding_out() -> Iterator[None]:
    """The block's transient failures (`_transient`) are swallowed, as a user who runs the
    command again would; anything else (a group holding anything else) is raised."""
    try:
        yield
    except BaseExceptionGroup as group:
        _, lasting = group.split(_transient)
        if lasting is not None:
            raise lasting from None
    except Exception as exc:
        if not _transient(exc):
            raise


def _transient(exc: BaseException) -> bool:
    """A failure of the way to the controlplane (a replica going away, the Service cut), which
    a user meets by running the command again; not an answer about the call itself."""
    if isinstance(exc, ApiError):
        return exc.code in RETRY_CODES
    return isinstance(exc, ControlClientError | OSError | trio.BrokenResourceError)


def kinds_submitted(tracks: Sequence[TaskTrack]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for track in tracks:
        counts[track.kind] = counts.get(track.kind, 0) + 1
    return counts
