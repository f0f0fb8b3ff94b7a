"""Task records: the state machine table, and the SQLite store on a real file in tmp_path."""

from __future__ import annotations

import itertools
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio

from agent.api.models import GcsCredentials, S3Credentials, VolumeSpec
from agent.wire.errors import ApiError, ErrorCode
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
    open_task_store,
    transition,
)

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


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[TaskStore]:
    async with open_task_store(tmp_path / "tasks.db", clock=Clock()) as s:
        yield s


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


async def test_records_survive_restart(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with open_task_store(path) as first:
        task = await first.create("ws-a", spec(env={"K": "v"}, ports=(80, 443)))
        task = await first.apply("ws-a", task.id, Start(worker="w9", node="n9"))
        other = await first.create("ws-a", spec("alpine"))
    async with open_task_store(path) as second:
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


async def test_volume_credentials_never_reach_the_database(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
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
    async with open_task_store(path) as store:
        task = await store.create("ws-a", spec(volumes=volumes))
        assert task.spec.volumes == tuple(attrs.evolve(v, s3=None, gcs=None) for v in volumes)
        await store.apply("ws-a", task.id, Cancel())
        stored = await store.get("ws-a", task.id)
        assert [v.url for v in stored.spec.volumes] == ["s3://bucket/data", "gs://bucket2"]
        # Read the files while the store is open (WAL not yet checkpointed) and after close.
        during = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    after = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert b"s3://bucket/data" in during + after  # the spec itself was written
    for secret in [*secrets, "GOOGID"]:
        assert secret.encode() not in during
        assert secret.encode() not in after


async def test_ended_tasks_logs_are_kept_across_restart_and_scoped(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with open_task_store(path) as first:
        task = await first.create("ws-a", spec())
        await first.apply("ws-a", task.id, Start(worker="w1"))
        assert [r.id for r in await first.active()] == [task.id]
        await first.apply("ws-a", task.id, Exited(0))
        assert await first.active() == ()
        assert await first.logs("ws-a", task.id) is None
        await first.save_logs(task.id, b'{"text":"hello"}\n')
    async with open_task_store(path) as second:
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
    # FIFO follows the order in which creates completed.
    assert [t.id for t in await store.pending()] == [t.id for t in created]


async def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with open_task_store(path) as store:
        task = await store.create("ws-a", spec())
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("UPDATE schema_version SET version = 99")
    finally:
        conn.close()
    with pytest.raises(ApiError) as info:
        async with open_task_store(path):
            pass
    assert info.value.code is ErrorCode.FAILED_PRECONDITION
    assert "99" in info.value.message and str(path) in info.value.message
    # The refused open left the file alone.
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (99,)
        assert conn.execute("SELECT id FROM tasks").fetchall() == [(task.id,)]
    finally:
        conn.close()


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


async def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = await TaskStore.open(tmp_path / "tasks.db")
    await store.aclose()
    with pytest.raises(ApiError) as info:
        await store.pending()
    assert info.value.code is ErrorCode.UNAVAILABLE


async def test_unusable_path_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "tasks.db"
    with pytest.raises(ApiError) as info:
        await TaskStore.open(path)
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert str(path) in info.value.message
