"""One validation of a container spec for both programs (`workerapi.validation`): a task the
controlplane accepts at create is one a worker takes, a task it refuses is refused by the worker
naming the same field, and only what the node itself lacks is the worker's alone. The models
that share their fields keep the JSON they had; a container state a newer worker adds is read,
not refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.runtime.spec import validate_spec as validate_container
from control.models import TaskRequest, TaskState
from control.tasks.dispatch import container_spec
from control.tasks.store import TaskRecord, TaskSpec
from control.tasks.store import validate_spec as validate_task
from control.workers.registry import open_worker_registry
from wire.errors import ApiError, ErrorCode, dumps, loads, structure, unstructure
from workerapi.models import (
    CardState,
    ContainerList,
    ContainerSpec,
    ContainerState,
    ContainerStatus,
    Registration,
    Resources,
    VolumeSpec,
)
from workerapi.validation import (
    MIN_CPU_MILLIS,
    MIN_MEMORY_BYTES,
    check_container_spec,
    check_resources,
)

DIGEST = "sha256:" + "ab" * 32
NODE_MEMORY_BYTES = 1 << 40
"""A node with more memory than any spec here asks for: only the shared rules can refuse."""
TASK_ONLY = {"timeoutS"}
"""Fields a task has and a container does not."""


def as_container(spec: TaskSpec) -> ContainerSpec:
    """The container the dispatcher asks a worker for, for a task with this spec."""
    record = TaskRecord("t-0123456789ab", "ws", spec, TaskState.STARTING, 0.0, worker="w1")
    return container_spec(record, (), registry_auth=None, pull_policy="if-not-present")


def container_field(task_field: str) -> str:
    """Where a task's field sits in the container spec: limits are under `resources`."""
    return f"resources.{task_field}" if task_field in ("cpuMillis", "memoryBytes") else task_field


GOOD: dict[str, list[object]] = {
    "image": ["busybox", "registry.example:5000/team/x:1", f"busybox@{DIGEST}"],
    "command": [None, ("sh", "-c")],
    "env": [{}, {"A": "1", "_b2": "x y"}],
    "cards": [0, 2],
    "cpu_millis": [None, MIN_CPU_MILLIS, 500],
    "memory_bytes": [None, MIN_MEMORY_BYTES, 1 << 30],
    "ports": [(), (1, 65535)],
    "snapshot": [None, DIGEST],
    "timeout_s": [None, 5.0],
}
BAD: dict[str, list[object]] = {
    "image": ["", " busybox", "Bad/Name", "busybox@sha512:" + "a" * 128],
    "command": [("a\x00b",)],
    "env": [{"A-B": "1"}, {"A": "\x00"}],
    "cards": [-1],
    "cpu_millis": [-1, 0, 1, MIN_CPU_MILLIS - 1],
    "memory_bytes": [-1, 0, 1, MIN_MEMORY_BYTES - 1],
    "ports": [(0,), (65536,), (80, 80)],
    "snapshot": ["sha256:short", "latest"],
    "timeout_s": [0.0],
}


@given(st.data())
def test_a_task_is_accepted_at_create_exactly_when_a_worker_would_take_it(
    data: st.DataObject,
) -> None:
    broken = data.draw(st.sets(st.sampled_from(sorted(BAD)), max_size=2), label="broken")
    values = {
        name: data.draw(st.sampled_from(BAD[name] if name in broken else good), label=name)
        for name, good in GOOD.items()
    }
    spec = TaskSpec(**values)  # type: ignore[arg-type]
    try:
        validate_task("ws", spec)
    except ApiError as task_refused:
        assert broken
        if task_refused.field in TASK_ONLY:
            return
        with pytest.raises(ApiError) as worker_refused:
            validate_container(as_container(spec), node_memory_bytes=NODE_MEMORY_BYTES)
        assert worker_refused.value.code is task_refused.code
        assert worker_refused.value.field == container_field(task_refused.field or "")
    else:
        assert not broken
        validate_container(as_container(spec), node_memory_bytes=NODE_MEMORY_BYTES)


@pytest.mark.parametrize(
    ("field", "value", "minimum"),
    [("memoryBytes", 1, MIN_MEMORY_BYTES), ("cpuMillis", 1, MIN_CPU_MILLIS)],
)
def test_a_limit_below_what_a_container_starts_with_names_the_field_and_the_minimum(
    field: str, value: int, minimum: int
) -> None:
    limits = {"memoryBytes": "memory_bytes", "cpuMillis": "cpu_millis"}
    with pytest.raises(ApiError) as task:
        validate_task("ws", TaskSpec(image="busybox", **{limits[field]: value}))  # type: ignore[arg-type]
    assert (task.value.code, task.value.field) == (ErrorCode.INVALID_ARGUMENT, field)
    assert f"at least {minimum} " in task.value.message
    resources = Resources(**{limits[field]: value})
    with pytest.raises(ApiError) as container:
        check_container_spec(ContainerSpec(image="busybox", resources=resources))
    assert container.value.field == f"resources.{field}"
    assert f"at least {minimum} " in container.value.message
    check_resources(cpu_millis=MIN_CPU_MILLIS, memory_bytes=MIN_MEMORY_BYTES, pids=1)
    check_resources(cpu_millis=None, memory_bytes=None)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"id": "Bad_Id"}, "id"),
        ({"id": "ok\n"}, "id"),
        ({"pull_policy": "sometimes"}, "pullPolicy"),
        ({"workdir": "relative"}, "workdir"),
        ({"stop_grace_s": -1.0}, "stopGraceS"),
        ({"resources": Resources(pids=0)}, "resources.pids"),
        ({"ports": (80, 80)}, "ports"),
    ],
)
def test_what_only_a_container_has_is_checked_in_the_shared_validation(
    changes: dict[str, object], field: str
) -> None:
    spec = ContainerSpec(image="busybox", **changes)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as refused:
        check_container_spec(spec)
    assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, field)
    assert refused.value.message.startswith(f"field {field!r}: ")


