"""The worker's cards: which of the node's cards are ours, which container gets which, and what a
container needs in its OCI spec to use them.

Each question is answered by a pure function from plain values, with thin I/O around it:

- **claim**: `read_assignment` asks the kubelet (PodResources) or reads NVIDIA_VISIBLE_DEVICES for
  the cards Kubernetes gave this pod; `open_nvml().snapshot()` says what NVML sees; `decide_claim`
  turns both, and the pids that are ours, into a `Claim`: each card serving, or refused with why
  and what to do. A refused card is reported and left alone; the rest serve.
- **allocation**: `choose_cards` picks N free cards, the best-connected set first (NVLink, then a
  shared PCIe switch, ...), or refuses saying how many are free. A `CardLedger` remembers which
  container holds which card, releases them when it ends, and is rebuilt after an agent restart
  from the containers still running, so a card is never handed out twice.
- **spec edits**: `discover_node_files` looks at device nodes, the driver directory and CDI specs
  under configurable roots; `spec_edits` says which device nodes, cgroup rules, read-only mounts,
  hooks and environment a container with a given set of cards gets. A node with a CDI spec for
  NVIDIA devices gets that spec's edits instead of ours.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import re
import stat
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from agent.podresources import (
    DEFAULT_SOCKET,
    PodResourcesError,
    list_pod_resources,
    pod_devices,
)
from nvml import Link, Snapshot, Topology, open_nvml
from nvml.model import DeviceState

# -- configuration ---------------------------------------------------------------------------------


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


# -- which cards Kubernetes gave us ----------------------------------------------------------------

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


# -- the claim -------------------------------------------------------------------------------------


class CardState(enum.Enum):
    SERVING = "serving"
    REFUSED = "refused"


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
# are faults of the application that ran, and the card is fine once it has ended.
CARD_FAULT_XIDS: Mapping[int, str] = {
    48: "a double-bit ECC error",
    61: "an internal micro-controller breakpoint",
    62: "an internal micro-controller halt",
    64: "a failed page retirement or row remapping",
    74: "an NVLink error",
    79: "the GPU falling off the bus",
    92: "a high single-bit ECC error rate",
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
    with open_nvml() as nvml:
        snapshot = nvml.snapshot()
    return decide_claim(assignment, snapshot, own_pids)


async def claim_cards(
    config: GpuConfig, environ: Mapping[str, str], own_pids: Collection[int] = ()
) -> Claim:
    """`claim_cards_blocking` in a worker thread, for the agent's trio code."""
    return await trio.to_thread.run_sync(claim_cards_blocking, config, environ, own_pids)


# -- allocation across containers ------------------------------------------------------------------


@attrs.frozen
class Allocation:
    cards: tuple[Card, ...]
    worst_link: Link | None
    """The farthest link between two of the cards; None for a single card."""


@attrs.frozen
class Refusal:
    requested: int
    free: int
    total: int
    reason: str


# Beyond this many candidate sets, choose greedily instead of trying every one.
_MAX_CANDIDATE_SETS = 5_000


def _score(
    chosen: Sequence[Card], free: Sequence[Card], topology: Topology
) -> tuple[int, int, int, tuple[int, ...]]:
    """Lower is better: farthest link, then all links together, then how many close neighbours
    of the chosen cards stay behind split from them (so whole NVLink groups stay whole for later
    requests), then the lowest indices."""
    ranks = [topology.between(a.uuid, b.uuid).rank for a, b in itertools.combinations(chosen, 2)]
    chosen_ids = {c.uuid for c in chosen}
    stranded = sum(
        1
        for c in chosen
        for other in free
        if other.uuid not in chosen_ids
        and topology.between(c.uuid, other.uuid).rank <= Link.PCIE_SWITCH.rank
    )
    return (max(ranks, default=0), sum(ranks), stranded, tuple(c.index for c in chosen))


def _greedy(free: Sequence[Card], count: int, topology: Topology) -> tuple[Card, ...]:
    best: tuple[Card, ...] | None = None
    for seed in free:
        chosen = [seed]
        while len(chosen) < count:
            rest = [c for c in free if c not in chosen]
            chosen.append(min(rest, key=lambda c: _score([*chosen, c], free, topology)))
        if best is None or _score(chosen, free, topology) < _score(best, free, topology):
            best = tuple(chosen)
    assert best is not None
    return best


