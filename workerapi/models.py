"""Wire models of the worker API and the one cattrs converter that (de)serialises them.

Every request and response body is an attrs class; JSON field names are camelCase on the
wire (as Kubernetes and the controlplane's CLI print them) and snake_case in Python. Unknown
keys are rejected, and a structuring failure is turned into an `ApiError` whose message names
the field, so bad input is refused at the edge with something a caller can act on. The one
exception is a container's state: a word a newer worker may add is read and kept as it came
(`ContainerState`), so one new state never makes a whole list unreadable.
"""

from __future__ import annotations

import enum

import attrs


@attrs.frozen
class Health:
    status: str
    worker_id: str


@attrs.frozen
class CardInfo:
    """One card this worker was given, and whether it serves (or why not)."""

    uuid: str
    index: int
    model: str
    memory_total_bytes: int
    state: CardState
    reason: str


@attrs.frozen
class WorkerInfo:
    worker_id: str
    version: str
    mode: str
    started_at: float
    uptime_s: float
    node: str | None = None
    driver_version: str | None = None
    cards: tuple[CardInfo, ...] = ()
    gpu_problems: tuple[str, ...] = ()


@attrs.frozen
class Registration:
    """What an agent tells the controlplane about itself when it registers."""

    worker_id: str
    version: str
    mode: str
    address: str | None = None
    fingerprint: str | None = None
    node: str | None = None
    cards: tuple[CardInfo, ...] = ()
    cpu_millis: int | None = None
    """What the worker may give its containers: CPU (thousandths of a core) and memory."""
    memory_bytes: int | None = None
    containers: bool = True
    """False for an agent that runs no containers (LEVERS9_CONTAINERS=off)."""


@attrs.frozen
class WorkerSummary:
    """One registered worker as the controlplane lists it."""

    worker_id: str
    mode: str
    connected: bool
    version: str | None = None
    address: str | None = None
    node: str | None = None
    registered_at: float | None = None
    cards: int = 0
    replica: str | None = None
    """The controlplane replica that holds the worker (its tunnel, or its claim)."""
    connected_at: float | None = None
    """Since when the answering replica's tunnel or direct connection to it is open."""
    rtt_ms: float | None = None
    """That connection's last keepalive round trip."""
    card_model: str | None = None


@attrs.frozen
class RegistryAuth:
    """Credentials for one pull; used for that pull only, never stored or logged."""

    username: str = ""
    password: str = attrs.field(default="", repr=False)


@attrs.frozen
class Resources:
    """What a container may use; None leaves that resource unlimited."""

    cpu_millis: int | None = None
    memory_bytes: int | None = None
    pids: int | None = None


@attrs.frozen
class S3Credentials:
    """Keys for an S3 bucket (AWS when `endpoint` is None, else any S3-compatible store)."""

    access_key_id: str = attrs.field(repr=False)
    secret_access_key: str = attrs.field(repr=False)
    session_token: str | None = attrs.field(default=None, repr=False)
    endpoint: str | None = None
    """`https://host[:port]`; None means AWS S3 in `region`."""
    region: str = "us-east-1"


@attrs.frozen
class GcsCredentials:
    """A service-account key (JSON) or HMAC keys (GCS's S3-compatible API); exactly one."""

    service_account_json: str | None = attrs.field(default=None, repr=False)
    hmac_access_id: str | None = attrs.field(default=None, repr=False)
    hmac_secret: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class VolumeSpec:
    """One volume of a container spec: the workspace's bucket at `mount_path` in the container,
    with that workspace's credentials (held in memory only; never echoed back)."""

    workspace: str
    url: str
    mount_path: str
    read_only: bool = False
    s3: S3Credentials | None = None
    gcs: GcsCredentials | None = None


@attrs.frozen
class ProcessSpec:
    """What to run and what it is given, as a task and a container both name it.

    Written once here and extended by `ContainerSpec` (the worker API) and by the controlplane's
    `TaskRequest` and `TaskSpec` (`control.models`, `control.tasks.store`); the one validation
    of these fields is `workerapi.validation.check_process`. A subclass's JSON is flat (these
    keys beside its own), so sharing them changes no wire shape and no stored record.

    `command` replaces the image's entrypoint and `args` its cmd (Kubernetes' meaning of the
    words); `snapshot` is the digest of a snapshot layer to start from, on top of the image.
    """

    image: str
    command: tuple[str, ...] | None = None
    args: tuple[str, ...] | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    cards: int = 0
    ports: tuple[int, ...] = ()
    snapshot: str | None = None


