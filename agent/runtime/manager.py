"""The container manager: one owner for every container on this worker, from pull to cleanup.

Each part of a container lives in its own module behind one interface: the object store
(`objects`), image pulls (`images`), the shared layer cache (`layers`), the overlay rootfs
(`rootfs`), the network namespace (`network`), the OCI config (`ocispec`) and runc with its
log-and-exit shim (`runc`). This module decides the order, keeps each container's record, and
makes sure whatever a container was given is taken back exactly once: when it ends, when its
creation fails half way, and after the agent restarts (the record on node-local disk, the
shim's exit file and the runc state say what is still there).

The container's stdio and exit status belong to the shim, not to the agent, so a container
outlives an agent that is killed and is re-adopted, logs and all, by the next one. A record
never holds a secret: registry credentials are used for the pull and dropped.

Shutdown always ends. SIGTERM cancels the daemon's main task (`proc.signals`), and the
exit of `open_container_manager` stops every container, then the bucket mounts, then the
network rules, each part under a deadline counted from the start of the shutdown
(`ShutdownBudget`, defaults in brackets), so the agent is done well inside the worker Job's
60 s termination grace (`control.kube.manifests.TERMINATION_GRACE_S`) whatever a container, runc
or rclone does:

- [0-15 s] every container gets SIGTERM and its own stop grace, at most `stop_grace_max_s`;
- [+10 s] then SIGKILL to all its processes and `kill_wait_s` for the shim to record the exit.
  A container still running after that is left as it is, `stopping` on disk, with an event on
  its record saying so; the next agent's recovery kills it and cleans up after it;
- [+15 s] a container that ended gives everything back; its bucket mounts' pending uploads get
  `final_upload_s`, and what is still pending then is named (warning and event) and not
  waited for;
- [40 s] `containers_s` cuts all of that, whatever it is waiting for (a runc call that hangs is
  killed after `runc_call_s` and eats into it);
- [45 s] `volumes_s`: every bucket mount is unmounted and its rclone stopped (a mount still held
  by a container left running first drains what it can, keeping time for the unmount; a mount
  that could not be unmounted is swept by the next agent);
- [50 s] `total_s`: network rules and registry connections are gone; 10 s remain for the
  process to exit.

Every shielded cleanup here has a deadline: `_cleanup_scope` gives it one, and the shutdown
lowers the deadline of those running when it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Sequence,
)
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio

from agent.gpus.allocator import Refusal
from agent.gpus.edits import spec_edits
from agent.gpus.ledger import CardConflict, ConflictKind
from agent.host.cgroups import oom_killed, remove_cgroup
from agent.runtime.config import ContainerConfig
from agent.runtime.exec import ExecSession
from agent.runtime.images.auth import RegistryCredentials
from agent.runtime.images.puller import ImagePuller, PulledImage
from agent.runtime.layers import LayerCache, UnpackedLayer
from agent.runtime.logreader import LogReader, LogWatch, parse_cri_line, read_lines
from agent.runtime.network import NETNS_DIR, Networking, hosts_file, resolv_conf
from agent.runtime.ocispec import (
    Bind,
    Limits,
    RuntimeSpec,
    exec_process,
    merge_env,
    write_bundle,
)
from agent.runtime.records import (
    MAX_EVENTS,
    Container,
    ContainerRecord,
    Gpus,
    ImageRecord,
    orphans,
)
from agent.runtime.rootfs import mount_overlay, overlay_mounts_under, unmount
from agent.runtime.runc import (
    ExitStatus,
    Runc,
    ShimLost,
    read_exit,
    run_container,
    running_shim,
    wait_exit,
)
from agent.runtime.shim import shim_path
from agent.runtime.spec import process_args, resolve_user, validate_spec
from agent.store.objects import ObjectStore
from agent.volumes.supervisor import Volumes
from wire.errors import ApiError, ErrorCode, dumps, loads
from workerapi.models import (
    ContainerSpec,
    ContainerState,
    ExecRequest,
    LogLine,
    SnapshotInfo,
    VolumeSpec,
)
from workerapi.validation import canonical_mount_path

log = logging.getLogger("levers9.containers")
SNAPSHOT_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
SNAPSHOT_OWNER = "snapshots"
TEARDOWN_MAX_S = math.inf
"""Outside a shutdown, how long a container that ended may take to give everything back. No
limit: what takes long is its bucket mounts' pending uploads (a checkpoint of tens of GB to a
slow store), and cutting them would lose the data; every other step is bounded on its own
(`runc_call_s`, `CLEANUP_STEP_S`). A shutdown lowers the deadline of a teardown in progress to
its budget (`_limit_cleanups`), and what did not finish by then is named on the record."""
CLEANUP_STEP_S = 15.0
"""One cleanup step that runs short commands of its own (a half-made network's removal, which
bounds each of its `ip` calls)."""
STILL_RUNNING = "still running after SIGKILL; left for the next agent's recovery"


@attrs.frozen
class ShutdownBudget:
    """How long each part of the agent's shutdown may take, in seconds (see the module
    docstring). `stop_grace_max_s`, `kill_wait_s`, `runc_call_s` and `final_upload_s` bound one
    step each; `containers_s`, `volumes_s` and `total_s` are deadlines counted from the start of
    the shutdown. The defaults fit the worker Job's 60 s grace with 10 s to spare."""

    stop_grace_max_s: float = 15.0
    """A container's own stop grace (SIGTERM to SIGKILL), at most this at shutdown."""
    kill_wait_s: float = 10.0
    """After SIGKILL, how long the shim may take to record the container's exit (in every
    stop, not only the shutdown's)."""
    runc_call_s: float = 5.0
    """Each runc call that stops or cleans up a container (kill, delete); a hung one is killed.
    Also in every stop and cleanup."""
    final_upload_s: float = 15.0
    """A stopped container's bucket mounts' pending uploads."""
    containers_s: float = 40.0
    """Every container stopped and, where it ended, cleaned up."""
    volumes_s: float = 45.0
    """Every bucket mount unmounted and its rclone stopped."""
    total_s: float = 50.0
    """Everything given back: network rules, registry connections, the object store."""


