"""What the CLI prints: tables and `--json`, task details, pull progress and outcomes.

Every field shown to a person goes through `visible`: a task's command, env, image and reason
are whatever a workspace token holder (or a worker) wrote, and a raw ESC sequence printed to a
terminal can retitle or clear it. Control characters are shown escaped (`\x1b`). `--json` is
safe as it is (the encoder escapes them), and logs are the task's own output: printed raw.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import (
    Callable,
    Sequence,
)
from typing import Any, TextIO, TypeVar

import attrs

from control.models import MachineView, PoolView, TaskState, TaskView
from wire.errors import unstructure
from workerapi.models import LogLine, PullStatus, WorkerSummary

T = TypeVar("T")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str, *, lines: bool = False) -> str:
    """`text` with every C0 and C1 control character (tab and newline too: one field, one
    line) written as its escape, `\x1b`, so a terminal shows it instead of obeying it.
    `lines`: tab and newline stay (a message of several lines)."""
    pattern = _CONTROL_BUT_LINES if lines else _CONTROL
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rows = [[visible(cell) for cell in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 86400:
        return f"{seconds // 86400}d{seconds % 86400 // 3600}h"
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m"
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


def _age(since: float | None, now: float | None = None) -> str:
    if since is None:
        return "-"
    return format_duration((time.time() if now is None else now) - since)


def format_memory(size: int) -> str:
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size} B"


def format_cpu(millis: int) -> str:
    return f"{millis // 1000}" if millis % 1000 == 0 else f"{millis}m"


def format_pull(pull: PullStatus) -> str:
    if pull.phase == "resolving":
        return "pulling image: resolving"
    if pull.phase == "done":
        return "pulling image: done"
    return f"pulling image: {pull.done_bytes / 1e6:.1f}/{pull.total_bytes / 1e6:.1f} MB"


def task_row(view: TaskView, now: float) -> list[str]:
    """One row of `levers9 task list`: ID STATE IMAGE CARDS WORKER AGE EXIT REASON."""
    return [
        view.id,
        view.state.value,
        view.image,
        str(view.cards),
        view.worker or "-",
        _age(view.created_at, now),
        "-" if view.exit_code is None else str(view.exit_code),
        view.waiting or view.reason or "-",
    ]


TASK_HEADERS = ("id", "state", "image", "cards", "worker", "age", "exit", "reason")


def _when(at: float | None, now: float) -> str | None:
    if at is None:
        return None
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{stamp} ({format_duration(now - at)} ago)"


def task_details(view: TaskView, now: float) -> list[tuple[str, str]]:
    """`levers9 task get` for people: the fields that are set, one per line."""
    fields: list[tuple[str, str | None]] = [
        ("id", view.id),
        ("workspace", view.workspace),
        ("state", view.state.value),
        ("waiting", view.waiting),
        ("pull", format_pull(view.pull) if view.pull else None),
        ("container", view.container_state),
        ("exit code", None if view.exit_code is None else str(view.exit_code)),
        ("reason", view.reason),
        ("image", view.image),
        ("command", " ".join(view.command) if view.command is not None else None),
        ("args", " ".join(view.args) if view.args is not None else None),
        ("cards", str(view.cards) if view.cards else None),
        ("card ids", ", ".join(view.card_ids) if view.card_ids else None),
        ("cpu", format_cpu(view.cpu_millis) if view.cpu_millis else None),
        ("memory", format_memory(view.memory_bytes) if view.memory_bytes else None),
        ("ports", ", ".join(map(str, view.ports)) if view.ports else None),
        ("timeout", f"{view.timeout_s:g} s" if view.timeout_s is not None else None),
        ("snapshot", view.snapshot),
        ("worker", view.worker),
        ("node", view.node),
        ("created", _when(view.created_at, now)),
        ("started", _when(view.started_at, now)),
        ("running", _when(view.running_at, now)),
        ("finished", _when(view.finished_at, now)),
    ]
    return [(name, value) for name, value in fields if value is not None]


def format_details(pairs: Sequence[tuple[str, str]]) -> str:
    width = max((len(name) for name, _ in pairs), default=0) + 1
    return "\n".join(f"{(name + ':').ljust(width)} {visible(value)}" for name, value in pairs)


def progress_text(view: TaskView) -> str:
    """What `levers9 run` shows while the task starts."""
    if view.state is TaskState.PENDING:
        return view.waiting or "waiting for a worker"
    if view.state is TaskState.STARTING:
        if view.pull is not None and view.pull.phase != "done":
            return format_pull(view.pull)
        where = f" on {view.worker}" if view.worker else ""
        return f"starting the container{where}"
    return view.state.value


def _progress_phase(view: TaskView) -> tuple[str, str | None, str | None]:
    return view.state.value, view.waiting, view.pull.phase if view.pull else None


def not_started_detail(view: TaskView) -> str:
    """Why a task has not started, for the DEADLINE_EXCEEDED line."""
    if view.waiting:
        return view.waiting.removeprefix("waiting: ")
    if view.pull is not None:
        return format_pull(view.pull)
    if view.container_state:
        return f"container {view.container_state}"
    return "no progress reported yet"


def deadline_message(view: TaskView, wait_s: float) -> str:
    return (
        f"DEADLINE_EXCEEDED: task {view.id} has not started within {wait_s:g} s "
        f"({view.state.value}: {visible(not_started_detail(view))}); it goes on: follow it with "
        f"'levers9 task logs -f {view.id}' or 'levers9 task get {view.id}'"
    )


def task_outcome(view: TaskView) -> tuple[int, str | None]:
    """The exit code `levers9 run` ends with for an ended task, and what to print (stderr)."""
    code = view.exit_code
    if view.state is TaskState.SUCCEEDED:
        return (code if code is not None and 0 <= code <= 255 else 0), None
    reason = visible(view.reason or "no reason given")
    message = f"task {view.id} {view.state.value}: {reason}"
    if view.state is TaskState.FAILED and code is not None and 0 < code <= 255:
        return code, (message if view.reason else None)
    return 1, message


@attrs.define
class Progress:
    """The starting task's progress on stderr: on a terminal one line rewritten in place (as
    it changes), elsewhere a line each time the phase (state, waiting reason, pull phase)
    changes, so logs stay readable."""

    tty: bool
    width: int = 0
    _shown: str | None = None
    _phase: tuple[str, str | None, str | None] | None = None
    _open: bool = False

    def update(self, view: TaskView) -> str:
        """What to write to stderr for this state of the task ('' for nothing)."""
        text = visible(progress_text(view))
        if self.tty:
            if self.width > 1:
                text = text[: self.width - 1]
            if text == self._shown:
                return ""
            self._shown = text
            self._open = True
            return f"\r{text}\x1b[K"
        phase = _progress_phase(view)
        if phase == self._phase:
            return ""
        self._phase = phase
        return text + "\n"

    def finish(self) -> str:
        """What clears the progress line before other output."""
        if self._open:
            self._open = False
            self._shown = None
            return "\r\x1b[K"
        return ""


@attrs.define
class Console:
    """Where a command writes: stdout, stderr, and whether stderr is a terminal."""

    out: TextIO
    err: TextIO
    err_tty: bool = False

    @classmethod
    def from_sys(cls) -> Console:
        return cls(sys.stdout, sys.stderr, isatty(sys.stderr))

    def status(self, text: str) -> None:
        if text:
            self.err.write(text)
            self.err.flush()

    def print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def log_line(self, line: LogLine) -> None:
        stream = self.err if line.stream == "stderr" else self.out
        stream.write(line.text if line.partial else line.text + "\n")
        stream.flush()

    def write_bytes(self, channel: int, data: bytes) -> None:
        stream = self.err if channel == 2 else self.out
        stream.flush()
        buffer = getattr(stream, "buffer", None)
        if buffer is None:
            stream.write(data.decode(errors="replace"))
        else:
            buffer.write(data)
            buffer.flush()


def has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    return True


def isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def show_list(
    as_json: bool,
    items: Sequence[T],
    headers: Sequence[str],
    row: Callable[[T], Sequence[str]],
) -> None:
    """A listing as a table for people, or (`--json`) as a JSON list of the wire objects."""
    if as_json:
        print(json.dumps([unstructure(item) for item in items], indent=2))
        return
    print(render_table(headers, [row(item) for item in items]))


WORKER_HEADERS = (
    "worker",
    "mode",
    "connected",
    "node",
    "cards",
    "address",
    "version",
    "age",
    "replica",
)


def worker_row(w: WorkerSummary) -> list[str]:
    return [
        w.worker_id,
        w.mode,
        "yes" if w.connected else "no",
        w.node or "-",
        str(w.cards),
        w.address or "-",
        w.version or "-",
        _age(w.registered_at),
        w.replica or "-",
    ]


def format_gib(value: int) -> str:
    return f"{value / (1 << 30):.1f}Gi"


MACHINE_HEADERS = (
    "POOL",
    "NODE",
    "GPU",
    "CARDS T/BUSY/IDLE/BAD/OTHERS/FREE",
    "CPU FREE",
    "MEM FREE",
    "WORKER",
    "AGE",
)


def machine_row(m: MachineView) -> list[str]:
    """One row of `levers9 machine list`."""
    cards = m.cards
    worker = m.worker
    bad = cards.unhealthy + cards.occupied + cards.refused
    return [
        m.pool,
        m.node,
        m.gpu_model or "-",
        f"{cards.total}/{cards.busy}/{cards.idle}/{bad}/{cards.others}/{cards.free}",
        f"{m.cpu_free_millis}m",
        format_gib(m.memory_free_bytes),
        worker.state.value if worker else "-",
        f"{int(worker.age_seconds)}s" if worker else "-",
    ]


def card_problem_lines(m: MachineView) -> list[str]:
    """`levers9 machine list`'s line under the table for each card counted BAD: which card,
    what is wrong with it (the worker's words)."""
    return [
        f"pool {m.pool}: node {m.node}: card {p.index} ({p.uuid}): {_problem(p.state, p.reason)}"
        for p in m.card_problems
    ]


def _problem(state: str, reason: str) -> str:
    if state == "occupied" or reason.startswith(state):
        return reason  # "used by a process outside levers9: pid 4242, 1024 MiB"
    return f"{state}: {reason}"


POOL_HEADERS = (
    "POOL",
    "SOURCE",
    "FLAVOR",
    "ENDPOINT",
    "NAMESPACE",
    "MODE",
    "MACHINES",
    "LEADER",
    "ERROR",
)


def pool_row(v: PoolView) -> list[str]:
    return [
        v.name,
        v.source,
        v.flavor,
        v.endpoint,
        v.namespace,
        "tunnel" if v.tunnel else "direct",
        str(v.machines),
        v.leader or "-",
        v.error or "-",
    ]
