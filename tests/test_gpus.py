"""The worker's cards: claim, allocation across containers, and the OCI spec edits for them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agent.gpus.allocator import Allocation, Refusal, choose_cards
from agent.gpus.claim import (
    Card,
    Claim,
    GpuConfig,
    GpuSetupError,
    claim_cards,
    decide_claim,
    parse_device_id,
    parse_visible_devices,
)
from agent.gpus.edits import discover_node_files, spec_edits
from agent.gpus.ledger import CardConflict, CardLedger, ConflictKind
from nvml import Link, open_nvml
from nvml.standin import (
    StandinNode,
    StandinProcess,
    eight_card_node,
    nvlinked_node,
    standin_device,
)
from workerapi.models import CardState

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode, MakeDevDir

pytest_plugins = ["tests.nvml_fixtures"]

UUID = [standin_device(i).uuid for i in range(8)]


def claim_for(visible: str, own_pids: frozenset[int] = frozenset()) -> Claim:
    """The claim of a worker whose pod got `visible` as NVIDIA_VISIBLE_DEVICES, on the node
    NVML describes now."""
    with open_nvml() as nvml:
        snapshot = nvml.snapshot()
    return decide_claim(parse_visible_devices(visible), snapshot, own_pids)


def states(claim: Claim) -> dict[int, CardState]:
    return {card.index: card.state for card in claim.cards}


# -- NVIDIA_VISIBLE_DEVICES and device plugin ids -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (UUID[3], {"uuid": UUID[3]}),
        (f"{UUID[3]}::2", {"uuid": UUID[3]}),
        ("3", {"index": 3}),
        ("nvidia5", {"minor": 5}),
        (f"MIG-{UUID[1]}/1/0", {"uuid": UUID[1], "mig": f"MIG-{UUID[1]}/1/0"}),
        (
            "MIG-8ab3c1d2-0000-5000-a000-000000000001",
            {"mig": "MIG-8ab3c1d2-0000-5000-a000-000000000001"},
        ),
        ("0:1", {"index": 0, "mig": "0:1"}),
        ("nvidia2/gi1", {"minor": 2, "mig": "nvidia2/gi1"}),
        ("tpu-7", {}),
        (f"{UUID[0]}::x", {}),
    ],
)
def test_card_names_are_understood(text: str, expected: dict[str, Any]) -> None:
    ref = parse_device_id(text)
    found = {k: v for k in ("uuid", "index", "minor", "mig") if (v := getattr(ref, k)) is not None}
    assert found == expected
    assert ref.understood == bool(expected)


@pytest.mark.parametrize("value", [None, "", "none", "void", "NONE"])
def test_visible_devices_that_give_no_cards(value: str | None) -> None:
    assignment = parse_visible_devices(value)
    assert assignment.refs == ()
    assert not assignment.all_cards
    assert "no cards" in assignment.notes[0]


def test_visible_devices_all_and_lists() -> None:
    assert parse_visible_devices("all").all_cards
    listed = parse_visible_devices(f"0, {UUID[2]},nvidia4")
    assert [(r.index, r.uuid, r.minor) for r in listed.refs] == [
        (0, None, None),
        (None, UUID[2], None),
        (None, None, 4),
    ]


# -- the claim ------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 4, 8])
def test_every_healthy_card_given_serves(describe_node: DescribeNode, count: int) -> None:
    describe_node(nvlinked_node(count))
    claim = claim_for("all")
    assert [c.uuid for c in claim.serving] == UUID[:count]
    card = claim.cards[0]
    assert (card.model, card.memory_total_bytes, card.state) == (
        "NVIDIA A100-SXM4-80GB",
        80 << 30,
        CardState.SERVING,
    )
    assert claim.driver_version == "550.54.15"
    assert claim.problems() == ()


def test_only_the_cards_given_to_the_pod_are_claimed(describe_node: DescribeNode) -> None:
    describe_node(eight_card_node())
    claim = claim_for(f"{UUID[6]},1,{UUID[6]}::1")
    assert [c.index for c in claim.cards] == [1, 6]
    assert claim.source == "NVIDIA_VISIBLE_DEVICES"


def test_a_card_with_a_foreign_process_is_refused(describe_node: DescribeNode) -> None:
    describe_node(eight_card_node({3: {"processes": (StandinProcess(pid=4242),)}}))
    claim = claim_for("all")
    assert states(claim)[3] is CardState.REFUSED
    assert len(claim.serving) == 7
    refused = claim.cards[3]
    assert refused.reason == (
        f"card {UUID[3]} (index 3) is held by process 4242 that is not ours; it will not be used"
    )
    assert refused.action
    assert claim.problems() == (f"{refused.reason}; {refused.action}",)


def test_our_own_processes_do_not_count_as_foreign(describe_node: DescribeNode) -> None:
    describe_node(eight_card_node({3: {"processes": (StandinProcess(4242), StandinProcess(99))}}))
    assert states(claim_for("all", own_pids=frozenset({4242, 99})))[3] is CardState.SERVING
    refused = claim_for("all", own_pids=frozenset({4242})).cards[3]
    assert "process 99 that is not ours" in refused.reason


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"xids": (79,)}, "XID 79 (the GPU falling off the bus)"),
        ({"ecc_uncorrected_volatile": 3}, "3 uncorrectable ECC errors"),
        ({"retired_pages_pending": True}, "retired memory pages waiting for a reset"),
        ({"remapped_rows_pending": True}, "remapped memory rows waiting for a reset"),
        ({"remapped_rows_failed": True}, "failed to remap a faulty memory row"),
        ({"errors": {"nvmlDeviceGetRemappedRows": "GPU_IS_LOST"}}, "does not answer NVML"),
        ({"mig_enabled": True}, "has MIG mode on"),
    ],
)
def test_an_unhealthy_card_is_refused_and_the_rest_serve(
    describe_node: DescribeNode, changes: Mapping[str, Any], why: str
) -> None:
    describe_node(eight_card_node({5: changes}))
    claim = claim_for("all")
    assert [i for i, s in states(claim).items() if s is CardState.REFUSED] == [5]
    assert why in claim.cards[5].reason
    assert claim.cards[5].reason.endswith("it will not be used")


def test_application_xids_do_not_refuse_a_card(describe_node: DescribeNode) -> None:
    describe_node(nvlinked_node(1, {0: {"xids": (13, 43)}}))
    assert states(claim_for("all")) == {0: CardState.SERVING}


def test_a_lost_card_and_an_unknown_card_are_reported(describe_node: DescribeNode) -> None:
    describe_node(eight_card_node({2: {"errors": {"*": "GPU_IS_LOST"}}}))
    stranger = "GPU-deadbeef-0000-4000-8000-000000000000"
    claim = claim_for(f"0,2,{stranger},tpu0")
    assert [c.index for c in claim.serving] == [0]
    reasons = {u.ref: u.reason for u in claim.unresolved}
    assert "card at index 2 does not answer NVML (" in reasons["2"]
    assert "NVML on this node does not show it" in reasons[stranger]
    assert "not a card id we understand" in reasons["tpu0"]
    assert len(claim.problems()) == 3


def test_a_mig_instance_is_understood_but_not_served(describe_node: DescribeNode) -> None:
    mig = "MIG-8ab3c1d2-0000-5000-a000-000000000001"
    describe_node(eight_card_node({4: {"mig_enabled": True, "mig_devices": (mig,)}}))
    claim = claim_for(f"{mig},0")
    assert states(claim) == {0: CardState.SERVING, 4: CardState.REFUSED}
    assert f"only as MIG instance {mig}" in claim.cards[1].reason


def test_gke_device_ids_name_device_nodes(describe_node: DescribeNode) -> None:
    describe_node(StandinNode(devices=(standin_device(0, minor=3), standin_device(1, minor=0))))
    claim = claim_for("nvidia3")
    assert [(c.index, c.minor) for c in claim.cards] == [(0, 3)]


async def test_claim_cards_from_trio(describe_node: DescribeNode, tmp_path: Path) -> None:
    describe_node(nvlinked_node(4, {1: {"processes": (StandinProcess(pid=31),)}}))
    config = GpuConfig(podresources_socket=tmp_path / "absent.sock")
    claim = await claim_cards(config, {"NVIDIA_VISIBLE_DEVICES": "all"}, own_pids={31})
    assert len(claim.serving) == 4
    assert claim.topology.between(UUID[0], UUID[3]) is Link.NVLINK


# -- allocation ------------------------------------------------------------------------------------


@pytest.fixture
def eight(describe_node: DescribeNode) -> Claim:
    describe_node(eight_card_node())
    return claim_for("all")


def indices(result: Allocation | Refusal) -> list[int]:
    assert isinstance(result, Allocation), result
    return [c.index for c in result.cards]


def test_a_request_gets_a_whole_nvlink_group(eight: Claim) -> None:
    used = {UUID[0], UUID[1]}
    result = choose_cards(eight.cards, used, 4, eight.topology)
    assert indices(result) == [4, 5, 6, 7]
    assert isinstance(result, Allocation)
    assert result.worst_link is Link.NVLINK


def test_small_requests_keep_whole_groups_free(eight: Claim) -> None:
    assert indices(choose_cards(eight.cards, {UUID[0]}, 2, eight.topology)) == [1, 2]
    assert indices(choose_cards(eight.cards, {UUID[0], UUID[1], UUID[2]}, 1, eight.topology)) == [3]


def test_without_nvlink_a_shared_pcie_switch_wins(describe_node: DescribeNode) -> None:
    describe_node(
        StandinNode(
            devices=tuple(standin_device(i) for i in range(4)),
            pcie_switches=((0, 1), (2, 3)),
            host_bridges=((0, 1, 2, 3),),
            numa_nodes=((0, 1, 2, 3),),
        )
    )
    claim = claim_for("all")
    result = choose_cards(claim.cards, {UUID[0]}, 2, claim.topology)
    assert indices(result) == [2, 3]
    assert isinstance(result, Allocation)
    assert result.worst_link is Link.PCIE_SWITCH


def test_big_nodes_are_allocated_greedily_but_still_by_group(describe_node: DescribeNode) -> None:
    halves = (tuple(range(8)), tuple(range(8, 16)))
    describe_node(
        StandinNode(
            devices=tuple(standin_device(i) for i in range(16)),
            nvlink_groups=halves,
            host_bridges=halves,
            numa_nodes=halves,
        )
    )
    claim = claim_for("all")
    first = choose_cards(claim.cards, set(), 8, claim.topology)
    assert indices(first) == list(range(8))
    second = choose_cards(claim.cards, {claim.cards[9].uuid}, 8, claim.topology)
    assert indices(second) == list(range(8))
    assert isinstance(second, Allocation)
    assert second.worst_link is Link.NVLINK


def test_a_request_too_big_is_refused_saying_how_many_are_free(eight: Claim) -> None:
    busy = choose_cards(eight.cards, set(UUID[:5]), 4, eight.topology)
    assert isinstance(busy, Refusal)
    assert (busy.free, busy.total) == (3, 8)
    assert busy.reason == "4 cards requested; 3 of this worker's 8 are free (5 in use)"
    huge = choose_cards(eight.cards, set(), 9, eight.topology)
    assert isinstance(huge, Refusal)
    assert "never split across workers" in huge.reason
    assert isinstance(choose_cards(eight.cards, set(), 0, eight.topology), Refusal)


def test_refused_cards_are_never_allocated(describe_node: DescribeNode) -> None:
    describe_node(nvlinked_node(2, {0: {"xids": (79,)}}))
    claim = claim_for("all")
    assert indices(choose_cards(claim.cards, set(), 1, claim.topology)) == [1]
    assert isinstance(choose_cards(claim.cards, set(), 2, claim.topology), Refusal)


def test_cards_are_released_when_their_container_ends(eight: Claim) -> None:
    ledger = CardLedger.for_claim(eight)
    first = ledger.assign("c1", 4)
    second = ledger.assign("c2", 4)
    assert indices(first) == [0, 1, 2, 3]
    assert indices(second) == [4, 5, 6, 7]
    assert isinstance(ledger.assign("c3", 1), Refusal)
    assert ledger.release("c1") == tuple(sorted(UUID[:4]))
    assert ledger.free_count() == 4
    assert indices(ledger.assign("c3", 2)) == [0, 1]
    assert ledger.holder(UUID[0]) == "c3"
    with pytest.raises(ValueError, match="already holds"):
        ledger.assign("c3", 1)


def test_restart_rebuilds_the_ledger_from_running_containers(eight: Claim) -> None:
    ledger = CardLedger.for_claim(eight)
    ledger.assign("gone", 2)  # held before the restart by a container that is not running now
    running = {"b": [UUID[4], UUID[5]], "a": [UUID[0]], "z": [UUID[4], UUID[6]]}
    conflicts = ledger.rebuild(running)
    assert ledger.in_use() == {UUID[0], UUID[4], UUID[5], UUID[6]}
    assert ledger.cards_of("b") == (UUID[4], UUID[5])
    assert ledger.cards_of("z") == (UUID[6],)
    assert ledger.cards_of("gone") == ()
    assert conflicts == (CardConflict(ConflictKind.SHARED, UUID[4], "z", holder="b"),)
    assert conflicts[0].must_stop
    assert conflicts[0].describe() == (
        f"card {UUID[4]} is named by running containers b and z; b keeps it and z must stop"
    )
    # Never double-assigned: the next request gets exactly the cards no running container holds.
    held = ledger.in_use()
    assert {UUID[i] for i in indices(ledger.assign("new", 4))} == set(UUID) - held
    assert isinstance(ledger.assign("more", 1), Refusal)
    # Stopping the container that must stop gives back only what it alone held.
    assert ledger.release("z") == (UUID[6],)
    assert ledger.holder(UUID[4]) == "b"


def test_a_running_container_keeps_a_card_no_longer_served(describe_node: DescribeNode) -> None:
    describe_node(nvlinked_node(2, {1: {"processes": (StandinProcess(pid=500),)}}))
    claim = claim_for("all")  # pid 500 is a container from before the restart, not known yet
    ledger = CardLedger.for_claim(claim)
    conflicts = ledger.rebuild({"old": [UUID[1]]})
    assert UUID[1] in ledger.in_use()
    assert conflicts == (CardConflict(ConflictKind.NOT_SERVING, UUID[1], "old"),)
    assert not conflicts[0].must_stop
    assert "does not serve now" in conflicts[0].describe()
    assert indices(ledger.assign("new", 1)) == [0]


def test_a_card_no_longer_given_to_the_worker_stops_its_container(eight: Claim) -> None:
    claim = claim_for("0,1")
    ledger = CardLedger.for_claim(claim)
    conflicts = ledger.rebuild({"moved": [UUID[0], UUID[5]]})
    assert conflicts == (CardConflict(ConflictKind.NOT_CLAIMED, UUID[5], "moved"),)
    assert conflicts[0].must_stop
    assert UUID[5] in conflicts[0].describe()
    assert ledger.release("moved") == (UUID[0], UUID[5])
    assert ledger.free_count() == 2


# -- OCI spec edits -------------------------------------------------------------------------------


def two_of_eight(eight: Claim) -> list[Card]:
    chosen = choose_cards(eight.cards, set(UUID[:6]), 2, eight.topology)
    assert isinstance(chosen, Allocation)
    return list(chosen.cards)


def test_spec_edits_for_two_of_eight_cards(
    eight: Claim, make_dev_dir: MakeDevDir, driver_dir: Path, tmp_path: Path
) -> None:
    dev = make_dev_dir(range(8))
    config = GpuConfig(dev_dir=dev, driver_dir=driver_dir, cdi_dirs=(tmp_path / "cdi",))
    edits = spec_edits(two_of_eight(eight), discover_node_files(config), config)
    assert edits.source == "levers9"
    assert [(d.path, d.host_path, d.major, d.minor) for d in edits.devices] == [
        ("/dev/nvidia6", str(dev / "nvidia6"), 195, 6),
        ("/dev/nvidia7", str(dev / "nvidia7"), 195, 7),
        ("/dev/nvidiactl", str(dev / "nvidiactl"), 195, 255),
        ("/dev/nvidia-uvm", str(dev / "nvidia-uvm"), 509, 0),
        ("/dev/nvidia-uvm-tools", str(dev / "nvidia-uvm-tools"), 509, 1),
        ("/dev/nvidia-modeset", str(dev / "nvidia-modeset"), 195, 254),
    ]
    assert {(r.major, r.minor, r.access, r.allow) for r in edits.cgroup_rules} == {
        (d.major, d.minor, "rwm", True) for d in edits.devices
    }
    (mount,) = edits.mounts
    assert (mount.source, mount.destination) == (str(driver_dir), "/usr/local/nvidia")
    assert "ro" in mount.options
    assert dict(edits.env) == {
        "NVIDIA_VISIBLE_DEVICES": f"{UUID[6]},{UUID[7]}",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    env = edits.process_env(["PATH=/bin", "HOME=/root"])
    assert "PATH=/usr/local/nvidia/bin:/bin" in env
    assert "LD_LIBRARY_PATH=/usr/local/nvidia/lib64" in env
    oci = edits.oci_fragment()
    assert [d["path"] for d in oci["linux"]["devices"]][:2] == ["/dev/nvidia6", "/dev/nvidia7"]
    assert len(oci["linux"]["resources"]["devices"]) == 6
    assert oci["mounts"][0]["type"] == "bind"
    json.dumps(oci)  # plain data, ready for config.json


def test_spec_edits_say_what_is_missing(
    eight: Claim, make_dev_dir: MakeDevDir, driver_dir: Path, tmp_path: Path
) -> None:
    cards = two_of_eight(eight)
    dev = make_dev_dir([6])
    config = GpuConfig(dev_dir=dev, driver_dir=driver_dir, cdi_dirs=())
    with pytest.raises(GpuSetupError, match=f"nvidia7 for card {UUID[7]} \\(index 7\\) is missing"):
        spec_edits(cards, discover_node_files(config), config)
    no_driver = GpuConfig(dev_dir=make_dev_dir([7]), driver_dir=tmp_path / "none", cdi_dirs=())
    with pytest.raises(GpuSetupError, match="LEVERS9_GPU_DRIVER_DIR"):
        spec_edits(cards, discover_node_files(no_driver), no_driver)


def test_a_cdi_spec_for_nvidia_devices_is_used_instead(
    eight: Claim, make_dev_dir: MakeDevDir, tmp_path: Path
) -> None:
    dev = make_dev_dir(range(8))
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {
                "name": str(i),
                "containerEdits": {
                    "deviceNodes": [
                        {"path": f"/dev/nvidia{i}", "hostPath": str(dev / f"nvidia{i}")}
                    ]
                },
            }
            for i in range(8)
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": str(dev / "nvidiactl")}],
            "mounts": [
                {
                    "hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                    "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                    "options": ["ro", "nosuid", "nodev", "bind"],
                }
            ],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-ctk",
                    "args": ["nvidia-ctk", "hook", "update-ldcache"],
                }
            ],
        },
    }
    (cdi / "nvidia.yaml").write_text(json.dumps(spec))  # JSON is YAML too
    (cdi / "other.json").write_text(json.dumps({"kind": "vendor.example/fpga", "devices": []}))
    (cdi / "broken.json").write_text("{")
    config = GpuConfig(dev_dir=dev, driver_dir=tmp_path / "none", cdi_dirs=(cdi,))
    files = discover_node_files(config)
    assert len(files.problems) == 1
    assert "broken.json" in files.problems[0]
    edits = spec_edits(two_of_eight(eight), files, config)
    assert edits.source == f"CDI spec {cdi / 'nvidia.yaml'}"
    assert [(d.path, d.major, d.minor) for d in edits.devices] == [
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia6", 195, 6),
        ("/dev/nvidia7", 195, 7),
    ]
    assert len(edits.cgroup_rules) == 3
    assert edits.mounts[0].options == ("ro", "nosuid", "nodev", "bind")
    assert dict(edits.env)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert dict(edits.env)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert edits.oci_fragment()["hooks"]["createContainer"][0]["path"] == "/usr/bin/nvidia-ctk"
