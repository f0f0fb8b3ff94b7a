"""Parsing what a person types: sizes, CPUs, env, volumes, ports, selectors, into the task
request the API takes. Pure; errors are `UsageError`s naming the option.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import (
    Mapping,
    Sequence,
)
from decimal import Decimal
from typing import Any

from control.cli.usage import UsageError
from control.models import TaskRequest, TaskState, TaskVolume
from wire.errors import ApiError

TASK_STATES = tuple(state.value for state in TaskState)


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


def parse_states(text: str) -> tuple[TaskState, ...]:
    """`--state running,pending` → those states, in the order given."""
    states = []
    for word in (s.strip() for s in text.split(",")):
        if not word:
            continue
        if word not in TASK_STATES:
            raise UsageError(
                f"--state {word!r} is not a task state; give some of {','.join(TASK_STATES)}"
            )
        states.append(TaskState(word))
    return tuple(states)


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
        from workerapi.digests import parse_digest

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


POOL_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


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