def choose_cards(
    cards: Sequence[Card], in_use: Collection[str], count: int, topology: Topology
) -> Allocation | Refusal:
    """The `count` free serving cards to give one container, best connected first. Pure.

    A request is served from this worker alone or refused: it is never split across workers.
    """
    serving = [c for c in cards if c.state is CardState.SERVING]
    free = [c for c in serving if c.uuid not in in_use]
    total = len(serving)
    if count < 1:
        return Refusal(
            count, len(free), total, f"a request must be for at least 1 card, not {count}"
        )
    if count > total:
        return Refusal(
            count,
            len(free),
            total,
            f"{count} cards requested but this worker serves {total}; a {count}-card job needs "
            f"one worker with {count} free cards (it is never split across workers)",
        )
    if count > len(free):
        return Refusal(
            count,
            len(free),
            total,
            f"{count} cards requested; {len(free)} of this worker's {total} are free "
            f"({total - len(free)} in use)",
        )
    if math.comb(len(free), count) <= _MAX_CANDIDATE_SETS:
        best = min(itertools.combinations(free, count), key=lambda s: _score(s, free, topology))
    else:
        best = _greedy(free, count, topology)
    chosen = tuple(sorted(best, key=lambda c: c.index))
    links = [topology.between(a.uuid, b.uuid) for a, b in itertools.combinations(chosen, 2)]
    worst = max(links, key=lambda link: link.rank) if links else None
    return Allocation(cards=chosen, worst_link=worst)


@attrs.define
class CardLedger:
    """Which container holds which of this worker's cards. One per agent; not thread-safe (the
    agent uses it from its trio thread only)."""

    cards: tuple[Card, ...]
    topology: Topology = attrs.field(factory=Topology)
    _holders: dict[str, str] = attrs.field(factory=dict)
    """card UUID -> container id"""

    @classmethod
    def for_claim(cls, claim: Claim) -> CardLedger:
        return cls(cards=claim.serving, topology=claim.topology)

    def in_use(self) -> frozenset[str]:
        return frozenset(self._holders)

    def holder(self, uuid: str) -> str | None:
        return self._holders.get(uuid)

    def cards_of(self, container_id: str) -> tuple[str, ...]:
        return tuple(sorted(u for u, c in self._holders.items() if c == container_id))

    def free_count(self) -> int:
        return sum(1 for c in self.cards if c.uuid not in self._holders)

    def assign(self, container_id: str, count: int) -> Allocation | Refusal:
        """Gives `container_id` `count` cards, or refuses saying how many are free."""
        if self.cards_of(container_id):
            raise ValueError(f"container {container_id} already holds cards")
        result = choose_cards(self.cards, self.in_use(), count, self.topology)
        if isinstance(result, Allocation):
            for card in result.cards:
                self._holders[card.uuid] = container_id
        return result

    def release(self, container_id: str) -> tuple[str, ...]:
        """Frees the cards of a container that ended; returns their UUIDs."""
        freed = self.cards_of(container_id)
        for uuid in freed:
            del self._holders[uuid]
        return freed

    @classmethod
    def rebuild(
        cls, claim: Claim, running: Mapping[str, Iterable[str]]
    ) -> tuple[CardLedger, tuple[str, ...]]:
        """The ledger after an agent restart, from the containers still running and the card
        UUIDs each was given. Returns it with one line per conflict found.

        A card claimed by two running containers stays with the first (by container id) and the
        conflict is reported; a running container's card that this worker no longer serves is
        still counted as in use, so it is never handed to another container.
        """
        ledger = cls.for_claim(claim)
        serving = {c.uuid for c in ledger.cards}
        problems: list[str] = []
        for container_id in sorted(running):
            for uuid in sorted(set(running[container_id])):
                holder = ledger._holders.get(uuid)
                if holder is not None:
                    problems.append(
                        f"card {uuid} is held by running containers {holder} and {container_id}; "
                        f"it stays with {holder}, stop {container_id}"
                    )
                    continue
                if uuid not in serving:
                    problems.append(
                        f"running container {container_id} holds card {uuid}, which this "
                        "worker does not serve now; it stays in use until the container ends"
                    )
                ledger._holders[uuid] = container_id
        return ledger, tuple(problems)


# -- OCI spec edits --------------------------------------------------------------------------------

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
