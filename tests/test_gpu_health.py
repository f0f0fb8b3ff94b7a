"""The health decisions while the worker runs (agent/gpus/health.py), the ledger's part in them,
the "ours" test by cgroup, the settings, and the claim that counts our containers' processes."""

from __future__ import annotations

import datetime
from pathlib import Path

import attrs
import pytest

from agent.daemon.config import ConfigError, load_health_config
from agent.daemon.metrics import AgentCollector
from agent.gpus.claim import CARD_FAULT_XIDS, Assignment, Card, CardRef, Claim, decide_claim
from agent.gpus.health import (
    CGROUP_PARENT,
    DEFAULT_FAULT_XIDS,
    SERVING_REASON,
    CardObservation,
    CardWatch,
    decide_card,
    decide_health,
    is_ours,
    occupied_reason,
    our_pids,
)
from agent.gpus.ledger import CardLedger
from agent.runtime import ocispec
from nvml.model import Device, DeviceState, Health, Process, Snapshot, XidEvent
from workerapi.models import CardInfo, CardState

UUID = "GPU-00000000-0000-0000-0000-000000000001"
OTHER = "GPU-00000000-0000-0000-0000-000000000002"
AT = datetime.datetime(2026, 12, 8, 12, 3, 1, tzinfo=datetime.UTC)
FAULTS = DEFAULT_FAULT_XIDS


def serving(uuid: str = UUID, index: int = 0, ecc: int | None = 0) -> CardWatch:
    return CardWatch(uuid, index, CardState.SERVING, SERVING_REASON, ecc_uncorrected_volatile=ecc)


def healthy(uuid: str = UUID, ecc: int = 0, processes: tuple[Process, ...] = ()) -> CardObservation:
    return CardObservation(
        uuid, health=Health(responsive=True, ecc_uncorrected_volatile=ecc), processes=processes
    )


def test_default_fault_xids_hold_the_documented_set_and_every_card_fault() -> None:
    documented = {48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}
    assert documented <= DEFAULT_FAULT_XIDS
    assert set(CARD_FAULT_XIDS) == DEFAULT_FAULT_XIDS


def test_a_critical_xid_quarantines_the_card_naming_xid_meaning_and_time() -> None:
    after = decide_card(serving(), [79], None, (), FAULTS, AT)
    assert after.state is CardState.UNHEALTHY
    assert after.xid == 79
    assert "XID 79 at 12:03:01 UTC" in after.reason
    assert CARD_FAULT_XIDS[79] in after.reason
    assert UUID in after.reason and "card 0" in after.reason


def test_an_xid_outside_the_configured_set_leaves_the_card_serving() -> None:
    assert decide_card(serving(), [13], None, (), FAULTS, AT).state is CardState.SERVING
    assert decide_card(serving(), [79], None, (), frozenset({48}), AT).state is CardState.SERVING


def test_an_xid_for_another_card_leaves_this_one_alone() -> None:
    cards, changes = decide_health(
        [serving(), serving(OTHER, 1)], [XidEvent(OTHER, 48)], {}, (), FAULTS, AT
    )
    assert [c.state for c in cards] == [CardState.SERVING, CardState.UNHEALTHY]
    assert [(t.uuid, t.before, t.after, t.xid) for t in changes] == [
        (OTHER, CardState.SERVING, CardState.UNHEALTHY, 48)
    ]


def test_an_xid_read_with_the_health_counts_too() -> None:
    observation = CardObservation(UUID, health=Health(responsive=True, xids=(94,)))
    cards, _ = decide_health([serving()], [], {UUID: observation}, (), FAULTS, AT)
    assert cards[0].state is CardState.UNHEALTHY and cards[0].xid == 94


def test_grown_uncorrectable_ecc_errors_quarantine_the_card() -> None:
    after = decide_card(serving(ecc=2), [], healthy(ecc=3), (), FAULTS, AT)
    assert after.state is CardState.UNHEALTHY
    assert "1 new uncorrectable ECC error" in after.reason


def test_the_first_ecc_count_is_the_baseline_and_an_unchanged_one_is_fine() -> None:
    first = decide_card(serving(ecc=None), [], healthy(ecc=5), (), FAULTS, AT)
    assert first.state is CardState.SERVING and first.ecc_uncorrected_volatile == 5
    assert decide_card(first, [], healthy(ecc=5), (), FAULTS, AT).state is CardState.SERVING


