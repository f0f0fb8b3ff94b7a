"""`levers9 port`: a local listener forwarding to a task's port."""

from __future__ import annotations

import argparse

import trio

from control.cli.client import ControlClient
from control.cli.common import client_from_args, interruptible, timed
from control.cli.output import Console
from control.cli.parse import parse_local, parse_port
from control.cli.usage import CliError
from wire.errors import ApiError


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
    from wire.service import splice

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
        # The local client's bytes go on while the controlplane and the worker connect, so a
        # client that speaks first waits one round trip to the container, not two.
        async with local:
            try:
                remote = await client.connect_port_early(task_id, port)
                async with remote:
                    await splice(local, remote, opening=remote.wait_open)
            except ApiError as exc:
                console.status(f"levers9: cannot forward a connection to {task_id}:{port}: {exc}\n")

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
    async with client_from_args(args) as client:
        view = await timed(client.task(args.task_id))
        if view.terminal:
            raise CliError(
                f"task {view.id} has ended ({view.state}); forward ports of a running task"
            )
        if port not in view.ports:
            declared = ", ".join(str(p) for p in view.ports) or "none"
            raise CliError(
                f"task {view.id} declares no port {port} (its ports: {declared}); only declared "
                "ports are reachable: run the task with --port"
            )
        await interruptible(lambda: forward_port(client, view.id, port, host, local_port, console))
    return 0
