"""The claim: which cards Kubernetes gave this pod (device plugin environment, the kubelet's
PodResources answer) checked with NVML, decided by a pure function (`decide_claim`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from agent.gpus.podresources import (
    DEFAULT_SOCKET,
    PodResourcesError,
    list_pod_resources,
    pod_devices,
)
from nvml import Snapshot, Topology, open_nvml
from nvml.model import DeviceState
from workerapi.models import CardState


@attrs.frozen
class GpuConfig:
    """Where the agent finds what the node offers for GPUs, as paths in the agent's pod."""

    dev_dir: Path = Path("/dev")
    driver_dir: Path = Path("/usr/local/nvidia")
    """The node's driver files (GKE: the node's /home/kubernetes/bin/nvidia, mounted here)."""
    driver_container_dir: str = "/usr/local/nvidia"
    """Where containers see the driver directory."""
    cdi_dirs: tuple[Path, ...] = (Path("/etc/cdi"), Path("/var/run/cdi"))
    """CDI spec directories, lowest priority first (as the CDI specification orders them)."""
    podresources_socket: Path = DEFAULT_SOCKET

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> GpuConfig:
        """Reads LEVERS9_GPU_DEV_DIR, LEVERS9_GPU_DRIVER_DIR, LEVERS9_GPU_DRIVER_CONTAINER_DIR,
        LEVERS9_GPU_CDI_DIRS (colon-separated) and LEVERS9_PODRESOURCES_SOCKET; unset means the
        default."""
        default = cls()
        cdi = environ.get("LEVERS9_GPU_CDI_DIRS")
        return cls(
            dev_dir=Path(environ.get("LEVERS9_GPU_DEV_DIR") or default.dev_dir),
            driver_dir=Path(environ.get("LEVERS9_GPU_DRIVER_DIR") or default.driver_dir),
            driver_container_dir=environ.get("LEVERS9_GPU_DRIVER_CONTAINER_DIR")
            or default.driver_container_dir,
            cdi_dirs=default.cdi_dirs
            if cdi is None
            else tuple(Path(p) for p in cdi.split(os.pathsep) if p),
            podresources_socket=Path(
                environ.get("LEVERS9_PODRESOURCES_SOCKET") or default.podresources_socket
            ),
        )


class GpuSetupError(Exception):
    """A container cannot be given its cards; the message names what is missing and what to do."""


_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
_INDEX_AND_MIG = re.compile(r"(\d+):(\d+)")
_DEVICE_NAME = re.compile(r"nvidia(\d+)(/.+)?")


@attrs.frozen
class CardRef:
    """One card as a device plugin or NVIDIA_VISIBLE_DEVICES names it.

    At most one of uuid / index / minor is set; none is set for a MIG UUID (NVML says which card
    it belongs to) or for a text we do not understand. `mig` is set when a MIG instance of a card
    is named rather than the whole card.
    """

    text: str
    uuid: str | None = None
    index: int | None = None
    minor: int | None = None
    mig: str | None = None

    @property
    def understood(self) -> bool:
        return (
            self.uuid is not None
            or self.index is not None
            or self.minor is not None
            or self.mig is not None
        )


def parse_device_id(text: str) -> CardRef:
    """Understands the ways cards are named to a pod:

    - `GPU-<uuid>` (NVIDIA device plugin), `GPU-<uuid>::<n>` (its n-th time-sliced replica);
    - `MIG-<uuid>` and the older `MIG-GPU-<uuid>/<gi>/<ci>` (a MIG instance);
    - `<index>` and `<index>:<mig index>` (NVML index, as NVIDIA_VISIBLE_DEVICES allows);
    - `nvidia<minor>` and `nvidia<minor>/gi<n>...` (GKE's device plugin: the device node).
    """
    name = text.strip()
    base, replica_sep, replica = name.partition("::")
    if replica_sep and not replica.isdigit():
        return CardRef(text=name)
    if _GPU_UUID.fullmatch(base):
        return CardRef(text=name, uuid=base)
    if base.startswith("MIG-GPU-"):
        parent = base[len("MIG-") :].split("/", 1)[0]
        if _GPU_UUID.fullmatch(parent):
            return CardRef(text=name, uuid=parent, mig=base)
        return CardRef(text=name)
    if base.startswith("MIG-") and len(base) > len("MIG-"):
        return CardRef(text=name, mig=base)
    if base.isdigit():
        return CardRef(text=name, index=int(base))
    if match := _INDEX_AND_MIG.fullmatch(base):
        return CardRef(text=name, index=int(match[1]), mig=base)
    if match := _DEVICE_NAME.fullmatch(base):
        return CardRef(text=name, minor=int(match[1]), mig=base if match[2] else None)
    return CardRef(text=name)


