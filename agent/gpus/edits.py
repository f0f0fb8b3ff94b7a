"""What a container needs to see its cards: device nodes, cgroup rules, driver files and
hooks, from the node's CDI spec where there is one, else discovered; applied to the OCI spec.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from agent.gpus.claim import Card, GpuConfig, GpuSetupError

CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_CDI_KIND = "nvidia.com/gpu"
_RO_BIND = ("rbind", "ro", "nosuid", "nodev")
_DRIVER_BIN_DIRS = ("bin",)
_DRIVER_LIB_DIRS = ("lib64", "lib")


@attrs.frozen
class DeviceNode:
    """A device node the container gets (OCI linux.devices)."""

    path: str
    """In the container."""
    host_path: str
    major: int
    minor: int
    type: str = "c"
    file_mode: int = 0o666
    uid: int = 0
    gid: int = 0


@attrs.frozen
class CgroupRule:
    """A device cgroup rule (OCI linux.resources.devices)."""

    major: int
    minor: int
    type: str = "c"
    access: str = "rwm"
    allow: bool = True


@attrs.frozen
class BindMount:
    source: str
    destination: str
    options: tuple[str, ...] = _RO_BIND
    type: str = "bind"


@attrs.frozen
class Hook:
    """An OCI hook, from a CDI spec."""

    stage: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout_s: int | None = None


@attrs.frozen
class SpecEdits:
    """What a container's OCI spec needs for its cards; the container code applies it."""

    devices: tuple[DeviceNode, ...]
    cgroup_rules: tuple[CgroupRule, ...]
    mounts: tuple[BindMount, ...]
    env: tuple[tuple[str, str], ...]
    """Variables to set, overriding the image's."""
    search_paths: tuple[tuple[str, str], ...] = ()
    """(variable, directory) to put in front of the image's PATH / LD_LIBRARY_PATH."""
    hooks: tuple[Hook, ...] = ()
    source: str = "levers9"
    """"levers9", or the CDI spec file whose edits these are."""

    def process_env(self, image_env: Sequence[str] = ()) -> list[str]:
        """The container's environment: the image's, with ours set and search paths prepended."""
        merged: dict[str, str] = {}
        for entry in image_env:
            key, _, value = entry.partition("=")
            merged[key] = value
        merged.update(self.env)
        for key, directory in reversed(self.search_paths):
            current = merged.get(key) or (
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                if key == "PATH"
                else ""
            )
            merged[key] = f"{directory}:{current}" if current else directory
        return [f"{key}={value}" for key, value in merged.items()]

    def oci_fragment(self, image_env: Sequence[str] = ()) -> dict[str, Any]:
        """These edits in the OCI runtime spec's own field names, to merge into config.json."""
        hooks: dict[str, list[dict[str, Any]]] = {}
        for hook in self.hooks:
            entry: dict[str, Any] = {"path": hook.path}
            if hook.args:
                entry["args"] = list(hook.args)
            if hook.env:
                entry["env"] = list(hook.env)
            if hook.timeout_s is not None:
                entry["timeout"] = hook.timeout_s
            hooks.setdefault(hook.stage, []).append(entry)
        fragment: dict[str, Any] = {
            "process": {"env": self.process_env(image_env)},
            "mounts": [
                {
                    "destination": m.destination,
                    "type": m.type,
                    "source": m.source,
                    "options": list(m.options),
                }
                for m in self.mounts
            ],
            "linux": {
                "devices": [
                    {
                        "path": d.path,
                        "type": d.type,
                        "major": d.major,
                        "minor": d.minor,
                        "fileMode": d.file_mode,
                        "uid": d.uid,
                        "gid": d.gid,
                    }
                    for d in self.devices
                ],
                "resources": {
                    "devices": [
                        {
                            "allow": r.allow,
                            "type": r.type,
                            "major": r.major,
                            "minor": r.minor,
                            "access": r.access,
                        }
                        for r in self.cgroup_rules
                    ]
                },
            },
        }
        if hooks:
            fragment["hooks"] = hooks
        return fragment


@attrs.frozen
class DeviceFile:
    """A character device found under the device directory."""

    path: Path
    major: int
    minor: int
    mode: int
    uid: int
    gid: int


@attrs.frozen
class CdiDeviceNode:
    path: str
    host_path: str
    type: str
    major: int | None
    minor: int | None
    """None when the spec gave none and the node could not be found to read them from."""
    file_mode: int | None = None
    permissions: str = "rwm"
    uid: int | None = None
    gid: int | None = None


@attrs.frozen
class CdiEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[CdiDeviceNode, ...] = ()
    mounts: tuple[BindMount, ...] = ()
    hooks: tuple[Hook, ...] = ()


@attrs.frozen
class CdiSpec:
    path: Path
    kind: str
    edits: CdiEdits
    devices: Mapping[str, CdiEdits] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class NodeFiles:
    """What the node offers for GPUs on disk, as `discover_node_files` found it."""

    dev_dir: Path
    device_files: Mapping[str, DeviceFile] = attrs.field(factory=dict, hash=False)
    """By name under the device directory: nvidia0, nvidiactl, nvidia-uvm, ..."""
    driver_dir_present: bool = False
    driver_subdirs: tuple[str, ...] = ()
    cdi_specs: tuple[CdiSpec, ...] = ()
    """NVIDIA CDI specs, highest priority first."""
    problems: tuple[str, ...] = ()


