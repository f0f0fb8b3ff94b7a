"""A typed facade over NVML, the NVIDIA driver's management library.

The agent learns everything about a node's cards here: which cards there are (index, UUID, model,
memory, PCI bus id, the minor number of `/dev/nvidia<minor>`, MIG mode), what runs on them, how
healthy they are, what they measure (utilisation, temperature, power, ECC errors, XID events)
and how they connect to each other. pynvml does the calls underneath, in exactly one module
(`nvml.facade`), which turns its answers into frozen values (`nvml.model`) and its exceptions
into ours (`nvml.errors`).

Machines without a GPU test the same code path against a stand-in `libnvidia-ml.so.1` built from
C at test time (`nvml.standin`), which pynvml loads like the real one.
"""

from nvml.errors import DeviceUnresponsiveError, NotSupportedError, NvmlError, NvmlUnavailableError
from nvml.facade import Nvml, XidListener, open_nvml
from nvml.model import (
    Device,
    DeviceState,
    Health,
    Link,
    Process,
    Readings,
    Snapshot,
    Topology,
    Unreachable,
    XidEvent,
)

__all__ = [
    "Device",
    "DeviceState",
    "DeviceUnresponsiveError",
    "Health",
    "Link",
    "NotSupportedError",
    "Nvml",
    "NvmlError",
    "NvmlUnavailableError",
    "Process",
    "Readings",
    "Snapshot",
    "Topology",
    "Unreachable",
    "XidEvent",
    "XidListener",
    "open_nvml",
]