@attrs.frozen
class Assignment:
    """The cards Kubernetes gave this pod, and where we learned it."""

    source: str
    refs: tuple[CardRef, ...] = ()
    all_cards: bool = False
    notes: tuple[str, ...] = ()


def parse_visible_devices(value: str | None, *, notes: Sequence[str] = ()) -> Assignment:
    """NVIDIA_VISIBLE_DEVICES as the NVIDIA container runtime reads it: a comma-separated list of
    card ids, or `all`; `none`, `void`, empty or unset give no cards."""
    source = "NVIDIA_VISIBLE_DEVICES"
    text = (value or "").strip()
    if text.lower() == "all":
        return Assignment(source=source, all_cards=True, notes=tuple(notes))
    if not text or text.lower() in ("none", "void"):
        shown = "unset" if value is None else f"{text or 'empty'!r}"
        return Assignment(
            source=source,
            notes=(
                *notes,
                f"NVIDIA_VISIBLE_DEVICES is {shown}, so this pod was given no cards; the Job "
                "must request nvidia.com/gpu (and mount the kubelet's pod-resources socket where "
                "the device plugin sets no NVIDIA_VISIBLE_DEVICES, as on GKE)",
            ),
        )
    refs = tuple(parse_device_id(part) for part in text.split(",") if part.strip())
    return Assignment(source=source, refs=refs, notes=tuple(notes))


def read_assignment(config: GpuConfig, environ: Mapping[str, str]) -> Assignment:
    """Asks the kubelet which cards this pod has (when its socket is mounted; the pod is named by
    POD_NAME and POD_NAMESPACE, which the Job sets through the downward API), else reads
    NVIDIA_VISIBLE_DEVICES. Blocks. Why the kubelet was not used goes into `notes`."""
    notes: list[str] = []
    if config.podresources_socket.exists():
        pod_name, namespace = environ.get("POD_NAME"), environ.get("POD_NAMESPACE")
        if not pod_name or not namespace:
            notes.append(
                "POD_NAME / POD_NAMESPACE are not set, so the kubelet's answer cannot be matched "
                "to this pod; the Job sets them through the downward API"
            )
        else:
            try:
                pods = list_pod_resources(config.podresources_socket)
            except PodResourcesError as exc:
                notes.append(f"{exc}; falling back to NVIDIA_VISIBLE_DEVICES")
            else:
                ids = pod_devices(pods, pod_name=pod_name, namespace=namespace)
                if ids is not None:
                    source = f"kubelet PodResources (pod {namespace}/{pod_name})"
                    more = () if ids else (f"the kubelet lists no nvidia.com/gpu for {source}",)
                    return Assignment(
                        source=source, refs=tuple(parse_device_id(i) for i in ids), notes=more
                    )
                notes.append(
                    f"the kubelet does not list pod {namespace}/{pod_name}; falling back to "
                    "NVIDIA_VISIBLE_DEVICES"
                )
    return parse_visible_devices(environ.get("NVIDIA_VISIBLE_DEVICES"), notes=notes)


@attrs.frozen
class Card:
    """One card Kubernetes gave this worker, with whether it serves and why (not)."""

    uuid: str
    index: int
    minor: int
    model: str
    memory_total_bytes: int
    pci_bus_id: str
    state: CardState
    reason: str
    action: str = ""

    def describe(self) -> str:
        return f"card {self.uuid} (index {self.index})"

    @property
    def device_name(self) -> str:
        """Its device node's name under /dev."""
        return f"nvidia{self.minor}"


@attrs.frozen
class Unresolved:
    """A card Kubernetes named that NVML does not show (or a name we do not understand)."""

    ref: str
    reason: str
    action: str


