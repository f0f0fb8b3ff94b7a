"""The dispatcher's pure decisions: which workers take tasks and with how much free, what a
container's end means for its task, how much of a log is kept; the task routes' input checks;
how a stopping dispatcher bounds the clean-ups under way; and how a restore's snapshot copy
rides out a holder, or its own worker, going away."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from control.api.tasks import TaskRoutes, query_limit, query_states, spec_of, workspace_of
from control.db.base import TaskStoreError
from control.models import TaskRequest, TaskState, TaskView
from control.tasks.dispatch import (
    CLEANUP_S,
    STOP_GRACE_S,
    Dispatcher,
    Hold,
    WorkerLost,
    capacities,
    is_ready,
    keep_tail,
    outcome,
)
from control.tasks.scheduler import (
    Assignment,
    MachineSize,
    PendingTask,
    Retire,
    SchedulePlan,
    Waiting,
    WorkerCapacity,
)
from control.tasks.store import (
    Exited,
    Failed,
    Running,
    Start,
    TaskEvent,
    TaskRecord,
    TaskSpec,
    TaskStore,
    open_task_store,
    validate_spec,
)
from control.workers.registry import WorkerEntry, open_worker_registry
from control.workspaces import Workspaces
from wire.errors import ApiError, ErrorCode, dumps, loads
from wire.service import Request, Router
from workerapi.models import ContainerState, ContainerStatus, LogLine

NOW = 1_000.0


def entry(worker_id: str = "w1", **kw: object) -> WorkerEntry:
    values: dict[str, object] = {
        "mode": "direct",
        "registered_at": NOW - 5,
        "runs_containers": True,
        "cards": 4,
        "cpu_millis": 8000,
        "memory_bytes": 32 << 30,
        "node": "n1",
    }
    values.update(kw)
    return WorkerEntry(worker_id, "token", **values)  # type: ignore[arg-type]


def test_a_registered_direct_worker_is_ready_until_it_is_silent_or_winds_down() -> None:
    assert is_ready(entry(), NOW, lost_after_s=60)
    assert not is_ready(entry(registered_at=None), NOW, lost_after_s=60)
    assert not is_ready(entry(registered_at=NOW - 61), NOW, lost_after_s=60)
    assert not is_ready(entry(draining=True), NOW, lost_after_s=60)
    assert not is_ready(entry(runs_containers=False), NOW, lost_after_s=60)


def test_a_tunnel_worker_is_ready_only_while_its_tunnel_is_up() -> None:
    assert not is_ready(entry(mode="tunnel"), NOW, lost_after_s=60)


def test_free_capacity_is_what_the_worker_has_less_what_its_tasks_hold() -> None:
    holding = {"w1": {"t1": Hold(1, 1500, 1 << 30), "t2": Hold(2, 500, 1 << 30)}}
    (one, two) = capacities([entry("w1"), entry("w2", cards=1)], holding, NOW, 60)
    assert (one.cards_free, one.cpu_free_millis, one.memory_free_bytes) == (1, 6000, 30 << 30)
    assert (one.cards_total, one.cpu_total_millis) == (4, 8000)
    assert (two.cards_free, two.cards_total) == (1, 1)
    assert one.ready and two.ready


def status(**kw: object) -> ContainerStatus:
    values: dict[str, object] = {"id": "t-1", "image": "busybox", "state": ContainerState.EXITED}
    values.update(kw)
    return ContainerStatus(created_at=NOW, **values)  # type: ignore[arg-type]


def test_a_containers_end_becomes_the_tasks_event() -> None:
    assert outcome(status(exit_code=0)) == Exited(0)
    assert outcome(status(exit_code=3)) == Exited(3)
    oom = outcome(status(exit_code=137, oom_killed=True))
    assert isinstance(oom, Failed) and "more memory" in oom.reason
    pull = outcome(status(state=ContainerState.FAILED, error="image busybox:nope not found"))
    assert pull == Failed("image busybox:nope not found")


def test_the_kept_log_is_its_last_whole_lines_within_the_limit() -> None:
    lines = [b"first\n", b"second\n", b"third\n"]
    assert keep_tail(lines, 100) == b"first\nsecond\nthird\n"
    assert keep_tail(lines, 13) == b"second\nthird\n"
    assert keep_tail(lines, 3) == b""


def test_task_calls_need_a_workspace_token() -> None:
    assert workspace_of("ws:team-a") == "team-a"
    with pytest.raises(ApiError) as info:
        workspace_of("api:ops")
    assert info.value.code is ErrorCode.PERMISSION_DENIED


def test_listing_queries_are_checked() -> None:
    assert query_states("pending,running") == [TaskState.PENDING, TaskState.RUNNING]
    assert query_states(None) is None
    with pytest.raises(ApiError, match="'sleeping' is not a task state"):
        query_states("sleeping")
    assert query_limit("5") == 5
    for bad in ("0", "1001", "many"):
        with pytest.raises(ApiError, match="limit"):
            query_limit(bad)


async def test_a_tasks_state_goes_on_the_wire_as_the_word_it_always_was(tmp_path: Path) -> None:
    words = ("pending", "starting", "running", "succeeded", "failed", "cancelled", "lost")
    async with (
        open_task_store(tmp_path / "tasks.db") as store,
        open_worker_registry({}) as registry,
    ):
        dispatcher = Dispatcher(store, registry, Workspaces(()), lost_after_s=1)
        for state, word in zip(TaskState, words, strict=True):
            record = TaskRecord("t-1", "a", TaskSpec(image="busybox"), state, created_at=0.0)
            body = dumps(dispatcher.view(record))
            assert json.loads(body)["state"] == word
            back = loads(body, TaskView)
            assert back.state is state and back.state == word
            assert back.terminal == (word in ("succeeded", "failed", "cancelled", "lost"))


def test_a_snapshot_must_be_a_digest() -> None:
    spec = spec_of(TaskRequest(image="busybox", snapshot="sha256:" + "a" * 64), ())
    validate_spec("team", spec)
    assert spec.snapshot == "sha256:" + "a" * 64
    with pytest.raises(ApiError) as info:
        validate_spec("team", spec_of(TaskRequest(image="busybox", snapshot="latest"), ()))
    assert info.value.field == "snapshot"


def test_an_image_reference_is_checked_when_the_task_is_created() -> None:
    with pytest.raises(ApiError) as info:
        spec_of(TaskRequest(image="Not A Reference!"), ())
    assert info.value.field == "image"
    assert "Not A Reference!" in info.value.message


async def test_a_stopping_dispatcher_cuts_short_a_clean_up_that_cannot_reach_its_worker(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A clean-up is shielded so that a task's container is removed even while its watcher is
    cancelled; when the controlplane stops, one whose worker does not answer gets
    `STOP_GRACE_S`, not `CLEANUP_S`, so SIGTERM is not held up."""
    # w1 is known and never connects.
    async with (
        open_task_store(tmp_path / "tasks.db") as store,
        open_worker_registry({"w1": "token"}) as registry,
        trio.open_nursery() as nursery,
    ):
        dispatcher = Dispatcher(store, registry, Workspaces(()), lost_after_s=120)
        scope = trio.CancelScope()
        stopped = trio.Event()

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            try:
                with scope:
                    await dispatcher.run(task_status=task_status)
            finally:
                stopped.set()

        await nursery.start(serve)
        record = TaskRecord(
            id="t-1",
            workspace="a",
            spec=TaskSpec(image="busybox"),
            state=TaskState.CANCELLED,
            created_at=0.0,
            worker="w1",
        )
        # As a cancelled task's watcher does: stop the container, keep its log, delete it.
        assert dispatcher._nursery is not None
        dispatcher._nursery.start_soon(functools.partial(dispatcher._clean_up, stop=True), record)
        await trio.sleep(1)
        asked_at = trio.current_time()
        scope.cancel()
        await stopped.wait()
        assert trio.current_time() - asked_at == pytest.approx(STOP_GRACE_S)
        assert STOP_GRACE_S < CLEANUP_S
        nursery.cancel_scope.cancel()


