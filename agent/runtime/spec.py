"""Pure checks and derivations on a `ContainerSpec`: what only this node can judge, after the
one validation both programs apply (`workerapi.validation.check_container_spec`); the
process's argv and user as the image and the spec combine them (the environment is merged by
`agent.runtime.ocispec.merge_env`, with the rest of the process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from agent.volumes.specs import validate_volume
from wire.errors import ApiError, ErrorCode
from workerapi.models import ContainerSpec
from workerapi.validation import check_container_spec


def validate_spec(spec: ContainerSpec, *, node_memory_bytes: int) -> None:
    """Reject what can never run here, naming the field, before anything is pulled or made:
    what no worker could run (the shared check), then each bucket's URL and credentials, then
    limits beyond what this node has."""
    check_container_spec(spec)
    for i, volume in enumerate(spec.volumes):
        try:
            validate_volume(volume)
        except ApiError as exc:
            raise ApiError(
                exc.code, f"volumes[{i}]: {exc.message}", field=f"volumes[{i}].{exc.field}"
            ) from None
    res = spec.resources
    cpu_millis = (os.cpu_count() or 1) * 1000
    _check_fits("memoryBytes", res.memory_bytes, node_memory_bytes, " bytes")
    _check_fits("cpuMillis", res.cpu_millis, cpu_millis, " millicores")


def _check_fits(name: str, value: int | None, node_has: int, unit: str) -> None:
    """A limit above what the node has is RESOURCE_EXHAUSTED naming the field."""
    field = f"resources.{name}"
    if value is not None and value > node_has:
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
