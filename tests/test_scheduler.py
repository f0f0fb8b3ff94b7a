"""The scheduler's plan: placement, best fit, FIFO per workspace, and the reasons users read."""

from __future__ import annotations

import random
import time

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.tasks.scheduler import (
    MachineSize,
    PendingTask,
    WorkerCapacity,
    beyond_every_machine,
    idle_workers_to_retire,
    schedule,
)

GIB = 1 << 30


def task(
    id: str, seq: int, *, ws: str = "ws-a", cards: int = 0, cpu: int = 1000, mem: int = GIB
) -> PendingTask:
    return PendingTask(
        id=id, workspace=ws, created_seq=seq, cards=cards, cpu_millis=cpu, memory_bytes=mem
    )


def worker(
    id: str,
    *,
    cards: int = 0,
    cpu: int = 32_000,
    mem: int = 256 * GIB,
    cards_total: int | None = None,
    cpu_total: int | None = None,
    mem_total: int | None = None,
    ready: bool = True,
    draining: bool = False,
) -> WorkerCapacity:
    return WorkerCapacity(
        worker_id=id,
        node=f"node-{id}",
        ready=ready,
        cards_free=cards,
        cpu_free_millis=cpu,
        memory_free_bytes=mem,
        draining=draining,
        cards_total=cards_total,
        cpu_total_millis=cpu_total,
        memory_total_bytes=mem_total,
    )


@attrs.frozen
class Case:
    pending: list[PendingTask]
    workers: list[WorkerCapacity]
    assigned: dict[str, str]
    waiting: dict[str, str]


NEVER_SPLIT = "(a task is never split across workers)"