def _device_file(path: Path) -> DeviceFile | None:
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return DeviceFile(
        path=path,
        major=os.major(st.st_rdev),
        minor=os.minor(st.st_rdev),
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
    )


def _cdi_edits(raw: Any, where: str, resolve: bool) -> CdiEdits:
    if raw is None:
        return CdiEdits()
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} is not a mapping")
    nodes = []
    for i, node in enumerate(raw.get("deviceNodes") or ()):
        if not isinstance(node, Mapping) or not isinstance(node.get("path"), str):
            raise ValueError(f"{where}.deviceNodes[{i}] has no path")
        host_path = str(node.get("hostPath") or node["path"])
        major, minor = node.get("major"), node.get("minor")
        if resolve and (major is None or minor is None):
            found = _device_file(Path(host_path))
            if found is not None:
                major, minor = found.major, found.minor
        nodes.append(
            CdiDeviceNode(
                path=node["path"],
                host_path=host_path,
                type=str(node.get("type") or "c"),
                major=None if major is None else int(major),
                minor=None if minor is None else int(minor),
                file_mode=node.get("fileMode"),
                permissions=str(node.get("permissions") or "rwm"),
                uid=node.get("uid"),
                gid=node.get("gid"),
            )
        )
    mounts = []
    for i, mount in enumerate(raw.get("mounts") or ()):
        if not isinstance(mount, Mapping) or not mount.get("hostPath"):
            raise ValueError(f"{where}.mounts[{i}] has no hostPath")
        mounts.append(
            BindMount(
                source=str(mount["hostPath"]),
                destination=str(mount.get("containerPath") or mount["hostPath"]),
                options=tuple(mount.get("options") or ("bind",)),
                type=str(mount.get("type") or "bind"),
            )
        )
    hooks = []
    for i, hook in enumerate(raw.get("hooks") or ()):
        if not isinstance(hook, Mapping) or not hook.get("path") or not hook.get("hookName"):
            raise ValueError(f"{where}.hooks[{i}] needs hookName and path")
        hooks.append(
            Hook(
                stage=str(hook["hookName"]),
                path=str(hook["path"]),
                args=tuple(hook.get("args") or ()),
                env=tuple(hook.get("env") or ()),
                timeout_s=hook.get("timeout"),
            )
        )
    return CdiEdits(
        env=tuple(str(e) for e in raw.get("env") or ()),
        device_nodes=tuple(nodes),
        mounts=tuple(mounts),
        hooks=tuple(hooks),
    )


