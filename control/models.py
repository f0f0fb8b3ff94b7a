"""Wire models of the controlplane's task API, shared by its routes and the `levers9` CLI.

The same conventions as the worker API (`workerapi.models`): attrs classes, camelCase on the wire,
unknown keys refused with the field named, one converter. A task is asked for with a
`TaskRequest` and reported as a `TaskView`: the stored record (`control.tasks.store.TaskRecord`)
plus what only the running system knows (why a pending task waits, how far its image pull
got). Bucket credentials never appear here: a request names a bucket of its workspace and the
controlplane attaches that workspace's credentials when it starts the container.

Routes (HTTPS, HTTP/2, `Authorization: Bearer <workspace token>`):

- `POST /v1/tasks` (`TaskRequest`) → 201 `TaskView`
- `GET /v1/tasks[?state=pending,running][&limit=N]` → `TaskList` (newest first)
- `GET /v1/tasks/{id}` → `TaskView`; `GET /v1/tasks/{id}/wait` → `TaskView` once it has ended
- `POST /v1/tasks/{id}/cancel` → `TaskView`
- `GET /v1/tasks/{id}/logs[?follow=true]` → NDJSON of `workerapi.models.LogLine`
- `POST /v1/tasks/{id}/snapshot` → 201 `TaskSnapshot`
- WebSocket (RFC 8441) `/v1/tasks/{id}/exec`: the worker's exec protocol (`workerapi.exec`), relayed
- `CONNECT <task id>:<port>`: a byte stream to that port of the task's container (box port)
- any method on `/v1/tasks/{id}/ports/{port}/<path>`: HTTP to a declared port (endpoint)

Pool routes (operator token, `apiTokens`):

- `GET /v1/pools` → `PoolList`: every pool, from config or joined
- `PUT /v1/pools/{name}` (the pool block as `config.worker.pools` takes it, credentials
  included) → `PoolView`: what `levers9 cluster join` calls; creates or replaces a joined pool
- `DELETE /v1/pools/{name}` → `PoolView`: a joined pool's workers are removed, then the pool

Machine route (an operator or a workspace token):

- `GET /v1/machines` → `MachineList`: every pool's machines as its last reconcile saw them, and
  how that pass went

States are `enum.StrEnum`s, not plain enums: on the wire and in `--json` they are their
lowercase words, and scripts comparing `view.state == "running"` keep working.
"""

from __future__ import annotations

import enum

import attrs

from workerapi.models import ProcessSpec, PullStatus, WorkerSummary


class TaskState(enum.StrEnum):
    """Where a task is in its life; the transition table is `control.tasks.store.TRANSITIONS`."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.LOST})


class WorkerState(enum.StrEnum):
    """A pool's worker (its Job) as the controlplane sees it: pending from the Job's creation
    until the agent registers, then ready; stopping while its pod winds down with no Job left."""

    PENDING = "pending"
    READY = "ready"
    STOPPING = "stopping"


@attrs.frozen
class TaskVolume:
    """A bucket of the task's workspace (by its configured name) mounted at `mount_path`."""

    bucket: str
    mount_path: str
    read_only: bool = False


@attrs.frozen
class TaskFields(ProcessSpec):
    """What a task asks for, as the request (`TaskRequest`) and the stored spec
    (`control.tasks.store.TaskSpec`) both hold it: the process (`ProcessSpec`, shared with the
    worker's `ContainerSpec`), its limits and how long it may run. Each adds its `volumes` in its
    own form (a bucket's name, or the bucket itself); the JSON is flat, as before."""

    cpu_millis: int | None = None
    memory_bytes: int | None = None
    timeout_s: float | None = None


@attrs.frozen
class TaskRequest(TaskFields):
    """What `levers9 run` submits. `snapshot` is a digest from `POST /v1/tasks/{id}/snapshot`
    to start from."""

    volumes: tuple[TaskVolume, ...] = ()