CASES = {
    "single card goes to the worker with a card": Case(
        [task("t1", 1, cards=1)],
        [worker("cpu-only"), worker("gpu", cards=1)],
        {"t1": "gpu"},
        {},
    ),
    "best fit takes the worker with fewest free cards": Case(
        [task("t1", 1, cards=1)],
        [worker("big", cards=8), worker("small", cards=2), worker("mid", cards=4)],
        {"t1": "small"},
        {},
    ),
    "best fit breaks a card tie on least free CPU": Case(
        [task("t1", 1, cards=1, cpu=2000)],
        [worker("roomy", cards=2, cpu=64_000), worker("tight", cards=2, cpu=4000)],
        {"t1": "tight"},
        {},
    ),
    "best fit keeps the big worker for the big task": Case(
        [task("small", 1, cards=1), task("big", 2, ws="ws-b", cards=8)],
        [worker("eight", cards=8), worker("one", cards=1)],
        {"small": "one", "big": "eight"},
        {},
    ),
    "capacity taken within one pass is subtracted": Case(
        [
            task("t1", 1, ws="a", cards=1),
            task("t2", 2, ws="b", cards=1),
            task("t3", 3, ws="c", cards=1),
        ],
        [worker("w", cards=2)],
        {"t1": "w", "t2": "w"},
        {"t3": "waiting: 1 card asked, at most 0 free on any worker"},
    ),
    "reasons count what this pass already took": Case(
        [task("t1", 1, ws="a", cpu=3000), task("t2", 2, ws="b", cpu=2000)],
        [worker("w", cpu=4000)],
        {"t1": "w"},
        {"t2": "waiting: 2 CPUs asked, at most 1 free on any worker"},
    ),
    "multi-card task waits until one worker has them all": Case(
        [task("t1", 1, cards=2)],
        [worker("w1", cards=1, cards_total=2), worker("w2", cards=1, cards_total=2)],
        {},
        {"t1": "waiting: 2 cards asked, at most 1 free on any worker"},
    ),
    "multi-card task placed once one worker has them all": Case(
        [task("t1", 1, cards=2)],
        [worker("w1", cards=2, cards_total=2), worker("w2", cards=1, cards_total=2)],
        {"t1": "w1"},
        {},
    ),
    "a task is never split across workers": Case(
        [task("t1", 1, cards=2)],
        [worker("w1", cards=1, cards_total=1), worker("w2", cards=1, cards_total=1)],
        {},
        {"t1": f"2 cards asked; the largest worker has 1 card {NEVER_SPLIT}"},
    ),
    "a big first task blocks the small second one of its workspace": Case(
        [task("big", 1, cards=2), task("small", 2, cards=1)],
        [worker("w", cards=1, cards_total=2)],
        {},
        {
            "big": "waiting: 2 cards asked, at most 1 free on any worker",
            "small": "waiting behind task big (first come, first served within workspace ws-a)",
        },
    ),
    "another workspace is not blocked": Case(
        [task("big", 1, ws="a", cards=2), task("small", 2, ws="b", cards=1)],
        [worker("w", cards=1, cards_total=2)],
        {"small": "w"},
        {"big": "waiting: 2 cards asked, at most 1 free on any worker"},
    ),
    "workspaces interleave in created order": Case(
        # Given out of order on purpose: created order decides, not the order passed in.
        [
            task("a2", 3, ws="a", cards=1),
            task("b1", 2, ws="b", cards=1),
            task("a1", 1, ws="a", cards=1),
        ],
        [worker("w", cards=2)],
        {"a1": "w", "b1": "w"},
        {"a2": "waiting: 1 card asked, at most 0 free on any worker"},
    ),
    "a task no worker could ever hold does not block its workspace": Case(
        [task("huge", 1, cards=4), task("small", 2, cards=1)],
        [worker("w", cards=2, cards_total=2)],
        {"small": "w"},
        {"huge": f"4 cards asked; the largest worker has 2 cards {NEVER_SPLIT}"},
    ),
    "behind a waiting task, one that can never fit says so": Case(
        [task("big", 1, cards=2), task("huge", 2, cards=4)],
        [worker("w", cards=1, cards_total=2)],
        {},
        {
            "big": "waiting: 2 cards asked, at most 1 free on any worker",
            "huge": f"4 cards asked; the largest worker has 2 cards {NEVER_SPLIT}",
        },
    ),
    "CPU short now": Case(
        [task("t1", 1, cards=1, cpu=2000)],
        [worker("w", cards=4, cpu=1000, cpu_total=8000)],
        {},
        {"t1": "waiting: 2 CPUs asked, at most 1 free on any worker"},
    ),
    "CPU in fractions": Case(
        [task("t1", 1, cpu=1500)],
        [worker("w", cpu=250, cpu_total=8000)],
        {},
        {"t1": "waiting: 1.5 CPUs asked, at most 0.25 free on any worker"},
    ),
    "CPU never enough": Case(
        [task("t1", 1, cpu=16_000)],
        [worker("w", cpu=8000, cpu_total=8000)],
        {},
        {"t1": f"16 CPUs asked; the largest worker has 8 CPUs {NEVER_SPLIT}"},
    ),
    "memory short now": Case(
        [task("t1", 1, mem=8 * GIB)],
        [worker("w", mem=4 * GIB, mem_total=64 * GIB)],
        {},
        {"t1": "waiting: 8 GiB memory asked, at most 4 GiB free on any worker"},
    ),
    "memory never enough": Case(
        [task("t1", 1, mem=64 * GIB)],
        [worker("w", mem=32 * GIB, mem_total=32 * GIB)],
        {},
        {"t1": f"64 GiB memory asked; the largest worker has 32 GiB memory {NEVER_SPLIT}"},
    ),
    "memory amounts that would round alike are given exactly": Case(
        [task("t1", 1, mem=4 * GIB + 1)],
        [worker("w", mem=4 * GIB, mem_total=8 * GIB)],
        {},
        {
            "t1": f"waiting: {4 * GIB + 1} bytes memory asked, "
            f"at most {4 * GIB} bytes free on any worker"
        },
    ),
    "memory decides between workers that fit cards and CPU": Case(
        [task("t1", 1, cards=1, mem=16 * GIB)],
        [worker("low-mem", cards=1, mem=8 * GIB), worker("high-mem", cards=1, mem=32 * GIB)],
        {"t1": "high-mem"},
        {},
    ),
    "no single worker has everything free at once": Case(
        [task("t1", 1, cards=1, cpu=4000)],
        [worker("cards", cards=2, cpu=1000, cpu_total=8000), worker("cpu", cards=0, cpu=8000)],
        {},
        {
            "t1": "waiting: 1 card, 4 CPUs and 1 GiB memory asked; "
            "no single worker has all of that free now"
        },
    ),
    "no worker has everything even when idle": Case(
        [task("t1", 1, cards=2, cpu=16_000)],
        [worker("cards", cards=2, cpu=1000), worker("cpu", cards=0, cpu=16_000)],
        {},
        {"t1": f"2 cards, 16 CPUs and 1 GiB memory asked; no worker has all of that {NEVER_SPLIT}"},
    ),
    "draining and not-ready workers are skipped": Case(
        [task("t1", 1, cards=1)],
        [
            worker("draining", cards=1, draining=True),
            worker("starting", cards=1, ready=False),
            worker("ok", cards=8),
        ],
        {"t1": "ok"},
        {},
    ),
    "no ready worker": Case(
        [task("t1", 1, cards=1), task("t2", 2, cards=1)],
        [worker("draining", cards=8, draining=True), worker("starting", cards=8, ready=False)],
        {},
        {
            "t1": "waiting: no worker is ready (1 draining, 1 not ready)",
            "t2": "waiting: no worker is ready (1 draining, 1 not ready)",
        },
    ),
    "no worker at all": Case(
        [task("t1", 1)],
        [],
        {},
        {"t1": "waiting: no worker has joined yet"},
    ),
    "largest worker counts only workers taking tasks": Case(
        [task("t1", 1, cards=4)],
        [worker("draining", cards=8, draining=True), worker("ok", cards=2, cards_total=2)],
        {},
        {"t1": f"4 cards asked; the largest worker has 2 cards {NEVER_SPLIT}"},
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan(case: Case) -> None:
    plan = schedule(case.pending, case.workers, now=0.0)
    assert {a.task_id: a.worker_id for a in plan.assignments} == case.assigned
    assert {w.task_id: w.reason for w in plan.waiting} == case.waiting


def test_waiting_comes_back_in_created_order() -> None:
    plan = schedule(
        [task("c", 3, cards=9), task("a", 1, cards=9), task("b", 2, cards=9)],
        [worker("w", cards=1)],
        now=0.0,
    )
    assert [w.task_id for w in plan.waiting] == ["a", "b", "c"]


def test_negative_request_is_refused() -> None:
    with pytest.raises(ValueError, match="cards"):
        task("t1", 1, cards=-1)


# ---- properties -----------------------------------------------------------------------------


def _reference(pending: list[PendingTask], workers: list[WorkerCapacity]) -> dict[str, str]:
    """The rules written as plainly as possible: a scan of every worker for every task."""
    free = {
        w.worker_id: [max(w.cards_free, 0), max(w.cpu_free_millis, 0), max(w.memory_free_bytes, 0)]
        for w in workers
        if w.ready and not w.draining
    }
    totals = [
        (
            max(w.cards_total or 0, w.cards_free),
            max(w.cpu_total_millis or 0, w.cpu_free_millis),
            max(w.memory_total_bytes or 0, w.memory_free_bytes),
        )
        for w in workers
        if w.ready and not w.draining
    ]
    assigned: dict[str, str] = {}
    blocked: set[str] = set()
    for t in sorted(pending, key=lambda t: (t.created_seq, t.id)):
        need = (t.cards, t.cpu_millis, t.memory_bytes)
        if not any(all(tot[k] >= need[k] for k in range(3)) for tot in totals):
            continue
        if t.workspace in blocked:
            continue
        fits = [wid for wid, f in free.items() if all(f[k] >= need[k] for k in range(3))]
        if not fits:
            blocked.add(t.workspace)
            continue
        best = min(fits, key=lambda wid: (*free[wid], wid))
        for k in range(3):
            free[best][k] -= need[k]
        assigned[t.id] = best
    return assigned


@st.composite
def tasks_st(draw: st.DrawFn) -> list[PendingTask]:
    n = draw(st.integers(0, 25))
    return [
        PendingTask(
            id=f"t{i}",
            workspace=draw(st.sampled_from(["a", "b", "c"])),
            created_seq=draw(st.integers(0, 10)),
            cards=draw(st.integers(0, 4)),
            cpu_millis=draw(st.integers(0, 8)) * 500,
            memory_bytes=draw(st.integers(0, 8)) * GIB,
        )
        for i in range(n)
    ]


@st.composite
def workers_st(draw: st.DrawFn) -> list[WorkerCapacity]:
    n = draw(st.integers(0, 8))
    out = []
    for i in range(n):
        cards_total = draw(st.integers(0, 8))
        cpu_total = draw(st.integers(0, 16)) * 500
        mem_total = draw(st.integers(0, 16)) * GIB
        out.append(
            WorkerCapacity(
                worker_id=f"w{i}",
                node=f"n{i}",
                ready=draw(st.booleans()),
                # Now and then a worker reports less than its tasks hold.
                cards_free=draw(st.integers(-1, cards_total)),
                cpu_free_millis=draw(st.integers(-500, cpu_total)),
                memory_free_bytes=draw(st.integers(0, mem_total)),
                draining=draw(st.booleans()),
                cards_total=draw(st.sampled_from([cards_total, None])),
                cpu_total_millis=cpu_total,
                memory_total_bytes=mem_total,
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(pending=tasks_st(), workers=workers_st())
def test_no_worker_overcommitted_and_every_task_accounted_once(
    pending: list[PendingTask], workers: list[WorkerCapacity]
) -> None:
    plan = schedule(pending, workers, now=0.0)
    ids = [a.task_id for a in plan.assignments] + [w.task_id for w in plan.waiting]
    assert sorted(ids) == sorted(t.id for t in pending)

    by_id = {t.id: t for t in pending}
    eligible = {w.worker_id: w for w in workers if w.ready and not w.draining}
    used = {wid: [0, 0, 0] for wid in eligible}
    for a in plan.assignments:
        assert a.worker_id in eligible
        t = by_id[a.task_id]
        u = used[a.worker_id]
        u[0] += t.cards
        u[1] += t.cpu_millis
        u[2] += t.memory_bytes
    for wid, (cards, cpu, mem) in used.items():
        w = eligible[wid]
        assert cards <= max(w.cards_free, 0)
        assert cpu <= max(w.cpu_free_millis, 0)
        assert mem <= max(w.memory_free_bytes, 0)


@settings(max_examples=300, deadline=None)
@given(pending=tasks_st(), workers=workers_st())
def test_matches_plain_reference(pending: list[PendingTask], workers: list[WorkerCapacity]) -> None:
    plan = schedule(pending, workers, now=0.0)
    assert {a.task_id: a.worker_id for a in plan.assignments} == _reference(pending, workers)


@settings(max_examples=100, deadline=None)
@given(pending=tasks_st(), workers=workers_st(), seed=st.integers(0, 1000))
def test_input_order_does_not_change_the_plan(
    pending: list[PendingTask], workers: list[WorkerCapacity], seed: int
) -> None:
    rng = random.Random(seed)
    shuffled_pending, shuffled_workers = pending[:], workers[:]
    rng.shuffle(shuffled_pending)
    rng.shuffle(shuffled_workers)
    assert schedule(shuffled_pending, shuffled_workers, now=0.0) == schedule(
        pending, workers, now=0.0
    )


def test_large_pass_timing(capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(7)
    workers = []
    for i in range(1000):
        cards_used = rng.choice([0, 0, 2, 4, 8])
        workers.append(
            worker(
                f"w{i:04d}",
                cards=8 - cards_used,
                cpu=96_000 - cards_used * 12_000,
                mem=(1024 - cards_used * 128) * GIB,
                cards_total=8,
                cpu_total=96_000,
                mem_total=1024 * GIB,
                ready=rng.random() > 0.02,
                draining=rng.random() < 0.02,
            )
        )
    pending = [
        task(
            f"t{i:05d}",
            i,
            ws=f"ws{rng.randrange(100)}",
            cards=(c := rng.choice([0, 1, 1, 2, 4, 8])),
            cpu=max(c, 1) * rng.choice([1000, 4000, 12_000]),
            mem=max(c, 1) * rng.choice([4, 32, 128]) * GIB,
        )
        for i in range(10_000)
    ]
    start = time.perf_counter()
    plan = schedule(pending, workers, now=0.0)
    elapsed = time.perf_counter() - start
    with capsys.disabled():
        print(
            f"\nschedule: {len(pending)} tasks, {len(workers)} workers: {elapsed * 1000:.0f} ms "
            f"({len(plan.assignments)} assigned, {len(plan.waiting)} waiting)"
        )
    assert len(plan.assignments) + len(plan.waiting) == len(pending)
    assert plan.assignments, "a thousand mostly idle workers take some of the tasks"


def test_a_task_larger_than_every_machine_names_the_largest_and_what_it_waits_for() -> None:
    machines = [MachineSize("b", "n-2", 8), MachineSize("a", "n-9", 8), MachineSize("a", "n-1", 4)]
    assert beyond_every_machine(9, machines) == (
        "waiting: 9 cards asked; the largest machine has 8 cards (node n-9, pool a), and a "
        "task never spans machines; it waits for a node with 9 cards to join a pool"
    )
    assert beyond_every_machine(8, machines) is None
    assert beyond_every_machine(0, machines) is None
    assert beyond_every_machine(9, []) is None  # no machine known here: nothing to say


def test_a_task_that_fits_only_with_unhealthy_cards_is_not_promised_them() -> None:
    machines = [MachineSize("a", "n-1", 4, worker="w1", broken=1), MachineSize("a", "n-2", 2)]
    assert beyond_every_machine(4, machines) == (
        "waiting: 4 cards asked; the largest machine has 4 cards (node n-1, pool a), but 1 of "
        "them are unhealthy (`levers9 machine list` names them) and take no task until its "
        "worker is replaced; a task never spans machines"
    )
    assert beyond_every_machine(3, machines) is None
    healthy = [*machines, MachineSize("b", "n-3", 4)]
    assert beyond_every_machine(4, healthy) is None  # another machine has 4 sound cards


def machine(id: str, cards: int, free: int, worker: str | None = None) -> MachineSize:
    """The machine of `worker(id)`: its node, with `free` cards no pod holds."""
    return MachineSize(
        "gpu", f"node-{id}", cards, free=free, worker=id if worker is None else worker
    )


def test_an_idle_worker_whose_cards_and_the_free_ones_fit_a_waiting_task_is_retired() -> None:
    # A 4-card node: our idle worker holds 2 cards, the 2 a model server held are free now.
    retire = idle_workers_to_retire(
        [task("big", 0, cards=3)],
        [worker("w1", cards=2, cards_total=2)],
        busy=(),
        machines=[machine("w1", 4, free=2)],
    )
    assert [(r.worker_id, r.node, r.task_id) for r in retire] == [("w1", "node-w1", "big")]
    (only,) = retire
    assert only.waiting == (
        "waiting: 3 cards asked; the idle worker on node node-w1 (2 cards) is being replaced "
        "by one with all 4 free cards there"
    )
    assert "task big asks 3 cards" in only.why


@pytest.mark.parametrize(
    ("asked", "workers", "busy", "machines", "promised"),
    [
        # The worker holds a task: it is not idle.
        (3, [worker("w1", cards=1, cards_total=2)], {"w1"}, [machine("w1", 4, 2)], ()),
        # Its cards and the free ones are still too few.
        (4, [worker("w1", cards=2, cards_total=2)], (), [machine("w1", 4, 1)], ()),
        # The task fits the worker as it is (it waits for CPU or memory, not cards).
        (2, [worker("w1", cards=2, cards_total=2)], (), [machine("w1", 4, 2)], ()),
        # Not ready, or draining.
        (3, [worker("w1", cards=2, ready=False)], (), [machine("w1", 4, 2)], ()),
        (3, [worker("w1", cards=2, draining=True)], (), [machine("w1", 4, 2)], ()),
        # Its node is no machine of a pool here (another replica's pool), or another worker
        # is ours there.
        (3, [worker("w1", cards=2)], (), [], ()),
        (3, [worker("w1", cards=2)], (), [machine("w1", 4, 2, worker="w9")], ()),
        # The task was promised a retirement already (its new worker is on the way).
        (3, [worker("w1", cards=2)], (), [machine("w1", 4, 2)], {"t"}),
    ],
)
def test_no_worker_is_retired_when_it_would_not_make_room(
    asked: int,
    workers: list[WorkerCapacity],
    busy: set[str],
    machines: list[MachineSize],
    promised: set[str],
) -> None:
    assert (
        idle_workers_to_retire(
            [task("t", 0, cards=asked)], workers, busy=busy, machines=machines, promised=promised
        )
        == ()
    )


def test_retirement_is_best_fit_and_one_worker_per_task() -> None:
    workers = [worker("w1", cards=2), worker("w2", cards=2), worker("w3", cards=1)]
    machines = [machine("w1", 8, 6), machine("w2", 4, 2), machine("w3", 4, 3)]
    retire = idle_workers_to_retire(
        [task("a", 0, cards=3), task("b", 1, cards=4), task("c", 2, cards=4)],
        workers,
        busy=(),
        machines=machines,
    )
    # a: w2 (2 + 2 = 4) before w3 (1 + 3 = 4) by node name, w1's 8 kept for bigger ones; b: w3
    # (4); c: w1 (8), the only one left.
    assert [(r.task_id, r.worker_id) for r in retire] == [("a", "w2"), ("b", "w3"), ("c", "w1")]
