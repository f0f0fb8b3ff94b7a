"""The one adapter between levers9 and NVML (through pynvml).

Why a facade: pynvml returns ctypes structures and raises one exception class per return code,
and some of its calls need care (versioned structs, "not supported" on some cards, a card that
falls off the bus mid-scan). Here each call is made once, its answer becomes a frozen value from
`nvml.model`, and every `pynvml.NVMLError` becomes one of `nvml.errors`, so nothing above this
module imports pynvml or sees its exceptions.

It is synchronous on purpose: NVML calls are blocking C calls, so the agent runs them in a worker
thread (`trio.to_thread.run_sync`). `open_nvml()` initialises NVML and shuts it down again; NVML
counts initialisations, so nested or concurrent sessions are fine, and NVML itself is thread-safe,
so one session may serve two threads (the agent's metrics read readings in one while another
waits for XIDs).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from nvml.errors import DeviceUnresponsiveError, NotSupportedError, NvmlError, NvmlUnavailableError
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

T = TypeVar("T")

# NVML return codes (nvml.h, nvmlReturn_t). Spelled out so that this module's decisions do not
# depend on which names a given pynvml release exports.
_SUCCESS = 0
_ERROR_UNINITIALIZED = 1
_ERROR_NOT_SUPPORTED = 3
_ERROR_NO_PERMISSION = 4
_ERROR_NOT_FOUND = 6
_ERROR_DRIVER_NOT_LOADED = 9
_ERROR_TIMEOUT = 10
_ERROR_IRQ_ISSUE = 11
_ERROR_LIBRARY_NOT_FOUND = 12
_ERROR_FUNCTION_NOT_FOUND = 13
_ERROR_CORRUPTED_INFOROM = 14
_ERROR_GPU_IS_LOST = 15
_ERROR_RESET_REQUIRED = 16
_ERROR_OPERATING_SYSTEM = 17
_ERROR_LIB_RM_VERSION_MISMATCH = 18
_ERROR_ARGUMENT_VERSION_MISMATCH = 25
_ERROR_UNKNOWN = 999

_CARD_FAILURES = frozenset(
    {
        _ERROR_TIMEOUT,
        _ERROR_IRQ_ISSUE,
        _ERROR_CORRUPTED_INFOROM,
        _ERROR_GPU_IS_LOST,
        _ERROR_RESET_REQUIRED,
        _ERROR_OPERATING_SYSTEM,
        _ERROR_UNKNOWN,
    }
)
_NOT_OFFERED = frozenset({_ERROR_NOT_SUPPORTED, _ERROR_FUNCTION_NOT_FOUND})

_MEMORY_V2 = (2 << 24) | 40  # NVML_STRUCT_VERSION(Memory, 2): sizeof(nvmlMemory_v2_t) == 40
_MEMORY_ERROR_CORRECTED = 0
_MEMORY_ERROR_UNCORRECTED = 1
_TEMPERATURE_GPU = 0
_VOLATILE_ECC = 0
_EVENT_XID_CRITICAL = 0x8
_P2P_CAPS_NVLINK = 2
_P2P_STATUS_OK = 0
_TOPOLOGY_LEVELS = {
    0: Link.SAME_BOARD,
    10: Link.PCIE_SWITCH,
    20: Link.PCIE_SWITCHES,
    30: Link.HOST_BRIDGE,
    40: Link.NUMA_NODE,
    50: Link.CROSS_SOCKET,
}
_XID_EVENTS_PER_READ = 64

_UNAVAILABLE: dict[int, tuple[str, str]] = {
    _ERROR_LIBRARY_NOT_FOUND: (
        "the NVIDIA driver's library libnvidia-ml.so.1 was not found",
        "run on a node with the NVIDIA driver, and mount the driver into the pod (GKE: the "
        "node's /home/kubernetes/bin/nvidia at /usr/local/nvidia with its lib64 on "
        "LD_LIBRARY_PATH)",
    ),
    _ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded",
        "install or load the driver on the node (GKE: the driver installer DaemonSet), then "
        "restart the worker",
    ),
    _ERROR_LIB_RM_VERSION_MISMATCH: (
        "libnvidia-ml.so.1 does not match the loaded kernel driver",
        "mount the library of the driver the node runs, or reboot the node after a driver upgrade",
    ),
    _ERROR_NO_PERMISSION: (
        "NVML refused access",
        "run the agent privileged (the worker Job does) or with access to /dev/nvidia*",
    ),
}


def _translate(exc: Exception, function: str, *, starting: bool = False) -> NvmlError:
    """Turns a pynvml exception into ours: the one place where that happens.

    "No permission" means NVML is closed to us only when it comes from starting NVML; from a
    single query it means that query is not offered to this process.
    """
    code = getattr(exc, "value", None)
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ calls back into the library, which may be gone
        text = f"NVML error {code}"
    if code == _ERROR_NO_PERMISSION and not starting:
        return NotSupportedError(f"{function}: {text}", function=function, code=code)
    if code in _UNAVAILABLE:
        what, action = _UNAVAILABLE[code]
        return NvmlUnavailableError(f"{what} ({text})", action=action, function=function, code=code)
    if code in _NOT_OFFERED:
        return NotSupportedError(f"{function}: {text}", function=function, code=code)
    if code in _CARD_FAILURES:
        return DeviceUnresponsiveError(f"{function}: {text}", function=function, code=code)
    return NvmlError(f"{function} failed: {text}", function=function, code=code)


def _import_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailableError(
            "the Python package nvidia-ml-py (pynvml) is not installed",
            action="install levers9 with its dependencies (pip install nvidia-ml-py)",
        ) from exc
    module: ModuleType = pynvml
    return module


class Nvml:
    """An initialised NVML session. Get one from `open_nvml()`; all methods block."""

    def __init__(self, lib: ModuleType) -> None:
        self._lib = lib
        self._handles: dict[int, Any] = {}

    def _call(self, function: str, *args: Any) -> Any:
        """Calls pynvml's `function`; its exceptions leave translated."""
        try:
            return getattr(self._lib, function)(*args)
        except self._lib.NVMLError as exc:
            raise _translate(exc, function) from exc

    def _optional(self, read: Callable[[], T]) -> T | None:
        """`read()`, or None where the card or driver does not offer it."""
        try:
            return read()
        except NotSupportedError:
            return None

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call("nvmlDeviceGetHandleByIndex", index)
        return self._handles[index]

    # -- the node ------------------------------------------------------------------------------

    def driver_version(self) -> str:
        return str(self._call("nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> str | None:
        """The CUDA version the driver supports, as "12.4"; None if it does not say."""
        version = self._optional(lambda: int(self._call("nvmlSystemGetCudaDriverVersion_v2")))
        if version is None:
            return None
        return f"{version // 1000}.{version % 1000 // 10}"

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    # -- one card --------------------------------------------------------------------------------

    def device(self, index: int) -> Device:
        """The card at NVML index `index`. Raises DeviceUnresponsiveError if it does not answer."""
        handle = self._handle(index)
        memory = self._memory(handle)
        pci = self._call("nvmlDeviceGetPciInfo_v3", handle)
        mig_mode = self._optional(lambda: self._call("nvmlDeviceGetMigMode", handle))
        mig_enabled = None if mig_mode is None else bool(mig_mode[0])
        return Device(
            index=index,
            uuid=str(self._call("nvmlDeviceGetUUID", handle)),
            name=str(self._call("nvmlDeviceGetName", handle)),
            minor=int(self._call("nvmlDeviceGetMinorNumber", handle)),
            pci_bus_id=_text(pci.busId),
            memory_total_bytes=int(memory.total),
            memory_used_bytes=int(memory.used),
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(handle) if mig_enabled else (),
        )

    def _memory(self, handle: Any) -> Any:
        try:
            return self._call(
                "nvmlDeviceGetMemoryInfo", handle, getattr(self._lib, "nvmlMemory_v2", _MEMORY_V2)
            )
        except NotSupportedError:  # a driver from before the versioned struct
            return self._call("nvmlDeviceGetMemoryInfo", handle)

    def _mig_devices(self, handle: Any) -> tuple[str, ...]:
        count = self._optional(lambda: int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle)))
        uuids = []
        for slot in range(count or 0):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except NvmlError as exc:
                if exc.code == _ERROR_NOT_FOUND:  # an empty slot
                    continue
                raise
            uuids.append(str(self._call("nvmlDeviceGetUUID", mig)))
        return tuple(uuids)

    def processes(self, index: int) -> tuple[Process, ...] | None:
        """Compute processes on the card; None if NVML cannot list them for this card."""
        handle = self._handle(index)
        found = self._optional(lambda: self._call("nvmlDeviceGetComputeRunningProcesses", handle))
        if found is None:
            return None
        return tuple(
            Process(
                pid=int(p.pid),
                used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
            )
            for p in found
        )

    def health(self, index: int, *, xid_wait_ms: int = 0) -> Health:
        """The card's health. A card that does not answer gives `responsive=False`.

        Critical XIDs are events, not state: NVML delivers those that happen while a listener is
        registered. This registers one, collects what arrives within `xid_wait_ms` and stops.
        """
        try:
            handle = self._handle(index)
            retired = self._optional(
                lambda: bool(self._call("nvmlDeviceGetRetiredPagesPendingStatus", handle))
            )
            rows = self._optional(lambda: self._call("nvmlDeviceGetRemappedRows", handle))
            ecc = self._optional(
                lambda: int(
                    self._call(
                        "nvmlDeviceGetTotalEccErrors",
                        handle,
                        _MEMORY_ERROR_UNCORRECTED,
                        _VOLATILE_ECC,
                    )
                )
            )
            xids = self._xids(handle, xid_wait_ms)
        except NvmlUnavailableError:
            raise
        except NvmlError as exc:  # lost, needs a reset, or failing in a way NVML cannot name
            return Health(responsive=False, error=exc.message)
        return Health(
            responsive=True,
            retired_pages_pending=retired,
            remapped_rows_pending=None if rows is None else bool(rows[2]),
            remapped_rows_failed=None if rows is None else bool(rows[3]),
            ecc_uncorrected_volatile=ecc,
            xids=xids,
        )

    def readings(self, index: int) -> Readings:
        """What card `index` measures now. Raises DeviceUnresponsiveError if it does not answer;
        a reading the card or driver does not offer is None."""
        handle = self._handle(index)
        memory = self._optional(lambda: self._memory(handle))
        utilization = self._optional(lambda: self._call("nvmlDeviceGetUtilizationRates", handle))
        power_mw = self._optional(lambda: int(self._call("nvmlDeviceGetPowerUsage", handle)))
        return Readings(
            utilization_gpu_percent=None if utilization is None else int(utilization.gpu),
            utilization_memory_percent=None if utilization is None else int(utilization.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            temperature_celsius=self._optional(lambda: self._temperature(handle)),
            power_watts=None if power_mw is None else power_mw / 1000,
            ecc_corrected_volatile=self._optional(
                lambda: self._ecc_volatile(handle, _MEMORY_ERROR_CORRECTED)
            ),
            ecc_uncorrected_volatile=self._optional(
                lambda: self._ecc_volatile(handle, _MEMORY_ERROR_UNCORRECTED)
            ),
        )

    def _temperature(self, handle: Any) -> int:
        """The die's temperature: the versioned call where pynvml and the driver have it (NVML
        13 deprecates the other), else the unversioned one older drivers offer."""
        if hasattr(self._lib, "nvmlDeviceGetTemperatureV"):
            try:
                return int(self._call("nvmlDeviceGetTemperatureV", handle, _TEMPERATURE_GPU))
            except NvmlError as exc:
                if not isinstance(exc, NotSupportedError) and (
                    exc.code != _ERROR_ARGUMENT_VERSION_MISMATCH
                ):
                    raise
        return int(self._call("nvmlDeviceGetTemperature", handle, _TEMPERATURE_GPU))

    def _ecc_volatile(self, handle: Any, error_type: int) -> int:
        return int(self._call("nvmlDeviceGetTotalEccErrors", handle, error_type, _VOLATILE_ECC))

    @contextlib.contextmanager
    def listen_for_xids(self) -> Iterator[XidListener]:
        """An event set that hears the critical XIDs of every card offering them, until the
        block ends. A card that does not offer XID events, or refuses the registration, is
        left out (`XidListener.listening` names the cards heard)."""
        event_set = self._call("nvmlEventSetCreate")
        try:
            listening: dict[int, str] = {}
            for index in range(self.device_count()):
                registered = self._register_xids(index, event_set)
                if registered is not None:
                    handle, uuid = registered
                    listening[_handle_address(handle)] = uuid
            yield XidListener(self, event_set, listening)
        finally:
            with contextlib.suppress(NvmlError):
                self._call("nvmlEventSetFree", event_set)

    def _register_xids(self, index: int, event_set: Any) -> tuple[Any, str] | None:
        """Registers card `index` for critical XIDs in `event_set`; its handle and UUID, or None
        where it does not offer them, refuses, or does not answer."""
        try:
            handle = self._handle(index)
            supported = self._optional(
                lambda: int(self._call("nvmlDeviceGetSupportedEventTypes", handle))
            )
            if not supported or not supported & _EVENT_XID_CRITICAL:
                return None
            uuid = str(self._call("nvmlDeviceGetUUID", handle))
            self._call("nvmlDeviceRegisterEvents", handle, _EVENT_XID_CRITICAL, event_set)
        except NvmlUnavailableError:
            raise
        except NvmlError:
            return None
        return handle, uuid

    def _xids(self, handle: Any, wait_ms: int) -> tuple[int, ...] | None:
        supported = self._optional(
            lambda: int(self._call("nvmlDeviceGetSupportedEventTypes", handle))
        )
        if not supported or not supported & _EVENT_XID_CRITICAL:
            return None
        # Events are an extra: where registering or waiting fails (some containers may not
        # listen), XIDs are unknown, and the card's other answers still say whether it is lost.
        try:
            event_set = self._call("nvmlEventSetCreate")
        except NvmlUnavailableError:
            raise
        except NvmlError:
            return None
        try:
            self._call("nvmlDeviceRegisterEvents", handle, _EVENT_XID_CRITICAL, event_set)
            xids: list[int] = []
            for _ in range(_XID_EVENTS_PER_READ):
                try:
                    event = self._call("nvmlEventSetWait", event_set, wait_ms)
                except NvmlError as exc:
                    if exc.code == _ERROR_TIMEOUT:  # no (more) events: the normal end
                        break
                    raise
                if int(event.eventType) & _EVENT_XID_CRITICAL:
                    xids.append(int(event.eventData))
            return tuple(xids)
        except NvmlUnavailableError:
            raise
        except NvmlError:
            return None
        finally:
            with contextlib.suppress(NvmlError):
                self._call("nvmlEventSetFree", event_set)

    def link(self, a: int, b: int) -> Link:
        """How cards `a` and `b` (NVML indices) reach each other."""
        first, second = self._handle(a), self._handle(b)
        nvlink = self._optional(
            lambda: int(self._call("nvmlDeviceGetP2PStatus", first, second, _P2P_CAPS_NVLINK))
        )
        if nvlink == _P2P_STATUS_OK:
            return Link.NVLINK
        level = self._optional(
            lambda: int(self._call("nvmlDeviceGetTopologyCommonAncestor", first, second))
        )
        return Link.UNKNOWN if level is None else _TOPOLOGY_LEVELS.get(level, Link.UNKNOWN)

    # -- everything at once ---------------------------------------------------------------------

    def snapshot(self, *, xid_wait_ms: int = 0) -> Snapshot:
        """Every card with its processes and health, and the links between them.

        A card that does not answer does not spoil the rest: it is listed as unreachable (if it
        could not be described) or with `health.responsive` False.
        """
        try:
            count = self.device_count()
            driver_version = self.driver_version()
        except NvmlUnavailableError:
            raise
        except NvmlError as exc:
            raise NvmlUnavailableError(
                f"NVML started but does not answer: {exc.message}",
                action="check the node's NVIDIA driver (nvidia-smi on the node), then restart "
                "the worker",
                function=exc.function,
                code=exc.code,
            ) from exc
        states: list[DeviceState] = []
        unreachable: list[Unreachable] = []
        for index in range(count):
            try:
                device = self.device(index)
            except NvmlUnavailableError:
                raise
            except NvmlError as exc:
                unreachable.append(
                    Unreachable(index=index, uuid=self._uuid_if_known(index), reason=exc.message)
                )
                continue
            health = self.health(index, xid_wait_ms=xid_wait_ms)
            try:
                processes = self.processes(index)
            except NvmlUnavailableError:
                raise
            except NvmlError as exc:
                processes = None
                health = Health(responsive=False, error=exc.message)
            states.append(DeviceState(device=device, processes=processes, health=health))
        links = {}
        for first, second in itertools.combinations(states, 2):
            if first.health.responsive and second.health.responsive:
                try:
                    link = self.link(first.device.index, second.device.index)
                except NvmlUnavailableError:
                    raise
                except NvmlError:
                    link = Link.UNKNOWN
            else:
                link = Link.UNKNOWN
            links[frozenset((first.device.uuid, second.device.uuid))] = link
        return Snapshot(
            driver_version=driver_version,
            cuda_driver_version=self.cuda_driver_version(),
            devices=tuple(states),
            unreachable=tuple(unreachable),
            topology=Topology(links),
        )

    def _uuid_if_known(self, index: int) -> str | None:
        try:
            return str(self._call("nvmlDeviceGetUUID", self._handle(index)))
        except NvmlError:
            return None


class XidListener:
    """An NVML event set registered for critical XIDs; get one from `Nvml.listen_for_xids()`.

    NVML queues a registered card's events in the set until they are read, so successive
    `wait` calls return every critical XID reported since the listener was opened, each once.
    Its methods block.
    """

    def __init__(self, nvml: Nvml, event_set: Any, listening: Mapping[int, str]) -> None:
        self._nvml = nvml
        self._event_set = event_set
        # The UUIDs by handle, learnt at registration: a card that reports a critical XID often
        # stops answering (XID 79: fallen off the bus), its UUID included.
        self._uuids = dict(listening)
        self.listening = frozenset(listening.values())
        """The UUIDs of the cards whose XIDs this set hears."""

    def wait(self, timeout_ms: int) -> tuple[XidEvent, ...]:
        """The XIDs that arrive within `timeout_ms` (0: those already queued), returned as soon
        as one has, with whatever was queued behind it; empty when none came."""
        events: list[XidEvent] = []
        for _ in range(_XID_EVENTS_PER_READ):
            try:
                event = self._nvml._call(
                    "nvmlEventSetWait", self._event_set, 0 if events else timeout_ms
                )
            except NvmlError as exc:
                if exc.code == _ERROR_TIMEOUT:  # no (more) events: the normal end
                    break
                raise
            if int(event.eventType) & _EVENT_XID_CRITICAL:
                uuid = self._uuids.get(_handle_address(event.device))
                if uuid is None:  # not a card registered here: ask NVML which it is
                    uuid = str(self._nvml._call("nvmlDeviceGetUUID", event.device))
                events.append(XidEvent(uuid=uuid, xid=int(event.eventData)))
        return tuple(events)


def _handle_address(handle: Any) -> int:
    """Where an NVML device handle points: the same card's handles compare equal by it."""
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


DRIVER_LIBRARY = "libnvidia-ml.so.1"
_DRIVER_LIBRARY_DIRS = ("lib64", "lib")


def load_driver_library(driver_dir: Path) -> Path | None:
    """Loads `driver_dir`'s own libnvidia-ml.so.1 (from its lib64 or lib), if it has one, so that
    pynvml's later load by soname finds that library; returns its path.

    The worker Job mounts the node's driver directory but nothing puts its lib64 on the
    loader's path (GKE's device plugin sets no LD_LIBRARY_PATH and the worker image has none),
    so without this the agent in its image finds no NVML on a node that has one."""
    for name in _DRIVER_LIBRARY_DIRS:
        path = driver_dir / name / DRIVER_LIBRARY
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                return None  # nvmlInit then says the library was not found, and what to do
            return path
    return None


@contextlib.contextmanager
def open_nvml(driver_dir: Path | None = None) -> Iterator[Nvml]:
    """An NVML session: initialised on entry, shut down on exit; the library is the one in
    `driver_dir` when it has one (`load_driver_library`), else the loader's.

    Raises NvmlUnavailableError, naming what is missing and what to do, when NVML cannot be used
    here (no driver library, no kernel driver, mismatched versions, no permission).
    """
    if driver_dir is not None:
        load_driver_library(driver_dir)
    lib = _import_pynvml()
    try:
        lib.nvmlInit()
    except lib.NVMLError as exc:
        error = _translate(exc, "nvmlInit", starting=True)
        if isinstance(error, NvmlUnavailableError):
            raise error from exc
        raise NvmlUnavailableError(
            f"NVML did not start: {error.message}",
            action="check the node's NVIDIA driver (nvidia-smi on the node), then restart the "
            "worker",
            function="nvmlInit",
            code=error.code,
        ) from exc
    try:
        yield Nvml(lib)
    finally:
        with contextlib.suppress(lib.NVMLError):
            lib.nvmlShutdown()