def test_a_card_that_stops_answering_is_quarantined() -> None:
    lost = CardObservation(UUID, error="nvmlDeviceGetHandleByIndex: GPU is lost")
    after = decide_card(serving(), [], lost, (), FAULTS, AT)
    assert after.state is CardState.UNHEALTHY and "GPU is lost" in after.reason
    unresponsive = CardObservation(UUID, health=Health(responsive=False, error="off the bus"))
    after = decide_card(serving(), [], unresponsive, (), FAULTS, AT)
    assert after.state is CardState.UNHEALTHY and "off the bus" in after.reason


def test_unhealthy_is_final() -> None:
    sick = decide_card(serving(), [79], None, (), FAULTS, AT)
    cards, changes = decide_health([sick], [], {UUID: healthy()}, (), FAULTS, AT)
    assert cards == (sick,) and changes == ()
    refused = CardWatch(UUID, 0, CardState.REFUSED, "held by another")
    assert decide_card(refused, [], healthy(), (), FAULTS, AT) == refused


def test_a_foreign_process_occupies_the_card_and_its_end_gives_it_back() -> None:
    squatter = healthy(processes=(Process(4242, 1024 << 20),))
    cards, changes = decide_health([serving()], [], {UUID: squatter}, (), FAULTS, AT)
    assert cards[0].state is CardState.OCCUPIED
    assert cards[0].reason == "used by process outside levers9: pid 4242, 1024 MiB"
    assert changes[0].after is CardState.OCCUPIED
    cards, changes = decide_health(cards, [], {UUID: healthy()}, (), FAULTS, AT)
    assert cards[0].state is CardState.SERVING and cards[0].reason == SERVING_REASON
    assert [(t.before, t.after) for t in changes] == [(CardState.OCCUPIED, CardState.SERVING)]


def test_an_occupied_card_whose_squatters_change_reports_the_new_reason() -> None:
    one = healthy(processes=(Process(1, 1 << 20),))
    two = healthy(processes=(Process(1, 1 << 20), Process(2, None)))
    cards, _ = decide_health([serving()], [], {UUID: one}, (), FAULTS, AT)
    cards, changes = decide_health(cards, [], {UUID: two}, (), FAULTS, AT)
    assert len(changes) == 1 and "pid 2, memory unknown" in changes[0].reason
    _, changes = decide_health(cards, [], {UUID: two}, (), FAULTS, AT)
    assert changes == ()


def test_our_own_processes_do_not_occupy_the_card() -> None:
    ours = healthy(processes=(Process(31, 1 << 30),))
    cards, changes = decide_health([serving()], [], {UUID: ours}, {31}, FAULTS, AT)
    assert cards[0].state is CardState.SERVING and changes == ()


def test_processes_nvml_cannot_list_leave_the_state_as_it_was() -> None:
    unknown = CardObservation(UUID, health=Health(responsive=True), processes=None)
    occupied = CardWatch(UUID, 0, CardState.OCCUPIED, occupied_reason([Process(9, None)]))
    assert decide_card(occupied, [], unknown, (), FAULTS, AT) == occupied


def test_an_occupied_card_can_still_turn_unhealthy() -> None:
    occupied = CardWatch(UUID, 0, CardState.OCCUPIED, occupied_reason([Process(9, None)]))
    assert decide_card(occupied, [48], None, (), FAULTS, AT).state is CardState.UNHEALTHY


# -- the ledger -------------------------------------------------------------------------------


def _card(uuid: str, index: int) -> Card:
    return Card(
        uuid, index, index, "Stand-in", 1 << 34, f"0000:0{index}:00.0", CardState.SERVING, ""
    )


def test_the_ledger_never_assigns_an_unhealthy_card_and_an_occupied_one_only_when_freed() -> None:
    ledger = CardLedger(cards=(_card(UUID, 0), _card(OTHER, 1)))
    assert ledger.free_count() == 2
    ledger.set_state(UUID, CardState.UNHEALTHY)
    assert ledger.free_count() == 1
    ledger.set_state(UUID, CardState.SERVING)  # quarantine is final
    assert ledger.free_count() == 1
    ledger.set_state(OTHER, CardState.OCCUPIED)
    assert ledger.free_count() == 0
    assert not hasattr(ledger.assign("c1", 1), "cards")
    ledger.set_state(OTHER, CardState.SERVING)
    allocation = ledger.assign("c1", 1)
    assert [c.uuid for c in getattr(allocation, "cards", ())] == [OTHER]


def test_a_card_held_by_a_container_stays_held_when_it_turns_unhealthy() -> None:
    ledger = CardLedger(cards=(_card(UUID, 0),))
    ledger.assign("c1", 1)
    ledger.set_state(UUID, CardState.UNHEALTHY)
    assert ledger.holder(UUID) == "c1"
    assert ledger.release("c1") == (UUID,)
    assert ledger.free_count() == 0


