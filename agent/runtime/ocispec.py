"""The OCI runtime config (config.json) of a container, made by pure functions from a `RuntimeSpec`.

Why a module of its own: what a container may do is decided here and nowhere else, so the
security defaults can be read in one place and unit tested without runc. The defaults are the
ones a reviewer knows from Docker: private PID, mount, UTS, IPC and network namespaces; Docker's
default capability set with `noNewPrivileges`; its masked and read-only /proc and /sys paths;
a device cgroup that denies everything but the usual character devices; an absolute cgroup path
under `/levers9/` so limits apply no matter where the agent itself runs.

GPU cards come as the fragment that `agent.gpus.edits.SpecEdits.oci_fragment()` makes, already
in OCI field names; it is merged in last (lists appended, the environment merged by name).
"""

from __future__ import annotations

import copy
import json
import os
import re
import resource
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from wire.errors import ApiError, ErrorCode

OCI_VERSION = "1.0.2"
CGROUP_PARENT = "/levers9"
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD_US = 100_000
# The kernel refuses quotas under 1 ms.
_MIN_CPU_QUOTA_US = 1_000
_MAX_NOFILE = 1 << 20

# Docker's default capability set (moby oci/caps/defaults.go).
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)

# Docker's (moby oci/defaults.go): kernel state a container must neither read nor change.
MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

# (type, major, minor) of the devices every container may use, as runc's and Docker's defaults:
# null, zero, full, random, urandom, tty, ptmx and the pty slaves. None is a wildcard.
DEFAULT_DEVICES: tuple[tuple[str, int, int | None], ...] = (
    ("c", 1, 3),
    ("c", 1, 5),
    ("c", 1, 7),
    ("c", 1, 8),
    ("c", 1, 9),
    ("c", 5, 0),
    ("c", 5, 2),
    ("c", 136, None),
)

PROPAGATIONS = ("rprivate", "private", "rslave", "slave")
"""Allowed for binds. Shared propagation is not: a container could then mount onto the host."""

_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def agent_nofile_limit() -> int:
    """This process's hard RLIMIT_NOFILE, capped at 2^20. Going above it would need
    CAP_SYS_RESOURCE, which the agent's pod may not have (runc then fails to start anything)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return _MAX_NOFILE if hard == resource.RLIM_INFINITY else min(hard, _MAX_NOFILE)


@attrs.frozen
class Limits:
    cpu_millis: int | None = None
    """Thousandths of a CPU; becomes a CFS quota over a 100 ms period."""
    memory_bytes: int | None = None
    """Also the memory+swap limit, so a container never swaps."""
    pids: int | None = None


@attrs.frozen
class Bind:
    """A host path bind-mounted (recursively) into the container."""

    source: str
    destination: str
    read_only: bool = False
    propagation: str = "rprivate"
    """`rslave` for volumes whose mounts may appear after the container started."""


@attrs.frozen
class RuntimeSpec:
    container_id: str
    rootfs: str
    args: tuple[str, ...]
    env: tuple[str, ...] = ()
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()
    hostname: str = ""
    """Empty: the container id (cut to 63 characters), as Docker uses the short id."""
    netns_path: str | None = None
    """A network namespace to join; None gives the container a new, empty one."""
    limits: Limits = Limits()
    binds: tuple[Bind, ...] = ()
    gpu: dict[str, Any] | None = None
    """`SpecEdits.oci_fragment(image_env)`, or None for a container without cards."""
    terminal: bool = False
    readonly_rootfs: bool = False
    hosts_file: str | None = None
    """Host file bind-mounted at /etc/hosts; give each container its own copy (it is writable,
    as in Docker)."""
    resolv_conf: str | None = None
    """Host file bind-mounted at /etc/resolv.conf (own copy per container, writable)."""
    hostname_file: str | None = None
    """Host file bind-mounted at /etc/hostname (own copy per container, writable)."""
    shm_bytes: int = 64 << 20
    """Size of /dev/shm; Docker's default is 64 MiB."""
    nofile: int = attrs.field(factory=agent_nofile_limit)
    """RLIMIT_NOFILE, soft and hard; by default the agent's own hard limit (at most 2^20)."""

    @property
    def cgroups_path(self) -> str:
        return f"{CGROUP_PARENT}/{self.container_id}"


def _invalid(message: str, field: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_ARGUMENT, message, field=field)


