"""Checks on the free-text fields of a container spec that both programs apply: where a bucket
may be mounted, what an environment variable may be called, what argv may hold.

Pure functions, one place, because the same rule is enforced twice: by the controlplane at its
edge (a workspace token holder's request, refused naming `volumes[i].mountPath`) and again by
the worker (whatever reached it). Each raises ValueError with a message that says what to give;
the caller names the field.

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


__all__ = [
    "ENV_NAME",
    "MAX_PATH_BYTES",
    "SYSTEM_DIRECTORIES",
    "SYSTEM_TREES",
    "canonical_mount_path",
    "check_c_string",
    "check_env_name",
]