class ContainerManager:
    """Creates, watches and cleans up this worker's containers. Use `open_container_manager`."""

    def __init__(
        self,
        config: ContainerConfig,
        *,
        store: ObjectStore,
        puller: ImagePuller,
        layers: LayerCache,
        networking: Networking,
        runc: Runc,
        shim: Path,
        nursery: trio.Nursery,
        gpus: Gpus | None = None,
        volumes: Volumes | None = None,
        shutdown_budget: ShutdownBudget | None = None,
    ) -> None:
        self.config = config
        self.volumes = volumes
        self.shutdown_budget = shutdown_budget or ShutdownBudget()
        self.store = store
        self.puller = puller
        self.layers = layers
        self.networking = networking
        self.runc = runc
        self.shim = shim
        self.gpus = gpus
        self._nursery = nursery
        self._containers: dict[str, Container] = {}
        self._card_faults: dict[str, str] = {}
        """container id -> why it was stopped: a card it held turned unhealthy."""
        self._snapshot_lock = trio.Lock()
        self.root = config.state_dir / "containers"
        self.snapshots_dir = config.state_dir / "snapshots"
        self.problems: list[str] = []
        self._shutdown_deadline = math.inf
        """Set when the shutdown starts: no cleanup runs past it."""
        self._cleanups: set[trio.CancelScope] = set()
        self.log_watch = LogWatch()
        """Run by `open_container_manager` beside the manager's other background tasks."""

    # -- queries ---------------------------------------------------------------------------------

    def get(self, container_id: str) -> Container:
        try:
            return self._containers[container_id]
        except KeyError:
            raise ApiError(
                ErrorCode.NOT_FOUND, f"no container {container_id!r} on this worker", field="id"
            ) from None

    def all(self) -> list[Container]:
        return sorted(self._containers.values(), key=lambda c: c.record.created_at)

    def address_of(self, container_id: str, port: int) -> str:
        """The address to dial for `port` of a running container: only a port it declared
        (`ContainerSpec.ports`) is reached, never whatever else listens inside."""
        container = self.get(container_id)
        declared = container.record.spec.ports
        if port not in declared:
            ports = f"ports {', '.join(map(str, declared))}" if declared else "no ports"
            raise ApiError(
                ErrorCode.PERMISSION_DENIED,
                f"container {container_id} declares {ports}; CONNECT to {port} is refused; "
                "add it to the task's ports",
                field=":authority",
            )
        net = container.record.network
        if container.state is not ContainerState.RUNNING or net is None:
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"container {container_id} is {container.state}, not running; its ports are "
                "reachable only while it runs",
            )
        return net.address

    # -- create ----------------------------------------------------------------------------------

    async def create(self, spec: ContainerSpec) -> Container:
        """Accept a container and start creating it in the background; returns at once.

        The spec is checked first (nothing is made for a spec that cannot run). Creation then
        belongs to the manager, not to the caller: a caller that goes away (a CLI deadline)
        does not stop it. `wait_settled` waits for running or failed."""
        validate_spec(spec, node_memory_bytes=psutil.virtual_memory().total)
        container_id = spec.id or f"c-{os.urandom(6).hex()}"
        existing = self._containers.get(container_id)
        if existing is not None:
            if not existing.state.finished:
                raise ApiError(
                    ErrorCode.ALREADY_EXISTS,
                    f"container {container_id} already exists ({existing.state})",
                    field="id",
                )
            await self.delete(container_id)
        credentials = None
        if spec.registry_auth is not None:
            credentials = RegistryCredentials(
                username=spec.registry_auth.username, password=spec.registry_auth.password
            )
        # The record is on disk: no registry password and no bucket credentials in it.
        record = ContainerRecord(
            id=container_id,
            spec=attrs.evolve(
                spec,
                id=container_id,
                registry_auth=None,
                volumes=tuple(attrs.evolve(v, s3=None, gcs=None) for v in spec.volumes),
            ),
            created_at=time.time(),
            state=ContainerState.PULLING,
        )
        container = Container(record=record, directory=self.root / container_id)
        self._containers[container_id] = container
        container.directory.mkdir(parents=True, exist_ok=True)
        self._save(container)
        self._nursery.start_soon(self._create, container, credentials, spec.volumes)
        return container

    async def wait_settled(self, container: Container) -> Container:
        await container.settled.wait()
        if container.failure is not None:
            raise container.failure
        return container

    async def _create(
        self,
        container: Container,
        credentials: RegistryCredentials | None,
        volumes: tuple[VolumeSpec, ...],
    ) -> None:
        try:
            with container.cancel_scope:
                await self._build_and_start(container, credentials, volumes)
        except ApiError as exc:
            container.failure = exc
        except Exception as exc:
            log.exception(
                "container %s: creation failed", container.id, extra={"container": container.id}
            )
            container.failure = ApiError(
                ErrorCode.INTERNAL, f"container {container.id} could not be created: {exc}"
            )
        if container.cancel_scope.cancelled_caught and container.failure is None:
            container.failure = ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"container {container.id} was stopped before it started",
            )
        if container.failure is not None:
            await self._fail(container, container.failure.code, container.failure.message)
            return
        container.settled.set()
        await self._watch(container)

    async def _build_and_start(
        self,
        container: Container,
        credentials: RegistryCredentials | None,
        volumes: tuple[VolumeSpec, ...],
    ) -> None:
        spec = container.record.spec
        clock = time.monotonic()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.monotonic()
            container.timings[phase] = now - clock
            clock = now

        # The network (two short-lived `ip` processes) is made while the image is pulled,
        # unpacked and mounted and the bundle written: none of those needs its address.
        making = _Background(self._nursery, self.networking.create, container.id)
        try:
            binds = await self._mount_volumes(container, volumes)
            runtime = await self._prepare_rootfs(container, credentials, binds, lap)
            network = await making.result()
        finally:
            with self._cleanup_scope(CLEANUP_STEP_S):
                await making.cancel_and_wait()
        directory = container.directory

        def write_hosts() -> None:
            (directory / "etc/hosts").write_text(hosts_file(runtime.hostname, network.address))

        await trio.to_thread.run_sync(write_hosts)
        self._update(container, network=network, runtime=runtime)
        lap("prepare")
        handle = await run_container(
            self.runc,
            container_id=container.id,
            bundle=directory / "bundle",
            log_path=container.log_path,
            exit_path=directory / "exit.json",
            log_max_bytes=self.config.log_max_bytes,
            shim=self.shim,
        )
        lap("start")
        self._update(
            container,
            state=ContainerState.RUNNING,
            started_at=time.time(),
            shim_pid=handle.shim_pid,
            container_pid=handle.pid,
        )
        log.info(
            "container %s running (image %s)",
            container.id,
            spec.image,
            extra={
                "container": container.id,
                "image": spec.image,
                "duration_s": round(sum(container.timings.values()), 3),
                **{f"{k}_ms": round(v * 1000, 1) for k, v in container.timings.items()},
            },
        )
        self._nursery.start_soon(self._evict)

    async def _mount_volumes(
        self, container: Container, volumes: Sequence[VolumeSpec]
    ) -> tuple[Bind, ...]:
        """Each bucket mounted (or shared) and probed for this container; bound into it with
        slave propagation, so a remount after rclone died reaches it."""
        if not volumes:
            return ()
        if self.volumes is None:
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                "this worker mounts no buckets; start it with volumes enabled",
                field="volumes",
            )
        binds = []
        for volume in volumes:
            mounted = await self.volumes.acquire(volume, container.id)
            binds.append(
                Bind(
                    source=str(mounted.host_path),
                    # Checked by `validate_spec`; mounted at the spelling it was checked in.
                    destination=canonical_mount_path(volume.mount_path),
                    read_only=volume.read_only,
                    propagation="rslave",
                )
            )
        return tuple(binds)

    async def _prepare_rootfs(
        self,
        container: Container,
        credentials: RegistryCredentials | None,
        binds: tuple[Bind, ...],
        lap: Callable[[str], None],
    ) -> RuntimeSpec:
        """Pull, unpack, mount the rootfs and write the bundle; returns the runtime spec."""
        image, unpacked = await self._pull_and_unpack(container, credentials, lap)
        spec = container.record.spec
        directory = container.directory
        rootfs = directory / "rootfs"

        def make_rootfs() -> tuple[str, str]:
            for name in ("upper", "work", "rootfs", "etc"):
                (directory / name).mkdir(exist_ok=True)
            mount_overlay(
                [u.path for u in reversed(unpacked)],
                directory / "upper",
                directory / "work",
                rootfs,
                image=spec.image,
            )
            return _read_text(rootfs / "etc/passwd"), _read_text(rootfs / "etc/group")

        passwd, group = await trio.to_thread.run_sync(make_rootfs)
        runtime = self._runtime_spec(container, image, binds, passwd, group)

        def write_files() -> None:
            (directory / "etc/hostname").write_text(runtime.hostname + "\n")
            (directory / "etc/resolv.conf").write_text(
                resolv_conf(_read_text(Path("/etc/resolv.conf")))
            )
            write_bundle(directory / "bundle", runtime)

        await trio.to_thread.run_sync(write_files)
        return runtime

    async def _pull_and_unpack(
        self,
        container: Container,
        credentials: RegistryCredentials | None,
        lap: Callable[[str], None],
    ) -> tuple[PulledImage, list[UnpackedLayer]]:
        """The image pulled and pinned, and its layers (then the snapshot's) unpacked, bottom
        first; the container's record names them (in memory only, until it starts)."""
        spec = container.record.spec
        image = await self.puller.pull(
            spec.image,
            credentials=credentials,
            policy=spec.pull_policy,
            progress=container.progress,
        )
        for blob in image.blobs:
            self.store.pin(blob, container.id)
        lap("pull")
        layer_digests = [layer.digest for layer in image.layers]
        unpacked = []
        for layer, diff_id in zip(image.layers, image.diff_ids, strict=False):
            unpacked.append(
                await self.layers.ensure(
                    self.store, layer.digest, layer.media_type, diff_id=diff_id
                )
            )
        if spec.snapshot is not None:
            unpacked.append(await self._snapshot_layer(container, spec.snapshot))
            layer_digests.append(spec.snapshot)
        lap("unpack")
        # Kept in memory only until the network and runtime are known (one write, below): a
        # restart before then finds nothing running and cleans up by the container's id.
        self._update(
            container,
            save=False,
            state=ContainerState.CREATING,
            image=ImageRecord(
                reference=image.reference,
                manifest_digest=image.manifest_digest,
                blobs=image.blobs,
                layers=tuple(layer_digests),
            ),
        )
        return image, unpacked

    def _runtime_spec(
        self,
        container: Container,
        image: PulledImage,
        binds: tuple[Bind, ...],
        passwd: str,
        group: str,
    ) -> RuntimeSpec:
        """What runc runs: the task's spec over the image's config, with its cards assigned."""
        spec = container.record.spec
        directory = container.directory
        uid, gid, extra_gids = resolve_user(
            spec.user if spec.user is not None else image.config.user, passwd, group
        )
        argv = process_args(spec, image.config.entrypoint, image.config.cmd)
        env = merge_env(image.config.env, [f"{k}={v}" for k, v in spec.env.items()])
        gpu_fragment = None
        if spec.cards:
            gpu_fragment, cards = self._assign_cards(container, env)
            env = list(gpu_fragment["process"]["env"])
            self._update(container, cards=cards)
        return RuntimeSpec(
            container_id=container.id,
            rootfs=str(directory / "rootfs"),
            args=tuple(argv),
            env=tuple(env),
            cwd=spec.workdir or image.config.working_dir or "/",
            uid=uid,
            gid=gid,
            additional_gids=extra_gids,
            hostname=container.id[:63],
            # The namespace's path follows from the container's id; the network itself is
            # being made meanwhile and exists before runc runs.
            netns_path=str(NETNS_DIR / self.networking.netns_name(container.id)),
            limits=Limits(
                cpu_millis=spec.resources.cpu_millis,
                memory_bytes=spec.resources.memory_bytes,
                pids=spec.resources.pids,
            ),
            gpu=gpu_fragment,
            binds=binds,
            hosts_file=str(directory / "etc/hosts"),
            resolv_conf=str(directory / "etc/resolv.conf"),
            hostname_file=str(directory / "etc/hostname"),
        )

    async def _snapshot_layer(self, container: Container, digest: str) -> UnpackedLayer:
        if not self.store.contains(digest):
            raise ApiError(
                ErrorCode.NOT_FOUND,
                f"snapshot {digest} is not on this worker; copy it here first "
                f"(PUT /v1/objects/{digest})",
                field="snapshot",
            )
        self.store.pin(digest, container.id)
        return await self.layers.ensure(self.store, digest, SNAPSHOT_MEDIA_TYPE, diff_id=digest)

    def _assign_cards(
        self, container: Container, env: list[str]
    ) -> tuple[dict[str, Any], tuple[str, ...]]:
        spec = container.record.spec
        if self.gpus is None:
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"{spec.cards} card(s) asked for but this worker serves no cards",
                field="cards",
            )
        result = self.gpus.ledger.assign(container.id, spec.cards)
        if isinstance(result, Refusal):
            raise ApiError(ErrorCode.RESOURCE_EXHAUSTED, result.reason, field="cards")
        edits = spec_edits(result.cards, self.gpus.files, self.gpus.config)
        return edits.oci_fragment(env), tuple(card.uuid for card in result.cards)

    # -- running and ending ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _cleanup_scope(self, seconds: float) -> Iterator[trio.CancelScope]:
        """A shielded scope for cleanup: the caller's cancellation does not cut it short, but
        `seconds` do, and so does the shutdown's deadline (also one set while it runs)."""
        scope = trio.CancelScope(
            shield=True, deadline=min(trio.current_time() + seconds, self._shutdown_deadline)
        )
        self._cleanups.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._cleanups.discard(scope)

    def _limit_cleanups(self, deadline: float) -> None:
        """No cleanup, running or to come, lasts past `deadline` (the shutdown's)."""
        self._shutdown_deadline = min(self._shutdown_deadline, deadline)
        for scope in self._cleanups:
            scope.deadline = min(scope.deadline, self._shutdown_deadline)

    async def _watch(self, container: Container) -> None:
        """Wait for the container to end, then give back what it held."""
        status: ExitStatus | None
        try:
            status = await wait_exit(container.directory / "exit.json")
        except ShimLost:
            status = None
        await self._finish(container, status)

    async def _finish(self, container: Container, status: ExitStatus | None) -> None:
        container.exited.set()
        oom = await trio.to_thread.run_sync(oom_killed, container.cgroups_path)
        if status is None:
            await self._fail(
                container,
                ErrorCode.INTERNAL,
                "the container's shim ended without recording an exit status",
                oom_killed=oom,
            )
            return
        fault = self._card_faults.pop(container.id, None)
        if fault is not None:
            await self._fail(container, ErrorCode.UNAVAILABLE, fault, oom_killed=oom)
            return
        await self._give_back(container)
        self._update(
            container,
            state=ContainerState.EXITED,
            finished_at=time.time(),
            exit_code=status.exit_code,
            oom_killed=oom,
        )
        log.info(
            "container %s exited with %s%s",
            container.id,
            status.exit_code,
            " (out of memory)" if oom else "",
            extra={"container": container.id, "exit_code": status.exit_code, "oom_killed": oom},
        )
        container.finished.set()

    async def _fail(
        self,
        container: Container,
        code: ErrorCode,
        reason: str,
        *,
        kill: bool = False,
        **changes: Any,
    ) -> None:
        """The one way a container ends as failed: with `kill`, SIGKILL whatever of it may
        still run; give back everything it held; record why (`reason`, `code`); wake whoever
        waits for it to settle or end."""
        if kill:
            await self._runc_kill(container.id, signal.SIGKILL)
        container.exited.set()
        await self._give_back(container)
        self._update(
            container,
            state=ContainerState.FAILED,
            finished_at=time.time(),
            error=reason,
            error_code=code.name,
            **changes,
        )
        log.warning(
            "container %s failed: %s",
            container.id,
            reason,
            extra={"container": container.id, "error_code": code.name},
        )
        container.settled.set()
        container.finished.set()

    async def _give_back(self, container: Container) -> None:
        """`_teardown`, shielded and bounded: a cut one says so on the record."""
        with self._cleanup_scope(TEARDOWN_MAX_S) as scope:
            await self._teardown(container)
        if scope.cancelled_caught:
            self._event(
                container,
                "its cleanup did not finish in time; what is left of it is removed by the next "
                "agent's recovery",
            )

    async def _teardown(self, container: Container) -> None:
        """Give back every runtime resource the container may hold. Idempotent: each step
        checks what is there, so it serves failed creations, exits and recovery alike."""
        cid = container.id
        problems: list[str] = []

        async def step(what: str, fn: Any, *args: Any) -> None:
            try:
                result = fn(*args)
                if hasattr(result, "__await__"):
                    await result
            except Exception as exc:
                problems.append(f"{what}: {exc}")

        runc_call_s = self.shutdown_budget.runc_call_s
        with trio.move_on_after(runc_call_s) as deleting:
            try:
                await self.runc.delete(cid, force=True)
            except Exception as exc:
                problems.append(f"runc delete: {exc}")
        if deleting.cancelled_caught:
            problems.append(f"runc delete did not finish within {runc_call_s:g} s")
        await step("cgroup", remove_cgroup, container.cgroups_path)
        rootfs = container.directory / "rootfs"
        await step("unmount", unmount, rootfs)
        await step("network", self.networking.delete, cid)
        if self.gpus is not None:
            self.gpus.ledger.release(cid)
        if self.volumes is not None:
            # After the container is gone: waits for its uploads, unmounts what no one holds.
            # At shutdown the uploads get `final_upload_s`; the volumes name (event and warning)
            # what was still pending when the wait was cut.
            upload_s = TEARDOWN_MAX_S
            if self._shutdown_deadline < math.inf:
                upload_s = self.shutdown_budget.final_upload_s
            failed: list[str] = []
            with trio.move_on_after(upload_s):
                try:
                    failed = await self.volumes.release(cid)
                except Exception as exc:
                    failed = [f"releasing its buckets failed: {exc}"]
            for message in failed:
                self._event(container, message)
        for problem in problems:
            log.warning("container %s cleanup: %s", cid, problem, extra={"container": cid})

    async def stop(self, container_id: str, *, grace_s: float | None = None) -> Container:
        """SIGTERM, then SIGKILL to every process after the grace period; waits for the end.

        A container whose processes are still there `kill_wait_s` after SIGKILL (runc hangs,
        a process stuck in the kernel) is left `stopping`, with an event saying so: this
        returns, and the container is cleaned up when it does end (or by the next agent)."""
        container = self.get(container_id)
        grace = container.record.spec.stop_grace_s if grace_s is None else grace_s
        if not container.settled.is_set():
            container.cancel_scope.cancel()
            await container.finished.wait()
            return container
        if container.state.finished:
            return container
        self._update(container, state=ContainerState.STOPPING)
        await self._runc_kill(container_id, signal.SIGTERM)
        with trio.move_on_after(grace):
            await container.exited.wait()
        if not container.exited.is_set():
            await self._runc_kill(container_id, signal.SIGKILL)
            with trio.move_on_after(self.shutdown_budget.kill_wait_s):
                await container.exited.wait()
        if not container.exited.is_set():
            if self._shutdown_deadline < math.inf:
                self._event(container, STILL_RUNNING)
            else:
                self._event(container, "still running after SIGKILL; cleaned up once it ends")
            return container
        # It ended: what it held comes back under the teardown's own deadlines.
        await container.finished.wait()
        return container

    async def _runc_kill(self, container_id: str, signum: int) -> None:
        """Signal the container (SIGKILL: every process of it); bounded, as runc may hang."""
        runc_call_s = self.shutdown_budget.runc_call_s
        with trio.move_on_after(runc_call_s) as scope:
            with contextlib.suppress(ApiError):
                await self.runc.kill(container_id, signum, all_processes=signum == signal.SIGKILL)
        if scope.cancelled_caught:
            log.warning(
                "container %s: runc kill did not answer within %g s",
                container_id,
                runc_call_s,
                extra={
                    "container": container_id,
                    "signal": signal.Signals(signum).name,
                    "duration_s": runc_call_s,
                },
            )

    async def delete(self, container_id: str) -> None:
        """Stop the container if needed, then remove everything of it: files, pins, record."""
        container = self.get(container_id)
        await self.stop(container_id)
        if not container.finished.is_set():
            # Its record is what lets this agent (or the next) clean up after it.
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"container {container_id} is still running after SIGKILL; delete it again "
                "once it has ended",
            )
        self.store.unpin_owner(container_id)
        self._containers.pop(container_id, None)
        await trio.to_thread.run_sync(
            shutil.rmtree,
            container.directory,
            True,  # ignore_errors
        )

    # -- exec ------------------------------------------------------------------------------------

    async def exec(self, container_id: str, request: ExecRequest) -> ExecSession:
        """Start a process in the running container, as its main process's user, with the same
        capabilities and limits."""
        container = self.get(container_id)
        runtime = container.record.runtime
        if container.state is not ContainerState.RUNNING or runtime is None:
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"container {container_id} is {container.state}; exec needs it running",
            )
        if request.workdir is not None and not request.workdir.startswith("/"):
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"workdir must be an absolute path, not {request.workdir!r}",
                field="workdir",
            )
        process = exec_process(
            runtime,
            request.command,
            env=[f"{k}={v}" for k, v in request.env.items()],
            cwd=request.workdir,
            terminal=request.tty,
        )
        if request.tty:
            # Sized before the process starts, so its first look at the terminal is right.
            process["consoleSize"] = {"height": request.rows, "width": request.cols}
        started = await self.runc.exec(container_id, process, tty=request.tty)
        session = ExecSession(started)
        if request.tty:
            session.resize(request.rows, request.cols)
        return session

    # -- snapshots -------------------------------------------------------------------------------

    async def snapshot(self, container_id: str) -> SnapshotInfo:
        """Write the container's filesystem changes as one OCI layer into the object store."""
        from agent.runtime.snapshots import write_layer

        container = self.get(container_id)
        upper = container.directory / "upper"
        if container.record.image is None or not upper.is_dir():
            raise ApiError(
                ErrorCode.FAILED_PRECONDITION,
                f"container {container_id} has no filesystem yet ({container.state})",
            )
        paused = False
        if container.state is ContainerState.RUNNING:
            # A frozen container cannot change files while they are read.
            with contextlib.suppress(ApiError):
                await self.runc.pause(container_id)
                paused = True
        try:
            digest, size, diff_id = await write_layer(upper, self.store)
        finally:
            if paused:
                with contextlib.suppress(ApiError):
                    await self.runc.resume(container_id)
        info = SnapshotInfo(
            digest=digest,
            size=size,
            diff_id=diff_id,
            media_type=SNAPSHOT_MEDIA_TYPE,
            image=container.record.spec.image,
            image_digest=container.record.image.manifest_digest,
            container_id=container_id,
        )
        self.store.pin(digest, SNAPSHOT_OWNER)
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.snapshots_dir / f"{digest.removeprefix('sha256:')}.json", info)
        return info

    # -- logs ------------------------------------------------------------------------------------

    async def log_lines(self, container_id: str, *, follow: bool) -> AsyncGenerator[LogLine, None]:
        """The container's log from the start (the rotated file first); with `follow`, new
        lines as they are written until the container has ended and everything is read."""
        container = self.get(container_id)
        path = container.log_path
        previous = path.with_name("log.1")
        if previous.exists():
            for line in await trio.to_thread.run_sync(read_lines, previous):
                parsed = parse_cri_line(line)
                if parsed:
                    yield parsed
        reader = LogReader(path)
        try:
            with self.log_watch.watching(container.directory) as watched:
                while True:
                    finished = container.finished.is_set()
                    changed = watched.changed  # before the read: a write during it wakes us
                    lines = await trio.to_thread.run_sync(reader.read)
                    for line in lines:
                        parsed = parse_cri_line(line)
                        if parsed:
                            yield parsed
                    if lines:
                        continue
                    if not follow or finished:
                        return
                    with trio.move_on_after(watched.poll_s):
                        await _first_of(changed, container.finished)
        finally:
            reader.close()

    def _event(self, container: Container, message: str) -> None:
        log.warning("container %s: %s", container.id, message, extra={"container": container.id})
        self._update(container, events=(*container.record.events, message)[-MAX_EVENTS:])

    async def card_fault(self, container_id: str, message: str, *, stop: bool) -> None:
        """A card `container_id` holds turned unhealthy (the health watch says which, and why,
        in `message`): the event goes on its status; with `stop`, it is killed and ends FAILED
        with `message` as its error, so the controlplane fails its task with that reason."""
        container = self._containers.get(container_id)
        if container is None or container.state.finished:
            return
        self._event(container, message)
        if not stop:
            return
        self._card_faults[container_id] = message
        await self.stop(container_id, grace_s=0)

    def volume_event(self, holders: tuple[str, ...], message: str) -> None:
        """What the bucket mounts report (a remount, a failed upload), kept on each holder."""
        for holder in holders:
            container = self._containers.get(holder)
            if container is not None:
                self._event(container, message)

    # -- persistence and recovery ----------------------------------------------------------------

    def _update(self, container: Container, *, save: bool = True, **changes: Any) -> None:
        container.record = attrs.evolve(container.record, **changes)
        if save:
            self._save(container)

    def _save(self, container: Container) -> None:
        _write_json(container.directory / "record.json", container.record)

    def _pin_snapshots(self) -> None:
        """Keep the snapshots the previous agent took (their info files say which) from
        eviction; an unreadable info file pins nothing."""
        for info in (
            sorted(self.snapshots_dir.glob("*.json")) if self.snapshots_dir.is_dir() else []
        ):
            with contextlib.suppress(ValueError, ApiError, OSError):
                snap = loads(info.read_bytes(), SnapshotInfo)
                if self.store.contains(snap.digest):
                    self.store.pin(snap.digest, SNAPSHOT_OWNER)

    async def recover(self) -> None:
        """Adopt what the previous agent left: containers still running keep running (with
        their logs and cards), those that ended are recorded as such, those that may not keep
        their cards are stopped, and whatever no record owns is cleaned away."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._pin_snapshots()
        adopted: list[Container] = []
        for directory in sorted(self.root.iterdir()):
            record_file = directory / "record.json"
            if not record_file.is_file():
                await trio.to_thread.run_sync(shutil.rmtree, directory, True)
                continue
            try:
                record = loads(record_file.read_bytes(), ContainerRecord)
            except ApiError as exc:
                log.warning(
                    "dropping unreadable container record %s: %s",
                    record_file,
                    exc,
                    extra={"container": directory.name},
                )
                container = Container(
                    record=ContainerRecord(
                        id=directory.name,
                        spec=ContainerSpec(image="unknown"),
                        created_at=time.time(),
                    ),
                    directory=directory,
                )
                await self._teardown(container)
                await trio.to_thread.run_sync(shutil.rmtree, directory, True)
                continue
            container = Container(record=record, directory=directory)
            container.settled.set()
            self._containers[record.id] = container
            if record.image is not None:
                for blob in (*record.image.blobs, *record.image.layers):
                    if self.store.contains(blob):
                        self.store.pin(blob, record.id)
            if await self._recover_one(container):
                adopted.append(container)
        kept = await self._settle_cards(adopted)
        for container in kept:
            self._nursery.start_soon(self._watch, container)
        running = {c.id for c in kept}
        runc_ids = [s.id for s in await self.runc.list()]
        stray_runc, stray_mounts = orphans(running, runc_ids, overlay_mounts_under(self.root))
        for cid in stray_runc:
            log.warning(
                "removing runc container %s that no running record owns",
                cid,
                extra={"container": cid},
            )
            with contextlib.suppress(ApiError):
                await self.runc.delete(cid, force=True)
                remove_cgroup(f"/levers9/{cid}")
        for mount in stray_mounts:
            log.warning(
                "unmounting %s that no running container owns",
                mount,
                extra={"container": mount.parent.name, "mount": str(mount)},
            )
            unmount(mount)
        swept = await self.networking.sweep(keep=running)
        for cid in swept:
            log.warning(
                "removed the network of %s, which no running container owns",
                cid,
                extra={"container": cid},
            )
        log.info(
            "recovered %d container record(s): %d re-adopted, %d stopped for their cards",
            len(self._containers),
            len(kept),
            len(adopted) - len(kept),
            extra={
                "records": len(self._containers),
                "adopted": len(kept),
                "stopped_for_cards": len(adopted) - len(kept),
                "stray_runc": len(stray_runc),
                "stray_mounts": len(stray_mounts),
                "stray_networks": len(swept),
            },
        )

    async def _recover_one(self, container: Container) -> bool:
        """What became of one record's container while no agent ran: it ended, it must stop,
        it was lost, or it still runs. True for the last: it is re-adopted, and watched once
        `_settle_cards` has given it its cards back."""
        record = container.record
        if record.state.finished:
            container.exited.set()
            container.finished.set()
            return False
        exit_status = read_exit(container.directory / "exit.json")
        state = await self.runc.state(record.id)
        alive = state is not None and state.status in ("running", "paused")
        if exit_status is not None or (state is not None and state.status == "stopped"):
            log.info(
                "container %s ended while the agent was away",
                record.id,
                extra={"container": record.id},
            )
            await self._finish(container, exit_status)
            return False
        if alive and record.state is ContainerState.STOPPING:
            # The previous agent was stopping it when its shutdown ran out of time: finish the
            # stop. It is watched like any other, so it ends `exited` (137) and is cleaned up.
            log.info(
                "container %s: still running after the previous agent stopped it; killing it",
                record.id,
                extra={"container": record.id},
            )
            await self._runc_kill(record.id, signal.SIGKILL)
            if running_shim(container.directory / "exit.json") is not None:
                return True
            # The shim may have recorded the exit and gone between the kill and the check.
            exit_status = read_exit(container.directory / "exit.json")
            if exit_status is not None:
                await self._finish(container, exit_status)
                return False
            await self._fail(
                container,
                ErrorCode.UNAVAILABLE,
                "killed after an agent restart: the previous agent's stop did not end it",
                kill=True,
            )
            return False
        if alive and record.spec.volumes:
            # Bucket credentials are held in memory only: the new agent cannot remount or
            # look after them, so such a container is stopped rather than left half served.
            await self._fail(
                container,
                ErrorCode.UNAVAILABLE,
                "stopped after an agent restart: its bucket credentials were held in memory by "
                "the previous agent; create it again",
                kill=True,
            )
            return False
        if alive and running_shim(container.directory / "exit.json") is not None:
            log.info("re-adopting running container %s", record.id, extra={"container": record.id})
            return True
        await self._fail(
            container,
            ErrorCode.UNAVAILABLE,
            "the container was lost while the agent was not running",
            kill=state is not None,
        )
        return False

    async def _settle_cards(self, adopted: Sequence[Container]) -> list[Container]:
        """Rebuild the card ledger from the re-adopted containers' records and act on what it
        reports: a container that shares a card with another or holds one no longer given to
        this worker is stopped, naming the card; one whose card merely does not serve now
        keeps it and is told. Returns the containers that keep running."""
        holding = {c.id: c.record.cards for c in adopted if c.record.cards}
        if self.gpus is not None:
            conflicts = self.gpus.ledger.rebuild(holding)
        else:
            # No ledger (no card serves now): nothing can be handed out twice, and a
            # container keeps what it holds.
            conflicts = tuple(
                CardConflict(ConflictKind.NOT_SERVING, uuid, cid)
                for cid, cards in sorted(holding.items())
                for uuid in cards
            )
        to_stop: dict[str, list[CardConflict]] = {}
        for conflict in conflicts:
            if conflict.must_stop:
                to_stop.setdefault(conflict.container, []).append(conflict)
            else:
                self._event(self._containers[conflict.container], conflict.describe())
        for cid, found in to_stop.items():
            await self._fail(
                self._containers[cid],
                ErrorCode.UNAVAILABLE,
                "stopped after an agent restart: "
                + "; ".join(c.describe() for c in found)
                + "; create it again",
                kill=True,
            )
        return [c for c in adopted if c.id not in to_stop]

    async def _evict(self) -> None:
        try:
            evicted = await self.store.evict()
        except Exception:
            log.exception("object store eviction failed")
            return
        if evicted:
            keep = {
                d
                for c in self._containers.values()
                if c.record.image
                for d in c.record.image.layers
            }
            removed = await trio.to_thread.run_sync(self.layers.remove_unused, keep)
            log.info(
                "evicted %d object(s) and %d unpacked layer(s)",
                len(evicted),
                len(removed),
                extra={"objects_evicted": len(evicted), "layers_removed": len(removed)},
            )

    async def shutdown(self, *, started_at: float | None = None) -> None:
        """Stop every container (the worker is going away), all at once, within the budget
        counted from `started_at` (trio time; now by default): each gets its own stop grace up
        to `stop_grace_max_s`, then SIGKILL; what still runs after that is left (an event on
        its record says so) and the next agent's recovery ends it."""
        budget = self.shutdown_budget
        start = trio.current_time() if started_at is None else started_at
        self._limit_cleanups(start + budget.containers_s)
        to_stop = [c for c in self._containers.values() if not c.state.finished]
        with trio.move_on_at(start + budget.containers_s):
            async with trio.open_nursery() as nursery:
                for container in to_stop:
                    grace = min(container.record.spec.stop_grace_s, budget.stop_grace_max_s)
                    nursery.start_soon(self._stop_quietly, container.id, grace)
        left = [c for c in to_stop if not c.finished.is_set()]
        for container in left:
            if not container.exited.is_set() and STILL_RUNNING not in container.record.events:
                self._event(
                    container,
                    "still running when the shutdown's time ran out; left for the next agent's "
                    "recovery",
                )
        log.info(
            "stopped %d container(s) for the shutdown; %d left for the next agent",
            len(to_stop) - len(left),
            len(left),
            extra={
                "stopped": len(to_stop) - len(left),
                "left_running": sum(1 for c in left if not c.exited.is_set()),
                "left_uncleaned": sum(1 for c in left if c.exited.is_set()),
                "duration_s": round(trio.current_time() - start, 3),
            },
        )

    async def _stop_quietly(self, container_id: str, grace_s: float) -> None:
        with contextlib.suppress(ApiError):
            await self.stop(container_id, grace_s=grace_s)