def parse_cdi_spec(path: Path, data: Any, *, resolve_nodes: bool = True) -> CdiSpec:
    """A CDI spec file's content (already parsed from JSON or YAML). Raises ValueError naming the
    field that is wrong. With `resolve_nodes`, device numbers the spec leaves out are read from
    the device nodes themselves, as a CDI runtime does."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path} is not a CDI spec (not a mapping)")
    kind = data.get("kind")
    if not isinstance(kind, str):
        raise ValueError(f"{path}: kind is missing")
    devices: dict[str, CdiEdits] = {}
    for i, device in enumerate(data.get("devices") or ()):
        if not isinstance(device, Mapping) or not isinstance(device.get("name"), str):
            raise ValueError(f"{path}: devices[{i}] has no name")
        devices[device["name"]] = _cdi_edits(
            device.get("containerEdits"), f"{path}: devices[{i}].containerEdits", resolve_nodes
        )
    return CdiSpec(
        path=path,
        kind=kind,
        edits=_cdi_edits(data.get("containerEdits"), f"{path}: containerEdits", resolve_nodes),
        devices=devices,
    )


def discover_node_files(config: GpuConfig) -> NodeFiles:
    """Looks at the device directory, the driver directory and the CDI directories. Blocks."""
    found: dict[str, DeviceFile] = {}
    try:
        names = sorted(p.name for p in config.dev_dir.iterdir())
    except OSError:
        names = []
    for name in names:
        if re.fullmatch(r"nvidia\d+", name) or name in CONTROL_DEVICES:
            device = _device_file(config.dev_dir / name)
            if device is not None:
                found[name] = device
    subdirs = tuple(
        d for d in (*_DRIVER_BIN_DIRS, *_DRIVER_LIB_DIRS) if (config.driver_dir / d).is_dir()
    )
    specs: list[CdiSpec] = []
    problems: list[str] = []
    for directory in reversed(config.cdi_dirs):
        try:
            files = sorted(p for p in directory.iterdir() if p.suffix in (".json", ".yaml", ".yml"))
        except OSError:
            continue
        for file in files:
            try:
                text = file.read_text()
                data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
                spec = parse_cdi_spec(file, data)
            except (OSError, ValueError, yaml.YAMLError) as exc:
                problems.append(f"CDI spec {file} could not be read ({exc}); it is ignored")
                continue
            if spec.kind == _CDI_KIND:
                specs.append(spec)
    return NodeFiles(
        dev_dir=config.dev_dir,
        device_files=found,
        driver_dir_present=config.driver_dir.is_dir(),
        driver_subdirs=subdirs,
        cdi_specs=tuple(specs),
        problems=tuple(problems),
    )


def _visible_env(cards: Sequence[Card]) -> tuple[tuple[str, str], ...]:
    """What the container sees: its cards, numbered from 0 in PCI order as CUDA numbers them."""
    return (
        ("NVIDIA_VISIBLE_DEVICES", ",".join(c.uuid for c in cards)),
        ("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(len(cards)))),
    )


def _edits_from_cdi(spec: CdiSpec, cards: Sequence[Card]) -> SpecEdits | None:
    per_card = []
    for card in cards:
        edits = spec.devices.get(card.uuid) or spec.devices.get(str(card.index))
        if edits is None:
            return None
        per_card.append(edits)
    devices: dict[str, DeviceNode] = {}
    rules: list[CgroupRule] = []
    mounts: dict[str, BindMount] = {}
    env: dict[str, str] = {}
    hooks: list[Hook] = []
    for edits in (spec.edits, *per_card):
        for node in edits.device_nodes:
            if node.major is None or node.minor is None:
                raise GpuSetupError(
                    f"CDI spec {spec.path} names device node {node.host_path}, which does not "
                    "exist here; regenerate the spec (nvidia-ctk cdi generate) or remove it"
                )
            if node.path in devices:
                continue
            devices[node.path] = DeviceNode(
                path=node.path,
                host_path=node.host_path,
                major=node.major,
                minor=node.minor,
                type=node.type,
                file_mode=0o666 if node.file_mode is None else node.file_mode,
                uid=node.uid or 0,
                gid=node.gid or 0,
            )
            rules.append(
                CgroupRule(
                    major=node.major, minor=node.minor, type=node.type, access=node.permissions
                )
            )
        for mount in edits.mounts:
            mounts.setdefault(mount.destination, mount)
        for entry in edits.env:
            key, _, value = entry.partition("=")
            env[key] = value
        hooks += [h for h in edits.hooks if h not in hooks]
    for key, value in _visible_env(cards):
        env.setdefault(key, value)
    return SpecEdits(
        devices=tuple(devices.values()),
        cgroup_rules=tuple(rules),
        mounts=tuple(mounts.values()),
        env=tuple(env.items()),
        hooks=tuple(hooks),
        source=f"CDI spec {spec.path}",
    )


def spec_edits(cards: Sequence[Card], files: NodeFiles, config: GpuConfig) -> SpecEdits:
    """The OCI spec edits for a container given `cards`. Pure.

    Uses the first NVIDIA CDI spec that names every card; otherwise our own: the cards' device
    nodes and the driver's control nodes, cgroup rules for exactly those, the driver directory
    mounted read-only, and NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES. Raises GpuSetupError
    when something the container needs is missing.
    """
    ordered = sorted(cards, key=lambda c: (c.pci_bus_id, c.index))
    for spec in files.cdi_specs:
        edits = _edits_from_cdi(spec, ordered)
        if edits is not None:
            return edits
    names = [c.device_name for c in ordered]
    missing = [c for c in ordered if c.device_name not in files.device_files]
    if missing:
        card = missing[0]
        raise GpuSetupError(
            f"device node {files.dev_dir / card.device_name} for {card.describe()} is missing; "
            "run the worker privileged with the node's /dev, and check the driver on the node"
        )
    if "nvidiactl" not in files.device_files:
        raise GpuSetupError(
            f"device node {files.dev_dir / 'nvidiactl'} is missing, and no CUDA program runs "
            "without it; run the worker privileged with the node's /dev"
        )
    names += [n for n in CONTROL_DEVICES if n in files.device_files]
    devices = tuple(
        DeviceNode(
            path=f"/dev/{name}",
            host_path=str(files.device_files[name].path),
            major=files.device_files[name].major,
            minor=files.device_files[name].minor,
            file_mode=files.device_files[name].mode or 0o666,
            uid=files.device_files[name].uid,
            gid=files.device_files[name].gid,
        )
        for name in names
    )
    if not files.driver_dir_present:
        raise GpuSetupError(
            f"the driver directory {config.driver_dir} is missing; mount the node's driver "
            "files there (GKE: hostPath /home/kubernetes/bin/nvidia) or set "
            "LEVERS9_GPU_DRIVER_DIR"
        )
    target = config.driver_container_dir.rstrip("/")
    search = [("PATH", f"{target}/{d}") for d in _DRIVER_BIN_DIRS if d in files.driver_subdirs]
    search += [
        ("LD_LIBRARY_PATH", f"{target}/{d}") for d in _DRIVER_LIB_DIRS if d in files.driver_subdirs
    ]
    return SpecEdits(
        devices=devices,
        cgroup_rules=tuple(CgroupRule(major=d.major, minor=d.minor) for d in devices),
        mounts=(BindMount(source=str(config.driver_dir), destination=target),),
        env=_visible_env(ordered),
        search_paths=tuple(search),
    )
