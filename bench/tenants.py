"""Workspaces are tenants: what one workspace at its limits costs another.

One loopback installation (`sim.cluster.open_cluster`: Kubernetes stand-in, simulated kubelet,
controlplane, registry) with one direct-mode worker. Workspace `team-b` is the victim; it is
measured twice, first with `team-a` idle (the anchor), then with `team-a` at every limit it
has by default (`control.config.WorkspaceLimits`):

- `maxActiveTasks` tasks pending (each asks for more cards than any worker has, so they stay
  in every scheduling pass and every list page), each with `maxSpecBytes` of command and args;
- `maxWatchStreams` list watches of its full page, none of them read (a 1 KiB HTTP/2 window
  never given back), opened again as soon as the controlplane cuts one, and one more asked
  for (refused);

and for `team-b`, as a user runs them (the CLI as a subprocess):

- `task list --json`: p50 and p99 (`figures.list_p50_ms`, `list_p99_ms`; anchors the same
  with team-a idle);
- `levers9 run busybox -- echo hello` until `hello` is on its stdout, worker warm and image
  cached (`figures.first_log_s`, median).

The ratios are loaded over idle; the target is <= 1.5 for each.

    python -m bench.tenants [--quick] --json FILE

Needs root, runc and docker-registry (`make deps`).
"""

from __future__ import annotations

import ssl
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import h2.config
import h2.connection
import h2.events
import h2.settings
import trio

from bench.anchors import percentile
from bench.e2e import GREETING, compile_as_installed, time_to_line
from bench.report import Results, ratios_of, run_planned
from control.config import WorkspaceLimits
from control.models import TaskRequest
from sim.cluster import REPO, Cluster, PoolSpec, open_cluster
from sim.kubeapi.http import start_kube_standin
from sim.kubelet import SimNode
from sim.registry import busybox_image, push, running_registry

TARGET = "target: each loaded/idle ratio <= 1.5 (one workspace at its limits costs another little)"
CLUSTER_START_DEADLINE_S = 90.0
TASK_DEADLINE_S = 90.0
UNREAD_WINDOW_BYTES = 1024


@attrs.frozen
class Plan:
    list_calls: int
    first_logs: int
    settle_s: float
    """How long the load runs before the victim is measured (streams blocked, passes run)."""


FULL = Plan(list_calls=60, first_logs=8, settle_s=5.0)
QUICK = Plan(list_calls=15, first_logs=3, settle_s=2.0)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "control.cli", *args]


async def measure_victim(cluster: Cluster, image: str, plan: Plan) -> dict[str, list[float]]:
    env = cluster.cli_env("team-b")
    samples: dict[str, list[float]] = {"list": [], "first_log": []}
    for _ in range(plan.list_calls):
        began = time.perf_counter()
        await trio.run_process(
            _cli("task", "list", "--json"), env=env, cwd=REPO, capture_stdout=True
        )
        samples["list"].append(time.perf_counter() - began)
    for _ in range(plan.first_logs):
        with trio.fail_after(TASK_DEADLINE_S):
            samples["first_log"].append(
                await time_to_line(_cli("run", image, "--", "echo", GREETING), GREETING, env=env)
            )
    return samples


async def fill_workspace(cluster: Cluster, image: str, limits: WorkspaceLimits) -> int:
    """team-a's tasks up to its limit, each as big as its limit allows; how many were taken."""
    filler = "x" * (limits.max_spec_bytes - 64)
    made = 0
    async with cluster.client("team-a") as client:
        for _ in range(limits.max_active_tasks):
            await client.create_task(
                TaskRequest(image=image, command=("sh", "-c"), args=(filler,), cards=64)
            )
            made += 1
    return made