class _Holder:
    """A worker's object routes as `_bring_snapshot` uses them: `breaks` makes a copy from it
    stop halfway (it went away), `down` makes every call fail as an unreachable worker's."""

    def __init__(self, name: str, objects: dict[str, bytes], *, breaks: bool = False) -> None:
        self.name = name
        self.objects = objects
        self.breaks = breaks
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ApiError(ErrorCode.UNAVAILABLE, f"worker {self.name} unreachable: reset")

    async def has_object(self, digest: str) -> int | None:
        self._check()
        data = self.objects.get(digest)
        return None if data is None else len(data)

    async def get_object(self, digest: str) -> AsyncIterator[bytes]:
        self._check()
        data = self.objects[digest]
        yield data[: len(data) // 2]
        if self.breaks:
            raise ApiError(ErrorCode.UNAVAILABLE, f"worker {self.name} unreachable: reset")
        yield data[len(data) // 2 :]

    async def put_object(self, digest: str, chunks: AsyncIterator[bytes], size: int) -> None:
        self._check()
        body = b"".join([chunk async for chunk in chunks])
        if self.breaks:
            self.down = True
            raise ApiError(ErrorCode.UNAVAILABLE, f"worker {self.name} unreachable: reset")
        assert len(body) == size
        self.objects[digest] = body


@attrs.frozen
class _Listed:
    worker_id: str
    connected: bool


class _Holders:
    """The registry's side: the holders, reached by name; those in `away` not connected."""

    def __init__(self, *holders: _Holder) -> None:
        self.holders = {h.name: h for h in holders}
        self.away: set[str] = set()

    def list(self) -> list[_Listed]:
        return [_Listed(name, name not in self.away) for name in self.holders]

    async def client_for(self, worker_id: str) -> _Holder:
        return self.holders[worker_id]

    def knows(self, worker_id: str) -> bool:
        return True


DIGEST = "sha256:" + "5" * 64


async def test_a_snapshot_copy_that_breaks_is_taken_from_the_next_holder() -> None:
    target = _Holder("w-target", {})
    holders = _Holders(
        _Holder("w-broken", {DIGEST: b"snapshot-bytes"}, breaks=True),
        _Holder("w-good", {DIGEST: b"snapshot-bytes"}),
        target,
    )
    dispatcher = Dispatcher(None, holders, None, lost_after_s=5)  # type: ignore[arg-type]
    await dispatcher._bring_snapshot(DIGEST, "w-target")
    assert target.objects == {DIGEST: b"snapshot-bytes"}


async def test_a_restore_whose_worker_went_away_mid_copy_is_lost_not_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    holders = _Holders(
        _Holder("w-source", {DIGEST: b"snapshot-bytes"}), _Holder("w-target", {}, breaks=True)
    )
    dispatcher = Dispatcher(None, holders, None, lost_after_s=5)  # type: ignore[arg-type]
    with pytest.raises(WorkerLost, match="w-target was unreachable for 5 s"):
        await dispatcher._bring_snapshot(DIGEST, "w-target")


async def test_a_snapshot_whose_node_has_no_worker_yet_is_copied_once_its_next_one_connects(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = _Holder("w-target", {})
    holders = _Holders(_Holder("w-next", {DIGEST: b"snapshot-bytes"}), target)
    holders.away.add("w-next")  # the node's next worker, still starting
    dispatcher = Dispatcher(None, holders, None, lost_after_s=30)  # type: ignore[arg-type]

    async def connects() -> None:
        await trio.sleep(10)
        holders.away.clear()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(connects)
        await dispatcher._bring_snapshot(DIGEST, "w-target")
    assert target.objects == {DIGEST: b"snapshot-bytes"}
    assert trio.current_time() >= 10


async def test_a_snapshot_no_worker_holds_fails_the_restore_after_a_while_saying_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    holders = _Holders(_Holder("w-other", {}), _Holder("w-target", {}))
    dispatcher = Dispatcher(None, holders, None, lost_after_s=30)  # type: ignore[arg-type]
    with pytest.raises(ApiError, match="no connected worker has held snapshot") as failed:
        await dispatcher._bring_snapshot(DIGEST, "w-target")
    assert failed.value.code is ErrorCode.FAILED_PRECONDITION
    assert DIGEST in failed.value.message
    assert trio.current_time() >= 30


async def test_a_worker_that_never_answers_a_create_loses_the_task_with_its_reason(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Seen in a chaos campaign: a worker killed while its task's container was created made
    the task 'failed: the controlplane failed to follow the task' (the reason for a bug): the
    loss came out of the pull-progress nursery as a group the watcher did not expect."""
    # w1 is known and never connects.
    async with (
        open_task_store(tmp_path / "tasks.db") as store,
        open_worker_registry({"w1": "token"}) as registry,
        trio.open_nursery() as nursery,
    ):
        dispatcher = Dispatcher(store, registry, Workspaces(()), lost_after_s=5)
        created = await store.create("a", TaskSpec(image="busybox"))
        placed = await store.apply("a", created.id, Start(worker="w1", node="n1"))
        await dispatcher._watch(placed, False)
        ended = await store.get("a", created.id)
        assert ended.state is TaskState.LOST, ended
        assert ended.reason == "worker w1 was unreachable for 5 s"
        nursery.cancel_scope.cancel()


class _PullFails:
    """A connected worker whose every create fails as `error` says, and that has no container
    (the pull never got far enough to make one)."""

    def __init__(self, error: ApiError) -> None:
        self.error = error
        self.creates = 0

    async def client_for(self, worker_id: str) -> _PullFails:
        return self

    def knows(self, worker_id: str) -> bool:
        return True

    async def create_container(self, spec: object) -> ContainerStatus:
        self.creates += 1
        raise self.error

    async def container(self, container_id: str) -> ContainerStatus:
        raise ApiError(ErrorCode.NOT_FOUND, f"no container {container_id}")

    async def container_logs(self, container_id: str) -> AsyncIterator[LogLine]:
        raise ApiError(ErrorCode.NOT_FOUND, f"no container {container_id}")
        yield  # an async generator

    async def delete_container(self, container_id: str) -> None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no container {container_id}")


UNREACHABLE_REGISTRY = (
    "registry 127.0.0.1:59999 is unreachable: All connection attempts failed; check that it "
    "runs and the address is right, then retry"
)


@pytest.mark.parametrize(
    ("error", "state", "reason"),
    [
        # The worker's answer about the task's image: the task's failure, with its words, now.
        (
            ApiError(ErrorCode.UNAVAILABLE, UNREACHABLE_REGISTRY, field="image"),
            TaskState.FAILED,
            UNREACHABLE_REGISTRY,
        ),
        # The way to the worker broke: asked again until the worker counts as lost.
        (
            ApiError(ErrorCode.UNAVAILABLE, "worker w1 unreachable: connection lost"),
            TaskState.LOST,
            "worker w1 was unreachable for 120 s (worker w1 unreachable: connection lost)",
        ),
    ],
)
async def test_a_pull_error_fails_its_task_at_once_and_an_unreachable_worker_is_waited_for(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    error: ApiError,
    state: TaskState,
    reason: str,
) -> None:
    async with open_task_store(tmp_path / "tasks.db") as store:
        worker = _PullFails(error)
        dispatcher = Dispatcher(store, worker, Workspaces(()), lost_after_s=120)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="127.0.0.1:59999/busybox:latest"))
        placed = await store.apply("a", created.id, Start(worker="w1", node="n1"))
        await dispatcher._watch(placed, False)
        ended = await store.get("a", created.id)
        assert (ended.state, ended.reason) == (state, reason)
        if state is TaskState.FAILED:
            assert worker.creates == 1 and trio.current_time() < 1


class _Restarting:
    """The task store while its database restarts: every write answers UNAVAILABLE, as a
    pooled connection the server closed does, until `back_at` (trio time)."""

    def __init__(self, store: TaskStore, back_at: float) -> None:
        self.store = store
        self.back_at = back_at
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def apply(self, workspace: str, task_id: str, event: TaskEvent) -> TaskRecord:
        if trio.current_time() < self.back_at:
            self.refused += 1
            raise TaskStoreError(
                ErrorCode.UNAVAILABLE,
                "task database postgresql://db/levers9: server closed the connection "
                "unexpectedly; retry shortly",
            )
        return await self.store.apply(workspace, task_id, event)


async def test_a_task_ends_as_it_did_once_its_database_is_back_and_the_dispatcher_goes_on(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Seen in a 35-minute chaos campaign: a PostgreSQL restart while a watcher recorded its
    task's end made the watcher fail the task with the database's error, whose write failed
    too, and the replica exited (all three at once, once). The end is written again until the
    database is back, as it happened."""
    # w1 is known and never connects.
    async with (
        open_task_store(tmp_path / "tasks.db") as store,
        open_worker_registry({"w1": "token"}) as registry,
        trio.open_nursery() as nursery,
    ):
        restarting = _Restarting(store, back_at=trio.current_time() + 20)
        dispatcher = Dispatcher(restarting, registry, Workspaces(()), lost_after_s=5)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="busybox"))
        placed = await store.apply("a", created.id, Start(worker="w1", node="n1"))
        await dispatcher._watch(placed, False)  # returns: no error reaches the dispatcher
        ended = await store.get("a", created.id)
        assert ended.state is TaskState.LOST, ended
        assert ended.reason == "worker w1 was unreachable for 5 s"
        assert restarting.refused > 1
        assert trio.current_time() >= 20

        other = await store.create("a", TaskSpec(image="busybox"))
        running = await store.apply("a", other.id, Start(worker="w1", node="n1"))
        restarting.back_at = trio.current_time() + 3
        after = await dispatcher._settle(running, Exited(0))
        assert after is not None and after.state is TaskState.SUCCEEDED
        nursery.cancel_scope.cancel()


async def test_a_watcher_whose_record_cannot_be_written_at_all_stops_alone(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A write the database refuses for good (not UNAVAILABLE) is logged by that task's
    watcher and goes no further: the dispatcher's other tasks go on."""

    class Refusing(_Restarting):
        async def apply(self, workspace: str, task_id: str, event: TaskEvent) -> TaskRecord:
            raise TaskStoreError(ErrorCode.INTERNAL, "task database: value too long")

    async with (
        open_task_store(tmp_path / "tasks.db") as store,
        open_worker_registry({"w1": "token"}) as registry,
        trio.open_nursery() as nursery,
    ):
        dispatcher = Dispatcher(Refusing(store, 0.0), registry, Workspaces(()), lost_after_s=5)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="busybox"))
        placed = await store.apply("a", created.id, Start(worker="w1", node="n1"))
        await dispatcher._watch(placed, False)
        assert not dispatcher.watching(created.id)
        nursery.cancel_scope.cancel()


class _BrokenFollow:
    """A worker whose log stream, reached through the replica that owns it, ends with the
    owner going away after `lines` lines."""

    def __init__(self, lines: int) -> None:
        self.lines = lines

    def list(self) -> list[_Listed]:
        return []

    async def client_for(self, worker_id: str) -> _BrokenFollow:
        return self

    async def container_logs(self, task_id: str, *, follow: bool) -> AsyncIterator[LogLine]:
        for number in range(1, self.lines + 1):
            yield LogLine(time="t", stream="stdout", text=f"line-{number}")
        raise ApiError(ErrorCode.UNAVAILABLE, "worker w1 unreachable from its owner: reset")


async def test_a_followed_log_whose_worker_stream_broke_takes_the_rest_from_the_kept_log(
    tmp_path: Path,
) -> None:
    """Seen in a 35-minute chaos campaign: the replica owning a worker went away while another
    replica relayed a follower's log from it; the task ended before the stream could be opened
    again, and the follow ended at once without the rest, as if the log were whole, because
    the log is kept by the task's watcher on another replica a moment after the end."""
    async with open_task_store(tmp_path / "tasks.db") as store:
        dispatcher = Dispatcher(store, _BrokenFollow(3), Workspaces(()), lost_after_s=5)  # type: ignore[arg-type]
        router = Router()
        TaskRoutes(dispatcher, None).add_to(router)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="busybox"))
        task = created.id
        placed = await store.apply("a", task, Start(worker="w1", node="n1"))
        await store.apply("a", task, Running(cards=()))
        handler, params = router.resolve("GET", f"/v1/tasks/{task}/logs")
        request = Request("GET", "", {"follow": "true"}, {}, params, None, principal="ws:a")  # type: ignore[arg-type]
        response = await handler(request)
        whole = [dumps(LogLine("t", "stdout", f"line-{n}")) + b"\n" for n in range(1, 6)]

        async def the_other_replica() -> None:
            # Its watcher records the end, then keeps the log as it cleans up.
            await trio.sleep(0.3)
            await store.apply("a", task, Exited(0))
            await trio.sleep(0.3)
            await store.save_logs(task, b"".join(whole))

        seen: list[bytes] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(the_other_replica)
            async with contextlib.aclosing(response.chunks()) as chunks:
                async for chunk in chunks:
                    seen.append(chunk)
        assert b"".join(seen) == b"".join(whole)
        assert placed.worker == "w1"