class _Background:
    """One call run in another nursery's task, whose result (or error) is awaited later; the
    awaiting task's errors stay its own (no exception group)."""

    def __init__(
        self, nursery: trio.Nursery, fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> None:
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        nursery.start_soon(self._run, fn, args)

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            with self._scope:
                self._value = await fn(*args)
        except Exception as exc:
            self._error = exc
        finally:
            self._done.set()

    async def result(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._scope.cancelled_caught:
            raise ApiError(ErrorCode.UNAVAILABLE, "the worker is shutting down")
        return self._value

    async def cancel_and_wait(self) -> None:
        self._scope.cancel()
        await self._done.wait()


def _read_text(path: Path) -> str:
    try:
        return path.read_text("utf-8", "replace")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return ""


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(dumps(value))
    os.replace(tmp, path)


@contextlib.asynccontextmanager
async def open_container_manager(
    config: ContainerConfig,
    *,
    gpus: Gpus | None = None,
    shutdown_budget: ShutdownBudget | None = None,
) -> AsyncIterator[ContainerManager]:
    """Own a worker's containers for the life of the block: recover what the previous agent
    left, serve, and on exit stop every container (when configured) and remove our rules,
    within `shutdown_budget` (the module docstring says how it is spent)."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    async with _node_lock(config.state_dir / "agent.lock"):
        async with _open_manager(config, gpus, shutdown_budget or ShutdownBudget()) as manager:
            yield manager


async def _shielded_nursery(
    *, task_status: trio.TaskStatus[tuple[trio.Nursery, trio.CancelScope]]
) -> None:
    """A nursery for the manager's background tasks (watchers, creations, the bucket mounts)
    that the caller's cancellation does not reach: a SIGTERM cancels the daemon's main task,
    and its watchers must still see the containers end while the shutdown stops them, and the
    mounts must still upload what those containers wrote. Only the returned scope's `cancel()`
    (the manager's exit, once the containers are stopped) ends them."""
    with trio.CancelScope(shield=True) as scope:
        async with trio.open_nursery() as nursery:
            task_status.started((nursery, scope))
            await trio.sleep_forever()


@contextlib.asynccontextmanager
async def _node_lock(path: Path) -> AsyncIterator[None]:
    """One agent at a time owns a state dir's containers (a rolled worker waits for the old
    one to finish stopping its containers)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        warned = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not warned:
                    log.warning(
                        "another agent is using %s; waiting for it to end",
                        path.parent,
                        extra={"state_dir": str(path.parent)},
                    )
                    warned = True
                await trio.sleep(0.5)
        yield
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def _open_manager(
    config: ContainerConfig, gpus: Gpus | None, budget: ShutdownBudget
) -> AsyncIterator[ContainerManager]:
    started_at: float | None = None
    store = ObjectStore(
        config.state_dir,
        budget_bytes=config.object_budget_bytes,
        free_floor_bytes=config.free_floor_bytes,
    )
    networking = Networking(
        table=config.network_table, pool=config.network_pool, prefix=config.network_prefix
    )
    await networking.install()
    shim = await trio.to_thread.run_sync(shim_path, config.state_dir / "bin")
    puller = ImagePuller(
        store,
        insecure_registries=config.insecure_registries,
        ca_file=config.registry_ca_file,
        refuse_local_registries=not config.allow_local_registries,
    )
    managers: list[ContainerManager] = []

    def on_volume_event(holders: tuple[str, ...], message: str) -> None:
        for manager in managers:
            manager.volume_event(holders, message)

    volumes = Volumes(
        config.state_dir / "volumes",
        rclone=config.rclone_binary,
        on_event=on_volume_event,
        ca_file=Path(config.bucket_ca_file) if config.bucket_ca_file else None,
    )
    try:
        async with trio.open_nursery() as outer:
            nursery, background = await outer.start(_shielded_nursery)
            try:
                await nursery.start(volumes.run)
                for stale in await volumes.sweep():
                    log.warning(
                        "unmounted bucket %s left by a previous agent",
                        stale,
                        extra={"mount": str(stale)},
                    )
                manager = ContainerManager(
                    config,
                    store=store,
                    puller=puller,
                    layers=LayerCache(config.state_dir),
                    networking=networking,
                    runc=Runc(config.state_dir / "runc", binary=config.runc_binary, shim=shim),
                    shim=shim,
                    nursery=nursery,
                    gpus=gpus,
                    volumes=volumes,
                    shutdown_budget=budget,
                )
                managers.append(manager)
                await nursery.start(manager.log_watch.run)
                await manager.recover()
                try:
                    yield manager
                finally:
                    started_at = trio.current_time()
                    # Also when the containers stay: creations cut short clean up in time.
                    manager._limit_cleanups(started_at + budget.containers_s)
                    with trio.CancelScope(shield=True, deadline=started_at + budget.containers_s):
                        if config.stop_on_shutdown:
                            await manager.shutdown(started_at=started_at)
            finally:
                # The mounts' teardowns (shielded, in `volumes.run`) end by then, however
                # many containers left uploads pending or still hold a mount.
                if started_at is None:
                    started_at = trio.current_time()
                volumes.shutdown_by(started_at + budget.volumes_s)
                background.cancel()
    finally:
        if started_at is None:
            started_at = trio.current_time()
        with trio.CancelScope(shield=True, deadline=started_at + budget.total_s) as scope:
            await puller.aclose()
            if config.stop_on_shutdown:
                await networking.uninstall()
        if scope.cancelled_caught:
            log.warning(
                "removing the network rules and registry connections did not finish within "
                "the shutdown's %g s; the next agent's start replaces them",
                budget.total_s,
                extra={"duration_s": round(trio.current_time() - started_at, 3)},
            )
        store.close()


async def _first_of(*events: trio.Event) -> None:
    """Until any of `events` is set."""
    if any(event.is_set() for event in events):
        await trio.lowlevel.checkpoint()
        return
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)
