"""The typed client of the controlplane's API, as the `levers9` CLI and scripts use it.

One HTTP/2 connection over verifying TLS carries everything a command needs: JSON calls, the
NDJSON log stream, the exec WebSocket and any number of CONNECT byte streams (`levers9 port`
forwards every local connection over the same connection). The calls mirror the routes listed
in `control.models`; failures are `ApiError`s with the server's code. Reaching the
controlplane is the one step with its own error (`ControlClientError`), since only there can
the message say what to set: the URL, the token or the CA file.
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.parse
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from control.models import (
    MachineList,
    PoolList,
    PoolView,
    TaskList,
    TaskRequest,
    TaskSnapshot,
    TaskState,
    TaskView,
    WorkerList,
)
from wire.client import ApiClient, OpeningStream, WorkerUnavailable, open_api_client
from wire.connection import H2ByteStream, KeepaliveConfig, StreamRefused
from wire.tls import TLSStream, verifying_client_context
from workerapi.models import ExecRequest, ExecResize, LogLine, WorkerInfo

T = TypeVar("T")

CONNECT_TIMEOUT_S = 30.0
"""How long reaching the controlplane (TCP and TLS) may take before the command gives up."""

KEEPALIVE = KeepaliveConfig(ping_interval_s=15.0, ping_timeout_s=15.0)
"""Long follows (logs, port forwarding) notice a controlplane that went away."""


class ControlClientError(Exception):
    """The controlplane could not be reached or trusted; the message says what to set."""


class ControlClient(ApiClient):
    """Typed calls to the controlplane's API (`control.models` lists the routes)."""

    def _unavailable(self, exc: BaseException) -> WorkerUnavailable:
        return WorkerUnavailable(
            f"the connection to the controlplane at {self.authority} broke ({exc}); "
            "run the command again",
            retryable=isinstance(exc, StreamRefused),
        )

    # -- tasks -------------------------------------------------------------------------------

    async def create_task(self, request: TaskRequest) -> TaskView:
        return await self._typed("POST", "/v1/tasks", request, TaskView)

    async def task(self, task_id: str) -> TaskView:
        return await self._typed("GET", _task_path(task_id), None, TaskView)

    async def tasks(
        self, states: Sequence[TaskState] | None = None, limit: int = 100, before: str | None = None
    ) -> tuple[TaskView, ...]:
        """The workspace's tasks, newest first, optionally only those in `states`; with
        `before`, those created before that task (the next page)."""
        query: dict[str, str] = {"limit": str(limit)}
        if states:
            query["state"] = ",".join(TaskState(s).value for s in states)
        if before:
            query["before"] = before
        path = "/v1/tasks?" + urllib.parse.urlencode(query, safe=",")
        listing = await self._typed("GET", path, None, TaskList)
        return listing.tasks

    async def wait_task(self, task_id: str) -> TaskView:
        """The task once it has ended (the server holds the request until then)."""
        return await self._typed("GET", _task_path(task_id, "wait"), None, TaskView)

    async def cancel_task(self, task_id: str) -> TaskView:
        return await self._typed("POST", _task_path(task_id, "cancel"), None, TaskView)

    async def snapshot_task(self, task_id: str) -> TaskSnapshot:
        return await self._typed("POST", _task_path(task_id, "snapshot"), None, TaskSnapshot)

    async def task_logs(self, task_id: str, *, follow: bool) -> AsyncGenerator[LogLine, None]:
        """The task's log lines from the start; with `follow`, the server first waits for a
        pending task to start and the stream ends when the task has ended."""
        path = _task_path(task_id, "logs") + ("?follow=true" if follow else "")
        async with contextlib.aclosing(self.ndjson(path, LogLine)) as lines:
            async for line in lines:
                yield line

    async def exec_in_task(
        self,
        task_id: str,
        request: ExecRequest,
        *,
        on_output: Callable[[int, bytes], Awaitable[None]],
        stdin: AsyncIterable[bytes] | None = None,
        resizes: trio.MemoryReceiveChannel[ExecResize] | None = None,
    ) -> int:
        """Run a process in the task's container; its output goes to `on_output(channel,
        data)` (1 stdout, 2 stderr; a TTY sends both on 1); returns its exit code."""
        from workerapi.exec import run_exec

        ws = await self.open_websocket(_task_path(task_id, "exec"))
        try:
            return await run_exec(ws, request, stdin=stdin, on_output=on_output, resizes=resizes)
        finally:
            with trio.CancelScope(shield=True):
                await ws.aclose()

    async def connect_port(self, task_id: str, port: int) -> H2ByteStream:
        """A byte stream to `port` of the task's container (a CONNECT to `<task id>:<port>`)."""
        return await self.connect(f"{task_id}:{port}")

    async def connect_port_early(self, task_id: str, port: int) -> OpeningStream:
        """`connect_port`, usable before the controlplane answers (`ApiClient.connect_early`):
        its `wait_open` raises a refusal as the controlplane's error."""
        return await self.connect_early(f"{task_id}:{port}")

    # -- workers and machines ----------------------------------------------------------------

    async def machines(self) -> MachineList:
        """`GET /v1/machines`: every pool's machines and how its last pass went."""
        return await self._typed("GET", "/v1/machines", None, MachineList)

    async def workers(self) -> WorkerList:

        return await self._typed("GET", "/v1/workers", None, WorkerList)

    async def worker(self, worker_id: str) -> WorkerInfo:
        path = "/v1/workers/" + urllib.parse.quote(worker_id, safe="")
        return await self._typed("GET", path, None, WorkerInfo)

    # -- pools -------------------------------------------------------------------------------

    async def pools(self) -> PoolList:
        return await self._typed("GET", "/v1/pools", None, PoolList)

    async def put_pool(self, name: str, block: Mapping[str, Any]) -> PoolView:
        """Create or replace a joined pool (the block as `config.worker.pools` takes it)."""
        return await self._typed("PUT", _pool_path(name), dict(block), PoolView)

    async def delete_pool(self, name: str) -> PoolView:
        return await self._typed("DELETE", _pool_path(name), None, PoolView)