# -- ours, by cgroup --------------------------------------------------------------------------


def test_the_cgroup_parent_is_the_runtimes() -> None:
    assert CGROUP_PARENT == ocispec.CGROUP_PARENT


@pytest.mark.parametrize(
    ("text", "ours"),
    [
        ("0::/levers9/c-1234\n", True),
        ("0::/levers9/c-1234/inner\n", True),
        ("0::/../../levers9/c-1234\n", True),
        ("12:memory:/levers9/c-1\n11:cpu:/levers9/c-1\n", True),
        ("0::/levers9\n", False),
        ("0::/kubepods/burstable/pod1/abc\n", False),
        ("0::/user.slice/levers9-ish/x\n", False),
        ("", False),
    ],
)
def test_is_ours_reads_the_cgroup_path(text: str, ours: bool) -> None:
    assert is_ours(text) is ours


def test_our_pids_reads_proc_and_skips_what_is_gone(tmp_path: Path) -> None:
    for pid, cgroup in ((10, "0::/levers9/c1\n"), (11, "0::/system.slice/x\n")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(cgroup)
    assert our_pids([10, 11, 12], tmp_path) == {10}


def test_a_claim_serves_a_card_that_runs_a_process_of_ours(tmp_path: Path) -> None:
    (tmp_path / "31").mkdir()
    (tmp_path / "31" / "cgroup").write_text("0::/levers9/running-container\n")
    device = Device(
        index=0,
        uuid=UUID,
        name="Stand-in",
        minor=0,
        memory_total_bytes=1 << 34,
        memory_used_bytes=1 << 30,
        pci_bus_id="0000:01:00.0",
        mig_enabled=False,
    )
    state = DeviceState(
        device=device,
        health=Health(responsive=True, ecc_uncorrected_volatile=0),
        processes=(Process(31, 1 << 30),),
    )
    snapshot = Snapshot(driver_version="1", cuda_driver_version=None, devices=(state,))
    assignment = Assignment(source="test", refs=(CardRef(text=UUID, uuid=UUID),))
    foreign = decide_claim(assignment, snapshot)
    assert foreign.cards[0].state is CardState.REFUSED
    claim: Claim = decide_claim(assignment, snapshot, our_pids([31], tmp_path))
    assert claim.cards[0].state is CardState.SERVING


# -- settings ---------------------------------------------------------------------------------


def test_health_settings_default_and_parse() -> None:
    default = load_health_config({})
    assert default.fault_xids == DEFAULT_FAULT_XIDS
    assert default.policy == "fail" and default.poll_s == 2.0
    config = load_health_config(
        {
            "LEVERS9_GPU_FAULT_XIDS": "79, 48",
            "LEVERS9_GPU_FAULT_POLICY": "mark",
            "LEVERS9_GPU_HEALTH_POLL_S": "0.5",
        }
    )
    assert config.fault_xids == {48, 79} and config.policy == "mark" and config.poll_s == 0.5


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LEVERS9_GPU_FAULT_XIDS", "79,bus"),
        ("LEVERS9_GPU_FAULT_XIDS", "-1"),
        ("LEVERS9_GPU_FAULT_POLICY", "ignore"),
        ("LEVERS9_GPU_HEALTH_POLL_S", "0"),
    ],
)
def test_bad_health_settings_are_refused_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        load_health_config({variable: value})


# -- metrics ----------------------------------------------------------------------------------


def test_the_card_states_are_a_metric_read_at_each_scrape() -> None:
    cards = [
        CardInfo(UUID, 0, "Stand-in", 1 << 34, CardState.SERVING, SERVING_REASON),
        CardInfo(OTHER, 1, "Stand-in", 1 << 34, CardState.SERVING, SERVING_REASON),
    ]
    collector = AgentCollector(worker="w", mode="tunnel", claim=lambda: tuple(cards))

    def health() -> dict[tuple[str, ...], float]:
        for family in collector.collect():
            if family.name == "levers9_gpu_health":
                return {
                    (s.labels["uuid"], s.labels["index"], s.labels["state"]): s.value
                    for s in family.samples
                }
        return {}

    assert health() == {(UUID, "0", "serving"): 1, (OTHER, "1", "serving"): 1}
    cards[0] = attrs.evolve(cards[0], state=CardState.UNHEALTHY, reason="XID 79")
    assert health() == {(UUID, "0", "unhealthy"): 1, (OTHER, "1", "serving"): 1}
