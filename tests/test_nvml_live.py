"""A card going bad while an NVML session is open, through pynvml and the facade.

The agent opens NVML once and keeps it open while its worker runs, so what it must notice (a
critical XID, a card falling off the bus, uncorrectable ECC errors, a process that is not ours)
happens inside one session. The stand-in reads its description again whenever the file changes;
these tests rewrite it with `write_description` between two NVML calls of one session.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from nvml import DeviceUnresponsiveError, XidEvent, open_nvml
from nvml.standin import (
    StandinNode,
    StandinProcess,
    change_device,
    nvlinked_node,
    standin_device,
    with_xid,
    write_description,
)

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode

pytest_plugins = ["tests.nvml_fixtures"]

GENEROUS_S = 30.0
"""How long a test waits for something that should take milliseconds before it fails."""


def _xid(node: StandinNode, index: int, xid: int) -> StandinNode:
    return change_device(node, index, xid_events=with_xid(node.devices[index], xid).xid_events)


def test_with_xid_numbers_events_from_one() -> None:
    card = with_xid(with_xid(standin_device(0), 79), 48)
    assert card.xid_events == ((1, 79), (2, 48))
    assert card.to_json()["xid_events"] == [{"id": 1, "xid": 79}, {"id": 2, "xid": 48}]


def test_write_description_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    write_description(path, nvlinked_node(2))
    write_description(path, nvlinked_node(1))
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]  # no temporary file left
    assert '"devices"' in path.read_text()


def test_an_xid_written_mid_session_is_heard_once(describe_node: DescribeNode) -> None:
    node = nvlinked_node(2)
    path = describe_node(node)
    uuid = standin_device(1).uuid
    with open_nvml() as nvml, nvml.listen_for_xids() as early:
        assert early.wait(0) == ()
        node = _xid(node, 1, 79)
        write_description(path, node)
        with nvml.listen_for_xids() as late:
            assert early.wait(0) == (XidEvent(uuid=uuid, xid=79),)
            assert early.wait(0) == ()  # once, not again
            # Registered after the XID happened: a driver does not replay it.
            assert late.wait(0) == ()
            node = _xid(node, 1, 48)
            write_description(path, node)
            assert early.wait(0) == (XidEvent(uuid=uuid, xid=48),)
            assert late.wait(0) == (XidEvent(uuid=uuid, xid=48),)
            assert (early.wait(0), late.wait(0)) == ((), ())


def test_a_blocked_wait_wakes_for_an_xid_written_meanwhile(describe_node: DescribeNode) -> None:
    node = nvlinked_node(2)
    path = describe_node(node)
    # Far longer than the test waits for the answer: only an early wake-up passes.
    timeout_ms = int(GENEROUS_S * 1000) * 2
    with (
        open_nvml() as nvml,
        nvml.listen_for_xids() as listener,
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        waiting = pool.submit(listener.wait, timeout_ms)
        write_description(path, _xid(node, 0, 79))
        heard = waiting.result(timeout=GENEROUS_S)
    assert heard == (XidEvent(uuid=standin_device(0).uuid, xid=79),)


def test_a_card_lost_mid_session_answers_gpu_is_lost(describe_node: DescribeNode) -> None:
    node = nvlinked_node(2)
    path = describe_node(node)
    with open_nvml() as nvml:
        assert nvml.health(1).responsive
        write_description(path, change_device(node, 1, errors={"*": "GPU_IS_LOST"}))
        lost = nvml.health(1)
        assert not lost.responsive
        assert lost.error is not None
        assert "GPU is lost" in lost.error
        with pytest.raises(DeviceUnresponsiveError, match="GPU is lost"):
            nvml.device(1)
        assert nvml.health(0).responsive  # the other card still answers
        assert nvml.device(0).uuid == standin_device(0).uuid


def test_uncorrected_ecc_errors_grow_mid_session(describe_node: DescribeNode) -> None:
    node = nvlinked_node(1)
    path = describe_node(node)
    with open_nvml() as nvml:
        assert nvml.health(0).ecc_uncorrected_volatile == 0
        write_description(path, change_device(node, 0, ecc_uncorrected_volatile=3))
        assert nvml.health(0).ecc_uncorrected_volatile == 3


def test_a_process_that_appears_mid_session_is_listed(describe_node: DescribeNode) -> None:
    node = nvlinked_node(2)
    path = describe_node(node)
    with open_nvml() as nvml:
        assert nvml.processes(1) == ()
        squatter = StandinProcess(pid=4242, used_memory_bytes=1 << 30)
        write_description(path, change_device(node, 1, processes=(squatter,)))
        found = nvml.processes(1)
        assert found is not None
        assert [(p.pid, p.used_memory_bytes) for p in found] == [(4242, 1 << 30)]
        write_description(path, node)  # and gone again
        assert nvml.processes(1) == ()


def test_a_description_that_does_not_parse_is_ignored_mid_session(
    describe_node: DescribeNode,
) -> None:
    node = nvlinked_node(1)
    path = describe_node(change_device(node, 0, ecc_uncorrected_volatile=1))
    with open_nvml() as nvml:
        path.write_text('{"devices": [')  # half a file: what an atomic write never leaves
        # The session keeps answering from the last description that made sense.
        assert nvml.health(0).ecc_uncorrected_volatile == 1
        write_description(path, change_device(node, 0, ecc_uncorrected_volatile=2))
        assert nvml.health(0).ecc_uncorrected_volatile == 2


def test_an_xid_of_a_card_then_lost_is_still_heard(describe_node: DescribeNode) -> None:
    # XID 79 is the card falling off the bus: by the time the event is read, it no longer
    # answers, yet the listener still names it.
    node = nvlinked_node(2)
    path = describe_node(node)
    with open_nvml() as nvml, nvml.listen_for_xids() as listener:
        write_description(path, change_device(_xid(node, 1, 79), 1, errors={"*": "GPU_IS_LOST"}))
        assert listener.wait(0) == (XidEvent(uuid=standin_device(1).uuid, xid=79),)
