"""`levers9`: the operator's and user's command line, speaking the controlplane's API.

Global options `--controlplane URL` and `--token TOKEN` (or `LEVERS9_CONTROLPLANE`,
`LEVERS9_TOKEN`; `LEVERS9_CA` names a CA file for a controlplane whose certificate is not
signed by a public CA). Listings print a table for people and JSON with `--json`. Errors are
one line that says what to do, and exit 1 (2 for a mistyped command line).

Parsing options and formatting what people read are pure functions at the top (unit-tested
without a controlplane); the commands below them are a thin layer that makes the calls
(`control.client`). `levers9 run` submits a task, then follows its logs and polls its state in
parallel, so the first line of output appears as soon as the task produces it; its exit code
is the task's. It waits `--wait` seconds for the task to start and then leaves it running
(exit 124), since a cold start (node, image pull) may take longer than anyone wants to stare
at a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import (
    AsyncIterable,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from decimal import Decimal
from typing import Any, TextIO, TypeVar

import attrs
import trio

from agent import __version__, models
from agent.models import ApiError, ExecRequest, ExecResize, LogLine, PullStatus, WorkerSummary
from control.client import ControlClient, ControlClientError, open_control_client
from control.models import PoolView, TaskRequest, TaskView, TaskVolume

T = TypeVar("T")

CALL_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.25
"""How often `levers9 run` asks for a starting task's state (for its progress line)."""
DEFAULT_WAIT_S = 60.0
EXIT_USAGE = 2
EXIT_DEADLINE = 124
EXIT_INTERRUPTED = 130
STDIN_CHUNK_BYTES = 64 * 1024
TASK_STATES = ("pending", "starting", "running", "succeeded", "failed", "cancelled", "lost")


class CliError(Exception):
    pass


class UsageError(CliError):
    """The command line itself is wrong (exit 2)."""


# -- parsing (pure) ------------------------------------------------------------------------------

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_MEMORY_RE = re.compile(_NUMBER + r"\s*([kKMGTP]i?)?B?")
_MEMORY_UNITS = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
_CPU_RE = re.compile(_NUMBER + r"(m?)")


def parse_memory(text: str, option: str = "--memory") -> int:
    """`512Mi`, `2Gi`, `2G`, `1.5Gi` or plain bytes → bytes."""
    match = _MEMORY_RE.fullmatch(text.strip())
    if match is None:
        raise UsageError(
            f"{option} {text!r} is not a size; give bytes or a number with a unit: "
            "Ki, Mi, Gi, Ti (powers of 1024) or k, M, G, T (powers of 1000), e.g. 512Mi"
        )
    value = Decimal(match.group(1)) * _MEMORY_UNITS[match.group(2) or ""]
    if value < 1:
        raise UsageError(f"{option} {text!r} is less than one byte; give a positive size")
    return int(value)


def parse_cpu(text: str, option: str = "--cpu") -> int:
    """Cores (`0.5`, `2`) or thousandths of a core (`500m`) → thousandths of a core."""
    match = _CPU_RE.fullmatch(text.strip())
    if match is None:
        raise UsageError(
            f"{option} {text!r} is not a CPU amount; give cores (0.5, 2) or thousandths of a "
            "core (500m)"
        )
    millis = Decimal(match.group(1)) * (1 if match.group(2) else 1000)
    if millis != millis.to_integral_value():
        raise UsageError(f"{option} {text!r} is finer than 1m (a thousandth of a core)")
    if millis < 1:
        raise UsageError(f"{option} {text!r} is zero; give a positive amount or leave it out")
    return int(millis)


