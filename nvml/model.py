"""What NVML tells about a node, as plain frozen values.

These are facts, not judgements: whether a card with a pending page retirement may serve is the
agent's decision (`agent.gpus`), made from a `Snapshot` without touching NVML. A field that the
card or driver cannot report is None, never a made-up zero.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs


@attrs.frozen
class Device:
    """One physical card, as NVML names it."""

    index: int
    uuid: str
    name: str
    minor: int
    pci_bus_id: str
    memory_total_bytes: int
    memory_used_bytes: int
    mig_enabled: bool | None
    """None: the card has no MIG mode at all."""
    mig_devices: tuple[str, ...] = ()
    """UUIDs of the MIG devices carved out of this card, when MIG is on."""

    @property
    def device_node(self) -> str:
        return f"/dev/nvidia{self.minor}"

    def describe(self) -> str:
        """How messages name the card: its UUID and index."""
        return f"card {self.uuid} (index {self.index})"


@attrs.frozen
class Process:
    """A compute process NVML sees on a card. Its pid is in the host's pid namespace."""

    pid: int
    used_memory_bytes: int | None


@attrs.frozen
class Health:
    """What NVML says about a card's health; None where the card or driver cannot say."""

    responsive: bool
    error: str | None = None
    """Why the card did not answer, when it did not."""
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    """Uncorrectable ECC errors since the driver last loaded."""
    xids: tuple[int, ...] | None = None
    """Critical XID events delivered while the health was read; None: not reported here."""


@attrs.frozen
class Readings:
    """What a card measures now, for monitoring; each None where the card or driver cannot say.

    Unlike `Health` these are not judged by the agent: they are reported as they are read.
    """

    utilization_gpu_percent: int | None = None
    """Share of the last sample period (1/6 s to 1 s) in which a kernel ran."""
    utilization_memory_percent: int | None = None
    """Share of the last sample period in which device memory was read or written."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: int | None = None
    """The GPU die's sensor."""
    power_watts: float | None = None
    """Power drawn by the whole board (NVML reports milliwatts)."""
    ecc_corrected_volatile: int | None = None
    """Corrected ECC errors since the driver last loaded."""
    ecc_uncorrected_volatile: int | None = None
    """Uncorrectable ECC errors since the driver last loaded."""


@attrs.frozen
class XidEvent:
    """A critical XID a card reported while an `XidListener` listened."""

    uuid: str
    """The card's UUID."""
    xid: int


class Link(enum.Enum):
    """How two cards reach each other, best first. `rank` orders them."""

    NVLINK = "nvlink"
    SAME_BOARD = "same-board"
    PCIE_SWITCH = "pcie-switch"
    PCIE_SWITCHES = "pcie-switches"
    HOST_BRIDGE = "host-bridge"
    NUMA_NODE = "numa-node"
    CROSS_SOCKET = "cross-socket"
    UNKNOWN = "unknown"

    @property
    def rank(self) -> int:
        """0 for the closest link; larger is farther."""
        return _LINK_ORDER.index(self)


_LINK_ORDER = tuple(Link)


@attrs.frozen
class Topology:
    """Links between pairs of cards, keyed by the two UUIDs."""

    links: Mapping[frozenset[str], Link] = attrs.field(factory=dict, hash=False)

    def between(self, a: str, b: str) -> Link:
        if a == b:
            return Link.SAME_BOARD
        return self.links.get(frozenset((a, b)), Link.UNKNOWN)


@attrs.frozen
class DeviceState:
    """A card with what was running on it and how healthy it was when the snapshot was taken."""

    device: Device
    processes: tuple[Process, ...] | None
    """None: NVML could not list them."""
    health: Health


@attrs.frozen
class Unreachable:
    """A card NVML counts but could not describe."""

    index: int
    uuid: str | None
    reason: str

    def describe(self) -> str:
        if self.uuid:
            return f"card {self.uuid} (index {self.index})"
        return f"card at index {self.index}"


@attrs.frozen
class Snapshot:
    """Everything the agent needs from NVML to decide its claim, read in one go."""

    driver_version: str
    cuda_driver_version: str | None
    devices: tuple[DeviceState, ...]
    unreachable: tuple[Unreachable, ...] = ()
    topology: Topology = attrs.field(factory=Topology)