async def test_an_idle_worker_is_retired_once_and_never_while_this_pass_places_on_it(
    tmp_path: Path,
) -> None:
    async with (
        open_task_store(tmp_path / "tasks.db") as store,
        open_worker_registry({"w1": "token"}) as registry,
        trio.open_nursery() as nursery,
    ):
        asked: list[Retire] = []

        def retire(decided: Retire) -> bool:
            asked.append(decided)
            return True

        dispatcher = Dispatcher(store, registry, Workspaces(()), lost_after_s=5, retire=retire)
        big = PendingTask("big", "a", 1, cards=3, cpu_millis=0, memory_bytes=0)
        small = PendingTask("small", "a", 0, cards=1, cpu_millis=0, memory_bytes=0)
        idle = WorkerCapacity("w1", "n1", True, 2, 1000, 1 << 30, False, 2)
        machines = [MachineSize("gpu", "n1", 4, free=2, worker="w1")]
        waits = (Waiting("big", "waiting"),)

        # This very pass places the small task on w1: w1 is not idle, whatever it holds now.
        placing = SchedulePlan((Assignment("small", "w1"),), waits)
        dispatcher._retire_idle([small, big], placing, [idle], machines)
        assert asked == []

        plan = SchedulePlan((), waits)
        dispatcher._retire_idle([big], plan, [idle], machines)
        assert [(r.worker_id, r.task_id) for r in asked] == [("w1", "big")]
        # Asked once: the next passes wait for the new worker (the task was promised it).
        dispatcher._retire_idle([big], plan, [attrs.evolve(idle, draining=True)], machines)
        assert len(asked) == 1
        nursery.cancel_scope.cancel()


