"""The one validation of a container spec, applied by both programs: by the controlplane when
a task is created (a workspace token holder's request, refused with 400 naming the field before
anything is stored or placed) and by the worker when a container is created (whatever reached
it). A rule written once cannot drift: a task the controlplane accepts is one every worker takes,
unless the node itself cannot (too little memory, cards it lacks, an image its policy refuses),
and those node-dependent checks are all the worker adds (`agent.runtime.spec`).

Two levels. The spec checks (`check_process`, `check_resources`, `check_mount_paths`,
`check_container_spec`) raise `ApiError(INVALID_ARGUMENT)` naming the field in the wire's
camelCase spelling and saying what to give; the caller passes the prefix its own shape puts
before a field (`resources.` in a container spec, none in a task). The free-text checks below
them (mount path, environment name, C string) raise ValueError and leave the field to the caller.

A mount target is compared only in its canonical form (`canonical_mount_path`): absolute,
repeated slashes collapsed (a leading `//` too: `PurePosixPath` keeps it, and `//etc` once
passed a check against `/etc` while the runtime mounted over `/etc`), no trailing slash, no
`.` or `..` component (refused rather than resolved: a caller who writes them means something
we would have to guess). The result is what is stored and what the runtime mounts at.

Text the kernel takes as C strings (argv, environment, paths) cannot hold NUL; other control
characters are allowed in argv and values (a script may print colour codes) and escaped where
the CLI shows them (`control.cli.output.visible`). Environment names are POSIX's shape.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from wire.errors import ApiError, ErrorCode
from workerapi.digests import parse_digest
from workerapi.models import ContainerSpec, ProcessSpec
from workerapi.reference import PULL_POLICIES, parse_reference

SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
    "/var/run",
)
"""Directories of the container's own system that no bucket may cover, nor go anywhere in."""
SYSTEM_DIRECTORIES = frozenset({"/", "/tmp", "/var", *SYSTEM_TREES})
"""Directories no bucket may replace; below `/tmp` and `/var` (outside `/var/run`) is fine."""
MAX_PATH_BYTES = 4096
"""PATH_MAX: the kernel takes no longer path."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONTAINER_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
"""A container's id: it names its directory, its cgroup and its runc container."""
MIN_MEMORY_BYTES = 8 << 20
"""Below this runc cannot even start a container's init."""
MIN_CPU_MILLIS = 10
"""cgroup v2's smallest CPU quota (1 ms in each 100 ms period) is a hundredth of a core."""
MIN_PIDS = 1
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def canonical_mount_path(path: str) -> str:
    """`path` as the one spelling it is checked, stored and mounted at; ValueError saying why
    it may not be a bucket's mount target (relative, NUL or another control character, `.` or
    `..`, `/` or a system directory or anything under one)."""
    if not path.startswith("/"):
        raise ValueError(f"mount path {path!r} must be absolute (start with /)")
    if _CONTROL.search(path):
        raise ValueError(f"mount path {path!r} must not contain NUL or control characters")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise ValueError(f"mount path is longer than {MAX_PATH_BYTES} bytes")
    parts = [part for part in path.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"mount path {path!r} must not contain '.' or '..' components")
    canonical = "/" + "/".join(parts)
    if canonical in SYSTEM_DIRECTORIES or any(
        canonical.startswith(tree + "/") for tree in SYSTEM_TREES
    ):
        raise ValueError(
            f"mount path {path!r} would hide a system directory; choose a path of its own "
            "such as /data or /workspace/bucket"
        )
    return canonical


def check_env_name(name: str) -> None:
    """ValueError unless `name` has POSIX's shape for an environment variable's name."""
    if not ENV_NAME.fullmatch(name):
        raise ValueError(
            f"variable name {name!r} must be a letter or '_' followed by letters, digits or "
            "'_' (POSIX)"
        )


def check_c_string(value: str, what: str) -> None:
    """ValueError if `value` holds NUL, which no argv, environment or path can carry."""
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL character, which a process cannot be given")


def invalid(field: str, message: str) -> ApiError:
    """INVALID_ARGUMENT naming `field` (its camelCase path) at the start of the message."""
    return ApiError(ErrorCode.INVALID_ARGUMENT, f"field {field!r}: {message}", field=field)