@attrs.frozen
class ContainerSpec(ProcessSpec):
    """What the controlplane asks a worker to run: the process (`ProcessSpec`) and what only a
    container has.

    `user` is `uid[:gid]` or a name from the image's /etc/passwd; the snapshot comes from this
    worker or is copied here through the objects API before the container is created.
    """

    id: str | None = None
    workdir: str | None = None
    user: str | None = None
    resources: Resources = Resources()
    volumes: tuple[VolumeSpec, ...] = ()
    registry_auth: RegistryAuth | None = None
    pull_policy: str = "if-not-present"
    stop_grace_s: float = 10.0
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class PullStatus:
    phase: str
    done_bytes: int
    total_bytes: int


class OpenState(enum.StrEnum):
    """A state word on the wire that a newer program may add to: a word this program does not
    know is read, not refused. It becomes a stand-in that keeps the word (shown and sent on as
    it came) and is none of the members, so each reader decides what an unknown state means
    and one new word never makes a whole list unreadable."""

    @classmethod
    def _missing_(cls, value: object) -> OpenState | None:
        if not isinstance(value, str):
            return None
        unknown = str.__new__(cls, value)
        unknown._name_ = "UNKNOWN"
        unknown._value_ = value
        return unknown


class CardState(OpenState):
    """Whether a card of the worker's serves containers (`CardInfo.state`). A controlplane
    places only on `SERVING` cards: an unknown word (a state a newer worker added) is a card
    that does not serve."""

    SERVING = "serving"
    REFUSED = "refused"
    """Not taken at the claim (a fault, or another's process on it); the reason says which."""
    UNHEALTHY = "unhealthy"
    """Quarantined while the worker ran (a critical XID, off the bus, uncorrectable ECC errors
    that grew, NVML's "GPU is lost"): back only once the worker is replaced and the next
    worker's claim checks it again."""
    OCCUPIED = "occupied"
    """A process outside levers9 uses it: out of placement until that process is gone."""


class ContainerState(OpenState):
    """Where a container is in its life: what `ContainerStatus.state` says on the wire (its
    lowercase word) and the worker's on-disk record keeps.

    An unknown word (`OpenState`) is a container neither being made nor ended: a controlplane
    waits for its end as for a running one and, told to remove it, stops it first.
    """

    PULLING = "pulling"
    CREATING = "creating"
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        """The container has ended and gives nothing back any more."""
        return self in (ContainerState.EXITED, ContainerState.FAILED)

    @property
    def settling(self) -> bool:
        """The container is still being made (its image pulled, its rootfs prepared)."""
        return self in (ContainerState.PULLING, ContainerState.CREATING)


@attrs.frozen
class ContainerStatus:
    """A container as the worker reports it."""

    id: str
    image: str
    state: ContainerState
    created_at: float
    image_digest: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    oom_killed: bool = False
    error: str | None = None
    error_code: str | None = None
    pull: PullStatus | None = None
    address: str | None = None
    ports: tuple[int, ...] = ()
    cards: tuple[str, ...] = ()
    labels: dict[str, str] = attrs.field(factory=dict)
    events: tuple[str, ...] = ()


@attrs.frozen
class ContainerList:
    containers: tuple[ContainerStatus, ...]


@attrs.frozen
class StopRequest:
    grace_s: float | None = None


@attrs.frozen
class SnapshotInfo:
    """A container's filesystem changes, kept as one OCI layer in the object store."""

    digest: str
    size: int
    diff_id: str
    media_type: str
    image: str
    image_digest: str | None
    container_id: str


@attrs.frozen
class ExecRequest:
    """The first message of an exec WebSocket: what to run in the container."""

    command: tuple[str, ...]
    tty: bool = False
    env: dict[str, str] = attrs.field(factory=dict)
    workdir: str | None = None
    rows: int = 24
    cols: int = 80


@attrs.frozen
class ExecResize:
    rows: int
    cols: int


@attrs.frozen
class ExecExit:
    exit_code: int


@attrs.frozen
class LogLine:
    time: str
    stream: str
    text: str
    partial: bool = False
