"""The GPU code against a real NVIDIA driver (`make gpu-check`, `pytest -m gpu`).

The rest of the suite runs the same code against the stand-in `libnvidia-ml.so.1`; these tests
run it where the driver is real, and check its answers against the driver's own `nvidia-smi`
(an independent reader of the same driver): the NVML facade (every field it reads, the link
between every pair of cards, the processes), the claim and the allocator for each way
NVIDIA_VISIBLE_DEVICES names cards, `self-check --json`, and a runc container that the agent's
own runtime gives one card and that sees exactly that card with `nvidia-smi -L`.

Without `/dev/nvidia0` or without the driver's `libnvidia-ml.so.1` they are skipped, saying
which. In one process with the stand-in suite they skip too (the stand-in, once loaded, is what
pynvml talks to); `make gpu-check` runs them alone.
"""

from __future__ import annotations

import ctypes.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from agent.gpus.allocator import Allocation, choose_cards
from agent.gpus.claim import Claim, GpuConfig, claim_cards_blocking
from agent.gpus.edits import discover_node_files
from agent.gpus.ledger import CardLedger
from agent.runtime.config import ContainerConfig
from agent.runtime.manager import open_container_manager
from agent.runtime.records import Gpus
from nvml import Link, open_nvml
from workerapi.models import CardState, ContainerSpec

if TYPE_CHECKING:
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.registry_fixtures"]

REPO = Path(__file__).resolve().parent.parent
_GIB = 1 << 30


def _no_gpu() -> str | None:
    if not os.path.exists("/dev/nvidia0"):
        return "no /dev/nvidia0: this machine has no NVIDIA GPU (or its device nodes are not here)"
    if ctypes.util.find_library("nvidia-ml") is None:
        return "no libnvidia-ml.so.1 from an NVIDIA driver where the loader looks (ldconfig -p)"
    if shutil.which("nvidia-smi") is None:
        return (
            "the driver's nvidia-smi is not on PATH; it is the independent reader checked against"
        )
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_no_gpu() is not None, reason=_no_gpu() or ""),
]


@pytest.fixture
def real_nvml() -> None:
    """Skips when this process already loaded the stand-in library (an earlier test did)."""
    maps = Path("/proc/self/maps").read_text()
    for line in maps.splitlines():
        if "libnvidia-ml.so" in line and "nvml-standin" in line:
            pytest.skip(reason="the NVML stand-in is loaded in this process; run make gpu-check")


def _smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=True
    ).stdout


