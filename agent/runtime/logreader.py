"""A container's log as the shim writes it (CRI lines), read from the start and followed.

A follower learns that the log grew from inotify (`LogWatch`: one instance for the worker while
anyone follows a log, a watch on each followed container's directory), so a line reaches it as
soon as it is written and a waiting follower costs nothing; where inotify cannot be had it
reads the file every `LOG_POLL_S` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from agent.host.inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVED_TO,
    Inotify,
)
from workerapi.models import (
    LogLine,
)

log = logging.getLogger("levers9.containers")

LOG_POLL_S = 0.025
"""How often a followed log is read for new lines without inotify: the delay a line may wait
(a read is one small syscall in a worker thread)."""
WATCHED_POLL_S = 2.0
"""How often a followed log is read anyway with inotify: a safety net (a lost event), not how
lines arrive."""
_LOG_CHANGES = IN_MODIFY | IN_CLOSE_WRITE | IN_CREATE | IN_MOVED_TO
"""Appends, the shim closing the file, and a rotation (log renamed to log.1, a new log)."""


@attrs.define
class Watched:
    """A followed directory: `changed` is set when its log changes (take it before reading,
    so a change during the read is not missed), then replaced by a fresh event."""

    wd: int
    poll_s: float
    users: int = 0
    changed: trio.Event = attrs.field(factory=trio.Event)

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class LogWatch:
    """Wakes the followers of a container's log when it changes. Each follower holds
    `watching`; while anyone does, one inotify instance is open and `run` reads its events.
    The instance is closed with the last follower, so an idle worker holds none; `run` itself
    lasts as long as its owner's nursery (it waits for the next follower in between)."""

    def __init__(self) -> None:
        self._watched: dict[int, Watched] = {}
        self._inotify: Inotify | None = None
        self._opened = trio.Event()
        """Set when a follower opens an instance for `run` to read."""
        self._running = False
        self._warned = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read the open instance's events whenever anyone follows a log, until cancelled.
        Followers who come before `started` or after the end read every `LOG_POLL_S`."""
        self._running = True
        try:
            task_status.started()
            while True:
                await self._opened.wait()
                self._opened = trio.Event()
                if self._inotify is not None:
                    await self._read(self._inotify)
        finally:
            self._running = False
            if self._inotify is not None:
                self._close(self._inotify)

    @contextlib.contextmanager
    def watching(self, directory: Path) -> Iterator[Watched]:
        """Watch `directory`'s log while the block runs; one that cannot be watched (no
        inotify, or the node's watches all used) is read every `LOG_POLL_S` instead."""
        wd = self._add(directory)
        if wd < 0:
            yield Watched(wd=-1, poll_s=LOG_POLL_S)
            return
        watched = self._watched.setdefault(wd, Watched(wd=wd, poll_s=WATCHED_POLL_S))
        watched.users += 1
        try:
            yield watched
        finally:
            watched.users -= 1
            if watched.users == 0 and self._watched.get(wd) is watched:
                del self._watched[wd]
                if self._inotify is not None:
                    # Its IN_IGNORED wakes the reader, which ends once nothing is watched.
                    with contextlib.suppress(OSError):
                        self._inotify.remove(wd)

    def _add(self, directory: Path) -> int:
        if not self._running:
            # Nobody would read the events (not started yet, or shutting down): poll.
            return -1
        if self._inotify is None:
            try:
                self._inotify = Inotify()
            except OSError as exc:
                self._warn(f"inotify is not available ({exc.strerror or exc})")
                return -1
            self._opened.set()
        try:
            return self._inotify.add(directory, _LOG_CHANGES)
        except OSError as exc:
            self._warn(f"cannot watch {directory} ({exc.strerror or exc})")
            return -1

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: followed logs are read every %g s", why, LOG_POLL_S)

    async def _read(self, inotify: Inotify) -> None:
        try:
            while self._watched:
                await trio.lowlevel.wait_readable(inotify.fileno())
                for change in inotify.read():
                    if change.overflowed:
                        for each in self._watched.values():
                            each.wake()
                        continue
                    found = self._watched.get(change.wd)
                    if found is None:
                        continue
                    if change.mask & IN_IGNORED:
                        # The directory went (the container was deleted): the followers read
                        # once more and find the container finished.
                        del self._watched[change.wd]
                    if change.name.startswith("log") or change.mask & IN_IGNORED:
                        found.wake()
        finally:
            self._close(inotify)

    def _close(self, inotify: Inotify) -> None:
        if self._inotify is inotify:
            self._inotify = None
        for each in self._watched.values():
            each.wake()  # their watch went with the instance: they read every poll_s
        self._watched.clear()
        inotify.close()


def parse_cri_line(line: str) -> LogLine | None:
    """One line of the shim's log (`TIME STREAM F|P TEXT`)."""
    parts = line.rstrip("\n").split(" ", 3)
    if len(parts) < 3:
        return None
    text = parts[3] if len(parts) == 4 else ""
    return LogLine(time=parts[0], stream=parts[1], text=text, partial=parts[2] == "P")


class LogReader:
    """Reads whole lines from a log file the shim appends to and may rotate."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None
        self._pending = b""

    def _open(self) -> bool:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 (kept open between reads)
            except FileNotFoundError:
                return False
        return True

    def read(self) -> list[str]:
        if not self._open():
            return []
        data = self._file.read(1 << 20)
        if not data:
            # Rotated? The shim renamed our file to log.1 and started a new one.
            try:
                if os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino:
                    self._file.close()
                    self._file = None
                    return self.read()
            except FileNotFoundError:
                pass
            return []
        data = self._pending + data
        lines = data.split(b"\n")
        self._pending = lines.pop()
        return [line.decode("utf-8", "replace") for line in lines]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return []
