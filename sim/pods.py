"""Runs a pod's container from its image with runc, as a node's container runtime would.

The simulated kubelet can run a worker Job as a local process (quick, for most tests) or, with
`runtime="image"`, from the image the Job names: the image is pulled from its registry with
skopeo, unpacked with umoci and run with runc under an OCI config shaped like the one containerd
writes for the pod: privileged (every capability, every device, no seccomp, /sys read-write),
in the node's network namespace when the pod asks hostNetwork, the Job's hostPath volumes bound
where it mounts them, and the environment the kubelet resolved. That is the only way to learn
that a binary, a path or a library is missing from the image before a customer's node does.

Design: `pod_config` is a pure function from what the kubelet decided to the runtime config;
the rest are thin wrappers over skopeo, umoci and runc, which never leak their exit statuses
further than a `PodRuntimeError` naming the command and what it said.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

ALL_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
)
"""Every capability Linux 6.x defines, in bit order: what a privileged container gets."""


def privileged_capabilities(bounding_mask: int) -> list[str]:
    """A privileged container's capabilities on a node whose runtime may only hand out
    `bounding_mask` (its own bounding set: all of them on a real node, fewer when the node is
    itself a container)."""
    return [name for bit, name in enumerate(ALL_CAPABILITIES) if bounding_mask >> bit & 1]


def node_bounding_mask(status: Path = Path("/proc/self/status")) -> int:
    """This process's bounding set (`CapBnd`), which a container it starts cannot exceed."""
    for line in status.read_text().splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    return (1 << len(ALL_CAPABILITIES)) - 1


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The devices every container's /dev has (the node's /dev, bound over it, has them too).
BASIC_DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
    "fuse": (10, 229),
}


class PodRuntimeError(Exception):
    """Pulling, unpacking or starting a pod's container failed; the message says which."""


@attrs.frozen
class ImageConfig:
    """What the pod's container takes from its image's config."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: tuple[str, ...]
    working_dir: str

    @classmethod
    def from_oci(cls, config: Mapping[str, Any]) -> ImageConfig:
        inner = config.get("config") or {}
        return cls(
            entrypoint=tuple(inner.get("Entrypoint") or ()),
            cmd=tuple(inner.get("Cmd") or ()),
            env=tuple(inner.get("Env") or ()),
            working_dir=str(inner.get("WorkingDir") or "/"),
        )


@attrs.frozen
class Mount:
    """A hostPath volume (or a file the kubelet provides) bound at `destination`."""

    source: Path
    destination: str
    read_only: bool = False


def container_argv(image: ImageConfig, command: Sequence[str], args: Sequence[str]) -> list[str]:
    """Kubernetes' rule: `command` replaces ENTRYPOINT, `args` replaces CMD; without a
    `command`, the image's CMD stays only when there are no `args`."""
    if command:
        return [*command, *args]
    return [*image.entrypoint, *(args or image.cmd)]


def container_env(image: ImageConfig, env: Mapping[str, str]) -> list[str]:
    """The image's environment with the pod's over it, as the runtime merges them."""
    merged: dict[str, str] = {}
    for entry in image.env:
        name, _, value = entry.partition("=")
        merged[name] = value
    merged.setdefault("PATH", DEFAULT_PATH)
    merged.update(env)
    return [f"{name}={value}" for name, value in merged.items()]


def pod_config(
    image: ImageConfig,
    *,
    argv: Sequence[str],
    env: Sequence[str],
    mounts: Sequence[Mount],
    host_network: bool,
    hostname: str,
    cgroups_path: str,
    capabilities: Sequence[str] = ALL_CAPABILITIES,
    user: tuple[int, int] = (0, 0),
    read_only_root: bool = False,
) -> dict[str, Any]:
    """The OCI runtime config of a pod's one container: privileged by default (see the module
    docstring); `capabilities=()` with a `user` (uid, gid) and `read_only_root` is a
    restricted one (securityContext drop ALL, runAsUser, readOnlyRootFilesystem).

    The node's /sys is bound (read-write when privileged: its cgroup file systems with it, so
    the agent's own runc can make its containers' cgroups); /run and /tmp are fresh, and /dev
    too unless a volume is mounted there. A pod with hostNetwork shares the node's network and
    UTS namespaces, as Kubernetes does."""
    privileged = bool(capabilities)
    namespaces = [{"type": kind} for kind in ("pid", "ipc", "mount")]
    if not host_network:
        namespaces += [{"type": "network"}, {"type": "uts"}]
    base_mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/sys",
            "type": "bind",
            "source": "/sys",
            "options": ["rbind", "rw" if privileged else "ro", "nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/run",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=755"],
        },
        {
            "destination": "/tmp",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777"],
        },
    ]
    if not any(mount.destination == "/dev" for mount in mounts):
        # runc makes the default devices (null, zero, urandom, ...) in a fresh /dev.
        base_mounts.insert(
            1,
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
        )
    volume_mounts: list[dict[str, Any]] = []
    for mount in mounts:
        options = ["rbind", "ro" if mount.read_only else "rw"]
        volume_mounts.append(
            {
                "destination": mount.destination,
                "type": "bind",
                "source": str(mount.source),
                "options": options,
            }
        )
    # /dev's own file systems go over the bound node /dev, as containerd orders them.
    dev_mounts: list[dict[str, Any]] = [
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
    ]
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": user[0], "gid": user[1]},
            "args": list(argv),
            "env": list(env),
            "cwd": image.working_dir or "/",
            "capabilities": {
                kind: list(capabilities) for kind in ("bounding", "effective", "permitted")
            },
            "noNewPrivileges": not privileged,
        },
        "root": {"path": "rootfs", "readonly": read_only_root},
        "mounts": base_mounts + volume_mounts + dev_mounts,
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": {"devices": [{"allow": True, "access": "rwm"}]},
            "maskedPaths": [],
            "readonlyPaths": [],
        },
    }
    if not host_network:
        config["hostname"] = hostname
    return config


