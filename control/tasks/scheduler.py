"""Which pending task goes to which worker: one pure decision per scheduling pass.

The controlplane gathers what workers report (cards, CPU, memory, less what running and starting
tasks hold) and the pending tasks, calls `schedule`, and only then does I/O to carry the plan
out. Nothing here touches a clock, a socket or the database, so every rule is unit-tested
directly and the same inputs always give the same plan.

Rules, in the order they apply:

- Only workers that are ready and not draining take tasks.
- A task runs on ONE worker: a multi-card task is never split, it waits until a single worker
  has all the cards, CPU and memory it asks for.
- Tasks are considered in created order (`created_seq`, then `id`). Within a workspace the order
  is strict first come, first served: once a task waits for room, every later task of that
  workspace waits behind it, even a small one that would fit now. That keeps a workspace's queue
  predictable and stops a stream of small tasks from starving a big one. Across workspaces
  nothing blocks: a waiting workspace does not hold up the others.
- A task that no ready worker could ever hold (it asks more than the largest worker has in
  total) does not block its workspace: no amount of waiting on the current workers makes room
  for it, so holding the queue behind it would stall the workspace until a bigger worker joins.
  It keeps its place in created order and is placed first once such a worker joins.
- Best fit: of the workers that fit, the one with the fewest free cards, then the least free
  CPU, then the least free memory (then worker id, for a stable plan). Big workers stay free for
  big tasks. Capacity taken by one assignment is subtracted before the next task is considered.

Every task not assigned gets a reason: a stable sentence a user can read in the task's status.

The workers are kept in buckets by free cards, each sorted by free CPU, so a placement is a
bisect per card level rather than a scan of every worker; 10,000 tasks over 1,000 workers take
well under a second.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence

import attrs

__all__ = [
    "Assignment",
    "MachineSize",
    "PendingTask",
    "Retire",
    "SchedulePlan",
    "Waiting",
    "WorkerCapacity",
    "beyond_every_machine",
    "idle_workers_to_retire",
    "schedule",
]

_NEVER_SPLIT = "(a task is never split across workers)"


@attrs.frozen
class PendingTask:
    """A task waiting for a worker, with what it asks for."""

    id: str
    workspace: str
    # Global order of creation; first come, first served follows it.
    created_seq: int
    cards: int = attrs.field(validator=attrs.validators.ge(0))
    cpu_millis: int = attrs.field(validator=attrs.validators.ge(0))
    memory_bytes: int = attrs.field(validator=attrs.validators.ge(0))


@attrs.frozen
class WorkerCapacity:
    """What one worker can take now.

    The `*_free` fields are what the worker reports less what its running and starting tasks
    hold. The `*_total` fields are the worker's whole size; they tell a task that waits for room
    from one that can never fit. Left at None they are taken to equal the free amount, which is
    right only for an idle worker: callers should pass them.
    """

    worker_id: str
    node: str
    ready: bool
    cards_free: int
    cpu_free_millis: int
    memory_free_bytes: int
    draining: bool
    cards_total: int | None = None
    cpu_total_millis: int | None = None
    memory_total_bytes: int | None = None


@attrs.frozen
class Assignment:
    task_id: str
    worker_id: str


@attrs.frozen
class Waiting:
    task_id: str
    # A sentence for the user, stable for the same situation (no times, no counters that move).
    reason: str


@attrs.frozen
class SchedulePlan:
    # In the order the decisions were made (created order).
    assignments: tuple[Assignment, ...]
    # In created order.
    waiting: tuple[Waiting, ...]


def schedule(
    pending: Sequence[PendingTask], workers: Sequence[WorkerCapacity], now: float
) -> SchedulePlan:
    """Place as many of `pending` on `workers` as the rules allow; say why the rest wait.

    `now` is the time of this pass. The plan does not depend on it yet; it is part of the
    signature so that aging (lifting a long-waiting big task ahead of other workspaces) can come
    without changing callers.
    """
    del now
    order = sorted(pending, key=lambda t: (t.created_seq, t.id))
    eligible = [w for w in workers if w.ready and not w.draining]
    if not eligible:
        reason = _no_worker_reason(workers)
        return SchedulePlan((), tuple(Waiting(t.id, reason) for t in order))

    pool = _Pool(eligible)
    assignments: list[Assignment] = []
    waiting: list[Waiting] = []
    # Workspace -> the id of its first task that waits for room.
    blocked: dict[str, str] = {}
    for task in order:
        never = pool.never_fits_reason(task)
        if never is not None:
            waiting.append(Waiting(task.id, never))
            continue
        first_waiting = blocked.get(task.workspace)
        if first_waiting is not None:
            waiting.append(
                Waiting(
                    task.id,
                    f"waiting behind task {first_waiting} "
                    f"(first come, first served within workspace {task.workspace})",
                )
            )
            continue
        worker_id = pool.take(task)
        if worker_id is not None:
            assignments.append(Assignment(task.id, worker_id))
            continue
        blocked[task.workspace] = task.id
        waiting.append(Waiting(task.id, pool.full_reason(task)))
    return SchedulePlan(tuple(assignments), tuple(waiting))


@attrs.frozen
class MachineSize:
    """A machine of a pool and its cards (all of them, free or not): what a worker started
    there could hold at most."""

    pool: str
    node: str
    cards: int
    free: int = 0
    """Cards no pod holds (ours or another's)."""
    worker: str = ""
    """Our worker there (its Job's name), if any."""
    broken: int = 0
    """Cards our worker there quarantined (unhealthy, or refused at its start): they serve
    again only once that worker is replaced."""


@attrs.frozen
class Retire:
    """An idle worker to give up, so that its node's next worker holds its cards and the node's
    free ones together, which a waiting task needs."""

    worker_id: str
    pool: str
    node: str
    task_id: str
    why: str
    """For the worker's end (its Job's Event, the log)."""
    waiting: str
    """For the task, while it waits for the next worker."""


def idle_workers_to_retire(
    waiting: Sequence[PendingTask],
    workers: Sequence[WorkerCapacity],
    busy: Collection[str],
    machines: Sequence[MachineSize],
    promised: Collection[str] = (),
) -> tuple[Retire, ...]:
    """Which idle workers to retire at once rather than when they idle out.

    A worker holds the cards that were free on its node when it started; cards freed there
    later (a neighbour scaled down) stay outside it. A task larger than the worker that would
    fit in the worker's cards plus the node's free ones waits for nothing but that worker:
    retired now, its node's next worker takes everything free. Rules:

    - only a ready, not draining worker holding no task (`busy`: those that hold one) whose
      node is a known machine with it as our worker;
    - for each waiting task in `waiting`'s order (created order), not already `promised` a
      retirement: the worker with fewer cards than the task asks for whose cards plus its
      node's free cards cover it; of several, the smallest such sum (best fit), then the node;
    - one retirement per task and per worker.
    """
    by_worker = {m.worker: m for m in machines if m.worker}
    idle = sorted(
        (
            (w, by_worker[w.worker_id])
            for w in workers
            if w.ready
            and not w.draining
            and w.worker_id not in busy
            and w.worker_id in by_worker
            and by_worker[w.worker_id].node == w.node
        ),
        key=lambda pair: (pair[0].cards_free + pair[1].free, pair[1].node, pair[0].worker_id),
    )
    taken: set[str] = set()
    out: list[Retire] = []
    for task in waiting:
        if task.id in promised or task.cards == 0:
            continue
        for worker, machine in idle:
            if worker.worker_id in taken:
                continue
            now_cards = worker.cards_free
            if not now_cards < task.cards <= now_cards + machine.free:
                continue
            taken.add(worker.worker_id)
            whole = now_cards + machine.free
            out.append(
                Retire(
                    worker_id=worker.worker_id,
                    pool=machine.pool,
                    node=machine.node,
                    task_id=task.id,
                    why=(
                        f"retired while idle: task {task.id} asks {_cards(task.cards)}, and "
                        f"this worker's {_cards(now_cards)} with the {machine.free} now free on "
                        f"node {machine.node} make {whole}"
                    ),
                    waiting=(
                        f"waiting: {_cards(task.cards)} asked; the idle worker on node "
                        f"{machine.node} ({_cards(now_cards)}) is being replaced by one with "
                        f"all {whole} free cards there"
                    ),
                )
            )
            break
    return tuple(out)


def beyond_every_machine(cards: int, machines: Sequence[MachineSize]) -> str | None:
    """Why a task asking `cards` cards waits for a node that no pool has yet: more cards than
    the largest machine has. None when a machine has that many, or when none is known (the
    pools of another replica)."""
    if not machines or cards == 0:
        return None
    largest = min(machines, key=lambda m: (-m.cards, m.pool, m.node))
    sound = min(machines, key=lambda m: (-(m.cards - m.broken), m.pool, m.node))
    if cards <= sound.cards - sound.broken:
        return None
    if cards <= largest.cards:
        # Never promise cards a worker quarantined: they are back only with its next worker.
        return (
            f"waiting: {_cards(cards)} asked; the largest machine has {_cards(largest.cards)} "
            f"(node {largest.node}, pool {largest.pool}), but {largest.broken} of them are "
            f"unhealthy (`levers9 machine list` names them) and take no task until its worker "
            f"is replaced; a task never spans machines"
        )
    return (
        f"waiting: {_cards(cards)} asked; the largest machine has {_cards(largest.cards)} "
        f"(node {largest.node}, pool {largest.pool}), and a task never spans machines; it "
        f"waits for a node with {_cards(cards)} to join a pool"
    )


def _no_worker_reason(workers: Sequence[WorkerCapacity]) -> str:
    if not workers:
        return "waiting: no worker has joined yet"
    draining = sum(1 for w in workers if w.draining)
    not_ready = len(workers) - draining
    return f"waiting: no worker is ready ({draining} draining, {not_ready} not ready)"


# One worker's free room as kept in a card bucket: sorted by CPU, then memory, then id, which is
# the best-fit order within one card level. The last item indexes `_Pool._ids`.
_Entry = tuple[int, int, str, int]


class _Pool:
    """The eligible workers' free room while one pass assigns tasks (private to `schedule`)."""

    def __init__(self, workers: Sequence[WorkerCapacity]) -> None:
        self._ids = [w.worker_id for w in workers]
        # A worker reporting less than its tasks hold has nothing free, not a debt.
        cards = [max(w.cards_free, 0) for w in workers]
        cpu = [max(w.cpu_free_millis, 0) for w in workers]
        memory = [max(w.memory_free_bytes, 0) for w in workers]
        self._buckets: dict[int, list[_Entry]] = {}
        for i, c in enumerate(cards):
            self._buckets.setdefault(c, []).append((cpu[i], memory[i], self._ids[i], i))
        for bucket in self._buckets.values():
            bucket.sort()
        self._levels = sorted(self._buckets)
        # Sorted multisets of free room, for "at most N free on any worker".
        self._free_cards = sorted(cards)
        self._free_cpu = sorted(cpu)
        self._free_memory = sorted(memory)
        totals = [
            (
                max(w.cards_total if w.cards_total is not None else 0, cards[i]),
                max(w.cpu_total_millis if w.cpu_total_millis is not None else 0, cpu[i]),
                max(w.memory_total_bytes if w.memory_total_bytes is not None else 0, memory[i]),
            )
            for i, w in enumerate(workers)
        ]
        self._largest = (
            max(t[0] for t in totals),
            max(t[1] for t in totals),
            max(t[2] for t in totals),
        )
        self._frontier = _pareto_frontier(totals)
        self._never_cache: dict[tuple[int, int, int], str | None] = {}

    def take(self, task: PendingTask) -> str | None:
        """Put `task` on the best-fitting worker and subtract what it holds; None if none fits."""
        start = bisect.bisect_left(self._levels, task.cards)
        for level in self._levels[start:]:
            bucket = self._buckets[level]
            pos = bisect.bisect_left(bucket, (task.cpu_millis,))
            while pos < len(bucket) and bucket[pos][1] < task.memory_bytes:
                pos += 1
            if pos < len(bucket):
                cpu, memory, worker_id, i = bucket.pop(pos)
                self._move(i, level, cpu, memory, task)
                return worker_id
        return None

    def _move(self, i: int, level: int, cpu: int, memory: int, task: PendingTask) -> None:
        cards_left = level - task.cards
        cpu_left = cpu - task.cpu_millis
        memory_left = memory - task.memory_bytes
        bucket = self._buckets.get(cards_left)
        if bucket is None:
            bucket = self._buckets[cards_left] = []
            bisect.insort(self._levels, cards_left)
        bisect.insort(bucket, (cpu_left, memory_left, self._ids[i], i))
        _replace(self._free_cards, level, cards_left)
        _replace(self._free_cpu, cpu, cpu_left)
        _replace(self._free_memory, memory, memory_left)

    def never_fits_reason(self, task: PendingTask) -> str | None:
        """Why no eligible worker could hold `task` even when idle, or None if one could."""
        shape = (task.cards, task.cpu_millis, task.memory_bytes)
        if shape in self._never_cache:
            return self._never_cache[shape]
        reason: str | None = None
        if not any(
            t[0] >= shape[0] and t[1] >= shape[1] and t[2] >= shape[2] for t in self._frontier
        ):
            cards, cpu, memory = self._largest
            if task.cards > cards:
                reason = (
                    f"{_cards(task.cards)} asked; the largest worker has {_cards(cards)} "
                    f"{_NEVER_SPLIT}"
                )
            elif task.cpu_millis > cpu:
                reason = (
                    f"{_cpus(task.cpu_millis)} asked; the largest worker has {_cpus(cpu)} "
                    f"{_NEVER_SPLIT}"
                )
            elif task.memory_bytes > memory:
                asked, has = _bytes_pair(task.memory_bytes, memory)
                reason = f"{asked} memory asked; the largest worker has {has} memory {_NEVER_SPLIT}"
            else:
                reason = f"{_shape(task)} asked; no worker has all of that {_NEVER_SPLIT}"
        self._never_cache[shape] = reason
        return reason

    def full_reason(self, task: PendingTask) -> str:
        """Why `task`, which some eligible worker could hold, does not fit any of them now."""
        cards, cpu, memory = self._free_cards[-1], self._free_cpu[-1], self._free_memory[-1]
        if task.cards > cards:
            return f"waiting: {_cards(task.cards)} asked, at most {cards} free on any worker"
        if task.cpu_millis > cpu:
            return (
                f"waiting: {_cpus(task.cpu_millis)} asked, "
                f"at most {_cpus(cpu, unit=False)} free on any worker"
            )
        if task.memory_bytes > memory:
            asked, has = _bytes_pair(task.memory_bytes, memory)
            return f"waiting: {asked} memory asked, at most {has} free on any worker"
        return f"waiting: {_shape(task)} asked; no single worker has all of that free now"


def _replace(values: list[int], old: int, new: int) -> None:
    del values[bisect.bisect_left(values, old)]
    bisect.insort(values, new)


def _pareto_frontier(points: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The points no other point covers in every dimension: enough to answer "does any fit"."""
    frontier: list[tuple[int, int, int]] = []
    # Descending order means a point can only be covered by one already kept.
    for p in sorted(set(points), reverse=True):
        if not any(f[0] >= p[0] and f[1] >= p[1] and f[2] >= p[2] for f in frontier):
            frontier.append(p)
    return frontier


def _cards(n: int) -> str:
    return "1 card" if n == 1 else f"{n} cards"


def _cpus(millis: int, *, unit: bool = True) -> str:
    whole, frac = divmod(millis, 1000)
    number = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if not unit:
        return number
    return f"{number} CPU" if millis == 1000 else f"{number} CPUs"


_BYTE_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _bytes(n: int) -> str:
    for name, size in _BYTE_UNITS:
        if n >= size:
            return f"{round(n / size, 2):g} {name}"
    return f"{n} bytes"


def _bytes_pair(asked: int, has: int) -> tuple[str, str]:
    """Both amounts readably, or exactly where rounding would make them read the same."""
    a, h = _bytes(asked), _bytes(has)
    if a == h:
        return f"{asked} bytes", f"{has} bytes"
    return a, h


def _shape(task: PendingTask) -> str:
    parts = []
    if task.cards:
        parts.append(_cards(task.cards))
    if task.cpu_millis:
        parts.append(_cpus(task.cpu_millis))
    if task.memory_bytes:
        parts.append(f"{_bytes(task.memory_bytes)} memory")
    if not parts:
        return "nothing"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]
