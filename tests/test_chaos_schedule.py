"""The chaos campaign's schedule (pure): the same seed draws the same faults, every round meets
every kind, and what is drawn fits the installation."""

from __future__ import annotations

import pytest

from sim.chaos.schedule import KINDS, planned

NODES = ("node-1", "node-2", "node-3", "node-4")


def test_the_same_seed_draws_the_same_faults_and_another_seed_others() -> None:
    first = planned(7, 60, nodes=NODES, replicas=3)
    assert planned(7, 60, nodes=NODES, replicas=3) == first
    assert planned(8, 60, nodes=NODES, replicas=3) != first
    assert [f.number for f in first] == list(range(60))


def test_each_round_meets_every_kind_once() -> None:
    faults = planned(3, 3 * len(KINDS), nodes=NODES, replicas=3)
    for start in range(0, len(faults), len(KINDS)):
        round_ = faults[start : start + len(KINDS)]
        assert sorted(f.kind for f in round_) == sorted(k.name for k in KINDS)


def test_what_is_drawn_fits_the_installation_and_the_kind() -> None:
    kinds = {k.name: k for k in KINDS}
    for fault in planned(11, 200, nodes=NODES, replicas=3):
        kind = kinds[fault.kind]
        low, high = kind.lasts_s
        assert low <= fault.lasts_s <= high
        assert 1.0 <= fault.pause_s <= 4.0
        if kind.target == "replica":
            assert fault.target in {"replica-0", "replica-1", "replica-2"}
        elif fault.kind == "node_not_ready":
            assert fault.target in NODES
        else:
            assert fault.target == ""
        if fault.kind == "watch_lag":
            assert 0.8 <= fault.amount <= 5.0
        if fault.kind == "registry_stall":
            assert 64 << 10 <= fault.amount < 1 << 20


def test_a_campaign_may_draw_from_some_kinds_only() -> None:
    faults = planned(5, 10, nodes=NODES, replicas=3, kinds=["watch_lag", "replica_kill"])
    assert {f.kind for f in faults} == {"watch_lag", "replica_kill"}
    with pytest.raises(KeyError):
        planned(5, 1, nodes=NODES, replicas=3, kinds=["no_such_kind"])
    with pytest.raises(ValueError, match="node"):
        planned(5, 1, nodes=(), replicas=3)