def _pool_path(name: str) -> str:
    return "/v1/pools/" + urllib.parse.quote(name, safe="")


def _task_path(task_id: str, *rest: str) -> str:
    return "/".join(("/v1/tasks", urllib.parse.quote(task_id, safe=""), *rest))


@asynccontextmanager
async def open_control_client(
    url: str, token: str, ca: str | None, *, ca_pem: str | None = None
) -> AsyncIterator[ControlClient]:
    """A `ControlClient` over verifying TLS (ALPN h2) to `url`, for the body of the `async
    with`. `ca` names a CA file, or `ca_pem` holds the PEM text (a login's context keeps it),
    for a controlplane whose certificate no public CA signed. Raises `ControlClientError` when
    the controlplane cannot be reached or trusted."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "https" or not parsed.hostname:
        raise ControlClientError(
            f"--controlplane must be an https:// URL, not {url!r} (or set LEVERS9_CONTROLPLANE, "
            "or run 'levers9 login URL' once)"
        )
    if not token:
        raise ControlClientError(
            "no API token: pass --token or set LEVERS9_TOKEN, or run 'levers9 login URL' once"
        )
    try:
        context = verifying_client_context(cafile=ca, cadata=ca_pem, alpn=("h2",))
    except (OSError, ssl.SSLError) as exc:
        if ca is None:
            raise ControlClientError(
                f"cannot load the CA certificate stored for {url} ({exc}); "
                f"run 'levers9 login {url} --ca FILE' again"
            ) from None
        raise ControlClientError(
            f"cannot load the CA file {ca!r} (--ca or LEVERS9_CA): {exc}; "
            "give a PEM file with the controlplane's CA certificate"
        ) from None
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            tls = await _connect(url, parsed.hostname, parsed.port or 443, context)
    except trio.TooSlowError:
        raise ControlClientError(
            f"no answer from the controlplane at {url} within {CONNECT_TIMEOUT_S:g} s; "
            "check the URL and that it can be reached from here"
        ) from None
    async with open_api_client(
        tls, ControlClient, token=token, authority=parsed.netloc, keepalive=KEEPALIVE
    ) as client:
        yield client


async def _connect(url: str, host: str, port: int, context: ssl.SSLContext) -> TLSStream:
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise ControlClientError(
            f"cannot reach the controlplane at {url}: {exc.strerror or exc}"
        ) from None
    tls = TLSStream(tcp, context, server_side=False, server_hostname=host)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tls)
        raise ControlClientError(
            f"TLS with {url} failed ({exc.__cause__ or exc}); "
            "if its certificate is from a private CA, pass that CA with --ca FILE"
        ) from None
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    if tls.selected_alpn_protocol() != "h2":
        await trio.aclose_forcefully(tls)
        raise ControlClientError(
            f"{url} does not speak HTTP/2; check that --controlplane is the controlplane's URL"
        )
    return tls
