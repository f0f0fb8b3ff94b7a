"""A stand-in libnvidia-ml.so.1 for machines without a GPU, and node descriptions for it.

Why: the agent's GPU code should run in tests exactly as it runs on a GPU node, pynvml included.
So instead of replacing the facade with a fake, tests replace the driver's library: the C file
beside this module is compiled with gcc against NVIDIA's own `nvml.h` (from the PyPI package
`nvidia-nvml-dev`) into a library with the real soname and ABI, and pynvml loads it through its
normal `CDLL("libnvidia-ml.so.1")`. What the library reports (cards, processes, health,
readings such as utilisation, temperature and power, topology) comes from a JSON description
named by the environment variable `LEVERS9_NVML_STANDIN`, which the library reads at each first
`nvmlInit`, and again whenever the file changes while a session is open: that is how a test makes
a card go bad under a running agent (`write_description` a changed node: new `xid_events`, a card
made lost with `errors={"*": "GPU_IS_LOST"}`, more uncorrected ECC errors, a process that appeared).

Two ways to put it under pynvml:
- a new process with `LD_LIBRARY_PATH` naming the library's directory (`standin_environ`), the
  same lookup as on a node;
- this process, by loading the library by path first (`load_in_process`): the dynamic loader then
  answers pynvml's later load by soname with it. The description can change between NVML sessions
  but the library cannot be swapped for another one afterwards.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

ENV_VAR = "LEVERS9_NVML_STANDIN"
LIBRARY_NAME = "libnvidia-ml.so.1"
SOURCE = Path(__file__).with_name("libnvidia-ml.c")

_CFLAGS = ("-O2", "-Wall", "-shared", "-fPIC", "-fvisibility=hidden")


class StandinError(Exception):
    """The stand-in library could not be built or loaded; the message says what to install."""


def nvml_include_dir() -> Path:
    """The directory holding NVIDIA's nvml.h, inside the installed `nvidia-nvml-dev` package."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or ()) if spec else []
    for root in roots:
        for header in sorted(Path(root).glob("*/include/nvml.h")):
            return header.parent
    raise StandinError(
        "NVIDIA's nvml.h was not found: install the PyPI package nvidia-nvml-dev (it is in "
        "levers9's sim and test dependencies: pip install 'levers9[sim]')"
    )


