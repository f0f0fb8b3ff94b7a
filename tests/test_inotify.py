"""inotify through its adapter (`agent.host.inotify`) and the watch that wakes log followers
(`agent.runtime.logreader.LogWatch`), on real files in a temporary directory. Followed logs
of real containers: tests/test_containers.py."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from agent.host.inotify import (
    IN_CREATE,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVED_TO,
    Change,
    Inotify,
    parse_events,
)
from agent.runtime.logreader import LOG_POLL_S, WATCHED_POLL_S, LogWatch


def _names(changes: list[Change], wd: int) -> list[tuple[str, int]]:
    return [(c.name, c.mask & (IN_MODIFY | IN_CREATE | IN_MOVED_TO)) for c in changes if c.wd == wd]


def test_events_are_parsed_with_their_padded_names() -> None:
    def event(wd: int, mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name)) if name else b""
        return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

    data = event(1, IN_MODIFY, b"log") + event(2, IN_IGNORED, b"") + event(-1, 0x4000, b"")
    assert list(parse_events(data)) == [
        Change(1, IN_MODIFY, "log"),
        Change(2, IN_IGNORED, ""),
        Change(-1, 0x4000, ""),
    ]
    assert [c.overflowed for c in parse_events(data)] == [False, False, True]


def test_a_watch_reports_what_changed_in_its_directory_and_nothing_else(tmp_path: Path) -> None:
    watched, other = tmp_path / "watched", tmp_path / "other"
    watched.mkdir()
    other.mkdir()
    inotify = Inotify()
    try:
        wd = inotify.add(watched, IN_MODIFY | IN_CREATE | IN_MOVED_TO)
        assert inotify.read() == []
        (other / "log").write_bytes(b"elsewhere\n")
        assert inotify.read() == []
        with open(watched / "log", "ab") as log:
            assert _names(inotify.read(), wd) == [("log", IN_CREATE)]
            log.write(b"line\n")
            log.flush()
            assert _names(inotify.read(), wd) == [("log", IN_MODIFY)]
        os.rename(watched / "log", watched / "log.1")
        assert _names(inotify.read(), wd) == [("log.1", IN_MOVED_TO)]
        # The same directory is the same watch; a removed one reports no more.
        assert inotify.add(watched, IN_MODIFY) == wd
        inotify.remove(wd)
        assert [c.mask & IN_IGNORED for c in inotify.read()] == [IN_IGNORED]
        (watched / "log.1").write_bytes(b"after\n")
        assert inotify.read() == []
        inotify.remove(wd)  # already gone: not an error
    finally:
        inotify.close()


def test_a_missing_directory_is_an_error_naming_it(tmp_path: Path) -> None:
    inotify = Inotify()
    try:
        with pytest.raises(FileNotFoundError) as err:
            inotify.add(tmp_path / "gone", IN_MODIFY)
        assert str(tmp_path / "gone") in str(err.value)
    finally:
        inotify.close()


async def test_a_follower_is_woken_by_its_log_only(tmp_path: Path, nursery: trio.Nursery) -> None:
    one, two = tmp_path / "c-1", tmp_path / "c-2"
    one.mkdir()
    two.mkdir()
    watch = LogWatch()
    await nursery.start(watch.run)
    with watch.watching(one) as first, watch.watching(one) as second, watch.watching(two) as third:
        assert first is second  # one watch per directory, however many follow it
        assert first.poll_s == WATCHED_POLL_S
        woken, other = first.changed, third.changed
        (one / "record.json").write_bytes(b"{}")  # the manager's record: not the log
        (two / "log").write_bytes(b"the other container\n")
        with trio.fail_after(5):
            await other.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert not woken.is_set()
        (one / "log").write_bytes(b"hello\n")
        with trio.fail_after(5):
            await woken.wait()
        assert first.changed is not woken  # the next change sets a fresh event


async def test_a_deleted_directory_wakes_its_followers(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    directory = tmp_path / "c-1"
    directory.mkdir()
    watch = LogWatch()
    await nursery.start(watch.run)
    with watch.watching(directory) as watched:
        woken = watched.changed
        directory.rmdir()
        with trio.fail_after(5):
            await woken.wait()


async def test_without_a_watch_a_follower_reads_on_a_short_period(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    watch = LogWatch()
    await nursery.start(watch.run)
    with watch.watching(tmp_path / "not-there") as watched:
        assert watched.poll_s == LOG_POLL_S


async def test_a_watch_that_does_not_run_leaves_its_followers_reading_on_a_short_period(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    watch = LogWatch()
    with watch.watching(tmp_path) as watched:  # before `run`: nobody would read the events
        assert watched.poll_s == LOG_POLL_S
    cancel = trio.CancelScope()

    async def run_until_cancelled(task_status: trio.TaskStatus[None]) -> None:
        with cancel:
            await watch.run(task_status=task_status)

    await nursery.start(run_until_cancelled)
    with watch.watching(tmp_path) as watched:
        assert watched.poll_s == WATCHED_POLL_S
        woken = watched.changed
        cancel.cancel()
        # Its end wakes the followers, whose watch went with the instance.
        with trio.fail_after(5):
            await woken.wait()
    with watch.watching(tmp_path) as watched:  # after the end
        assert watched.poll_s == LOG_POLL_S


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_nothing_is_left_open_once_nobody_follows(tmp_path: Path) -> None:
    before = _descriptors()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            watch = LogWatch()
            await nursery.start(watch.run)
            for _ in range(2):  # and a later follower opens an instance again
                with watch.watching(tmp_path) as first, watch.watching(tmp_path) as second:
                    assert first is second
                    assert _descriptors() != before
                    woken = first.changed
                    (tmp_path / "log").write_bytes(b"line\n")
                    await woken.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert _descriptors() == before
            nursery.cancel_scope.cancel()