@attrs.frozen
class TaskView:
    """A task as the API reports it. `waiting` says why a pending task has no worker yet;
    `pull` is the image pull's progress while the task starts; `card_ids` are the UUIDs of the
    cards it got."""

    id: str
    workspace: str
    state: TaskState
    image: str
    created_at: float
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None
    cards: int = 0
    cpu_millis: int | None = None
    memory_bytes: int | None = None
    ports: tuple[int, ...] = ()
    timeout_s: float | None = None
    snapshot: str | None = None
    started_at: float | None = None
    running_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    node: str | None = None
    card_ids: tuple[str, ...] = ()
    exit_code: int | None = None
    reason: str | None = None
    waiting: str | None = None
    pull: PullStatus | None = None
    container_state: str | None = None
    card_model: str | None = None
    """The model of its cards, as its worker reported them."""

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@attrs.frozen
class TaskList:
    tasks: tuple[TaskView, ...]
    next: str | None = None
    """The id to pass as `before` for the next page; None on the last page."""


@attrs.frozen
class TaskSnapshot:
    """A task's filesystem changes, kept on its worker; start a task from it with
    `TaskRequest.snapshot` (on any worker: the controlplane copies it there)."""

    digest: str
    size: int
    task: str
    worker: str


@attrs.frozen
class PoolView:
    """A pool as the API reports it; never its credentials. `source` is `config` (a block in
    the values) or `joined` (registered by `levers9 cluster join`)."""

    name: str
    source: str
    flavor: str
    endpoint: str
    namespace: str
    selector: str
    tunnel: bool
    host_network: bool
    image: str
    machines: int = 0
    error: str | None = None
    leader: str | None = None
    """With `config.leaderElection`: the replica that reconciles the pool (holds its Lease),
    None while no replica does or this one cannot tell."""


@attrs.frozen
class PoolList:
    pools: tuple[PoolView, ...]
    joined_pools: bool = False
    """Whether this controlplane keeps joined pools (`config.joinedPools`, store readable)."""


@attrs.frozen
class CardCounts:
    """A machine's cards: all of them, those our worker holds, those other pods hold, and
    those free; ours are `busy` (held by tasks placed on our worker), `idle`, or out of
    placement as our worker reports them: `unhealthy` (quarantined: an XID, off the bus, ECC),
    `occupied` (a process outside levers9 uses it) or `refused` at the worker's start."""

    total: int
    ours: int
    others: int
    free: int
    busy: int = 0
    idle: int = 0
    unhealthy: int = 0
    occupied: int = 0
    refused: int = 0


@attrs.frozen
class CardProblem:
    """One of our worker's cards that takes no task, and why (the worker's own words)."""

    index: int
    uuid: str
    state: str
    """unhealthy, occupied, refused (or a newer worker's word)."""
    reason: str


@attrs.frozen
class MachineWorker:
    """Our worker on a machine, and how long it has been in that state."""

    state: WorkerState
    age_seconds: float


@attrs.frozen
class MachineView:
    """A node a pool can place a worker on, with what the node's scheduler leaves free on it
    (the `levers9 machine list --json` shape). `worker` is None where no worker of ours is."""

    pool: str
    node: str
    gpu_model: str | None
    cards: CardCounts
    cpu_free_millis: int
    memory_free_bytes: int
    worker: MachineWorker | None = None
    error: str | None = None
    """Why the last write for this node (its worker Job or Secret) failed; it is retried on
    the node's own backoff while the pool's other nodes go on."""
    refused: str | None = None
    """Why the cluster refuses the pods of this node's worker Job (Pod Security, GKE
    Autopilot: Kubernetes' own words) and what to run; None once a pod is made."""
    card_problems: tuple[CardProblem, ...] = ()
    """Our worker's cards there that take no task (`cards.unhealthy`, `occupied`, `refused`)."""


@attrs.frozen
class SkippedNode:
    """A node of a pool that is not a machine, and why (not ready, no cards, tainted...)."""

    node: str
    reason: str
    error: str | None = None
    """Why the last write for this node (deleting its worker Job) failed."""


@attrs.frozen
class PoolPass:
    """How a pool's last reconcile went: when it passed (None before the first), the error
    it failed with, the nodes it left out."""

    pool: str
    passed_at: float | None = None
    error: str | None = None
    skipped: tuple[SkippedNode, ...] = ()


@attrs.frozen
class MachineList:
    machines: tuple[MachineView, ...]
    pools: tuple[PoolPass, ...] = ()


@attrs.frozen
class WorkerList:
    """`GET /v1/workers`: every registered worker (operator token)."""

    workers: tuple[WorkerSummary, ...]