def validate(spec: RuntimeSpec) -> None:
    """Refuses a spec runc would reject late or that would escape its cgroup or mounts."""
    if not _CONTAINER_ID.fullmatch(spec.container_id):
        raise _invalid(
            f"container id {spec.container_id!r} is not valid: use 1-128 letters, digits, "
            "'_', '.' or '-', starting with a letter or digit",
            "containerId",
        )
    if not spec.args:
        raise _invalid("the command is empty: give at least the program to run", "args")
    if not spec.cwd.startswith("/"):
        raise _invalid(f"working directory {spec.cwd!r} must be an absolute path", "cwd")
    for name, value in (
        ("uid", spec.uid),
        ("gid", spec.gid),
        *(("gid", g) for g in spec.additional_gids),
    ):
        if value < 0:
            raise _invalid(f"{name} {value} is negative; user and group ids are >= 0", name)
    limits = spec.limits
    for name, limit in (
        ("cpuMillis", limits.cpu_millis),
        ("memoryBytes", limits.memory_bytes),
        ("pids", limits.pids),
    ):
        if limit is not None and limit <= 0:
            raise _invalid(
                f"limit {name} is {limit}; give a positive number or no limit", f"limits.{name}"
            )
    for index, bind in enumerate(spec.binds):
        if not bind.destination.startswith("/"):
            raise _invalid(
                f"bind destination {bind.destination!r} must be an absolute path in the container",
                f"binds[{index}].destination",
            )
        if not bind.source.startswith("/"):
            raise _invalid(
                f"bind source {bind.source!r} must be an absolute path on the node",
                f"binds[{index}].source",
            )
        if bind.propagation not in PROPAGATIONS:
            raise _invalid(
                f"bind propagation {bind.propagation!r} is not allowed; use one of "
                f"{', '.join(PROPAGATIONS)}",
                f"binds[{index}].propagation",
            )
    if spec.shm_bytes <= 0:
        raise _invalid(f"/dev/shm size {spec.shm_bytes} must be positive", "shmBytes")


def merge_env(*layers: Iterable[str]) -> list[str]:
    """`KEY=value` lists merged by key, later layers winning, first-seen order kept. The one
    merge of a process's environment (the image's, the spec's, the cards', an exec's); it adds
    nothing itself: the default PATH is the first layer `oci_config` and `exec_process` give."""
    merged: dict[str, str] = {}
    for layer in layers:
        for entry in layer:
            key, _, value = entry.partition("=")
            merged[key] = value
    return [f"{key}={value}" for key, value in merged.items()]


def _process_env(spec: RuntimeSpec, extra: Iterable[str] = ()) -> list[str]:
    gpu_env: Sequence[str] = (spec.gpu or {}).get("process", {}).get("env", ())
    # runc resolves a bare command with the container's PATH, so one must be there.
    return merge_env((DEFAULT_PATH,), spec.env, gpu_env, extra)


def _capabilities(uid: int) -> dict[str, list[str]]:
    caps = list(DEFAULT_CAPABILITIES)
    if uid == 0:
        return {"bounding": caps, "effective": caps, "permitted": caps}
    # As Docker since 23.0 and as execve does: a non-root process starts with empty effective
    # and permitted sets; the bounding set still caps what a setuid binary may gain.
    return {"bounding": caps}


def _user(spec: RuntimeSpec) -> dict[str, Any]:
    user: dict[str, Any] = {"uid": spec.uid, "gid": spec.gid}
    if spec.additional_gids:
        user["additionalGids"] = list(spec.additional_gids)
    return user


def _process(
    spec: RuntimeSpec, args: Sequence[str], env: list[str], cwd: str, terminal: bool
) -> dict[str, Any]:
    return {
        "terminal": terminal,
        "user": _user(spec),
        "args": list(args),
        "env": env,
        "cwd": cwd,
        "capabilities": _capabilities(spec.uid),
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": spec.nofile, "soft": spec.nofile}],
        "noNewPrivileges": True,
    }


def _bind(source: str, destination: str, *, read_only: bool, propagation: str) -> dict[str, Any]:
    options = ["rbind", propagation]
    if read_only:
        options.append("ro")
    return {"destination": destination, "type": "bind", "source": source, "options": options}


def _mounts(spec: RuntimeSpec) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": [
                "nosuid",
                "noexec",
                "nodev",
                "mode=1777",
                f"size={max(1, spec.shm_bytes // 1024)}k",
            ],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
        },
    ]
    for source, destination in (
        (spec.hosts_file, "/etc/hosts"),
        (spec.resolv_conf, "/etc/resolv.conf"),
        (spec.hostname_file, "/etc/hostname"),
    ):
        if source is not None:
            mounts.append(_bind(source, destination, read_only=False, propagation="rprivate"))
    for bind in spec.binds:
        mounts.append(
            _bind(
                bind.source,
                bind.destination,
                read_only=bind.read_only,
                propagation=bind.propagation,
            )
        )
    return mounts


def _device_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
    for kind, major, minor in DEFAULT_DEVICES:
        rule: dict[str, Any] = {"allow": True, "type": kind, "major": major, "access": "rwm"}
        if minor is not None:
            rule["minor"] = minor
        rules.append(rule)
    return rules


