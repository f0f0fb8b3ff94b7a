"""`levers9 run` and `levers9 task list|get|logs|cancel|snapshot`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time

import trio

from control.cli.client import ControlClient
from control.cli.common import (
    POLL_INTERVAL_S,
    Interrupted,
    client_from_args,
    interruptible,
    timed,
)
from control.cli.output import (
    TASK_HEADERS,
    Console,
    Progress,
    deadline_message,
    format_details,
    show_list,
    task_details,
    task_outcome,
    task_row,
)
from control.cli.parse import parse_count, parse_seconds, parse_states, request_from_args
from control.cli.usage import EXIT_DEADLINE, EXIT_INTERRUPTED
from control.models import TaskState, TaskView
from wire.errors import ApiError, unstructure


def _follow_hint(task_id: str) -> str:
    return (
        f"follow it again with 'levers9 task logs -f {task_id}'; "
        f"stop it with 'levers9 task cancel {task_id}'"
    )


async def cmd_run(args: argparse.Namespace) -> int:
    request = request_from_args(args, os.environ)
    wait_s = parse_seconds(args.wait, "--wait", allow_zero=True)
    console = Console.from_sys()
    async with client_from_args(args) as client:
        view = await timed(client.create_task(request))
        if args.detach:
            console.print(view.id)
            return 0
        result = await interruptible(lambda: follow_run(client, view, wait_s, console))
    if isinstance(result, Interrupted):
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
                    while current.state in (TaskState.PENDING, TaskState.STARTING):
                        console.status(progress.update(current))
                        await trio.sleep(POLL_INTERVAL_S)
                        current = latest = await timed(client.task(task_id))
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
            latest = await timed(client.task(task_id))
        console.status(deadline_message(latest, wait_s) + "\n")
        return EXIT_DEADLINE
    console.status(progress.finish())
    return await _run_outcome(client, latest, log_error, console)


async def _run_outcome(
    client: ControlClient, latest: TaskView, log_error: ApiError | None, console: Console
) -> int:
    """Once the logs ended: wait for the task to end, say why, and return its exit code."""
    final = latest
    while not final.terminal:
        final = await client.wait_task(latest.id)
        if not final.terminal:
            await trio.sleep(POLL_INTERVAL_S)
    if log_error is not None:
        console.status(f"levers9: could not follow the logs of task {latest.id}: {log_error}\n")
    code, message = task_outcome(final)
    if message:
        console.status(f"levers9: {message}\n")
    return code


async def task_list(args: argparse.Namespace) -> None:
    states = parse_states(args.state) if args.state else None
    limit = parse_count(args.limit, "--limit", minimum=1)
    async with client_from_args(args) as client:
        tasks = await timed(client.tasks(states, limit, args.before))
    now = time.time()
    show_list(args.json, tasks, TASK_HEADERS, lambda t: task_row(t, now))


async def task_get(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        view = await timed(client.task(args.task_id))
    if args.json:
        print(json.dumps(unstructure(view), indent=2))
        return
    print(format_details(task_details(view, time.time())))


async def task_logs(args: argparse.Namespace) -> int:
    console = Console.from_sys()

    async def follow(client: ControlClient) -> None:
        async with contextlib.aclosing(client.task_logs(args.task_id, follow=args.follow)) as lines:
            async for line in lines:
                console.log_line(line)

    async with client_from_args(args) as client:
        result = await interruptible(lambda: follow(client))
    return EXIT_INTERRUPTED if isinstance(result, Interrupted) else 0


async def task_cancel(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        view = await timed(client.cancel_task(args.task_id))
    print(f"task {view.id}: {view.state.value}")


async def task_snapshot(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        snapshot = await timed(client.snapshot_task(args.task_id))
    print(snapshot.digest)