class _ExitsAtOnce:
    """A connected worker whose container has exited 0 by the time it is created, and whose
    log read answers as `logs` says: its lines, or an error every time (a worker gone)."""

    def __init__(self, logs: list[str] | ApiError) -> None:
        self.logs = logs
        self.deleted = False

    async def client_for(self, worker_id: str) -> _ExitsAtOnce:
        return self

    def knows(self, worker_id: str) -> bool:
        return True

    async def create_container(self, spec: Any) -> ContainerStatus:
        return ContainerStatus(
            id=spec.id,
            image="busybox",
            state=ContainerState.EXITED,
            created_at=1.0,
            started_at=1.0,
            finished_at=1.1,
            exit_code=0,
        )

    async def container_logs(self, container_id: str) -> AsyncIterator[LogLine]:
        if isinstance(self.logs, ApiError):
            raise self.logs
        for text in self.logs:
            yield LogLine(time="2026-12-07T00:00:00Z", stream="stdout", text=text)

    async def delete_container(self, container_id: str) -> None:
        self.deleted = True


class _NewerWorker(_ExitsAtOnce):
    """A worker of a newer release: its container runs in a state this controlplane does not
    know, and its wait answers with an end this controlplane does not know either."""

    async def create_container(self, spec: Any) -> ContainerStatus:
        running = await super().create_container(spec)
        return attrs.evolve(running, state=ContainerState("warming"), finished_at=None)

    async def wait_container(self, container_id: str) -> ContainerStatus:
        return ContainerStatus(
            id=container_id,
            image="busybox",
            state=ContainerState("retired"),
            created_at=1.0,
            started_at=1.0,
            finished_at=2.0,
        )