def _smi_cards() -> list[dict[str, str]]:
    """nvidia-smi's view of every card, by NVML index."""
    fields = ("index", "uuid", "name", "pci.bus_id", "memory.total", "driver_version")
    out = _smi(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits")
    return [
        dict(zip(fields, (part.strip() for part in line.split(",")), strict=True))
        for line in out.splitlines()
        if line.strip()
    ]


def _smi_cuda_version() -> str | None:
    match = re.search(r"CUDA Version:\s*([0-9.]+)", _smi())
    return match[1] if match else None


# -- the NVML facade ---------------------------------------------------------------------------


def test_the_facade_reads_what_nvidia_smi_reads(real_nvml: None) -> None:
    cards = _smi_cards()
    with open_nvml() as nvml:
        snapshot = nvml.snapshot()
        readings = [nvml.readings(state.device.index) for state in snapshot.devices]
        with nvml.listen_for_xids() as listener:
            xids = listener.wait(0)
            listening = listener.listening
    print(f"driver {snapshot.driver_version}, CUDA {snapshot.cuda_driver_version}")
    assert snapshot.unreachable == ()
    assert len(snapshot.devices) == len(cards)
    assert snapshot.driver_version == cards[0]["driver_version"]
    assert snapshot.cuda_driver_version == _smi_cuda_version()
    for state, smi, reading in zip(snapshot.devices, cards, readings, strict=True):
        device = state.device
        print(f"card {device.index}: {device}")
        print(f"  health {state.health}")
        print(f"  processes {state.processes}")
        print(f"  readings {reading}")
        assert device.index == int(smi["index"])
        assert device.uuid == smi["uuid"]
        assert device.name == smi["name"]
        assert device.pci_bus_id.lower() == smi["pci.bus_id"].lower()
        assert device.memory_total_bytes >> 20 == int(smi["memory.total"])
        assert 0 <= device.memory_used_bytes <= device.memory_total_bytes
        assert Path(f"/dev/nvidia{device.minor}").exists()
        if device.mig_enabled:
            assert all(uuid.startswith("MIG-") for uuid in device.mig_devices)
        else:
            assert device.mig_devices == ()
        assert state.health.responsive, state.health
        assert state.health.error is None
        if state.processes is not None:
            assert all(p.pid > 0 for p in state.processes)
        assert reading.memory_total_bytes in (None, device.memory_total_bytes)
        for percent in (reading.utilization_gpu_percent, reading.utilization_memory_percent):
            assert percent is None or 0 <= percent <= 100
        assert reading.temperature_celsius is None or 0 < reading.temperature_celsius < 130
        assert reading.power_watts is None or 0 < reading.power_watts < 2000
        for count in (reading.ecc_corrected_volatile, reading.ecc_uncorrected_volatile):
            assert count is None or count >= 0
    uuids = {state.device.uuid for state in snapshot.devices}
    assert listening <= uuids
    assert all(event.uuid in uuids for event in xids)


def test_the_link_between_every_pair_of_cards_is_known_both_ways(real_nvml: None) -> None:
    with open_nvml() as nvml:
        snapshot = nvml.snapshot()
        indices = [state.device.index for state in snapshot.devices]
        for a, b in itertools.combinations(indices, 2):
            link = nvml.link(a, b)
            print(f"cards {a} and {b}: {link.name}")
            assert nvml.link(b, a) is link
            assert link is not Link.UNKNOWN
            uuid_a, uuid_b = (snapshot.devices[i].device.uuid for i in (a, b))
            assert snapshot.topology.between(uuid_a, uuid_b) is link
    if len(indices) < 2:
        print(f"{len(indices)} card: no pair to link")


# -- the claim and the allocator ----------------------------------------------------------------


def _claim(tmp_path: Path, visible: str) -> Claim:
    config = GpuConfig(podresources_socket=tmp_path / "no-kubelet.sock")
    return claim_cards_blocking(config, {"NVIDIA_VISIBLE_DEVICES": visible})


def test_the_claim_reads_every_form_of_nvidia_visible_devices(
    tmp_path: Path, real_nvml: None
) -> None:
    cards = _smi_cards()
    with open_nvml() as nvml:
        minor = nvml.device(0).minor
    first = cards[0]["uuid"]
    forms = {
        "all": [c["uuid"] for c in cards],
        "0": [first],
        first: [first],
        f"{first}::1": [first],
        f"nvidia{minor}": [first],
        "none": [],
        "": [],
    }
    if len(cards) > 1:
        forms["0,1"] = [cards[0]["uuid"], cards[1]["uuid"]]
        forms[f"{cards[1]['uuid']},{first}"] = [first, cards[1]["uuid"]]
    for visible, expected in forms.items():
        claim = _claim(tmp_path, visible)
        print(
            f"NVIDIA_VISIBLE_DEVICES={visible!r}: {[(c.uuid, c.state.value) for c in claim.cards]}"
        )
        assert sorted(c.uuid for c in claim.cards) == sorted(expected), visible
        assert claim.unresolved == ()
        for card in claim.cards:
            assert card.state is CardState.SERVING or card.reason, card
    bogus = _claim(tmp_path, "GPU-00000000-0000-0000-0000-000000000000")
    assert bogus.cards == ()
    assert [u.ref for u in bogus.unresolved] == ["GPU-00000000-0000-0000-0000-000000000000"]


def test_the_allocator_gives_free_serving_cards_best_linked_first(
    tmp_path: Path, real_nvml: None
) -> None:
    claim = _claim(tmp_path, "all")
    serving = claim.serving
    print(f"serving: {[c.uuid for c in serving]}; problems: {claim.problems()}")
    if not serving:
        pytest.skip(reason=f"no card of this machine serves: {claim.problems()}")
    every = choose_cards(claim.cards, frozenset(), len(serving), claim.topology)
    assert isinstance(every, Allocation)
    assert {c.uuid for c in every.cards} == {c.uuid for c in serving}
    one = choose_cards(claim.cards, frozenset(), 1, claim.topology)
    assert isinstance(one, Allocation) and len(one.cards) == 1
    taken = frozenset(c.uuid for c in serving[:-1])
    last = choose_cards(claim.cards, taken, 1, claim.topology)
    assert isinstance(last, Allocation)
    assert [c.uuid for c in last.cards] == [serving[-1].uuid]
    assert not isinstance(
        choose_cards(claim.cards, frozenset(), len(serving) + 1, claim.topology), Allocation
    )


# -- self-check ------------------------------------------------------------------------------------


def _driver_dir(root: Path) -> Path:
    """A driver directory laid out like GKE's (bin/, lib64/), made from this machine's driver:
    nvidia-smi, the libnvidia-ml.so.1 it opens, and the C library it links against, so it runs
    in a container whose image has no C library of its own (busybox)."""
    driver = root / "nvidia-driver"
    (driver / "bin").mkdir(parents=True)
    (driver / "lib64").mkdir()
    smi = shutil.which("nvidia-smi")
    assert smi is not None
    shutil.copy(smi, driver / "bin" / "nvidia-smi")
    libraries: dict[str, str] = {}
    ldd = subprocess.run(["ldd", smi], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        if match := re.match(r"\s*(\S+) => (/\S+)", line):
            libraries[match[1]] = match[2]
        elif match := re.match(r"\s*(/\S+/(ld-linux[^/\s]*))", line):
            libraries[match[2]] = match[1]
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"libnvidia-ml\.so\.1 \(.*x86-64.*\) => (\S+)", cache) or re.search(
        r"libnvidia-ml\.so\.1 .*=> (\S+)", cache
    )
    assert found is not None, "ldconfig -p lists no libnvidia-ml.so.1"
    libraries["libnvidia-ml.so.1"] = found[1]
    for name, path in libraries.items():
        shutil.copy(path, driver / "lib64" / name)
    return driver


def test_self_check_json_reports_the_real_cards(tmp_path: Path, real_nvml: None) -> None:
    cards = _smi_cards()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("LEVERS9_", "NVIDIA_")) and key != "LD_LIBRARY_PATH"
    }
    env.update(
        {
            "NVIDIA_VISIBLE_DEVICES": "all",
            "LEVERS9_GPU_DRIVER_DIR": str(_driver_dir(tmp_path)),
            "LEVERS9_PODRESOURCES_SOCKET": str(tmp_path / "no-kubelet.sock"),
            "LEVERS9_STATE_DIR": str(tmp_path / "state"),
        }
    )
    result = subprocess.run(
        [sys.executable, "-m", "agent.daemon.selfcheck", "--json"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    print(result.stdout)
    print(result.stderr)
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["nvml"]["status"] == "ok", checks["nvml"]
    assert checks["driver"]["reason"].startswith(f"driver {cards[0]['driver_version']}")
    for card in cards:
        check = checks[f"card {card['index']}"]
        assert card["name"] in check["reason"]
        assert check["status"] in ("ok", "warn"), check
    assert checks["device nodes"]["status"] == "ok", checks["device nodes"]
    assert checks["driver directory"]["status"] == "ok", checks["driver directory"]


# -- a container given one card -----------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")
async def test_a_container_given_one_card_sees_exactly_that_card(
    tmp_path: Path, registry: SharedRegistry, real_nvml: None
) -> None:
    claim = await trio.to_thread.run_sync(_claim, tmp_path, "all")
    if not claim.serving:
        pytest.skip(reason=f"no card of this machine serves: {claim.problems()}")
    # Our own edits (device nodes, cgroup rules, the driver directory), not a CDI spec the
    # machine may have: they are what the agent falls back to and need nothing else installed.
    config = GpuConfig(
        dev_dir=Path("/dev"),
        driver_dir=await trio.to_thread.run_sync(_driver_dir, tmp_path),
        cdi_dirs=(),
    )
    gpus = Gpus(
        ledger=CardLedger.for_claim(claim),
        files=await trio.to_thread.run_sync(discover_node_files, config),
        config=config,
    )
    state = ContainerConfig(
        state_dir=tmp_path / "state",
        object_budget_bytes=1 << 30,
        free_floor_bytes=0,
        allow_local_registries=True,
    )
    lib = "/usr/local/nvidia/lib64"
    command = (
        f"{lib}/{next(p.name for p in (config.driver_dir / 'lib64').glob('ld-linux*'))} "
        f"--library-path {lib} /usr/local/nvidia/bin/nvidia-smi -L; echo exit=$?; ls /dev"
    )
    async with open_container_manager(state, gpus=gpus) as manager:
        container = await manager.wait_settled(
            await manager.create(
                ContainerSpec(
                    image=registry.busybox, id="one-card", cards=1, command=("sh", "-c", command)
                )
            )
        )
        given = container.status().cards
        texts = []
        with trio.fail_after(60):
            async for line in manager.log_lines("one-card", follow=True):
                texts.append(line.text)
    print("\n".join(texts))
    assert len(given) == 1
    listed = [text for text in texts if text.startswith("GPU ")]
    assert "exit=0" in texts
    assert len(listed) == 1, texts
    assert f"(UUID: {given[0]})" in listed[0]
    card = next(c for c in claim.cards if c.uuid == given[0])
    assert card.device_name in texts
    others = [c.device_name for c in claim.cards if c.uuid != given[0]]
    assert not set(others) & set(texts)