def check_process(spec: ProcessSpec) -> None:
    """Refuse a process no worker could run: the fields a task and a container share."""
    try:
        parse_reference(spec.image)
    except ApiError as exc:
        raise ApiError(exc.code, f"field 'image': {exc.message}", field="image") from None
    try:
        for name, value in spec.env.items():
            check_env_name(name)
            check_c_string(value, f"the value of {name}")
    except ValueError as exc:
        raise invalid("env", str(exc)) from None
    for field, values in (("command", spec.command), ("args", spec.args)):
        for i, value in enumerate(values or ()):
            try:
                check_c_string(value, f"item {i}")
            except ValueError as exc:
                raise invalid(field, str(exc)) from None
    if spec.cards < 0:
        raise invalid("cards", f"is {spec.cards}; give 0 or more cards")
    for port in spec.ports:
        if not 1 <= port <= 65535:
            raise invalid("ports", f"port {port} is outside 1..65535")
    if len(set(spec.ports)) != len(spec.ports):
        raise invalid("ports", "lists a port more than once; give each port once")
    if spec.snapshot is not None:
        try:
            parse_digest(spec.snapshot, field="snapshot")
        except ApiError:
            raise invalid(
                "snapshot",
                f"{spec.snapshot!r} is not a digest (sha256:<64 hex>); use the one a snapshot "
                "printed (`levers9 task snapshot`)",
            ) from None


def check_resources(
    *,
    cpu_millis: int | None,
    memory_bytes: int | None,
    pids: int | None = None,
    prefix: str = "",
) -> None:
    """Refuse a limit below what a container can start with; None leaves it unlimited.
    `prefix` is what the caller's shape puts before the field (`resources.`)."""
    for name, value, minimum, unit in (
        ("memoryBytes", memory_bytes, MIN_MEMORY_BYTES, " bytes (8 MiB)"),
        ("cpuMillis", cpu_millis, MIN_CPU_MILLIS, " millicores (a hundredth of a core)"),
        ("pids", pids, MIN_PIDS, ""),
    ):
        if value is not None and value < minimum:
            raise invalid(
                prefix + name, f"is {value}; give at least {minimum}{unit}, or leave it out"
            )


def check_mount_paths(paths: Sequence[str]) -> None:
    """Refuse a volume's mount path that may not be a bucket's target, or that another
    volume's takes in any spelling (compared canonically), naming `volumes[i].mountPath`."""
    seen: set[str] = set()
    for i, path in enumerate(paths):
        field = f"volumes[{i}].mountPath"
        try:
            canonical = canonical_mount_path(path)
        except ValueError as exc:
            raise invalid(field, str(exc)) from None
        if canonical in seen:
            raise invalid(field, f"{path!r} is used by another volume; give each its own path")
        seen.add(canonical)


def check_container_spec(spec: ContainerSpec) -> None:
    """Refuse a container spec no worker could run, naming the field. What only a node can
    judge (its memory, its cards, its image policy) is the worker's own check after this."""
    check_process(spec)
    if spec.id is not None and not CONTAINER_ID.fullmatch(spec.id):
        raise invalid(
            "id",
            f"{spec.id!r} is not a container id; give 1-63 lowercase letters, digits or '-', "
            "starting with a letter or digit",
        )
    if spec.pull_policy not in PULL_POLICIES:
        raise invalid(
            "pullPolicy", f"is {spec.pull_policy!r}; give one of {', '.join(PULL_POLICIES)}"
        )
    res = spec.resources
    check_resources(
        cpu_millis=res.cpu_millis,
        memory_bytes=res.memory_bytes,
        pids=res.pids,
        prefix="resources.",
    )
    if spec.workdir is not None:
        if not spec.workdir.startswith("/"):
            raise invalid("workdir", f"is {spec.workdir!r}; give an absolute path")
        try:
            check_c_string(spec.workdir, "workdir")
        except ValueError as exc:
            raise invalid("workdir", str(exc)) from None
    check_mount_paths([volume.mount_path for volume in spec.volumes])
    if not spec.stop_grace_s >= 0:
        raise invalid("stopGraceS", f"is {spec.stop_grace_s}; give 0 or more seconds")


__all__ = [
    "CONTAINER_ID",
    "ENV_NAME",
    "MAX_PATH_BYTES",
    "MIN_CPU_MILLIS",
    "MIN_MEMORY_BYTES",
    "MIN_PIDS",
    "SYSTEM_DIRECTORIES",
    "SYSTEM_TREES",
    "canonical_mount_path",
    "check_c_string",
    "check_container_spec",
    "check_env_name",
    "check_mount_paths",
    "check_process",
    "check_resources",
    "invalid",
]
