"""A container as its owner keeps it: the on-disk record (node-local, no secrets) and the
in-memory holder the manager mutates.
"""

from __future__ import annotations

from collections.abc import (
    Sequence,
)
from pathlib import Path

import attrs
import trio

from agent.gpus.claim import GpuConfig
from agent.gpus.edits import NodeFiles
from agent.gpus.ledger import CardLedger
from agent.runtime.images.puller import PullProgress
from agent.runtime.network import ContainerNetwork
from agent.runtime.ocispec import RuntimeSpec
from wire.errors import ApiError
from workerapi.models import (
    ContainerSpec,
    ContainerState,
    ContainerStatus,
    PullStatus,
)

MAX_EVENTS = 20


@attrs.frozen
class ImageRecord:
    """What a container's rootfs is made of, kept so a restarted agent can re-pin and clean."""

    reference: str
    manifest_digest: str
    blobs: tuple[str, ...]
    layers: tuple[str, ...]
    """Layer digests, bottom first (the snapshot layer last, when there is one)."""


@attrs.frozen
class ContainerRecord:
    """The on-disk record of one container (node-local; no secrets)."""

    id: str
    spec: ContainerSpec
    created_at: float
    image: ImageRecord | None = None
    network: ContainerNetwork | None = None
    cards: tuple[str, ...] = ()
    runtime: RuntimeSpec | None = None
    started_at: float | None = None
    shim_pid: int | None = None
    container_pid: int | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    oom_killed: bool = False
    state: ContainerState = ContainerState.CREATING
    error: str | None = None
    error_code: str | None = None
    events: tuple[str, ...] = ()
    """What the container's owner should know that is not an error of its own (a bucket
    remounted, an upload that failed), newest last."""


@attrs.define(eq=False)
class Container:
    """A container this worker owns; mutated only by the manager."""

    record: ContainerRecord
    directory: Path
    progress: PullProgress = attrs.field(factory=PullProgress)
    settled: trio.Event = attrs.field(factory=trio.Event)
    """Set once creation has ended: the container runs, or it failed."""
    exited: trio.Event = attrs.field(factory=trio.Event)
    """Set once its processes are gone (the shim recorded the exit, or it failed)."""
    finished: trio.Event = attrs.field(factory=trio.Event)
    """Set once the container has ended and its runtime resources are back (or the cleanup's
    deadline passed: what is left is the next agent's)."""
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    failure: ApiError | None = None
    timings: dict[str, float] = attrs.field(factory=dict)
    """Seconds each phase of creation took: pull, unpack, prepare (rootfs, network, bundle),
    start (runc and the shim)."""

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> ContainerState:
        return self.record.state

    @property
    def log_path(self) -> Path:
        return self.directory / "log"

    @property
    def cgroups_path(self) -> str:
        return f"/levers9/{self.id}"

    def status(self) -> ContainerStatus:
        r = self.record
        pull = None
        if r.state is ContainerState.PULLING or self.progress.total_bytes:
            pull = PullStatus(
                phase=self.progress.phase,
                done_bytes=self.progress.done_bytes,
                total_bytes=self.progress.total_bytes,
            )
        return ContainerStatus(
            id=r.id,
            image=r.spec.image,
            state=r.state,
            created_at=r.created_at,
            image_digest=r.image.manifest_digest if r.image else None,
            started_at=r.started_at,
            finished_at=r.finished_at,
            exit_code=r.exit_code,
            oom_killed=r.oom_killed,
            error=r.error,
            error_code=r.error_code,
            pull=pull,
            address=(
                r.network.address if r.network and r.state is ContainerState.RUNNING else None
            ),
            ports=r.spec.ports,
            cards=r.cards,
            labels=r.spec.labels,
            events=r.events,
        )


@attrs.frozen
class Gpus:
    """What the manager needs to give containers cards: who holds which, and how to mount them."""

    ledger: CardLedger
    files: NodeFiles
    config: GpuConfig


def orphans(
    running: set[str], runc_ids: Sequence[str], mounts: Sequence[Path]
) -> tuple[list[str], list[Path]]:
    """What a restarted agent finds that no running container owns: runc containers and
    rootfs mounts (each mount is `<containers>/<id>/rootfs`)."""
    return (
        [i for i in runc_ids if i not in running],
        [m for m in mounts if m.parent.name not in running],
    )