class UnreadWatches:
    """`count` list watches of team-a on one HTTP/2 connection, never read: each gets a 1 KiB
    window that is never given back. A stream the controlplane cuts is opened again."""

    def __init__(self, cluster: Cluster, count: int) -> None:
        self.cluster = cluster
        self.count = count
        self.cut = 0
        self.refused = 0
        self.open: set[int] = set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        port = int(self.cluster.url.rpartition(":")[2])
        context = ssl.create_default_context(cafile=str(self.cluster.pki.ca_file))
        context.set_alpn_protocols(["h2"])
        tls = trio.SSLStream(
            await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="127.0.0.1"
        )
        await tls.do_handshake()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: UNREAD_WINDOW_BYTES})
        token = self.cluster.tokens["team-a"]

        def ask() -> None:
            stream_id = conn.get_next_available_stream_id()
            conn.send_headers(
                stream_id,
                [
                    (":method", "GET"),
                    (":scheme", "https"),
                    (":authority", f"127.0.0.1:{port}"),
                    (":path", "/v1/tasks?watch=true"),
                    ("authorization", f"Bearer {token}"),
                ],
                end_stream=True,
            )
            self.open.add(stream_id)

        for _ in range(self.count + 1):  # one more than allowed: refused
            ask()
        await tls.send_all(conn.data_to_send())
        task_status.started()
        async with tls:
            while data := await tls.receive_some():
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        if dict(event.headers).get(b":status") == b"429":
                            self.refused += 1
                            self.open.discard(event.stream_id)  # not asked again
                    elif (
                        isinstance(event, h2.events.StreamReset | h2.events.StreamEnded)
                        and event.stream_id in self.open
                    ):
                        self.open.discard(event.stream_id)
                        if isinstance(event, h2.events.StreamReset):
                            self.cut += 1
                        ask()  # at its limit again
                await tls.send_all(conn.data_to_send())


async def run_benchmark(workdir: Path, plan: Plan) -> tuple[Results, dict[str, float]]:
    limits = WorkspaceLimits()
    with running_registry(workdir / "registry") as registry:
        push(registry.url, "busybox", "latest", busybox_image())
        image = f"{registry.host}/busybox:latest"
        running = start_kube_standin(workdir / "kube")
        try:
            async with open_cluster(
                workdir / "cluster",
                running.kube,
                nodes=[(SimNode("node-direct", 1), "direct")],
                pools=[PoolSpec("direct")],
            ) as cluster:
                with trio.fail_after(CLUSTER_START_DEADLINE_S):
                    await cluster.wait_workers(1)
                await compile_as_installed()
                env = cluster.cli_env("team-b")
                with trio.fail_after(TASK_DEADLINE_S):  # warm: image pulled, worker used
                    await time_to_line(
                        _cli("run", image, "--", "echo", GREETING), GREETING, env=env
                    )
                print("idle: measuring team-b with team-a idle", flush=True)
                idle = await measure_victim(cluster, image, plan)
                print("loaded: team-a at its limits", flush=True)
                made = await fill_workspace(cluster, image, limits)
                watches = UnreadWatches(cluster, limits.max_watch_streams)
                async with trio.open_nursery() as nursery:
                    await nursery.start(watches.run)
                    await trio.sleep(plan.settle_s)
                    loaded = await measure_victim(cluster, image, plan)
                    nursery.cancel_scope.cancel()
        finally:
            running.stop()
    figures = {
        "list_p50_ms": statistics.median(loaded["list"]) * 1000,
        "list_p99_ms": percentile(loaded["list"], 99) * 1000,
        "first_log_s": statistics.median(loaded["first_log"]),
        "watch_streams_cut": float(watches.cut),
        "watch_streams_refused": float(watches.refused),
    }
    anchors = {
        "idle_list_p50_ms": statistics.median(idle["list"]) * 1000,
        "idle_list_p99_ms": percentile(idle["list"], 99) * 1000,
        "idle_first_log_s": statistics.median(idle["first_log"]),
    }
    ratios = ratios_of(
        {
            "list_p50_loaded_vs_idle": ("list_p50_ms", "idle_list_p50_ms"),
            "list_p99_loaded_vs_idle": ("list_p99_ms", "idle_list_p99_ms"),
            "first_log_loaded_vs_idle": ("first_log_s", "idle_first_log_s"),
        },
        figures,
        anchors,
    )
    inputs = {
        "tasks": float(made),
        "spec_bytes": float(limits.max_spec_bytes),
        "watch_streams": float(limits.max_watch_streams),
        "list_calls": float(plan.list_calls),
        "first_logs": float(plan.first_logs),
    }
    return Results(figures=figures, anchors=anchors, ratios=ratios), inputs


def main(argv: Sequence[str] | None = None) -> None:
    run_planned(
        argv,
        prog="python -m bench.tenants",
        description="Another workspace's `task list` and `levers9 run` with one workspace at "
        "its limits, against the same with it idle.",
        quick_help="fewer samples",
        plans=(FULL, QUICK),
        run=run_benchmark,
        target=TARGET,
    )


if __name__ == "__main__":
    main()
