"""`?watch=true` streams: the value once, then only what changed.

A list watch sends its page (a `TaskList`, what a plain GET returns) as the first line, then
one `TaskListChanges` line per change: each task that changed or arrived with its place in
the page, and the ids that left it. Nothing is encoded or sent when nothing changed, however
often the stream looks; views are compared as values, and only a changed task is encoded.
`page_changes` is the pure diff; the dashboard applies it (control/ui/static/app.js).

A stream the caller does not read blocks its generator at its one pending line (HTTP/2 flow
control), which then holds the last page sent and the line: a bounded amount. Past
`WATCH_STALL_S` blocked, the stream is reset (`StreamResponse.stall_timeout_s`), and a slot of
the token's `maxWatchStreams` comes free.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import attrs
import trio

from control.limits import WatchSlot
from control.models import TaskList, TaskView
from wire.errors import dumps
from wire.service import StreamResponse

WATCH_REFRESH_S = 30.0
"""A watch reads again at least this often, for a change it was not told of; what it reads is
compared with what it sent, and sent only if it differs."""
WATCH_COALESCE_S = 0.25
"""After a change, a watch waits this long for the rest of a burst before reading again."""
WATCH_STALL_S = 30.0
"""A watch whose caller has read nothing for this long is ended."""


@attrs.frozen
class TaskChange:
    """A task that changed or arrived, and its place (0: first) in the page now."""

    index: int
    task: TaskView


@attrs.frozen
class TaskListChanges:
    """A watched page's change: apply `removed` first, then each of `changed` in order (each
    taken out by id, if there, and put at its `index`). `next` is the page's cursor now."""

    changed: tuple[TaskChange, ...] = ()
    removed: tuple[str, ...] = ()
    next: str | None = None


def page_changes(before: TaskList, after: TaskList) -> TaskListChanges | None:
    """What turns page `before` into `after`, or None when they are the same. Pure.

    The page's order is its tasks' creation order, which never changes for a task, so the
    tasks in both pages that did not change keep their order, and putting each changed one at
    its index, in ascending order, after taking out the rest, gives `after` exactly."""
    old = {view.id: view for view in before.tasks}
    now = {view.id for view in after.tasks}
    changed = tuple(
        TaskChange(i, view) for i, view in enumerate(after.tasks) if old.get(view.id) != view
    )
    removed = tuple(view.id for view in before.tasks if view.id not in now)
    if not changed and not removed and before.next == after.next:
        return None
    return TaskListChanges(changed, removed, after.next)


def apply_changes(page: TaskList, changes: TaskListChanges) -> TaskList:
    """The page a watcher holds after `changes` (what the dashboard does). Pure."""
    moved = set(changes.removed) | {c.task.id for c in changes.changed}
    tasks = [view for view in page.tasks if view.id not in moved]
    for change in changes.changed:
        tasks.insert(change.index, change.task)
    return TaskList(tuple(tasks), next=changes.next)


def watch_list(
    read: Callable[[], Awaitable[TaskList]],
    changed: Callable[[], Awaitable[None]],
    slot: WatchSlot,
) -> StreamResponse:
    """A list watch: the page, then its changes, until the caller goes."""

    async def frames() -> AsyncGenerator[bytes, None]:
        try:
            sent = await read()
            yield dumps(sent) + b"\n"
            while True:
                await _wait_for_change(changed)
                page = await read()
                changes = page_changes(sent, page)
                sent = page
                if changes is not None:
                    yield dumps(changes) + b"\n"
        finally:
            slot.release()

    return StreamResponse(
        frames, content_type="application/x-ndjson", stall_timeout_s=WATCH_STALL_S
    )


def watch_value(
    read: Callable[[], Awaitable[Any]],
    changed: Callable[[], Awaitable[None]],
    done: Callable[[Any], bool],
    slot: WatchSlot,
) -> StreamResponse:
    """A watch of one value (a task): it, as one JSON line now and again each time it differs,
    until `done` says the last one sent is final (an ended task) or the caller goes."""

    async def frames() -> AsyncGenerator[bytes, None]:
        try:
            last: Any = None
            first = True
            while True:
                current = await read()
                if first or current != last:
                    first, last = False, current
                    yield dumps(current) + b"\n"
                if done(current):
                    return
                await _wait_for_change(changed)
        finally:
            slot.release()

    return StreamResponse(
        frames, content_type="application/x-ndjson", stall_timeout_s=WATCH_STALL_S
    )


async def _wait_for_change(changed: Callable[[], Awaitable[None]]) -> None:
    with trio.move_on_after(WATCH_REFRESH_S):
        await changed()
    await trio.sleep(WATCH_COALESCE_S)


__all__ = [
    "TaskChange",
    "TaskListChanges",
    "apply_changes",
    "page_changes",
    "watch_list",
    "watch_value",
]
