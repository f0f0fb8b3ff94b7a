"""Task records: the state machine table, and the store's whole suite on both databases: a
real SQLite file in tmp_path and a real PostgreSQL server (`tests.postgres_fixtures`)."""

from __future__ import annotations

import itertools
import re
import socket
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
import trio

from control.config import DatabaseSettings
from control.db.open import open_database
from control.models import TaskState
from control.tasks.store import (
    Cancel,
    Exited,
    Failed,
    Lost,
    Running,
    Start,
    TaskEvent,
    TaskRecord,
    TaskSpec,
    TaskStore,
    TransitionError,
    open_task_store,
    transition,
)
from wire.errors import ApiError, ErrorCode
from workerapi.models import GcsCredentials, S3Credentials, VolumeSpec

if TYPE_CHECKING:  # imported by pytest as a plugin, so not here (its asserts are rewritten)
    from tests.postgres_fixtures import PostgresServer

pytest_plugins = ["tests.postgres_fixtures"]

P, S, R = TaskState.PENDING, TaskState.STARTING, TaskState.RUNNING
EVENTS: dict[str, TaskEvent] = {
    "start": Start(worker="w1", node="n1", cards=("GPU-a",)),
    "running": Running(),
    "exited0": Exited(0),
    "exited3": Exited(3),
    "failed": Failed("image pull failed"),
    "cancel": Cancel(),
    "lost": Lost("worker w1 vanished"),
}
# Written out independently of the module's table: (state, event) -> resulting state.
ALLOWED: dict[tuple[TaskState, str], TaskState] = {
    (P, "start"): S,
    (P, "failed"): TaskState.FAILED,
    (P, "cancel"): TaskState.CANCELLED,
    (S, "running"): R,
    (S, "exited0"): TaskState.SUCCEEDED,
    (S, "exited3"): TaskState.FAILED,
    (S, "failed"): TaskState.FAILED,
    (S, "cancel"): TaskState.CANCELLED,
    (S, "lost"): TaskState.LOST,
    (R, "exited0"): TaskState.SUCCEEDED,
    (R, "exited3"): TaskState.FAILED,
    (R, "failed"): TaskState.FAILED,
    (R, "cancel"): TaskState.CANCELLED,
    (R, "lost"): TaskState.LOST,
}
REFUSED = [
    (state, name)
    for state, name in itertools.product(TaskState, EVENTS)
    if (state, name) not in ALLOWED
]


def record_in(state: TaskState) -> TaskRecord:
    return TaskRecord(
        id="t-0123456789ab",
        workspace="ws-a",
        spec=TaskSpec(image="busybox", cards=1),
        state=state,
        created_at=1.0,
        worker="w1" if state is not P else None,
    )


@pytest.mark.parametrize(("state", "name"), sorted(ALLOWED, key=str))
def test_allowed_transition(state: TaskState, name: str) -> None:
    after = transition(record_in(state), EVENTS[name], now=50.0)
    assert after.state is ALLOWED[state, name]
    if name == "start":
        assert (after.worker, after.node, after.cards, after.started_at) == (
            "w1",
            "n1",
            ("GPU-a",),
            50.0,
        )
    elif name == "running":
        assert after.running_at == 50.0 and after.finished_at is None
    else:
        assert after.finished_at == 50.0
    if name == "exited0":
        assert (after.exit_code, after.reason) == (0, None)
    if name == "exited3":
        assert after.exit_code == 3 and after.reason == "exited with code 3"
    if name in ("failed", "cancel", "lost"):
        event = EVENTS[name]
        assert isinstance(event, Failed | Cancel | Lost)
        assert after.reason == event.reason


@pytest.mark.parametrize(("state", "name"), REFUSED)
def test_refused_transition_names_task_state_and_event(state: TaskState, name: str) -> None:
    event = EVENTS[name]
    with pytest.raises(ApiError) as info:
        transition(record_in(state), event, now=50.0)
    assert info.value.code is ErrorCode.FAILED_PRECONDITION
    assert "t-0123456789ab" in info.value.message
    assert state.value in info.value.message
    assert repr(event.kind) in info.value.message