async def test_a_state_a_newer_worker_added_is_waited_on_and_its_end_named(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_task_store(tmp_path / "tasks.db") as store:
        worker = _NewerWorker([])
        dispatcher = Dispatcher(store, worker, Workspaces(()), lost_after_s=30)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="busybox"))
        placed = await store.apply("a", created.id, Start(worker="w1", node="n1"))
        await dispatcher._watch(placed, False)
        ended = await store.get("a", created.id)
        assert (ended.state, ended.reason) == (
            TaskState.FAILED,
            "the container ended in state retired",
        )
        assert ended.running_at is not None and worker.deleted


async def test_a_task_ends_once_its_log_is_kept_and_a_worker_gone_first_loses_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Seen in a chaos campaign: a restore's agent killed right after `cat /keep` exited left
    the task succeeded with an empty log; the end was written before the log was kept."""
    async with open_task_store(tmp_path / "tasks.db") as store:
        ends: list[tuple[TaskState, bool]] = []

        class _Watched:
            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            async def apply(self, workspace: str, task_id: str, event: TaskEvent) -> TaskRecord:
                after = await store.apply(workspace, task_id, event)
                if after.state.terminal:
                    ends.append((after.state, bool(await store.logs(workspace, task_id))))
                return after

        worker = _ExitsAtOnce(["snapshot-1"])
        dispatcher = Dispatcher(_Watched(), worker, Workspaces(()), lost_after_s=30)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="busybox"))
        placed = await store.apply("a", created.id, Start(worker="w1", node="n1"))
        await dispatcher._watch(placed, False)
        # The end was written with the log already kept, and the container deleted after.
        assert ends == [(TaskState.SUCCEEDED, True)]
        assert worker.deleted

        ends.clear()
        gone = _ExitsAtOnce(ApiError(ErrorCode.UNAVAILABLE, "worker w2 unreachable: reset"))
        dispatcher = Dispatcher(_Watched(), gone, Workspaces(()), lost_after_s=30)  # type: ignore[arg-type]
        created = await store.create("a", TaskSpec(image="busybox"))
        placed = await store.apply("a", created.id, Start(worker="w2", node="n1"))
        await dispatcher._watch(placed, False)
        ended = await store.get("a", created.id)
        # Not "succeeded" with its output missing: lost, with why.
        assert (ended.state, ended.reason) == (
            TaskState.LOST,
            "worker w2 was unreachable for 30 s (worker w2 unreachable: reset)",
        )