def runc_id(pod_uid: str, pod_name: str) -> str:
    """A runc container id for a pod: its name and a hash of its uid (ids must be unique on the
    node, and a Job's next pod has the same name prefix)."""
    return f"{pod_name}-{hashlib.sha256(pod_uid.encode()).hexdigest()[:8]}"


def _run(argv: Sequence[str], what: str) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PodRuntimeError(
            f"{what} failed ({' '.join(argv[:2])} exited {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-2000:]}"
        )
    return result.stdout


def pull(reference: str, layout: Path, *, tls_verify: bool) -> tuple[str, ImageConfig]:
    """Pulls `reference` into the OCI layout `layout` (skopeo shares blobs between pulls);
    returns the layout's tag for it and the image's config."""
    tag = hashlib.sha256(reference.encode()).hexdigest()[:16]
    layout.mkdir(parents=True, exist_ok=True)
    _run(
        [
            "skopeo",
            "copy",
            "--quiet",
            f"--src-tls-verify={str(tls_verify).lower()}",
            f"docker://{reference}",
            f"oci:{layout}:{tag}",
        ],
        f"pulling image {reference}",
    )
    raw = _run(["skopeo", "inspect", "--config", f"oci:{layout}:{tag}"], "reading its config")
    return tag, ImageConfig.from_oci(json.loads(raw))


def unpack(layout: Path, tag: str, bundle: Path) -> Path:
    """The image's layers unpacked into `bundle`/rootfs (umoci applies whiteouts and owners)."""
    bundle.mkdir(parents=True, exist_ok=True)
    rootfs = bundle / "rootfs"
    _run(
        ["umoci", "raw", "unpack", "--image", f"{layout}:{tag}", str(rootfs)],
        f"unpacking {layout}:{tag}",
    )
    return rootfs


def write_config(bundle: Path, config: Mapping[str, Any]) -> Path:
    path = bundle / "config.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def run_argv(runc_root: Path, bundle: Path, container_id: str) -> list[str]:
    """`runc run` in the foreground: it forwards SIGTERM to the container's PID 1 and exits
    with its status, which is what the kubelet's agent loop expects of a process."""
    return ["runc", "--root", str(runc_root), "run", "--bundle", str(bundle), container_id]


def exec_argv(runc_root: Path, container_id: str, argv: Sequence[str]) -> list[str]:
    return ["runc", "--root", str(runc_root), "exec", container_id, *argv]


def kill(runc_root: Path, container_id: str, signal: str = "KILL") -> None:
    """Signals every process of the container (none running: nothing to do)."""
    subprocess.run(
        ["runc", "--root", str(runc_root), "kill", "--all", container_id, signal],
        capture_output=True,
        check=False,
    )


def delete(runc_root: Path, container_id: str) -> None:
    """Removes the container, killing what is left of it."""
    subprocess.run(
        ["runc", "--root", str(runc_root), "delete", "--force", container_id],
        capture_output=True,
        check=False,
    )


def state_pid(runc_root: Path, container_id: str) -> int | None:
    """The container's PID 1 on the node, or None when it does not run."""
    result = subprocess.run(
        ["runc", "--root", str(runc_root), "state", container_id],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return None
    state = json.loads(result.stdout)
    return int(state["pid"]) if state.get("status") == "running" else None


async def bridge_port(runc_root: Path, container_id: str, host: str, port: int) -> None:
    """Makes this machine's `host`:`port` answer on the same address inside the container's
    own network namespace, as a Service's address answers from a pod network, until cancelled:
    one socat listens in the container's namespace and hands each connection through a unix
    socket to another on the node."""
    pid = None
    while pid is None:
        pid = await trio.to_thread.run_sync(state_pid, runc_root, container_id)
        if pid is None:
            await trio.sleep(0.05)
    # A unix socket's path has at most 107 bytes, fewer than a test's temporary directory may
    # take: the sockets live in a short directory of their own.
    sockets = Path(tempfile.gettempdir()) / "levers9-sim-services"
    sockets.mkdir(mode=0o700, exist_ok=True)
    socket_path = sockets / f"{container_id[-8:]}-{secrets.token_hex(4)}-{port}.sock"
    node_side = ["socat", f"UNIX-LISTEN:{socket_path},fork,unlink-early", f"TCP:{host}:{port}"]
    pod_side = [
        "nsenter",
        f"--net=/proc/{pid}/ns/net",
        "socat",
        f"TCP-LISTEN:{port},bind={host},fork,reuseaddr",
        f"UNIX-CONNECT:{socket_path}",
    ]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.run_process, node_side, check=False))
            nursery.start_soon(partial(trio.run_process, pod_side, check=False))
    finally:
        socket_path.unlink(missing_ok=True)