@attrs.frozen
class Claim:
    """The cards of this worker: what the agent reports about itself and serves from."""

    source: str
    driver_version: str
    cards: tuple[Card, ...] = ()
    unresolved: tuple[Unresolved, ...] = ()
    notes: tuple[str, ...] = ()
    topology: Topology = attrs.field(factory=Topology)

    @property
    def serving(self) -> tuple[Card, ...]:
        return tuple(c for c in self.cards if c.state is CardState.SERVING)

    def problems(self) -> tuple[str, ...]:
        """One line per card that will not be used: what is wrong and what to do."""
        lines = [f"{c.reason}; {c.action}" for c in self.cards if c.state is CardState.REFUSED]
        lines += [f"{u.reason}; {u.action}" for u in self.unresolved]
        return tuple(lines)


# XIDs that say the card itself is at fault (NVIDIA's XID catalogue); others (13, 31, 43, ...)
# are faults of the application that ran, and the card is fine once it has ended. Their keys are
# also the default of LEVERS9_GPU_FAULT_XIDS, the XIDs that quarantine a card while the worker
# runs (agent/gpus/health.py).
CARD_FAULT_XIDS: Mapping[int, str] = {
    48: "a double-bit ECC error",
    61: "an internal micro-controller breakpoint",
    62: "an internal micro-controller halt",
    63: "an ECC page retirement or row remapping",
    64: "a failed page retirement or row remapping",
    74: "an NVLink error",
    79: "the GPU falling off the bus",
    92: "a high single-bit ECC error rate",
    94: "a contained ECC error",
    95: "an uncontained ECC error",
    119: "a GSP RPC timeout",
    120: "a GSP error",
    140: "an unrecovered ECC error",
}
_RESET = "reset the card (nvidia-smi -r) or reboot the node, then restart the worker"


def _refusal(state: DeviceState, own_pids: Collection[int]) -> tuple[str, str] | None:
    """Why a present card must not be used, and what to do; None when it may serve."""
    device, health = state.device, state.health
    name = device.describe()
    if not health.responsive:
        return (
            f"{name} does not answer NVML ({health.error}); it will not be used",
            "drain the node and reset or replace the card",
        )
    if device.mig_enabled:
        return (
            f"{name} has MIG mode on, and levers9 gives containers whole cards; it will not be "
            "used",
            f"turn MIG off (nvidia-smi -i {device.index} -mig 0) or use a node pool without MIG",
        )
    if health.remapped_rows_failed:
        return (
            f"{name} failed to remap a faulty memory row; it will not be used",
            "have the card replaced",
        )
    if health.retired_pages_pending:
        return (
            f"{name} has retired memory pages waiting for a reset; it will not be used",
            _RESET,
        )
    if health.remapped_rows_pending:
        return (
            f"{name} has remapped memory rows waiting for a reset; it will not be used",
            _RESET,
        )
    if health.ecc_uncorrected_volatile:
        return (
            f"{name} reported {health.ecc_uncorrected_volatile} uncorrectable ECC errors since "
            "the driver loaded; it will not be used",
            f"{_RESET}; replace the card if they come back",
        )
    faults = [x for x in health.xids or () if x in CARD_FAULT_XIDS]
    if faults:
        return (
            f"{name} reported XID {faults[0]} ({CARD_FAULT_XIDS[faults[0]]}); it will not be used",
            _RESET,
        )
    if state.processes is None:
        return (
            f"NVML cannot list the processes on {name}, so it may be in use; it will not be used",
            "check the card with nvidia-smi on the node",
        )
    foreign = sorted({p.pid for p in state.processes if p.pid not in own_pids})
    if foreign:
        held = (
            f"process {foreign[0]}"
            if len(foreign) == 1
            else "processes " + ", ".join(map(str, foreign))
        )
        verb = "is" if len(foreign) == 1 else "are"
        return (
            f"{name} is held by {held} that {verb} not ours; it will not be used",
            "stop that workload or move this pool off the card, then restart the worker",
        )
    return None


