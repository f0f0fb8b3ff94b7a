"""The NVML facade against the stand-in libnvidia-ml: what the agent learns about a node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from nvml import (
    DeviceUnresponsiveError,
    Link,
    NvmlUnavailableError,
    Readings,
    XidEvent,
    open_nvml,
)
from nvml.standin import (
    ENV_VAR,
    StandinNode,
    StandinProcess,
    eight_card_node,
    nvlinked_node,
    standin_device,
    write_node,
)

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode, RunPython

pytest_plugins = ["tests.nvml_fixtures"]


def test_eight_cards_are_described_one_by_one(describe_node: DescribeNode) -> None:
    describe_node(eight_card_node({5: {"memory_used_bytes": 3 << 30}}))
    with open_nvml() as nvml:
        snapshot = nvml.snapshot()
    assert snapshot.driver_version == "550.54.15"
    assert snapshot.cuda_driver_version == "12.4"
    assert [s.device.index for s in snapshot.devices] == list(range(8))
    fifth = snapshot.devices[5].device
    assert fifth.uuid == standin_device(5).uuid
    assert fifth.name == "NVIDIA A100-SXM4-80GB"
    assert fifth.minor == 5
    assert fifth.device_node == "/dev/nvidia5"
    assert fifth.pci_bus_id == "00000000:60:00.0"
    assert fifth.memory_total_bytes == 80 << 30
    assert fifth.memory_used_bytes == 3 << 30
    assert fifth.mig_enabled is False
    assert all(s.health.responsive and s.processes == () for s in snapshot.devices)
    assert snapshot.unreachable == ()


@pytest.mark.parametrize("count", [1, 4])
def test_smaller_nodes(describe_node: DescribeNode, count: int) -> None:
    describe_node(nvlinked_node(count))
    with open_nvml() as nvml:
        assert nvml.device_count() == count
        snapshot = nvml.snapshot()
    assert len(snapshot.devices) == count
    assert len(snapshot.topology.links) == count * (count - 1) // 2


def test_each_session_reads_the_node_description_again(describe_node: DescribeNode) -> None:
    describe_node(nvlinked_node(2))
    with open_nvml() as nvml:
        assert nvml.device_count() == 2
    describe_node(nvlinked_node(4))
    with open_nvml() as nvml:
        assert nvml.device_count() == 4


def test_compute_processes_on_a_card(describe_node: DescribeNode) -> None:
    running = (StandinProcess(pid=4242, used_memory_bytes=5 << 30), StandinProcess(pid=77))
    describe_node(nvlinked_node(2, {1: {"processes": running}}))
    with open_nvml() as nvml:
        assert nvml.processes(0) == ()
        found = nvml.processes(1)
    assert found is not None
    assert [(p.pid, p.used_memory_bytes) for p in found] == [(4242, 5 << 30), (77, 1 << 30)]


def test_health_as_the_driver_reports_it(describe_node: DescribeNode) -> None:
    describe_node(
        nvlinked_node(
            4,
            {
                0: {"ecc_uncorrected_volatile": None, "remapped_rows_supported": False},
                1: {"retired_pages_pending": True, "ecc_uncorrected_volatile": 2},
                2: {"remapped_rows_pending": True, "remapped_rows_failed": True},
                3: {"xids": (79, 13)},
            },
        )
    )
    with open_nvml() as nvml:
        unknown, retired, remapped, xid = (nvml.health(i) for i in range(4))
    # What a card cannot report is unknown, not "fine".
    assert unknown.responsive
    assert unknown.ecc_uncorrected_volatile is None
    assert unknown.remapped_rows_pending is None
    assert unknown.retired_pages_pending is None
    assert retired.retired_pages_pending is True
    assert retired.ecc_uncorrected_volatile == 2
    assert (remapped.remapped_rows_pending, remapped.remapped_rows_failed) == (True, True)
    assert xid.xids == (79, 13)


def test_xid_events_unsupported_are_unknown(describe_node: DescribeNode) -> None:
    describe_node({"devices": [{"xid_events_supported": False}]})
    with open_nvml() as nvml:
        assert nvml.health(0).xids is None


def test_xids_are_unknown_where_events_cannot_be_heard(describe_node: DescribeNode) -> None:
    describe_node(nvlinked_node(1, {0: {"errors": {"nvmlDeviceRegisterEvents": "UNKNOWN"}}}))
    with open_nvml() as nvml:
        health = nvml.health(0)
    assert health.responsive
    assert health.xids is None


def test_drivers_without_the_versioned_memory_call(describe_node: DescribeNode) -> None:
    old = {"errors": {"nvmlDeviceGetMemoryInfo_v2": "FUNCTION_NOT_FOUND"}}
    describe_node(nvlinked_node(1, {0: {**old, "memory_used_bytes": 1 << 30}}))
    with open_nvml() as nvml:
        device = nvml.device(0)
    assert (device.memory_total_bytes, device.memory_used_bytes) == (80 << 30, 1 << 30)


def test_readings_as_the_cards_report_them(describe_node: DescribeNode) -> None:
    describe_node(
        nvlinked_node(
            2,
            {
                0: {
                    "utilization_gpu_percent": 87,
                    "utilization_memory_percent": 41,
                    "memory_used_bytes": 7 << 30,
                    "temperature_celsius": 71,
                    "power_usage_mw": 312_500,
                    "ecc_corrected_volatile": 5,
                    "ecc_uncorrected_volatile": 1,
                },
            },
        )
    )
    with open_nvml() as nvml:
        busy, idle = nvml.readings(0), nvml.readings(1)
    assert busy == Readings(
        utilization_gpu_percent=87,
        utilization_memory_percent=41,
        memory_used_bytes=7 << 30,
        memory_total_bytes=80 << 30,
        temperature_celsius=71,
        power_watts=312.5,  # NVML says milliwatts
        ecc_corrected_volatile=5,
        ecc_uncorrected_volatile=1,
    )
    assert (idle.utilization_gpu_percent, idle.temperature_celsius, idle.power_watts) == (0, 33, 61)


def test_readings_a_card_cannot_give_are_unknown_not_zero(describe_node: DescribeNode) -> None:
    describe_node(
        nvlinked_node(
            1,
            {
                0: {
                    "utilization_supported": False,
                    "temperature_celsius": None,
                    "power_usage_mw": None,
                    "ecc_uncorrected_volatile": None,
                }
            },
        )
    )
    with open_nvml() as nvml:
        readings = nvml.readings(0)
    assert readings == Readings(memory_used_bytes=0, memory_total_bytes=80 << 30)


def test_temperature_from_drivers_without_the_versioned_call(describe_node: DescribeNode) -> None:
    old = {"errors": {"nvmlDeviceGetTemperatureV": "FUNCTION_NOT_FOUND"}}
    describe_node(nvlinked_node(1, {0: {**old, "temperature_celsius": 58}}))
    with open_nvml() as nvml:
        assert nvml.readings(0).temperature_celsius == 58


def test_readings_of_a_card_that_stops_answering(describe_node: DescribeNode) -> None:
    describe_node(nvlinked_node(2, {1: {"errors": {"nvmlDeviceGetPowerUsage": "GPU_IS_LOST"}}}))
    with open_nvml() as nvml:
        assert nvml.readings(0).power_watts == 61
        with pytest.raises(DeviceUnresponsiveError, match="GPU is lost"):
            nvml.readings(1)


def test_an_xid_listener_hears_each_xid_once(describe_node: DescribeNode) -> None:
    describe_node(
        nvlinked_node(
            4,
            {
                1: {"xids": (79, 13)},
                2: {"xid_events_supported": False, "xids": (48,)},
                3: {"errors": {"nvmlDeviceRegisterEvents": "UNKNOWN"}, "xids": (48,)},
            },
        )
    )
    uuid = [standin_device(i).uuid for i in range(4)]
    with open_nvml() as nvml, nvml.listen_for_xids() as listener:
        # Cards without XID events, or refusing the registration, are not heard.
        assert listener.listening == {uuid[0], uuid[1]}
        heard = listener.wait(0)
        assert listener.wait(0) == ()  # delivered once, not again at the next wait
    assert heard == (XidEvent(uuid=uuid[1], xid=79), XidEvent(uuid=uuid[1], xid=13))


def test_cards_that_stop_answering(describe_node: DescribeNode) -> None:
    describe_node(
        nvlinked_node(
            3,
            {
                1: {"errors": {"*": "GPU_IS_LOST"}},
                2: {"errors": {"nvmlDeviceGetTotalEccErrors": "GPU_IS_LOST"}},
            },
        )
    )
    with open_nvml() as nvml:
        snapshot = nvml.snapshot()
    # The lost card is counted but cannot be described; the others still are.
    assert [s.device.index for s in snapshot.devices] == [0, 2]
    (lost,) = snapshot.unreachable
    assert lost.index == 1
    assert "GPU is lost" in lost.reason
    failing = snapshot.devices[1].health
    assert not failing.responsive
    assert failing.error is not None
    assert "nvmlDeviceGetTotalEccErrors" in failing.error
    assert "GPU is lost" in failing.error


def test_topology_between_cards(describe_node: DescribeNode) -> None:
    describe_node(eight_card_node())
    with open_nvml() as nvml:
        assert nvml.link(0, 3) is Link.NVLINK
        assert nvml.link(4, 7) is Link.NVLINK
        assert nvml.link(0, 4) is Link.CROSS_SOCKET
        snapshot = nvml.snapshot()
    uuid = [s.device.uuid for s in snapshot.devices]
    assert snapshot.topology.between(uuid[1], uuid[2]) is Link.NVLINK
    assert snapshot.topology.between(uuid[3], uuid[6]) is Link.CROSS_SOCKET


def test_pcie_only_topology(describe_node: DescribeNode) -> None:
    describe_node(
        StandinNode(
            devices=tuple(standin_device(i) for i in range(4)),
            pcie_switches=((0, 1),),
            host_bridges=((0, 1, 2),),
            numa_nodes=((0, 1, 2),),
        )
    )
    with open_nvml() as nvml:
        assert nvml.link(0, 1) is Link.PCIE_SWITCH
        assert nvml.link(1, 2) is Link.HOST_BRIDGE
        assert nvml.link(2, 3) is Link.CROSS_SOCKET
    assert Link.NVLINK.rank < Link.PCIE_SWITCH.rank < Link.HOST_BRIDGE.rank
    assert Link.HOST_BRIDGE.rank < Link.CROSS_SOCKET.rank < Link.UNKNOWN.rank


def test_mig_mode_and_mig_devices(describe_node: DescribeNode) -> None:
    migs = ("MIG-11111111-2222-3333-4444-555555555555", "MIG-66666666-2222-3333-4444-555555555555")
    describe_node(
        nvlinked_node(3, {1: {"mig_enabled": True, "mig_devices": migs}, 2: {"mig_enabled": None}})
    )
    with open_nvml() as nvml:
        plain, mig, no_mig = (nvml.device(i) for i in range(3))
    assert (plain.mig_enabled, plain.mig_devices) == (False, ())
    assert (mig.mig_enabled, mig.mig_devices) == (True, migs)
    assert no_mig.mig_enabled is None


def test_driver_not_loaded_is_a_clear_error(describe_node: DescribeNode) -> None:
    describe_node(StandinNode(devices=(), init_error="DRIVER_NOT_LOADED"))
    with pytest.raises(NvmlUnavailableError) as caught, open_nvml():
        pass
    assert "kernel driver is not loaded" in caught.value.message
    assert "driver" in caught.value.action


def test_the_stand_in_checks_versioned_structs(describe_node: DescribeNode) -> None:
    import pynvml

    describe_node(nvlinked_node(1))
    with open_nvml():
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        good = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        assert good.total == 80 << 30
        with pytest.raises(pynvml.NVMLError) as caught:
            pynvml.nvmlDeviceGetMemoryInfo(handle, version=(3 << 24) | 40)
    assert caught.value.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


_LIST_UUIDS = """
import json
from nvml import open_nvml, NvmlUnavailableError
try:
    with open_nvml() as nvml:
        print(json.dumps([s.device.uuid for s in nvml.snapshot().devices]))
