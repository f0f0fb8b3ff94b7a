"""A container's log as the shim writes it (CRI lines), read from the start and followed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agent.api.models import (
    LogLine,
)

LOG_POLL_S = 0.025
"""How often a followed log is read for new lines: the delay a first line may wait (a read is
one small syscall in a worker thread)."""


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