def test_start_with_wrong_card_count_is_refused() -> None:
    with pytest.raises(ApiError) as info:
        transition(record_in(P), Start(worker="w1", cards=("GPU-a", "GPU-b", "GPU-c")), now=1.0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.field == "cards"


def test_cards_learned_when_the_container_runs() -> None:
    started = transition(record_in(P), Start(worker="w1"), now=1.0)
    assert started.cards == ()
    running = transition(started, Running(cards=("GPU-a",)), now=2.0)
    assert running.cards == ("GPU-a",)
    assert running.running_at == 2.0


# -- the store -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


Where = Path | DatabaseSettings


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    """Where a store keeps its records: one SQLite file, or one PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "tasks.db"
    settings: DatabaseSettings = request.getfixturevalue("postgres_database")
    return settings


@pytest.fixture
async def store(database: Where) -> AsyncIterator[TaskStore]:
    async with open_task_store(database, clock=Clock()) as s:
        yield s


def stored_bytes(database: Where, request: pytest.FixtureRequest) -> bytes:
    """Every byte the database has put on disk so far."""
    if isinstance(database, Path):
        files = [p for p in database.parent.iterdir() if p.is_file()]
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        with server.admin() as conn:
            conn.execute("CHECKPOINT")
        files = [p for p in server.data_dir.rglob("*") if p.is_file()]
    return b"".join(p.read_bytes() for p in files)


def set_schema_version(database: Where, version: int, request: pytest.FixtureRequest) -> None:
    if isinstance(database, Path):
        conn = sqlite3.connect(database)
        try:
            with conn:
                conn.execute("UPDATE schema_version SET version = ?", (version,))
        finally:
            conn.close()
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with server.admin(database_name(database)) as pg:
        pg.execute("UPDATE schema_version SET version = %s", (version,))


def database_name(settings: DatabaseSettings) -> str:
    assert settings.url is not None
    return settings.url.rsplit("/", 1)[1]


def where_named(database: Where) -> str:
    return str(database) if isinstance(database, Path) else str(database.url)


def spec(image: str = "busybox", **kw: object) -> TaskSpec:
    return TaskSpec(image=image, **kw)  # type: ignore[arg-type]


async def test_create_get_and_full_lifecycle(store: TaskStore) -> None:
    full = spec(
        command=("sh", "-c"),
        args=("echo hi",),
        env={"A": "1"},
        cards=2,
        cpu_millis=500,
        memory_bytes=1 << 30,
        ports=(8080,),
        timeout_s=60.0,
    )
    created = await store.create("ws-a", full)
    assert re.fullmatch(r"t-[0-9a-f]{12}", created.id)
    assert created.state is P and created.spec == full
    assert await store.get("ws-a", created.id) == created

    await store.apply("ws-a", created.id, Start(worker="w1", node="n1", cards=("G1", "G2")))
    await store.apply("ws-a", created.id, Running())
    done = await store.apply("ws-a", created.id, Exited(0))
    assert done.state is TaskState.SUCCEEDED and done.exit_code == 0
    assert done.created_at < done.started_at < done.running_at < done.finished_at  # type: ignore[operator]
    assert await store.get("ws-a", created.id) == done


async def test_refused_event_leaves_record_unchanged(store: TaskStore) -> None:
    task = await store.create("ws-a", spec())
    await store.apply("ws-a", task.id, Cancel())
    with pytest.raises(ApiError) as info:
        await store.apply("ws-a", task.id, Start(worker="w1"))
    assert info.value.code is ErrorCode.FAILED_PRECONDITION
    assert (await store.get("ws-a", task.id)).state is TaskState.CANCELLED


async def test_records_survive_restart(database: Where) -> None:
    async with open_task_store(database) as first:
        task = await first.create("ws-a", spec(env={"K": "v"}, ports=(80, 443)))
        task = await first.apply("ws-a", task.id, Start(worker="w9", node="n9"))
        other = await first.create("ws-a", spec("alpine"))
    async with open_task_store(database) as second:
        assert await second.get("ws-a", task.id) == task
        assert await second.pending() == (await second.get("ws-a", other.id),)
        assert await second.running_on("w9") == (task,)
        # A restarted store keeps appending after the old tasks.
        newer = await second.create("ws-a", spec("late"))
        assert [t.id for t in await second.pending()] == [other.id, newer.id]


async def test_workspace_isolation(store: TaskStore) -> None:
    mine = await store.create("ws-a", spec())
    with pytest.raises(ApiError) as theirs:
        await store.get("ws-b", mine.id)
    with pytest.raises(ApiError) as missing:
        await store.get("ws-b", "t-000000000000")
    assert theirs.value.code is missing.value.code is ErrorCode.NOT_FOUND
    assert theirs.value.message == missing.value.message.replace("t-000000000000", mine.id)
    assert await store.list("ws-b") == ()
    assert await store.pending("ws-b") == ()
    with pytest.raises(ApiError) as cancel:
        await store.apply("ws-b", mine.id, Cancel())
    assert cancel.value.code is ErrorCode.NOT_FOUND
    assert cancel.value.message == theirs.value.message
    assert (await store.get("ws-a", mine.id)).state is P


async def test_list_filters_by_state_newest_first_with_limit(store: TaskStore) -> None:
    a = await store.create("ws-a", spec("a"))
    b = await store.create("ws-a", spec("b"))
    c = await store.create("ws-a", spec("c"))
    await store.apply("ws-a", b.id, Cancel())
    assert [t.id for t in await store.list("ws-a")] == [c.id, b.id, a.id]
    assert [t.id for t in await store.list("ws-a", limit=2)] == [c.id, b.id]
    assert [t.id for t in await store.list("ws-a", states=[P])] == [c.id, a.id]
    assert [t.id for t in await store.list("ws-a", states=[TaskState.CANCELLED])] == [b.id]
    with pytest.raises(ApiError) as info:
        await store.list("ws-a", limit=0)
    assert info.value.field == "limit"


async def test_pending_is_fifo_across_workspaces(store: TaskStore) -> None:
    ids = []
    for i in range(6):
        task = await store.create("ws-a" if i % 2 else "ws-b", spec(f"img{i}"))
        ids.append(task.id)
    await store.apply("ws-a", ids[3], Start(worker="w1"))
    expected = [ids[0], ids[1], ids[2], ids[4], ids[5]]
    assert [t.id for t in await store.pending()] == expected
    assert [t.id for t in await store.pending("ws-a")] == [ids[1], ids[5]]


async def test_mark_worker_lost_only_touches_that_workers_active_tasks(
    store: TaskStore,
) -> None:
    starting = await store.create("ws-a", spec())
    running = await store.create("ws-b", spec())
    finished = await store.create("ws-a", spec())
    elsewhere = await store.create("ws-a", spec())
    waiting = await store.create("ws-a", spec())
    await store.apply("ws-a", starting.id, Start(worker="w1"))
    await store.apply("ws-b", running.id, Start(worker="w1"))
    await store.apply("ws-b", running.id, Running())
    await store.apply("ws-a", finished.id, Start(worker="w1"))
    await store.apply("ws-a", finished.id, Exited(1))
    await store.apply("ws-a", elsewhere.id, Start(worker="w2"))

    lost = await store.mark_worker_lost("w1", "worker w1 stopped answering")

    assert {t.id for t in lost} == {starting.id, running.id}
    for ws, task_id in (("ws-a", starting.id), ("ws-b", running.id)):
        after = await store.get(ws, task_id)
        assert after.state is TaskState.LOST
        assert after.reason == "worker w1 stopped answering"
    assert (await store.get("ws-a", finished.id)).state is TaskState.FAILED
    assert (await store.get("ws-a", elsewhere.id)).state is S
    assert (await store.get("ws-a", waiting.id)).state is P
    assert await store.running_on("w1") == ()
    assert [t.id for t in await store.running_on("w2")] == [elsewhere.id]


async def test_volume_credentials_never_reach_the_database(
    database: Where, request: pytest.FixtureRequest
) -> None:
    secrets = ["AKIDSECRETKEYID1", "sEcReT/acc3ss+key", "S3SESSIONTOKEN9", "HMACSECRETXYZ"]
    volumes = (
        VolumeSpec(
            workspace="ws-a",
            url="s3://bucket/data",
            mount_path="/data",
            s3=S3Credentials(
                access_key_id=secrets[0],
                secret_access_key=secrets[1],
                session_token=secrets[2],
            ),
        ),
        VolumeSpec(
            workspace="ws-a",
            url="gs://bucket2",
            mount_path="/out",
            gcs=GcsCredentials(hmac_access_id="GOOGID", hmac_secret=secrets[3]),
        ),
    )
    async with open_task_store(database) as store:
        task = await store.create("ws-a", spec(volumes=volumes))
        assert task.spec.volumes == tuple(attrs.evolve(v, s3=None, gcs=None) for v in volumes)
        await store.apply("ws-a", task.id, Cancel())
        stored = await store.get("ws-a", task.id)
        assert [v.url for v in stored.spec.volumes] == ["s3://bucket/data", "gs://bucket2"]
        # Read the files while the store is open (WAL not yet checkpointed) and after close.
        during = stored_bytes(database, request)
    after = stored_bytes(database, request)
    assert b"s3://bucket/data" in during + after  # the spec itself was written
    for secret in [*secrets, "GOOGID"]:
        assert secret.encode() not in during
        assert secret.encode() not in after


async def test_ended_tasks_logs_are_kept_across_restart_and_scoped(database: Where) -> None:
    async with open_task_store(database) as first:
        task = await first.create("ws-a", spec())
        await first.apply("ws-a", task.id, Start(worker="w1"))
        assert [r.id for r in await first.active()] == [task.id]
        await first.apply("ws-a", task.id, Exited(0))
        assert await first.active() == ()
        assert await first.logs("ws-a", task.id) is None
        await first.save_logs(task.id, b'{"text":"hello"}\n')
    async with open_task_store(database) as second:
        assert await second.logs("ws-a", task.id) == b'{"text":"hello"}\n'
        with pytest.raises(ApiError) as info:
            await second.logs("ws-b", task.id)
        assert info.value.code is ErrorCode.NOT_FOUND


async def test_concurrent_creates_get_distinct_ids_in_order(store: TaskStore) -> None:
    created: list[TaskRecord] = []

    async def make(i: int) -> None:
        created.append(await store.create("ws-a", spec(f"img{i}")))

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(make, i)
    assert len({t.id for t in created}) == 40
    # Every one queued once; the queue's order is the order the rows were inserted in.
    assert sorted(t.id for t in await store.pending()) == sorted(t.id for t in created)


async def test_newer_schema_version_is_refused(
    database: Where, request: pytest.FixtureRequest
) -> None:
    async with open_task_store(database) as store:
        task = await store.create("ws-a", spec())
    set_schema_version(database, 99, request)
    with pytest.raises(ApiError) as info:
        async with open_task_store(database):
            pass
    assert info.value.code is ErrorCode.FAILED_PRECONDITION
    assert "99" in info.value.message and where_named(database) in info.value.message
    # The refused open left the records alone.
    from control.db import postgres, sqlite

    known = sqlite.SCHEMA_VERSION if isinstance(database, Path) else postgres.SCHEMA_VERSION
    set_schema_version(database, known, request)
    async with open_task_store(database) as store:
        assert [t.id for t in await store.pending()] == [task.id]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (spec(""), "image"),
        (spec(cards=-1), "cards"),
        (spec(cpu_millis=0), "cpuMillis"),
        (spec(memory_bytes=-5), "memoryBytes"),
        (spec(timeout_s=0.0), "timeoutS"),
        (spec(ports=(0,)), "ports"),
        (spec(ports=(80, 80)), "ports"),
        (spec(env={"A=B": "x"}), "env"),
        (
            spec(volumes=(VolumeSpec(workspace="ws-b", url="s3://b", mount_path="/d"),)),
            "volumes[0].workspace",
        ),
        (
            spec(volumes=(VolumeSpec(workspace="ws-a", url="s3://b", mount_path="d"),)),
            "volumes[0].mountPath",
        ),
    ],
)
async def test_bad_specs_are_refused_naming_the_field(
    store: TaskStore, bad: TaskSpec, field: str
) -> None:
    with pytest.raises(ApiError) as info:
        await store.create("ws-a", bad)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.field == field
    assert await store.list("ws-a") == ()


async def test_closed_store_refuses_calls(database: Where) -> None:
    async with open_task_store(database) as store:
        pass
    with pytest.raises(ApiError) as info:
        await store.pending()
    assert info.value.code is ErrorCode.UNAVAILABLE


async def test_unusable_path_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "tasks.db"
    with pytest.raises(ApiError) as info:
        async with open_task_store(path):
            pass
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert str(path) in info.value.message


async def test_a_wrong_password_or_no_server_is_a_clear_error_without_the_password(
    postgres_database: DatabaseSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool tries for its whole connect timeout before it gives up; the words are the same
    # after 2 s as after 10.
    from control.db import postgres

    monkeypatch.setattr(postgres, "CONNECT_TIMEOUT_S", 2)
    wrong = attrs.evolve(postgres_database, password="not-the-password")
    with pytest.raises(ApiError) as info:
        async with open_task_store(wrong):
            pass
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert "password authentication failed" in info.value.message
    assert "not-the-password" not in info.value.message
    assert "config.database.password" in info.value.message
    assert postgres_database.password is not None
    assert postgres_database.password not in info.value.message

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nowhere = attrs.evolve(postgres_database, url=f"postgresql://postgres@127.0.0.1:{port}/x")
    with pytest.raises(ApiError) as info:
        async with open_task_store(nowhere):
            pass
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert f"127.0.0.1:{port}" in info.value.message and "config.database.url" in info.value.message


async def test_two_stores_on_one_database_never_both_move_a_task(database: Where) -> None:
    """Two replicas race to start the same tasks: each task starts exactly once, and the one
    that lost is told the task has moved on."""
    async with open_task_store(database) as one, open_task_store(database) as two:
        tasks = [await one.create("ws-a", spec()) for _ in range(12)]
        started: dict[str, list[str]] = {t.id: [] for t in tasks}
        refused: list[str] = []

        async def start(replica: TaskStore, name: str, task_id: str) -> None:
            try:
                record = await replica.apply("ws-a", task_id, Start(worker=name))
            except TransitionError as exc:
                assert exc.state is S
                refused.append(task_id)
            else:
                started[task_id].append(str(record.worker))

        async with trio.open_nursery() as nursery:
            for task in tasks:
                nursery.start_soon(start, one, "w-one", task.id)
                nursery.start_soon(start, two, "w-two", task.id)
        assert all(len(workers) == 1 for workers in started.values()), started
        assert sorted(refused) == sorted(t.id for t in tasks)
        for task in tasks:
            # Both stores read the one outcome.
            assert (await one.get("ws-a", task.id)).worker == started[task.id][0]
            assert (await two.get("ws-a", task.id)).worker == started[task.id][0]


async def test_a_write_from_a_stale_read_is_refused(database: Where) -> None:
    """The compare-and-set itself: a row written since it was read is not overwritten."""
    from control.db.base import CasConflict, Tx
    from control.tasks.store import _select_one, _update

    async with open_task_store(database) as store:
        task = await store.create("ws-a", spec())
        db = await open_database(database)
        try:
            read = await db.run(lambda tx: _select_one(tx, "ws-a", task.id))
            assert read is not None
            record, version = read
            await store.apply("ws-a", task.id, Cancel())

            def stale_write(tx: Tx) -> None:
                _update(tx, transition(record, Start(worker="w1"), 0.0), version)

            with pytest.raises(CasConflict):
                await db.run(stale_write)
        finally:
            await db.aclose()
        assert (await store.get("ws-a", task.id)).state is TaskState.CANCELLED


async def test_a_file_from_before_row_versions_is_migrated_and_keeps_its_tasks(
    tmp_path: Path,
) -> None:
    from control.db import sqlite as backend

    path = tmp_path / "tasks.db"
    conn = sqlite3.connect(path)
    try:
        with conn:
            for migration in backend.MIGRATIONS[:2]:
                conn.executescript(migration)
            conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            conn.execute("INSERT INTO schema_version VALUES (2)")
            conn.execute(
                "INSERT INTO tasks (id, workspace, state, spec, created_at) "
                "VALUES ('t-old', 'ws-a', 'pending', '{\"image\": \"busybox\"}', 1.0)"
            )
    finally:
        conn.close()
    async with open_task_store(path) as store:
        (old,) = await store.pending()
        assert old.id == "t-old" and old.spec.image == "busybox"
        started = await store.apply("ws-a", "t-old", Start(worker="w1"))
        assert started.state is S


async def test_another_replicas_changes_are_heard_at_once(
    postgres_database: DatabaseSettings,
) -> None:
    """PostgreSQL: a task created, moved or given its log through one store wakes a listener on
    another (LISTEN/NOTIFY) with what changed, so a replica does not wait for its next periodic
    look; a store does not hear its own changes."""
    heard = trio.Event()
    notes: list[tuple[str, str]] = []

    def on_change(task_id: str, what: str) -> None:
        notes.append((task_id, what))
        heard.set()

    async with (
        open_task_store(postgres_database) as one,
        open_task_store(postgres_database) as two,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(two.watch_changes, on_change)
        await nursery.start(one.watch_changes, lambda *_: notes.append(("echo", "")))
        with trio.fail_after(10):
            task = await one.create("ws-a", spec())
            await heard.wait()
            heard = trio.Event()
            await one.apply("ws-a", task.id, Cancel())
            await heard.wait()
            heard = trio.Event()
            await one.save_logs(task.id, b"{}\n")
            await heard.wait()
        nursery.cancel_scope.cancel()
    assert notes == [(task.id, "pending"), (task.id, "cancelled"), (task.id, "logs")]
