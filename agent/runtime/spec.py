"""Pure checks and derivations on a `ContainerSpec`: refused at the edge naming the field;
the process's argv and user as the image and the spec combine them (the environment is merged
by `agent.runtime.ocispec.merge_env`, with the rest of the process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from agent.runtime.records import CONTAINER_ID
from agent.volumes.specs import validate_volume
from wire.errors import ApiError, ErrorCode
from workerapi.digests import parse_digest
from workerapi.models import (
    ContainerSpec,
)
from workerapi.validation import canonical_mount_path, check_c_string, check_env_name

PULL_POLICIES = ("if-not-present", "always")
# Below this runc cannot even start a container's init.
MIN_MEMORY_BYTES = 8 << 20


def validate_spec(spec: ContainerSpec, *, node_memory_bytes: int) -> None:
    """Reject what can never run here, naming the field, before anything is pulled or made."""
    if not spec.image.strip():
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "image must not be empty", field="image")
    if spec.id is not None and not CONTAINER_ID.match(spec.id):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"container id {spec.id!r} must be 1-63 lowercase letters, digits or '-', "
            "starting with a letter or digit",
            field="id",
        )
    if spec.pull_policy not in PULL_POLICIES:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"pullPolicy must be one of {', '.join(PULL_POLICIES)}, not {spec.pull_policy!r}",
            field="pullPolicy",
        )
    if spec.cards < 0:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, "cards must be 0 or more", field="cards")
    res = spec.resources
    cpu_millis = (os.cpu_count() or 1) * 1000
    _check_resource("memoryBytes", res.memory_bytes, MIN_MEMORY_BYTES, node_memory_bytes, " bytes")
    _check_resource("cpuMillis", res.cpu_millis, 10, cpu_millis, " millicores")
    _check_resource("pids", res.pids, 1, None, "")
    for port in spec.ports:
        if not 0 < port < 65536:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT, f"port {port} is not a TCP port", field="ports"
            )
    _check_process_text(spec)
    if spec.workdir is not None and not spec.workdir.startswith("/"):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"workdir must be an absolute path, not {spec.workdir!r}",
            field="workdir",
        )
    if spec.snapshot is not None:
        parse_digest(spec.snapshot, field="snapshot")
    seen: set[str] = set()
    for i, volume in enumerate(spec.volumes):
        try:
            validate_volume(volume)
        except ApiError as exc:
            raise ApiError(
                exc.code, f"volumes[{i}]: {exc.message}", field=f"volumes[{i}].{exc.field}"
            ) from None
        path = canonical_mount_path(volume.mount_path)  # checked by validate_volume
        if path in seen:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"volumes[{i}].mountPath {volume.mount_path} is used by another volume",
                field=f"volumes[{i}].mountPath",
            )
        seen.add(path)
    if spec.stop_grace_s < 0:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, "stopGraceS must be 0 or more", field="stopGraceS"
        )


def _check_process_text(spec: ContainerSpec) -> None:
    """Environment names of POSIX's shape; no NUL where the kernel takes C strings."""
    try:
        for key, value in spec.env.items():
            check_env_name(key)
            check_c_string(value, f"the value of {key}")
    except ValueError as exc:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"env: {exc}", field="env") from None
    for field, values in (("command", spec.command), ("args", spec.args)):
        for i, value in enumerate(values or ()):
            try:
                check_c_string(value, f"{field}[{i}]")
            except ValueError as exc:
                raise ApiError(ErrorCode.INVALID_ARGUMENT, str(exc), field=field) from None
    if spec.workdir is not None:
        try:
            check_c_string(spec.workdir, "workdir")
        except ValueError as exc:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, str(exc), field="workdir") from None


def _check_resource(
    name: str, value: int | None, minimum: int, node_has: int | None, unit: str
) -> None:
    """A limit below what can run is INVALID_ARGUMENT; above what the node has,
    RESOURCE_EXHAUSTED. Both name the field."""
    field = f"resources.{name}"
    if value is None:
        return
    if value < minimum:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"{field} must be at least {minimum}{unit}, not {value}",
            field=field,
        )
    if node_has is not None and value > node_has:
        raise ApiError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"{field} asks for {value}{unit} but this node has {node_has}{unit}; ask for less "
            "or use a bigger machine",
            field=field,
        )


def process_args(spec: ContainerSpec, entrypoint: Sequence[str], cmd: Sequence[str]) -> list[str]:
    """The argv: `command` replaces the entrypoint (and drops the image's cmd), `args` the cmd."""
    if spec.command is not None:
        argv = [*spec.command, *(spec.args or ())]
    else:
        argv = [*entrypoint, *(spec.args if spec.args is not None else cmd)]
    if not argv:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"image {spec.image} has no entrypoint or cmd; give a command",
            field="command",
        )
    return argv


def _table(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def resolve_user(user: str, passwd: str, group: str) -> tuple[int, int, tuple[int, ...]]:
    """`uid`, `uid:gid`, `name` or `name:group` → (uid, gid, supplementary gids), from the
    image's own /etc/passwd and /etc/group texts."""
    if not user:
        return 0, 0, ()
    name, _, group_name = user.partition(":")
    users = {row[0]: row for row in _table(passwd) if len(row) >= 4}
    if name.isdigit():
        uid = int(name)
        row = next((r for r in users.values() if r[2] == name), None)
        gid = int(row[3]) if row and row[3].isdigit() else uid if not group_name else 0
        login = row[0] if row else None
    elif name in users and users[name][2].isdigit() and users[name][3].isdigit():
        uid, gid, login = int(users[name][2]), int(users[name][3]), name
    else:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"user {name!r} is not in the image's /etc/passwd; give a uid or a user it has",
            field="user",
        )
    groups = [row for row in _table(group) if len(row) >= 3]
    if group_name:
        if group_name.isdigit():
            gid = int(group_name)
        else:
            found = next((r for r in groups if r[0] == group_name and r[2].isdigit()), None)
            if found is None:
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"group {group_name!r} is not in the image's /etc/group",
                    field="user",
                )
            gid = int(found[2])
    extra = tuple(
        sorted(
            {
                int(r[2])
                for r in groups
                if login and len(r) >= 4 and login in r[3].split(",") and r[2].isdigit()
            }
            - {gid}
        )
    )
    return uid, gid, extra
