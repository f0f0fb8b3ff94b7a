"""Quantity limits: what one workspace may take of the controlplane that every workspace shares.

A workspace's token must not be able to slow the others down: specs are bounded in bytes and
entries, tasks pending or running are bounded per workspace, and each token has a request
rate (a token bucket) and a number of watch streams it may hold open. The decisions are pure
functions of the limits, the request and a count or a clock passed in; the task routes carry
them out. A refusal names the limit, its value and what to do.

Where each count lives: tasks pending or running are counted in the task database inside the
insert's transaction (`TaskStore.create`), so the limit holds across replicas; the request
rate and the watch streams are per replica, in memory, as they protect that replica's CPU and
memory (with N replicas behind one Service a token gets at most N times the figure).
"""

from __future__ import annotations

import hashlib
import weakref

import attrs

from control.config import WorkspaceLimits
from control.tasks.store import TaskSpec
from wire.errors import ApiError, ErrorCode


def spec_bytes(spec: TaskSpec) -> int:
    """Bytes of a spec's command, args and env (UTF-8), as `maxSpecBytes` counts them."""
    words = [*(spec.command or ()), *(spec.args or ())]
    total = sum(len(w.encode()) for w in words)
    return total + sum(len(k.encode()) + 1 + len(v.encode()) for k, v in spec.env.items())


def spec_refusal(spec: TaskSpec, limits: WorkspaceLimits) -> ApiError | None:
    """Why the spec is too big for the workspace (INVALID_ARGUMENT naming the field and the
    limit), or None. Pure."""
    if len(spec.env) > limits.max_env:
        return ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"field 'env': {len(spec.env)} variables is over this workspace's limit of "
            f"{limits.max_env} (maxEnv); pass fewer, or put the settings in a file or a bucket",
            field="env",
        )
    for name, value in spec.env.items():
        size = len(name.encode()) + 1 + len(value.encode())
        if size > limits.max_env_entry_bytes:
            return ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"field 'env': variable {name[:64]!r} is {size} bytes, over this workspace's "
                f"limit of {limits.max_env_entry_bytes} bytes (maxEnvEntryBytes); put large "
                "values in a file or a bucket",
                field="env",
            )
    size = spec_bytes(spec)
    if size > limits.max_spec_bytes:
        return ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"fields 'command', 'args' and 'env' hold {size} bytes together, over this "
            f"workspace's limit of {limits.max_spec_bytes} bytes (maxSpecBytes); put large "
            "inputs in a file, a bucket or the image",
            field="env" if spec.env else "args",
        )
    return None


def active_tasks_refusal(active: int, limits: WorkspaceLimits) -> ApiError | None:
    """Why one more task may not be created while `active` are pending or running
    (RESOURCE_EXHAUSTED), or None. Pure."""
    if active < limits.max_active_tasks:
        return None
    return ApiError(
        ErrorCode.RESOURCE_EXHAUSTED,
        f"this workspace has {active} tasks pending or running, its limit "
        f"(maxActiveTasks) is {limits.max_active_tasks}; wait for some to end or cancel "
        "some (`levers9 task cancel`), then try again",
    )


@attrs.frozen
class TokenBucket:
    """A request-rate bucket: `tokens` left at time `at`. Pure: `take` returns the next
    bucket, or None when the request must wait."""

    tokens: float
    at: float

    def take(self, now: float, rate_per_s: float, burst: int) -> TokenBucket | None:
        tokens = min(float(burst), self.tokens + max(0.0, now - self.at) * rate_per_s)
        if tokens < 1.0:
            return None
        return TokenBucket(tokens - 1.0, now)


def rate_refusal(limits: WorkspaceLimits) -> ApiError:
    return ApiError(
        ErrorCode.RESOURCE_EXHAUSTED,
        f"this token made more than {limits.requests_per_s:g} requests a second (bursts of "
        f"{limits.request_burst}; requestsPerS, requestBurst); slow down and try again in a "
        "second",
    )


def watch_refusal(open_streams: int, limits: WorkspaceLimits) -> ApiError | None:
    """Why one more watch stream may not open while the token holds `open_streams`, or None.
    Pure."""
    if open_streams < limits.max_watch_streams:
        return None
    return ApiError(
        ErrorCode.RESOURCE_EXHAUSTED,
        f"this token holds {open_streams} watch streams open, its limit (maxWatchStreams) is "
        f"{limits.max_watch_streams}; close some (each dashboard tab holds up to 2) or read "
        "without ?watch=true",
    )


def token_key(token: str | None, principal: str) -> str:
    """What a token's counts are kept under: a digest, so the secret is not kept again."""
    if token is None:
        return principal
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class WatchSlot:
    """One open watch stream; it counts while it is held, until `release` or until nothing
    refers to it any more (a stream whose body never started)."""

    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


@attrs.define
class TenantGuard:
    """This replica's per-token counts: request buckets and open watch streams. The I/O-free
    holder the task routes ask; each decision is one of the pure functions above."""

    buckets: dict[str, TokenBucket] = attrs.field(factory=dict)
    watches: dict[str, weakref.WeakSet[WatchSlot]] = attrs.field(factory=dict)

    def admit(self, key: str, limits: WorkspaceLimits, now: float) -> None:
        """Take one request from the token's bucket, or raise RESOURCE_EXHAUSTED."""
        bucket = self.buckets.get(key, TokenBucket(float(limits.request_burst), now))
        taken = bucket.take(now, limits.requests_per_s, limits.request_burst)
        if taken is None:
            self.buckets[key] = bucket
            raise rate_refusal(limits)
        self.buckets[key] = taken

    def open_watches(self, key: str) -> int:
        slots = self.watches.get(key)
        return 0 if slots is None else sum(1 for s in slots if not s.released)

    def watch(self, key: str, limits: WorkspaceLimits) -> WatchSlot:
        """A slot for one more watch stream, or RESOURCE_EXHAUSTED."""
        refused = watch_refusal(self.open_watches(key), limits)
        if refused is not None:
            raise refused
        slot = WatchSlot()
        self.watches.setdefault(key, weakref.WeakSet()).add(slot)
        return slot