def build_standin(out_dir: Path) -> Path:
    """Compiles the stand-in into `out_dir` (once per source, header and flags) and returns it.

    The library lands in a directory of its own, named by the hash of what it was built from,
    so that directory can go on `LD_LIBRARY_PATH` without bringing anything else along.
    """
    include = nvml_include_dir()
    compiler = os.environ.get("CC") or shutil.which("gcc")
    if not compiler:
        raise StandinError("gcc was not found: install it (make deps does, on Debian)")
    flags = (*_CFLAGS, f"-Wl,-soname,{LIBRARY_NAME}", f"-I{include}")
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update((include / "nvml.h").read_bytes())
    digest.update("\0".join(flags).encode())
    target_dir = out_dir / f"nvml-standin-{digest.hexdigest()[:16]}"
    target = target_dir / LIBRARY_NAME
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    partial = target_dir / f".{LIBRARY_NAME}.{os.getpid()}"
    result = subprocess.run(
        [compiler, *flags, "-o", str(partial), str(SOURCE), "-lpthread"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise StandinError(f"gcc could not build the NVML stand-in:\n{result.stderr}")
    os.replace(partial, target)  # atomic, so a concurrent build never sees half a library
    return target


def standin_environ(library: Path, description: Path) -> dict[str, str]:
    """Environment entries that make a new process's pynvml load `library` and describe a node."""
    search = [str(library.parent)]
    if os.environ.get("LD_LIBRARY_PATH"):
        search.append(os.environ["LD_LIBRARY_PATH"])
    return {"LD_LIBRARY_PATH": os.pathsep.join(search), ENV_VAR: str(description)}


def load_in_process(library: Path) -> None:
    """Makes pynvml in this process use `library` (see the module docstring for the limits)."""
    pynvml = sys.modules.get("pynvml")
    loaded = getattr(pynvml, "nvmlLib", None) if pynvml else None
    if loaded is not None and Path(str(loaded._name)).resolve() != library.resolve():
        raise StandinError(
            f"pynvml already loaded {loaded._name} in this process; load the stand-in before "
            "the first nvmlInit, or run the code in a new process (standin_environ)"
        )
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


# -- node descriptions ---------------------------------------------------------------------------


@attrs.frozen
class StandinProcess:
    pid: int
    used_memory_bytes: int = 1 << 30


@attrs.frozen
class StandinDevice:
    """One card of a described node; defaults are a healthy A100 80GB with nothing running."""

    uuid: str
    minor: int
    pci_bus_id: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_total_bytes: int = 80 << 30
    memory_used_bytes: int = 0
    mig_enabled: bool | None = False
    """None: the card has no MIG mode (NVML answers "not supported")."""
    mig_devices: tuple[str, ...] = ()
    processes: tuple[StandinProcess, ...] = ()
    retired_pages_pending: bool | None = None
    """None: not supported, as on Ampere and later (they remap rows instead)."""
    remapped_rows_supported: bool = True
    remapped_rows_pending: bool = False
    remapped_rows_failed: bool = False
    ecc_uncorrected_volatile: int | None = 0
    """None: the card has no ECC counters (NVML answers "not supported" for both kinds)."""
    ecc_corrected_volatile: int = 0
    utilization_supported: bool = True
    utilization_gpu_percent: int = 0
    utilization_memory_percent: int = 0
    temperature_celsius: int | None = 33
    """None: the card has no die sensor NVML can read."""
    power_usage_mw: int | None = 61000
    """Milliwatts, as NVML reports them; None: the card cannot measure its power."""
    xids: tuple[int, ...] = ()
    """Critical XIDs delivered to whoever registers for them, at each registration."""
    xid_events: tuple[tuple[int, int], ...] = ()
    """(event id, XID) pairs, ids ascending from 1: critical XIDs that happen while a session is
    open. Each id is delivered once to every event set registered on the card when the
    description listing it is written (not to sets registered after); see `with_xid`."""
    xid_events_supported: bool = True
    errors: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    """NVML function name (or "*" for all) -> NVML_ERROR_* name it fails with on this card."""

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "name": self.name,
            "minor": self.minor,
            "pci_bus_id": self.pci_bus_id,
            "memory_total": self.memory_total_bytes,
            "memory_used": self.memory_used_bytes,
            "mig_mode": None if self.mig_enabled is None else int(self.mig_enabled),
            "mig_devices": list(self.mig_devices),
            "processes": [
                {"pid": p.pid, "used_memory": p.used_memory_bytes} for p in self.processes
            ],
            "retired_pages_pending": self.retired_pages_pending,
            "remapped_rows": {
                "pending": self.remapped_rows_pending,
                "failure": self.remapped_rows_failed,
            }
            if self.remapped_rows_supported
            else None,
            "ecc": None
            if self.ecc_uncorrected_volatile is None
            else {
                "uncorrected_volatile": self.ecc_uncorrected_volatile,
                "corrected_volatile": self.ecc_corrected_volatile,
            },
            "utilization": {
                "gpu": self.utilization_gpu_percent,
                "memory": self.utilization_memory_percent,
            }
            if self.utilization_supported
            else None,
            "temperature": self.temperature_celsius,
            "power_usage": self.power_usage_mw,
            "xids": list(self.xids),
            "xid_events": [{"id": event_id, "xid": xid} for event_id, xid in self.xid_events],
            "xid_events_supported": self.xid_events_supported,
            "errors": dict(self.errors),
        }


def with_xid(device: StandinDevice, xid: int) -> StandinDevice:
    """`device` with one more critical XID happening: an `xid_events` entry with the next id."""
    next_id = max((event_id for event_id, _ in device.xid_events), default=0) + 1
    return attrs.evolve(device, xid_events=(*device.xid_events, (next_id, xid)))


def standin_device(index: int, **changes: Any) -> StandinDevice:
    """Card number `index` of a typical node (UUID, minor and PCI bus id follow from it)."""
    fields: dict[str, Any] = {
        "uuid": f"GPU-{index:08x}-7e57-4a11-8c0d-{index:012x}",
        "minor": index,
        "pci_bus_id": f"{index // 15:08X}:{0x10 + 0x10 * (index % 15):02X}:00.0",
    }
    fields.update(changes)
    return StandinDevice(**fields)


@attrs.frozen
class StandinNode:
    """A described node. Topology groups list card indices; a pair in no common group is
    across CPU sockets."""

    devices: tuple[StandinDevice, ...]
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    pcie_switches: tuple[tuple[int, ...], ...] = ()
    host_bridges: tuple[tuple[int, ...], ...] = ()
    numa_nodes: tuple[tuple[int, ...], ...] = ()
    init_error: str | None = None
    """An NVML_ERROR_* name that nvmlInit fails with, e.g. "DRIVER_NOT_LOADED"."""

    def to_json(self) -> dict[str, Any]:
        description: dict[str, Any] = {
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "devices": [device.to_json() for device in self.devices],
            "topology": {
                "nvlink_groups": [list(g) for g in self.nvlink_groups],
                "pcie_switches": [list(g) for g in self.pcie_switches],
                "host_bridges": [list(g) for g in self.host_bridges],
                "numa_nodes": [list(g) for g in self.numa_nodes],
            },
        }
        if self.init_error:
            description["init_error"] = self.init_error
        return description


NVIDIA_MAJOR = 195
UVM_MAJOR = 509
"""Device numbers as the NVIDIA driver registers them (`nvidia-uvm`'s is dynamic; 509 is a
typical value and only its presence matters to the agent)."""


def make_device_nodes(dev: Path, minors: Iterable[int]) -> Path:
    """A /dev-like directory with character devices for the cards `minors` and the driver's
    control nodes, as the NVIDIA driver creates them, for a node described to the stand-in.
    Needs root (mknod): PermissionError otherwise."""
    dev.mkdir(parents=True, exist_ok=True)
    nodes = {f"nvidia{m}": (NVIDIA_MAJOR, m) for m in minors}
    nodes.update({"nvidiactl": (NVIDIA_MAJOR, 255), "nvidia-modeset": (NVIDIA_MAJOR, 254)})
    nodes.update({"nvidia-uvm": (UVM_MAJOR, 0), "nvidia-uvm-tools": (UVM_MAJOR, 1)})
    for name, (major, minor) in nodes.items():
        if not (dev / name).exists():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return dev


def change_device(node: StandinNode, index: int, **changes: Any) -> StandinNode:
    """`node` with field changes to card `index`, e.g. `change_device(node, 1, errors={"*":
    "GPU_IS_LOST"})`; write it with `write_description` to change a running session."""
    devices = list(node.devices)
    devices[index] = attrs.evolve(devices[index], **changes)
    return attrs.evolve(node, devices=tuple(devices))


def write_description(path: Path, node: StandinNode) -> None:
    """Writes `node`'s description to `path` atomically (a temporary file in the same directory,
    then a rename), so the stand-in, which reads the file again whenever it changes while a
    session is open, never reads half of one."""
    _write_atomically(path, node.to_json())


def write_node(path: Path, node: StandinNode | Mapping[str, Any]) -> Path:
    """Writes a node description (a `StandinNode`, or the JSON shape as a mapping) to `path`,
    atomically as `write_description` does, and returns `path`."""
    _write_atomically(path, node.to_json() if isinstance(node, StandinNode) else dict(node))
    return path


def _write_atomically(path: Path, description: Mapping[str, Any]) -> None:
    text = json.dumps(description, indent=1)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(partial, 0o644)  # readable by the agent's processes, as a plain write leaves it
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def nvlinked_node(
    count: int, changes: Mapping[int, Mapping[str, Any]] | None = None
) -> StandinNode:
    """`count` A100s all on one NVLink fabric, one host bridge, one socket; `changes` maps a card
    index to field changes for that card (e.g. `{2: {"xids": (79,)}}`)."""
    changes = changes or {}
    everyone = (tuple(range(count)),)
    return StandinNode(
        devices=tuple(standin_device(i, **changes.get(i, {})) for i in range(count)),
        nvlink_groups=everyone,
        host_bridges=everyone,
        numa_nodes=everyone,
    )


def eight_card_node(changes: Mapping[int, Mapping[str, Any]] | None = None) -> StandinNode:
    """8 A100s as in a two-socket server: NVLink groups 0-3 and 4-7, PCIe switches in pairs,
    one host bridge and socket per group; `changes` as for `nvlinked_node`."""
    changes = changes or {}
    return StandinNode(
        devices=tuple(standin_device(i, **changes.get(i, {})) for i in range(8)),
        nvlink_groups=((0, 1, 2, 3), (4, 5, 6, 7)),
        pcie_switches=((0, 1), (2, 3), (4, 5), (6, 7)),
        host_bridges=((0, 1, 2, 3), (4, 5, 6, 7)),
        numa_nodes=((0, 1, 2, 3), (4, 5, 6, 7)),
    )