except NvmlUnavailableError as exc:
    print(json.dumps({"error": exc.message, "action": exc.action}))
"""


def test_pynvml_finds_the_stand_in_on_the_library_path(
    run_python: RunPython, tmp_path: Path
) -> None:
    description = write_node(tmp_path / "node.json", nvlinked_node(4))
    result = run_python(["-c", _LIST_UUIDS], node=description)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [standin_device(i).uuid for i in range(4)]


@pytest.mark.usefixtures("without_real_nvml")
def test_a_node_without_the_library_is_a_clear_error(run_python: RunPython) -> None:
    result = run_python(["-c", _LIST_UUIDS])
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert "libnvidia-ml.so.1 was not found" in answer["error"]
    assert "/usr/local/nvidia" in answer["action"]


_LIST_UUIDS_FROM_DRIVER = """
import json, sys
from pathlib import Path
from nvml import open_nvml
with open_nvml(Path(sys.argv[1])) as nvml:
    print(json.dumps([s.device.uuid for s in nvml.snapshot().devices]))
"""


@pytest.mark.usefixtures("without_real_nvml")
def test_the_driver_directorys_own_library_is_loaded_without_a_library_path(
    run_python: RunPython, standin_library: Path, tmp_path: Path
) -> None:
    # As in the worker image: the Job mounts the node's driver directory, nobody sets
    # LD_LIBRARY_PATH to its lib64.
    driver = tmp_path / "driver"
    (driver / "lib64").mkdir(parents=True)
    shutil.copy(standin_library, driver / "lib64" / "libnvidia-ml.so.1")
    description = write_node(tmp_path / "node.json", nvlinked_node(2))
    result = run_python(["-c", _LIST_UUIDS_FROM_DRIVER, str(driver)], {ENV_VAR: str(description)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [standin_device(i).uuid for i in range(2)]