def test_what_the_node_lacks_is_the_workers_own_refusal() -> None:
    spec = ContainerSpec(image="busybox", resources=Resources(memory_bytes=2 << 30))
    check_container_spec(spec)  # any worker with enough memory takes it
    with pytest.raises(ApiError) as refused:
        validate_container(spec, node_memory_bytes=1 << 30)
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert refused.value.field == "resources.memoryBytes"


# -- the shared fields keep each model's JSON --------------------------------------------------

TASK_KEYS = {
    "image",
    "command",
    "args",
    "env",
    "cards",
    "cpuMillis",
    "memoryBytes",
    "volumes",
    "ports",
    "timeoutS",
    "snapshot",
}
CONTAINER_KEYS = {
    "image",
    "id",
    "command",
    "args",
    "env",
    "workdir",
    "user",
    "cards",
    "resources",
    "ports",
    "snapshot",
    "volumes",
    "registryAuth",
    "pullPolicy",
    "stopGraceS",
    "labels",
}
# A task spec as a controlplane stored it before its fields were shared (key order and all).
STORED_BEFORE = (
    '{"image":"busybox","command":["sh","-c"],"args":["echo hi"],"env":{"A":"1"},"cards":2,'
    '"cpuMillis":500,"memoryBytes":1073741824,"volumes":[{"workspace":"ws","url":"s3://b",'
    '"mountPath":"/data","readOnly":true,"s3":null,"gcs":null}],"ports":[8080],'
    '"timeoutS":30.0,"snapshot":null}'
)


def test_the_shared_fields_leave_each_models_json_as_it_was() -> None:
    assert set(unstructure(TaskSpec(image="x"))) == TASK_KEYS
    assert set(unstructure(TaskRequest(image="x"))) == TASK_KEYS
    assert set(unstructure(ContainerSpec(image="x"))) == CONTAINER_KEYS
    assert set(unstructure(Resources())) == {"cpuMillis", "memoryBytes", "pids"}
    stored = structure(json.loads(STORED_BEFORE), TaskSpec)
    assert stored == TaskSpec(
        image="busybox",
        command=("sh", "-c"),
        args=("echo hi",),
        env={"A": "1"},
        cards=2,
        cpu_millis=500,
        memory_bytes=1 << 30,
        volumes=(VolumeSpec(workspace="ws", url="s3://b", mount_path="/data", read_only=True),),
        ports=(8080,),
        timeout_s=30.0,
    )
    assert json.loads(dumps(stored)) == json.loads(STORED_BEFORE)


# -- container states --------------------------------------------------------------------------


def status_json(state: object) -> bytes:
    return json.dumps(
        {"containers": [{"id": "c", "image": "busybox", "state": state, "createdAt": 1.0}]}
    ).encode()


def test_a_known_state_is_read_as_its_member() -> None:
    (status,) = loads(status_json("running"), ContainerList).containers
    assert status.state is ContainerState.RUNNING
    assert ContainerState.EXITED.finished and ContainerState.PULLING.settling


def test_a_state_a_newer_worker_adds_is_read_and_kept_not_refused() -> None:
    (status,) = loads(status_json("hibernating"), ContainerList).containers
    state = status.state
    assert state not in set(ContainerState)
    assert state.value == "hibernating" and f"{state}" == "hibernating"
    # Neither being made nor ended: the controlplane waits for its end as for a running one.
    assert not state.finished and not state.settling
    assert json.loads(dumps(status))["state"] == "hibernating"


def test_a_state_that_is_not_a_word_is_still_refused_naming_the_field() -> None:
    with pytest.raises(ApiError) as refused:
        loads(status_json(5), ContainerList)
    assert refused.value.field == "containers[0].state"


def test_a_worker_reports_its_own_states_as_members() -> None:
    status = ContainerStatus(id="c", image="busybox", state=ContainerState.FAILED, created_at=1)
    assert loads(dumps(status), ContainerStatus).state is ContainerState.FAILED


async def test_a_card_state_a_newer_worker_adds_is_read_and_not_placed_on() -> None:
    # A newer worker marks one of its two cards with a word this controlplane does not know:
    # its registration is still read, and only the serving card is counted for placement.
    card = {"index": 0, "model": "NVIDIA H100", "memoryTotalBytes": 80 << 30, "reason": "ok"}
    body = {
        "workerId": "w1",
        "version": "9.9.9",
        "mode": "tunnel",
        "cards": [
            {**card, "uuid": "GPU-a", "state": "serving"},
            {**card, "uuid": "GPU-b", "index": 1, "state": "quarantined", "reason": "XID 79"},
        ],
    }
    registration = loads(json.dumps(body).encode(), Registration)
    serving, other = registration.cards
    assert serving.state is CardState.SERVING
    assert other.state not in set(CardState) and f"{other.state}" == "quarantined"
    async with open_worker_registry({"w1": "token"}) as registry:
        await registry.register(registration)
        entry = registry.entry("w1")
        assert entry is not None and entry.cards == 1 and entry.card_ids == ("GPU-a",)