def _resolve(ref: CardRef, snapshot: Snapshot) -> DeviceState | Unresolved:
    """The card `ref` names, or why it cannot be found."""
    for state in snapshot.devices:
        device = state.device
        if (
            (ref.uuid is not None and device.uuid.lower() == ref.uuid.lower())
            or (ref.index is not None and device.index == ref.index)
            or (ref.minor is not None and device.minor == ref.minor)
            or (ref.uuid is None and ref.mig is not None and ref.mig in device.mig_devices)
        ):
            return state
    for lost in snapshot.unreachable:
        if (ref.uuid is not None and lost.uuid == ref.uuid) or ref.index == lost.index:
            return Unresolved(
                ref=ref.text,
                reason=f"{lost.describe()} does not answer NVML ({lost.reason}); it will not be "
                "used",
                action="drain the node and reset or replace the card",
            )
    if not ref.understood:
        return Unresolved(
            ref=ref.text,
            reason=f"{ref.text!r} is not a card id we understand (GPU-<uuid>, MIG-<uuid>, an "
            "index, or nvidia<N>); it will not be used",
            action="check the device plugin and the Job's NVIDIA_VISIBLE_DEVICES",
        )
    return Unresolved(
        ref=ref.text,
        reason=f"card {ref.text} was given to this pod but NVML on this node does not show it "
        f"(it shows {len(snapshot.devices)} cards); it will not be used",
        action="check that the pod runs on the node the device plugin allocated for, and that "
        "the driver sees every card (nvidia-smi on the node)",
    )


def decide_claim(
    assignment: Assignment, snapshot: Snapshot, own_pids: Collection[int] = ()
) -> Claim:
    """Which of the cards Kubernetes gave us serve. Pure.

    A card serves when NVML shows it, it answers, it is healthy, it is a whole card (not MIG),
    and every compute process on it is one of `own_pids` (the pids of our containers).
    """
    picked: dict[str, Card] = {}
    unresolved: list[Unresolved] = []
    if assignment.all_cards:
        targets: list[tuple[CardRef, DeviceState]] = [
            (CardRef(text=s.device.uuid, uuid=s.device.uuid), s) for s in snapshot.devices
        ]
        unresolved += [
            Unresolved(
                ref=lost.uuid or str(lost.index),
                reason=f"{lost.describe()} does not answer NVML ({lost.reason}); it will not be "
                "used",
                action="drain the node and reset or replace the card",
            )
            for lost in snapshot.unreachable
        ]
    else:
        targets = []
        for ref in assignment.refs:
            found = _resolve(ref, snapshot)
            if isinstance(found, Unresolved):
                if found.ref not in {u.ref for u in unresolved}:
                    unresolved.append(found)
            else:
                targets.append((ref, found))
    for ref, state in targets:
        device = state.device
        if device.uuid in picked:  # named twice, e.g. two time-sliced replicas of one card
            continue
        refusal = _refusal(state, own_pids)
        if ref.mig is not None:
            refusal = (
                f"{device.describe()} was given to this pod only as MIG instance {ref.mig}, and "
                "levers9 gives containers whole cards; it will not be used",
                "use a node pool without MIG (or with MIG off) for levers9 workers",
            )
        picked[device.uuid] = Card(
            uuid=device.uuid,
            index=device.index,
            minor=device.minor,
            model=device.name,
            memory_total_bytes=device.memory_total_bytes,
            pci_bus_id=device.pci_bus_id,
            state=CardState.SERVING if refusal is None else CardState.REFUSED,
            reason="healthy, and nothing else runs on it" if refusal is None else refusal[0],
            action="" if refusal is None else refusal[1],
        )
    return Claim(
        source=assignment.source,
        driver_version=snapshot.driver_version,
        cards=tuple(sorted(picked.values(), key=lambda c: c.index)),
        unresolved=tuple(unresolved),
        notes=assignment.notes,
        topology=snapshot.topology,
    )


def claim_cards_blocking(
    config: GpuConfig, environ: Mapping[str, str], own_pids: Collection[int] = ()
) -> Claim:
    """Reads the assignment and NVML and decides the claim. Blocks; raises NvmlUnavailableError."""
    assignment = read_assignment(config, environ)
    with open_nvml(config.driver_dir) as nvml:
        snapshot = nvml.snapshot()
    return decide_claim(assignment, snapshot, own_pids)


async def claim_cards(
    config: GpuConfig, environ: Mapping[str, str], own_pids: Collection[int] = ()
) -> Claim:
    """`claim_cards_blocking` in a worker thread, for the agent's trio code."""
    return await trio.to_thread.run_sync(claim_cards_blocking, config, environ, own_pids)
