"""The fault campaign's invariants: each finds what it is for in a small made-up input and
nothing in a clean one; the store check on a real object store; the leftover check against a
real container of the agent's own container manager (as root)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from agent.runtime.manager import ContainerManager, open_container_manager
from agent.store.objects import ObjectStore
from control.tasks.dispatch import NOT_FOLLOWED
from sim.chaos.invariants import (
    NodeState,
    TaskEnd,
    Violation,
    jobs_per_node,
    leftovers_in,
    lines_once,
    node_leftovers,
    ran_twice,
    replicas_agree,
    store_violations,
    summarize,
    task_ends,
)
from tests.test_containers import state_config
from workerapi.models import ContainerSpec

if TYPE_CHECKING:
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.registry_fixtures"]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")

# A network prefix, table and pool of this test's own: other tests on the machine use the
# default "l9", and the leftover check must see only this node's.
PREFIX = "lqc"


def names(violations: list[Violation]) -> list[str]:
    return [v.invariant for v in violations]


# -- samples ---------------------------------------------------------------------------------------


def test_two_active_jobs_on_a_node_is_one_violation_per_span() -> None:
    assert jobs_per_node([(0.0, {"n1": 1, "n2": 0}), (1.0, {"n1": 1, "n2": 1})]) == []
    found = jobs_per_node(
        [
            (0.0, {"n1": 1, "n2": 2}),
            (1.0, {"n1": 1, "n2": 3}),
            (2.0, {"n1": 1, "n2": 1}),
            (3.0, {"n1": 2, "n2": 1}),
        ]
    )
    assert names(found) == ["jobs-per-node", "jobs-per-node"]
    assert "node n2 had 3 active worker Jobs from t=0.0 s to t=1.0 s" in found[0].detail
    assert "node n1 had 2 active worker Jobs at t=3.0 s" in found[1].detail


def test_a_task_running_on_two_nodes_at_once_ran_twice() -> None:
    clean = [(0.0, {"n1": ["a"], "n2": ["b"]}), (1.0, {"n1": [], "n2": ["a", "b"]})]
    assert ran_twice(clean) == []
    found = ran_twice([(0.0, {"n1": ["a"], "n2": ["b"]}), (1.0, {"n1": ["a"], "n2": ["a"]})])
    assert found == [
        Violation("ran-twice", "task a ran twice at once, on nodes n1, n2, at t=1.0 s")
    ]


# -- task ends -------------------------------------------------------------------------------------


def test_every_task_ends_with_a_cause_or_exit_code_zero() -> None:
    clean = {
        "ok": TaskEnd("succeeded", exit_code=0),
        "bad": TaskEnd("failed", reason="exited with code 2", exit_code=2),
        "gone": TaskEnd("lost", reason="its worker went away"),
        "stop": TaskEnd("cancelled", reason="cancelled by its user"),
    }
    assert task_ends(list(clean), clean) == []
    records = {
        "running": TaskEnd("running"),
        "wrong-code": TaskEnd("succeeded", exit_code=1),
        "no-reason": TaskEnd("failed", reason="  "),
        "not-followed": TaskEnd("failed", reason=NOT_FOLLOWED),
        "by-transport": TaskEnd(
            "failed", reason="worker w-1 unreachable: connection lost: transport broke"
        ),
    }
    found = task_ends(["vanished", *records], records)
    assert summarize(found) == {
        "task-failed-by-transport": 1,
        "task-exit-code": 1,
        "task-no-cause": 1,
        "task-not-followed": 1,
        "task-unfinished": 1,
        "task-vanished": 1,
    }
    assert all(any(task in v.detail for v in found) for task in ["vanished", *records])


def test_replicas_answer_a_task_the_same() -> None:
    done = TaskEnd("succeeded", exit_code=0)
    assert replicas_agree({"r0": {"a": done}, "r1": {"a": done, "b": done}, "r2": {}}) == []
    found = replicas_agree({"r0": {"a": done}, "r1": {"a": TaskEnd("lost", reason="gone")}})
    assert names(found) == ["replicas-disagree"]
    assert "task a" in found[0].detail
    assert "replica r1 says lost" in found[0].detail


# -- log followers ---------------------------------------------------------------------------------


def test_a_follower_sees_each_line_once_and_in_order() -> None:
    expected = ["one", "two", "three", "four"]
    assert lines_once("f", "t", expected, expected, complete=True) == []
    assert lines_once("f", "t", ["one", "two"], expected, complete=False) == []
    found = lines_once("f", "t", ["one", "three", "two", "one", "eleven"], expected, complete=True)
    assert summarize(found) == {
        "log-duplicate": 1,
        "log-missing": 1,
        "log-order": 1,
        "log-unexpected": 1,
    }
    by_name = {v.invariant: v.detail for v in found}
    assert (
        by_name["log-duplicate"] == "follower f of task t saw 1 line(s) more than once, first 'one'"
    )
    assert "first 'two'" in by_name["log-order"]
    assert "first 'eleven'" in by_name["log-unexpected"]
    assert "first 'four'" in by_name["log-missing"]
    assert lines_once("f", "t", ["one", "two"], expected, complete=True) == [
        Violation(
            "log-missing",
            "follower f of task t missed 2 line(s) of a task that succeeded, first 'three'",
        )
    ]


def test_a_line_written_twice_may_be_seen_twice() -> None:
    expected = ["tick", "tick", "done"]
    assert lines_once("f", "t", expected, expected, complete=True) == []
    assert names(lines_once("f", "t", ["tick", "tick", "tick"], expected, complete=False)) == [
        "log-duplicate"
    ]


# -- the object store ------------------------------------------------------------------------------


async def test_a_corrupted_object_is_named_with_its_node(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "state", budget_bytes=1 << 30, free_floor_bytes=0)
    digests = []
    for number, content in enumerate([b"first object\n" * 1000, b"second", b""]):
        source = tmp_path / f"source-{number}"
        source.write_bytes(content)
        digests.append((await store.ingest_file(source)).digest)
    assert store_violations("n1", tmp_path / "state") == []

    victim = store.path_of(digests[0])
    os.chmod(victim, 0o644)
    with victim.open("r+b") as file:
        file.seek(5000)
        byte = file.read(1)
        file.seek(5000)
        file.write(bytes([byte[0] ^ 1]))
    found = store_violations("n1", tmp_path / "state")
    assert names(found) == ["store-corrupt"]
    assert "node n1" in found[0].detail
    assert digests[0] in found[0].detail

    victim.write_bytes(b"")
    (victim.parent / "not-a-digest").write_bytes(b"x")
    assert sorted(names(store_violations("n1", tmp_path / "state"))) == [
        "store-name",
        "store-truncated",
    ]


def test_a_node_without_a_store_has_nothing_wrong_in_it(tmp_path: Path) -> None:
    assert store_violations("n1", tmp_path) == []


# -- leftovers, decided ----------------------------------------------------------------------------


def test_what_no_owned_container_accounts_for_is_left_over(tmp_path: Path) -> None:
    state_dir = tmp_path.resolve() / "state"
    bucket = state_dir / "volumes" / "mounts" / "00001-ab" / "volume"
    state = NodeState(
        runc=("c1",),
        records=("c1", "c2"),
        mounts=(
            (state_dir / "containers" / "c1" / "rootfs", "overlay"),
            (bucket, "fuse.rclone"),
            (state_dir / "elsewhere", "tmpfs"),
        ),
        netns=(f"{PREFIX}-c1",),
        veths=((f"{PREFIX}ha9fe5000", "c1"), (f"{PREFIX}ha9fe5004", "")),
        cgroups=(("c1", Path("/sys/fs/cgroup/levers9/c1")),),
        rclones=((4242, f"rclone mount :s3:bucket {bucket}"),),
    )
    held = leftovers_in("n1", state_dir, PREFIX, state, {"c1"})
    # c1 is owned; only the unknown mount and the half-made veth are left.
    assert sorted(names(held)) == ["leftover-mount", "leftover-veth"]
    assert "half made" in next(v.detail for v in held if v.invariant == "leftover-veth")

    found = leftovers_in("n1", state_dir, PREFIX, state, {"c9"})
    assert summarize(found) == {
        "leftover-bucket-mount": 1,
        "leftover-cgroup": 1,
        "leftover-mount": 1,
        "leftover-netns": 1,
        "leftover-rclone": 1,
        "leftover-rootfs": 1,
        "leftover-runc": 1,
        "leftover-veth": 2,
    }
    assert all(v.detail.startswith("node n1: ") for v in found)
    kinds = {"runc", "rootfs", "netns", "cgroup"}
    assert all("c1" in v.detail for v in found if v.invariant.removeprefix("leftover-") in kinds)


# -- leftovers, read from a real container ---------------------------------------------------------


@pytest.fixture
async def own_network_manager(tmp_path: Path) -> AsyncIterator[ContainerManager]:
    config = state_config(
        tmp_path,
        network_prefix=PREFIX,
        network_table="levers9_chaos_test",
        network_pool="169.254.80.0/20",
    )
    async with open_container_manager(config) as manager:
        yield manager


@needs_root
async def test_a_running_container_is_a_leftover_only_when_no_task_owns_it(
    own_network_manager: ContainerManager, registry: SharedRegistry
) -> None:
    manager = own_network_manager
    state_dir = manager.config.state_dir
    cid = "chaos-leftover"
    spec = ContainerSpec(image=registry.busybox, id=cid, command=("sleep", "300"))
    container = await manager.wait_settled(await manager.create(spec))
    assert container.state.value == "running", container.status()

    def check(owned: set[str]) -> list[Violation]:
        return node_leftovers("n1", state_dir, PREFIX, owned)

    assert await trio.to_thread.run_sync(check, {cid}) == []
    found = await trio.to_thread.run_sync(check, set())
    assert {"leftover-runc", "leftover-rootfs", "leftover-netns", "leftover-veth"} <= set(
        names(found)
    ), found
    # One violation for the cgroup, however many hierarchies hold it.
    assert names(found).count("leftover-cgroup") == 1, found
    assert all(cid in v.detail and v.detail.startswith("node n1: ") for v in found), found

    await manager.stop(cid, grace_s=0)
    await manager.delete(cid)
    assert await trio.to_thread.run_sync(check, set()) == []
