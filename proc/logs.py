"""Structured logging for both programs: one JSON object per line when not on a TTY.

Operators read worker logs with `kubectl logs`; a line per event with its fields as JSON keys
is what log pipelines parse. On a terminal the same records print as plain text.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import threading
import time

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            entry[key] = value if isinstance(value, int | float | str | bool) else str(value)
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


def fields_of(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields a call passed with `extra=` (pool, node, worker, task, ...)."""
    return {
        key: value
        for key, value in vars(record).items()
        if key not in _STANDARD and not key.startswith("_")
    }


class TextFormatter(logging.Formatter):
    """A line for a person at a terminal: the message, then the fields as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = fields_of(record)
        if not fields:
            return line
        head, sep, tail = line.partition("\n")
        shown = " ".join(f"{key}={value}" for key, value in fields.items())
        return f"{head}  {shown}{sep}{tail}"


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if sys.stderr.isatty():
        handler.setFormatter(TextFormatter())
    else:
        handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RecentLogs(logging.Handler):
    """The agent's last log lines, kept in memory for `GET /v1/agent/logs` (bounded).

    Operators of a private cluster may not reach the pod's log through the cluster; the
    controlplane can read it over the worker's own connection instead. Records may come from
    worker threads (NVML calls), hence the lock; readers poll by sequence number.
    """

    def __init__(self, capacity: int = 2000) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=capacity)
        self._next = 0
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        with self._guard:
            self._lines.append((self._next, line))
            self._next += 1

    def since(self, sequence: int) -> tuple[list[str], int]:
        """Lines numbered `sequence` and later (those still kept), and the next number."""
        with self._guard:
            lines = [line for number, line in self._lines if number >= sequence]
            return lines, self._next