def _resources(limits: Limits) -> dict[str, Any]:
    resources: dict[str, Any] = {"devices": _device_rules()}
    if limits.cpu_millis is not None:
        quota = max(_MIN_CPU_QUOTA_US, limits.cpu_millis * CPU_PERIOD_US // 1000)
        # Kubernetes' conversion of millicores to shares, so a busy node divides CPU by request.
        shares = max(2, limits.cpu_millis * 1024 // 1000)
        resources["cpu"] = {"quota": quota, "period": CPU_PERIOD_US, "shares": shares}
    if limits.memory_bytes is not None:
        resources["memory"] = {"limit": limits.memory_bytes, "swap": limits.memory_bytes}
    if limits.pids is not None:
        resources["pids"] = {"limit": limits.pids}
    return resources


def _namespaces(netns_path: str | None) -> list[dict[str, str]]:
    network: dict[str, str] = {"type": "network"}
    if netns_path is not None:
        network["path"] = netns_path
    return [{"type": "pid"}, network, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]


def _merge(base: dict[str, Any], fragment: Mapping[str, Any]) -> None:
    """Deep merge: mappings recursively, lists appended, other values replaced."""
    for key, value in fragment.items():
        current = base.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            _merge(current, value)
        elif isinstance(current, list) and isinstance(value, list | tuple):
            current.extend(copy.deepcopy(list(value)))
        else:
            base[key] = copy.deepcopy(value)


def oci_config(spec: RuntimeSpec) -> dict[str, Any]:
    """The container's config.json as a dict (root.path is `spec.rootfs` as given)."""
    validate(spec)
    config: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": _process(spec, spec.args, _process_env(spec), spec.cwd, spec.terminal),
        "root": {"path": spec.rootfs, "readonly": spec.readonly_rootfs},
        "hostname": spec.hostname or spec.container_id[:63],
        "mounts": _mounts(spec),
        "linux": {
            "cgroupsPath": spec.cgroups_path,
            "resources": _resources(spec.limits),
            "namespaces": _namespaces(spec.netns_path),
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": seccomp_profile(),
        },
    }
    if spec.gpu:
        fragment = dict(spec.gpu)
        # The environment is merged by name above, not appended.
        process = {k: v for k, v in fragment.pop("process", {}).items() if k != "env"}
        if process:
            fragment["process"] = process
        _merge(config, fragment)
    return config


# System calls a container's workload has no business making: new user namespaces (a way
# around dropped capabilities), the kernel keyring (not namespaced), BPF, perf events and
# userfaultfd (kernel attack surface), module loading, clock setting, swap, reboot, kexec,
# mounts and namespace changes, raw I/O ports, handle-based opens. Most already need a
# capability we drop; refusing them here too is defence in depth, as Docker's profile does.
# Everything else is allowed, so ordinary programs behave as on a machine of their own.
DENIED_SYSCALLS = (
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "sysfs",
    "umount",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "ustat",
    "vm86",
    "vm86old",
)
CLONE_NEWUSER = 0x10000000
ENOSYS = 38
SECCOMP_ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64")
EPERM = 1


def seccomp_profile() -> dict[str, Any]:
    """The container's seccomp filter: allow by default, refuse `DENIED_SYSCALLS` with EPERM
    (a program then sees "operation not permitted", not a kill). `clone` with
    CLONE_NEWUSER is refused too: it is how `unshare -U` and friends make a user namespace.
    `clone3` passes its flags in memory a filter cannot read, so it answers ENOSYS and the C
    library falls back to `clone` (as under Docker's profile)."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": list(SECCOMP_ARCHITECTURES),
        "syscalls": [
            {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EPERM,
                "args": [
                    {
                        "index": 0,
                        "value": CLONE_NEWUSER,
                        "valueTwo": CLONE_NEWUSER,
                        "op": "SCMP_CMP_MASKED_EQ",
                    }
                ],
            },
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }


def exec_process(
    spec: RuntimeSpec,
    args: Sequence[str],
    *,
    env: Iterable[str] = (),
    cwd: str | None = None,
    terminal: bool = False,
) -> dict[str, Any]:
    """The process JSON for `runc exec --process`: same user, capabilities, limits and
    environment as the container's main process, with `env` set on top."""
    if not args:
        raise _invalid("the command is empty: give at least the program to run", "args")
    workdir = cwd if cwd is not None else spec.cwd
    if not workdir.startswith("/"):
        raise _invalid(f"working directory {workdir!r} must be an absolute path", "cwd")
    extra = list(env)
    if terminal and not any(entry.startswith("TERM=") for entry in (*spec.env, *extra)):
        extra.insert(0, "TERM=xterm")
    return _process(spec, args, _process_env(spec, extra), workdir, terminal)


def write_bundle(bundle: Path, spec: RuntimeSpec) -> Path:
    """Writes `bundle/config.json` (atomically) with an absolute rootfs path; returns its path.

    A relative `spec.rootfs` is taken relative to the bundle, as runc would.
    """
    config = oci_config(spec)
    bundle.mkdir(parents=True, exist_ok=True)
    rootfs = Path(spec.rootfs)
    if not rootfs.is_absolute():
        rootfs = bundle / rootfs
    config["root"]["path"] = str(rootfs.absolute())
    target = bundle / "config.json"
    partial = bundle / f".config.json.{os.getpid()}"
    partial.write_text(json.dumps(config, indent=1))
    os.replace(partial, target)
    return target