def parse_env(items: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """`K=V` sets K; a bare `K` takes K's value from `environ` (the caller's environment)."""
    env: dict[str, str] = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not name or "\0" in item:
            raise UsageError(f"--env {item!r} has no variable name; give NAME=VALUE or NAME")
        if not equals:
            if name not in environ:
                raise UsageError(
                    f"--env {name}: {name} is not set in your environment; "
                    f"give --env {name}=VALUE or export it"
                )
            value = environ[name]
        env[name] = value
    return env


def parse_volume(text: str) -> TaskVolume:
    """`BUCKET:/path` or `BUCKET:/path:ro` (`:rw` is the default)."""
    bucket, _, rest = text.partition(":")
    read_only = False
    path = rest
    if rest.endswith((":ro", ":rw")):
        path, mode = rest[:-3], rest[-2:]
        read_only = mode == "ro"
    if not bucket or not path.startswith("/"):
        raise UsageError(
            f"--volume {text!r} is not BUCKET:/absolute/path[:ro]; name a bucket of your "
            "workspace and where to mount it, e.g. data:/data:ro"
        )
    return TaskVolume(bucket=bucket, mount_path=path, read_only=read_only)


def parse_port(text: str, option: str = "--port", *, allow_zero: bool = False) -> int:
    low = 0 if allow_zero else 1
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not low <= port <= 65535:
        raise UsageError(f"{option} {text!r} is not a port; give a number from {low} to 65535")
    return port


def parse_seconds(text: str, option: str, *, allow_zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        kind = "zero or more" if allow_zero else "more than zero"
        raise UsageError(f"{option} {text!r} is not a number of seconds; give {kind}, e.g. 300")
    return value


def parse_count(text: str, option: str, *, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise UsageError(f"{option} {text!r} is not a whole number; give {minimum} or more")
    return value


def parse_states(text: str) -> tuple[str, ...]:
    states = tuple(s.strip() for s in text.split(",") if s.strip())
    for state in states:
        if state not in TASK_STATES:
            raise UsageError(
                f"--state {state!r} is not a task state; give some of {','.join(TASK_STATES)}"
            )
    return states


def parse_local(text: str | None, default_port: int) -> tuple[str, int]:
    """`levers9 port --local`: `[HOST:]PORT` → (host, port); 127.0.0.1 and `default_port`
    when not given; port 0 lets the system choose."""
    if not text:
        return "127.0.0.1", default_port
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = "127.0.0.1", text
    host = host.removeprefix("[").removesuffix("]")
    if not host:
        raise UsageError(f"--local {text!r} has an empty host; give [HOST:]PORT, e.g. 8080")
    return host, parse_port(port, "--local", allow_zero=True)


def request_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> TaskRequest:
    """The `TaskRequest` that `levers9 run`'s command line asks for."""
    if not args.image.strip():
        raise UsageError("IMAGE is empty; give an image reference such as busybox:latest")
    ports = tuple(parse_port(p) for p in args.port)
    if len(set(ports)) != len(ports):
        raise UsageError("--port lists a port more than once; give each port once")
    snapshot = None
    if args.snapshot is not None:
        from agent.objects import parse_digest

        try:
            snapshot = parse_digest(args.snapshot, field="--snapshot")
        except ApiError as exc:
            raise UsageError(exc.message + " (as 'levers9 task snapshot' prints it)") from None
    return TaskRequest(
        image=args.image,
        command=tuple(args.command) if args.command else None,
        env=parse_env(args.env, environ),
        cards=parse_count(args.gpus, "--gpus"),
        cpu_millis=None if args.cpu is None else parse_cpu(args.cpu),
        memory_bytes=None if args.memory is None else parse_memory(args.memory),
        volumes=tuple(parse_volume(v) for v in args.volume),
        ports=ports,
        timeout_s=None if args.timeout is None else parse_seconds(args.timeout, "--timeout"),
        snapshot=snapshot,
    )


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The options before the first `--`, and the command after it (None without `--`)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


# -- formatting (pure) ---------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
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
        view.state,
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
        ("state", view.state),
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
    return "\n".join(f"{(name + ':').ljust(width)} {value}" for name, value in pairs)


def progress_text(view: TaskView) -> str:
    """What `levers9 run` shows while the task starts."""
    if view.state == "pending":
        return view.waiting or "waiting for a worker"
    if view.state == "starting":
        if view.pull is not None and view.pull.phase != "done":
            return format_pull(view.pull)
        where = f" on {view.worker}" if view.worker else ""
        return f"starting the container{where}"
    return view.state


def _progress_phase(view: TaskView) -> tuple[str, str | None, str | None]:
    return view.state, view.waiting, view.pull.phase if view.pull else None


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
        f"({view.state}: {not_started_detail(view)}); it goes on: follow it with "
        f"'levers9 task logs -f {view.id}' or 'levers9 task get {view.id}'"
    )


def task_outcome(view: TaskView) -> tuple[int, str | None]:
    """The exit code `levers9 run` ends with for an ended task, and what to print (stderr)."""
    code = view.exit_code
    if view.state == "succeeded":
        return (code if code is not None and 0 <= code <= 255 else 0), None
    reason = view.reason or "no reason given"
    message = f"task {view.id} {view.state}: {reason}"
    if view.state == "failed" and code is not None and 0 < code <= 255:
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
        text = progress_text(view)
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


# -- output --------------------------------------------------------------------------------------


@attrs.define
class Console:
    """Where a command writes: stdout, stderr, and whether stderr is a terminal."""

    out: TextIO
    err: TextIO
    err_tty: bool = False

    @classmethod
    def from_sys(cls) -> Console:
        return cls(sys.stdout, sys.stderr, _isatty(sys.stderr))

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


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    return True


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# -- commands ------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> contextlib.AbstractAsyncContextManager[ControlClient]:
    return open_control_client(args.controlplane, args.token, args.ca)


async def _timed(call: Awaitable[T]) -> T:
    with trio.fail_after(CALL_TIMEOUT_S):
        return await call


class _Interrupted:
    """What `_interruptible` returns when Ctrl-C stopped the work."""


INTERRUPTED = _Interrupted()


async def _interruptible(work: Callable[[], Awaitable[T]]) -> T | _Interrupted:
    """Run `work` until it returns or Ctrl-C (SIGINT) cancels it. Signals reach only the main
    thread; elsewhere (tests calling `main` in a thread) `work` simply runs."""
    if threading.current_thread() is not threading.main_thread():
        return await work()
    result: T | _Interrupted = INTERRUPTED
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            result = await work()
            nursery.cancel_scope.cancel()
    return result


def show_list(
    as_json: bool,
    items: Sequence[T],
    headers: Sequence[str],
    row: Callable[[T], Sequence[str]],
) -> None:
    """A listing as a table for people, or (`--json`) as a JSON list of the wire objects."""
    if as_json:
        print(json.dumps([models.unstructure(item) for item in items], indent=2))
        return
    print(_table(headers, [row(item) for item in items]))


WORKER_HEADERS = ("worker", "mode", "connected", "node", "cards", "address", "version", "age")


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
    ]


async def worker_list(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        result = await _timed(client.workers())
    show_list(args.json, result.workers, WORKER_HEADERS, worker_row)


async def worker_get(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        info = await _timed(client.worker(args.worker_id))
    if args.json:
        print(json.dumps(models.unstructure(info), indent=2))
        return
    print(
        _table(
            ["worker", "mode", "version", "uptime"],
            [[info.worker_id, info.mode, info.version, f"{info.uptime_s:.0f}s"]],
        )
    )


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.1f}Gi"


async def machine_list(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        listing = await _timed(client.machines())
    machines = listing.get("machines", [])
    if args.json:
        print(json.dumps(machines, indent=2))
        return
    rows = []
    for m in machines:
        cards = m["cards"]
        worker = m.get("worker")
        rows.append(
            [
                m["pool"],
                m["node"],
                m.get("gpuModel") or "-",
                f"{cards['total']}/{cards['ours']}/{cards['others']}/{cards['free']}",
                f"{m['cpuFreeMillis']}m",
                _gib(m["memoryFreeBytes"]),
                worker["state"] if worker else "-",
                f"{int(worker['ageSeconds'])}s" if worker else "-",
            ]
        )
    print(
        _table(
            [
                "POOL",
                "NODE",
                "GPU",
                "CARDS T/OURS/OTHERS/FREE",
                "CPU FREE",
                "MEM FREE",
                "WORKER",
                "AGE",
            ],
            rows,
        )
    )
    for pool in listing.get("pools", []):
        if pool.get("error"):
            print(f"pool {pool['pool']}: last pass failed: {pool['error']}", file=sys.stderr)


# -- clusters ------------------------------------------------------------------------------------

_POOL_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def parse_selector(items: Sequence[str]) -> dict[str, Any]:
    """`--selector key=value` (a label) or `--selector key` (the label exists) → the pool
    block's selector."""
    labels: dict[str, str] = {}
    exists: list[dict[str, str]] = []
    for item in items:
        key, eq, value = item.partition("=")
        if not key or "," in item:
            raise UsageError(f"--selector {item!r} must be KEY=VALUE or KEY (one label each)")
        if eq:
            labels[key] = value
        else:
            exists.append({"key": key, "operator": "Exists"})
    selector: dict[str, Any] = dict(labels)
    if exists:
        selector["matchExpressions"] = exists
    return selector


def _join_checks(args: argparse.Namespace) -> None:
    if not _POOL_NAME.fullmatch(args.name):
        raise UsageError(
            f"pool name {args.name!r} must be a DNS label (lowercase letters, digits, '-')"
        )
    if not _POOL_NAME.fullmatch(args.namespace):
        raise UsageError(f"--namespace {args.namespace!r} must be a DNS label")
    if not args.host_network and not args.tunnel:
        raise UsageError(
            "--no-host-network needs --tunnel: nothing outside the cluster can dial a pod address"
        )
    if args.endpoint is not None and not args.endpoint.startswith("https://"):
        raise UsageError(f"--endpoint must be an https:// URL, not {args.endpoint!r}")


async def cluster_join(args: argparse.Namespace) -> None:
    from control.join import JoinError, open_cluster_side, pool_block

    _join_checks(args)
    selector = parse_selector(args.selector)
    async with _client(args) as client:
        # The operator token and the name are checked before the cluster is touched.
        known = await _timed(client.pools())
        if not known.joined_pools:
            raise CliError(
                "this controlplane keeps no joined pools: set config.joinedPools (the Helm "
                "chart does by default), or add the pool's block to config.worker.pools"
            )
        for view in known.pools:
            if view.name == args.name and view.source == "config":
                raise CliError(
                    f"pool {args.name} comes from config.worker.pools; join under another name"
                )
        try:
            side = await trio.to_thread.run_sync(open_cluster_side, args.kubeconfig, args.context)
            try:
                joined = await trio.to_thread.run_sync(side.apply, args.namespace)
            finally:
                side.close()
        except JoinError as exc:
            raise CliError(str(exc)) from None
        for step in joined.steps:
            print(step, file=sys.stderr)
        block = pool_block(
            name=args.name,
            flavor=args.flavor,
            endpoint=args.endpoint or joined.endpoint,
            ca_pem=joined.ca_pem,
            token=joined.token,
            namespace=args.namespace,
            selector=selector,
            tunnel=args.tunnel,
            host_network=args.host_network,
            image=args.image,
            driver_path=args.driver_path,
        )
        view = await _timed(client.put_pool(args.name, block))
    if args.json:
        print(json.dumps(models.unstructure(view), indent=2))
        return
    print(
        f"pool {view.name} joined: {view.endpoint}, namespace {view.namespace}, "
        f"selector {view.selector or '(every node with cards)'}"
        f"{', tunnel' if view.tunnel else ''}"
    )
    print("its nodes show up in 'levers9 machine list' within a reconcile (about 15 s)")


POOL_HEADERS = ("POOL", "SOURCE", "FLAVOR", "ENDPOINT", "NAMESPACE", "MODE", "MACHINES", "ERROR")


def pool_row(v: PoolView) -> list[str]:
    return [
        v.name,
        v.source,
        v.flavor,
        v.endpoint,
        v.namespace,
        "tunnel" if v.tunnel else "direct",
        str(v.machines),
        v.error or "-",
    ]


async def cluster_list(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        listing = await _timed(client.pools())
    show_list(args.json, listing.pools, POOL_HEADERS, pool_row)


async def cluster_leave(args: argparse.Namespace) -> None:
    from control.join import JoinError, open_cluster_side

    async with _client(args) as client:
        view = await _timed(client.delete_pool(args.name))
    print(f"pool {view.name} left: its workers were removed", file=sys.stderr)
    if args.keep_access:
        return
    try:
        side = await trio.to_thread.run_sync(open_cluster_side, args.kubeconfig, args.context)
        try:
            steps = await trio.to_thread.run_sync(
                lambda: side.remove(view.namespace, delete_namespace=args.delete_namespace)
            )
        finally:
            side.close()
    except JoinError as exc:
        raise CliError(str(exc)) from None
    for step in steps:
        print(step, file=sys.stderr)


# -- tasks ---------------------------------------------------------------------------------------


def _follow_hint(task_id: str) -> str:
    return (
        f"follow it again with 'levers9 task logs -f {task_id}'; "
        f"stop it with 'levers9 task cancel {task_id}'"
    )


async def cmd_run(args: argparse.Namespace) -> int:
    request = request_from_args(args, os.environ)
    wait_s = parse_seconds(args.wait, "--wait", allow_zero=True)
    console = Console.from_sys()
    async with _client(args) as client:
        view = await _timed(client.create_task(request))
        if args.detach:
            console.print(view.id)
            return 0
        result = await _interruptible(lambda: follow_run(client, view, wait_s, console))
    if isinstance(result, _Interrupted):
        console.status(f"\nlevers9: task {view.id} goes on; {_follow_hint(view.id)}\n")
        return EXIT_INTERRUPTED
    return result


async def follow_run(client: ControlClient, view: TaskView, wait_s: float, console: Console) -> int:
    """`levers9 run` after the task was created: its progress until it starts (at most
    `wait_s`), its logs, then its exit code."""
    task_id = view.id
    width = shutil.get_terminal_size().columns if console.err_tty else 0
    progress = Progress(tty=console.err_tty, width=width)
    started = trio.Event()
    watch_scope = trio.CancelScope()
    latest = view
    deadline_passed = False
    log_error: ApiError | None = None

    def mark_started() -> None:
        if not started.is_set():
            started.set()
            watch_scope.cancel()
            console.status(progress.finish())

    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            # The deadline counts from here, after the task was accepted.
            nonlocal latest, deadline_passed
            with watch_scope:
                with trio.move_on_after(wait_s):
                    current = view
                    while current.state in ("pending", "starting"):
                        console.status(progress.update(current))
                        await trio.sleep(POLL_INTERVAL_S)
                        current = latest = await _timed(client.task(task_id))
                    mark_started()
                    return
                if not started.is_set():
                    deadline_passed = True
                    nursery.cancel_scope.cancel()

        async def follow_logs() -> None:
            nonlocal log_error
            try:
                async with contextlib.aclosing(client.task_logs(task_id, follow=True)) as lines:
                    async for line in lines:
                        mark_started()
                        console.log_line(line)
            except ApiError as exc:
                log_error = exc

        nursery.start_soon(watch)
        nursery.start_soon(follow_logs)

    if deadline_passed:
        console.status(progress.finish())
        with contextlib.suppress(ApiError, trio.TooSlowError):
            latest = await _timed(client.task(task_id))
        console.status(deadline_message(latest, wait_s) + "\n")
        return EXIT_DEADLINE
    console.status(progress.finish())
    final = latest
    while not final.terminal:
        final = await client.wait_task(task_id)
        if not final.terminal:
            await trio.sleep(POLL_INTERVAL_S)
    if log_error is not None:
        console.status(f"levers9: could not follow the logs of task {task_id}: {log_error}\n")
    code, message = task_outcome(final)
    if message:
        console.status(f"levers9: {message}\n")
    return code


async def task_list(args: argparse.Namespace) -> None:
    states = parse_states(args.state) if args.state else None
    limit = parse_count(args.limit, "--limit", minimum=1)
    async with _client(args) as client:
        tasks = await _timed(client.tasks(states, limit))
    now = time.time()
    show_list(args.json, tasks, TASK_HEADERS, lambda t: task_row(t, now))


async def task_get(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        view = await _timed(client.task(args.task_id))
    if args.json:
        print(json.dumps(models.unstructure(view), indent=2))
        return
    print(format_details(task_details(view, time.time())))


async def task_logs(args: argparse.Namespace) -> int:
    console = Console.from_sys()

    async def follow(client: ControlClient) -> None:
        async with contextlib.aclosing(client.task_logs(args.task_id, follow=args.follow)) as lines:
            async for line in lines:
                console.log_line(line)

    async with _client(args) as client:
        result = await _interruptible(lambda: follow(client))
    return EXIT_INTERRUPTED if isinstance(result, _Interrupted) else 0


async def task_cancel(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        view = await _timed(client.cancel_task(args.task_id))
    print(f"task {view.id}: {view.state}")


async def task_snapshot(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        snapshot = await _timed(client.snapshot_task(args.task_id))
    print(snapshot.digest)


# -- exec ----------------------------------------------------------------------------------------


class FdReader:
    """A file descriptor's bytes as an async iterator, each read in a worker thread (blocking
    reads work for terminals, pipes and files alike; the descriptor's mode is left alone). A
    read still waiting when the exec ends is abandoned: the process exits right after."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._ended = False

    def __aiter__(self) -> FdReader:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        data = await trio.to_thread.run_sync(
            os.read, self.fd, STDIN_CHUNK_BYTES, abandon_on_cancel=True
        )
        if not data:
            self._ended = True
            raise StopAsyncIteration
        return data


@contextlib.contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """The terminal on `fd` in raw mode (keys go to the remote process as typed, Ctrl-C
    included), restored however the body ends."""
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    if size.lines <= 0 or size.columns <= 0:  # a terminal that never set its size
        return 24, 80
    return size.lines, size.columns


async def exec_session(
    client: ControlClient,
    task_id: str,
    request: ExecRequest,
    console: Console,
    *,
    stdin: AsyncIterable[bytes] | None,
    watch_resizes: bool,
) -> int:
    """Run `request` in the task, carrying stdio (and, on a terminal, its size)."""

    async def on_output(channel: int, data: bytes) -> None:
        console.write_bytes(channel, data)

    if not watch_resizes:
        return await client.exec_in_task(task_id, request, on_output=on_output, stdin=stdin)
    send, receive = trio.open_memory_channel[ExecResize](16)
    with trio.open_signal_receiver(signal.SIGWINCH) as winches:
        async with trio.open_nursery() as nursery:

            async def forward_resizes() -> None:
                async with send:
                    async for _ in winches:
                        rows, cols = _terminal_size(sys.stdout.fileno())
                        await send.send(ExecResize(rows=rows, cols=cols))

            nursery.start_soon(forward_resizes)
            code = await client.exec_in_task(
                task_id, request, on_output=on_output, stdin=stdin, resizes=receive
            )
            nursery.cancel_scope.cancel()
    return code


async def cmd_exec(args: argparse.Namespace) -> int:
    if not args.command:
        raise UsageError("exec needs a command after '--': levers9 exec TASK -- CMD...")
    stdin_tty, stdout_tty = _isatty(sys.stdin), _isatty(sys.stdout)
    tty = args.tty if args.tty is not None else (stdin_tty and stdout_tty)
    rows, cols = _terminal_size(sys.stdout.fileno()) if tty and stdout_tty else (24, 80)
    request = ExecRequest(command=tuple(args.command), tty=tty, rows=rows, cols=cols)
    console = Console.from_sys()
    main_thread = threading.current_thread() is threading.main_thread()
    async with _client(args) as client:
        stdin = FdReader(sys.stdin.fileno()) if _has_fileno(sys.stdin) else None
        raw = raw_terminal(sys.stdin.fileno()) if tty and stdin_tty else contextlib.nullcontext()
        with raw:
            result = await _interruptible(
                lambda: exec_session(
                    client,
                    args.task_id,
                    request,
                    console,
                    stdin=stdin,
                    watch_resizes=tty and stdout_tty and main_thread,
                )
            )
    if isinstance(result, _Interrupted):
        return EXIT_INTERRUPTED
    return result if 0 <= result <= 255 else 1


# -- port ----------------------------------------------------------------------------------------


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def forward_port(
    client: ControlClient,
    task_id: str,
    port: int,
    host: str,
    local_port: int,
    console: Console,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on `host:local_port` and carry each accepted connection to `port` of the task,
    every one over the client's one HTTP/2 connection, until cancelled. Reports the
    addresses it listens on through `task_status`."""
    from agent.service import splice

    try:
        listeners = await trio.open_tcp_listeners(local_port, host=host)
    except OSError as exc:
        raise CliError(
            f"--local: cannot listen on {_address(host, local_port)}: {exc.strerror or exc}; "
            "give another port with --local PORT (0 lets the system choose)"
        ) from None
    bound = [
        (str(sockname[0]), int(sockname[1]))
        for sockname in (listener.socket.getsockname() for listener in listeners)
    ]

    async def carry(local: trio.SocketStream) -> None:
        async with local:
            try:
                remote = await client.connect_port(task_id, port)
            except ApiError as exc:
                console.status(f"levers9: cannot forward a connection to {task_id}:{port}: {exc}\n")
                return
            async with remote:
                await splice(local, remote)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, carry, listeners)
        for address in bound:
            console.status(f"forwarding {_address(*address)} -> {task_id}:{port}\n")
        task_status.started(bound)
        await client.conn.wait_closed()
        raise CliError(
            f"the connection to the controlplane closed ({client.conn.close_reason}); "
            f"run 'levers9 port {task_id} {port}' again"
        )


async def cmd_port(args: argparse.Namespace) -> int:
    port = parse_port(args.port, "PORT")
    host, local_port = parse_local(args.local, port)
    console = Console.from_sys()
    async with _client(args) as client:
        view = await _timed(client.task(args.task_id))
        if view.terminal:
            raise CliError(
                f"task {view.id} has ended ({view.state}); forward ports of a running task"
            )
        await _interruptible(lambda: forward_port(client, view.id, port, host, local_port, console))
    return 0


# -- command line --------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (`levers9: ...`, exit 2), like every other error."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message}; see '{self.prog} --help'")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="levers9", description="levers9 command line")
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("--controlplane", default=os.environ.get("LEVERS9_CONTROLPLANE", ""))
    parser.add_argument("--token", default=os.environ.get("LEVERS9_TOKEN", ""))
    parser.add_argument("--ca", default=os.environ.get("LEVERS9_CA") or None)
    sub = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a task: an image, with cards, and follow its output",
        usage="levers9 run [options] IMAGE [-- CMD...]",
        description="Run IMAGE as a task and follow its logs; exits with the task's exit code. "
        "CMD after '--' replaces the image's entrypoint.",
    )
    run.add_argument("image", metavar="IMAGE")
    run.add_argument("--gpus", default="0", metavar="N", help="cards the task gets")
    run.add_argument("--cpu", metavar="CORES", help="CPU cores, e.g. 0.5, 2 or 500m")
    run.add_argument("--memory", metavar="SIZE", help="memory, e.g. 512Mi, 2Gi, 2G or bytes")
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="environment variable (repeatable); a bare K takes K's value from yours",
    )
    run.add_argument(
        "--volume",
        action="append",
        default=[],
        metavar="BUCKET:/PATH[:ro]",
        help="mount a bucket of your workspace (repeatable)",
    )
    run.add_argument(
        "--port", action="append", default=[], metavar="N", help="a port the task serves"
    )
    run.add_argument("--timeout", metavar="SECONDS", help="stop the task after this long")
    run.add_argument("--snapshot", metavar="DIGEST", help="start from a task's snapshot")
    run.add_argument(
        "--detach", "-d", action="store_true", help="print the task id and exit at once"
    )
    run.add_argument(
        "--wait",
        default=str(int(DEFAULT_WAIT_S)),
        metavar="SECONDS",
        help="how long to wait for the task to start before leaving it running (exit 124)",
    )
    run.set_defaults(func=cmd_run, takes_command=True)

    task = sub.add_parser("task", help="tasks of your workspace")
    tsub = task.add_subparsers(dest="action", required=True, metavar="ACTION")
    tls = tsub.add_parser("list", help="list tasks, newest first")
    tls.add_argument("--state", metavar="S,...", help="only tasks in these states")
    tls.add_argument("--limit", default="100", metavar="N")
    tls.add_argument("--json", action="store_true")
    tls.set_defaults(func=task_list)
    tget = tsub.add_parser("get", help="one task's details")
    tget.add_argument("task_id", metavar="ID")
    tget.add_argument("--json", action="store_true")
    tget.set_defaults(func=task_get)
    tlogs = tsub.add_parser("logs", help="a task's output")
    tlogs.add_argument("task_id", metavar="ID")
    tlogs.add_argument("-f", "--follow", action="store_true", help="until the task ends")
    tlogs.set_defaults(func=task_logs)
    tcancel = tsub.add_parser("cancel", help="stop a task")
    tcancel.add_argument("task_id", metavar="ID")
    tcancel.set_defaults(func=task_cancel)
    tsnap = tsub.add_parser("snapshot", help="keep a task's filesystem changes; prints a digest")
    tsnap.add_argument("task_id", metavar="ID")
    tsnap.set_defaults(func=task_snapshot)

    exec_ = sub.add_parser(
        "exec",
        help="run a command in a running task",
        usage="levers9 exec [-t | --no-tty] TASK -- CMD...",
    )
    exec_.add_argument("task_id", metavar="TASK")
    exec_.add_argument(
        "-t",
        "--tty",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a terminal (default: when stdin and stdout are terminals)",
    )
    exec_.set_defaults(func=cmd_exec, takes_command=True)

    port = sub.add_parser("port", help="forward a local port to a port of a running task")
    port.add_argument("task_id", metavar="TASK")
    port.add_argument("port", metavar="PORT")
    port.add_argument(
        "--local",
        metavar="[HOST:]PORT",
        help="where to listen (default 127.0.0.1 and the same port; 0 = any free port)",
    )
    port.set_defaults(func=cmd_port)

    worker = sub.add_parser("worker", help="workers known to the controlplane")
    wsub = worker.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = wsub.add_parser("list", help="list workers")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=worker_list)
    get = wsub.add_parser("get", help="ask one worker about itself (through its connection)")
    get.add_argument("worker_id")
    get.add_argument("--json", action="store_true")
    get.set_defaults(func=worker_get)
    machine = sub.add_parser("machine", help="machines: the pools' nodes that can take work")
    msub = machine.add_subparsers(dest="action", required=True, metavar="ACTION")
    mls = msub.add_parser("list", help="list machines with their free cards, CPU and memory")
    mls.add_argument("--json", action="store_true")
    mls.set_defaults(func=machine_list)

    cluster = sub.add_parser("cluster", help="clusters whose nodes are pools (operator token)")
    csub = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    join = csub.add_parser(
        "join",
        help="attach the cluster of your kubeconfig context as a pool, with no key file",
        description="With your kubeconfig's identity: create the namespace, a ServiceAccount "
        "with least-privilege RBAC and a token on that cluster, then register the pool with "
        "the controlplane. Safe to rerun.",
    )
    join.add_argument("name", metavar="POOL", help="the pool's name (a DNS label)")
    join.add_argument("--image", required=True, help="the worker image the Jobs run")
    join.add_argument("--context", help="kubeconfig context (default: the current one)")
    join.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )
    join.add_argument("--namespace", default="levers9", help="namespace of the worker Jobs")
    join.add_argument(
        "--selector",
        action="append",
        default=[],
        metavar="KEY=VALUE|KEY",
        help="node label the pool's nodes carry (repeatable); default: every node with cards",
    )
    join.add_argument("--flavor", choices=["gke", "eks", "generic"], default="generic")
    join.add_argument(
        "--endpoint",
        help="the API server URL the controlplane should use (default: your kubeconfig's)",
    )
    join.add_argument("--tunnel", action="store_true", help="workers dial out; nothing inbound")
    join.add_argument(
        "--host-network",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers use the node's network (--no-host-network needs --tunnel)",
    )
    join.add_argument("--driver-path", help="the NVIDIA driver dir on the nodes")
    join.add_argument("--json", action="store_true")
    join.set_defaults(func=cluster_join)
    clist = csub.add_parser("list", help="list pools: configured and joined")
    clist.add_argument("--json", action="store_true")
    clist.set_defaults(func=cluster_list)
    leave = csub.add_parser(
        "leave",
        help="remove a joined pool: its workers, then its access to the cluster",
    )
    leave.add_argument("name", metavar="POOL")
    leave.add_argument("--context", help="kubeconfig context (default: the current one)")
    leave.add_argument("--kubeconfig", help="kubeconfig file")
    leave.add_argument(
        "--delete-namespace", action="store_true", help="also delete the pool's namespace"
    )
    leave.add_argument(
        "--keep-access",
        action="store_true",
        help="leave the ServiceAccount and its roles on the cluster",
    )
    leave.set_defaults(func=cluster_leave)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line → its namespace (`command`: what followed `--`); UsageError else."""
    options, command = split_command(argv)
    args = build_parser().parse_args(options)
    if command is not None and not getattr(args, "takes_command", False):
        raise UsageError("'--' and a command only follow 'levers9 run IMAGE' or 'exec TASK'")
    args.command = command
    return args


def _leaves(group: BaseExceptionGroup[Any]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _api_message(exc: ApiError) -> str:
    return f"{exc.code.name}: {exc.message}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"levers9: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    code = 1
    messages: list[str] = []
    try:
        code = trio.run(args.func, args) or 0
    except* UsageError as group:
        messages += [str(e) for e in _leaves(group)]
        code = EXIT_USAGE
    except* (CliError, ControlClientError) as group:
        messages += [str(e) for e in _leaves(group)]
    except* ApiError as group:
        messages += [_api_message(e) for e in _leaves(group) if isinstance(e, ApiError)]
    except* trio.TooSlowError:
        messages.append(f"DEADLINE_EXCEEDED: no answer within {CALL_TIMEOUT_S:g} s")
    except* KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    for message in messages:
        print(f"levers9: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
