"""The end-to-end benchmark: what a user of a whole installation waits for, against bare runc
and direct HTTP measured in the same run.

One loopback installation (`sim.cluster.open_cluster`: Kubernetes stand-in, simulated
kubelet, controlplane, registry) with two nodes, one in a direct-mode pool (1 card) and one in a
tunnel-mode pool (2 cards). The scheduler's best fit decides placement, so a task's card count
picks its worker: 0 cards lands on the direct-mode worker, 2 cards can only go to the tunnel one.

- First log: `levers9 run IMAGE -- echo hello` as a user runs it (the CLI as a subprocess) until
  ``hello`` is on its stdout, with the worker warm and the image cached; the same through
  `control.cli.client` in this process (a fresh connection each time, no Python start-up); the CLI's
  bare start-up (``--version``); and the anchor, a bare ``runc run`` of the same image from a
  prepared bundle (`bench.containers`' bundle). The three take turns each repeat.
- Endpoint: GETs of a small page served from a task on the tunnel worker, through the
  controlplane's endpoint route over ONE HTTP/2 connection with C concurrent streams, against C
  concurrent HTTP/1.1 clients straight to the container's address, and through ``ssh -L`` to
  that address (the tool a user would otherwise reach for). Twice: from busybox ``httpd``, which
  closes each connection (so a new one per request, on every path), and from a small server
  that keeps them (`keepalive.c`, as an inference server does; each client keeps one
  connection, and the route keeps its upstream ones). Optionally the closing load through the
  same route to a task on the direct-mode worker.
- Followed log: a task quiet for a while, then writing a line every 50 ms, followed by several
  clients at once through the API (`levers9 task logs -f`): the worker's CPU while they wait on
  the quiet task, and how long each line took from the shim's timestamp (taken as it read the
  line from the container) to a follower. No anchor: these are what a follower pays.
- Token stream: a server-sent event stream (a CGI script of the same httpd writing one event
  every 2 ms, as a model streams tokens) through the endpoint route and straight to the
  container; the figure is the p99 of the gaps between events as the client receives them.

The load comes from a child process (this module with ``--load-generator``) so that the client's
work does not share a Python thread with the controlplane it measures, as it never would.

    python -m bench.e2e [--quick] --json FILE

Needs root, runc and docker-registry (`make deps`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio

from agent.host.cgroups import remove_cgroup
from agent.runtime.config import ContainerConfig
from agent.runtime.manager import open_container_manager
from bench.anchors import open_ssh_local_forward, open_sshd, percentile
from bench.containers import _bare_bundle
from bench.report import ratios_of, render_sections, write_report
from bench.tunnel import Terminated, run_until_sigterm
from control.cli.client import ControlClient, open_control_client
from control.models import TaskRequest, TaskView
from proc.malloc import tune_malloc
from sim.cluster import REPO, Cluster, PoolSpec, open_cluster
from sim.kubeapi.http import start_kube_standin
from sim.kubelet import SimNode
from sim.registry import File, Image, build_image, busybox_image, push, running_registry
from workerapi.models import ContainerSpec, ContainerState


@attrs.frozen
class Plan:
    first_logs: int
    """Repeats of each first-log measurement (CLI, API, bare runc)."""
    concurrency: int
    """Concurrent HTTP/2 streams, or HTTP/1.1 connections, of the endpoint load."""
    duration_s: float
    """How long each endpoint load runs (after an untimed warm-up)."""
    sse_events: int
    """Events of the token stream (one every 2 ms)."""
    log_lines: int = 20
    """Lines of the followed log (one every `LOG_EVERY_S`)."""
    log_followers: int = 20
    """Clients following that log at once."""
    direct_mode: bool = True
    """Also the endpoint route to a task on the direct-mode worker."""


QUICK = Plan(first_logs=3, concurrency=16, duration_s=1.0, sse_events=300)
FULL = Plan(first_logs=10, concurrency=16, duration_s=5.0, sse_events=1000, log_lines=100)
LOG_EVERY_S = 0.05
LOG_QUIET_S = 2.0
"""How long the followed task is quiet first; the worker's CPU is measured over half of it."""

FIRST_LOG_TARGET_S = 0.25
"""From `levers9 run` to its first log line, with a warm worker and a cached image."""
CLI_START_TARGET_S = 0.15
RATIOS = {
    "first_log_vs_runc": ("first_log_s", "runc_first_log_s"),
    "first_log_api_vs_runc": ("first_log_api_s", "runc_first_log_s"),
    "endpoint_rps_tunnel_vs_direct": ("endpoint_rps_tunnel", "endpoint_rps_direct"),
    "endpoint_p99_tunnel_vs_direct": ("endpoint_p99_ms_tunnel", "endpoint_p99_ms_direct"),
    "endpoint_rps_direct_mode_vs_direct": ("endpoint_rps_direct_mode", "endpoint_rps_direct"),
    "endpoint_rps_tunnel_vs_ssh": ("endpoint_rps_tunnel", "endpoint_rps_ssh"),
    "endpoint_rps_tunnel_vs_direct_keepalive": (
        "endpoint_rps_tunnel_keepalive",
        "endpoint_rps_direct_keepalive",
    ),
    "endpoint_p99_tunnel_vs_direct_keepalive": (
        "endpoint_p99_ms_tunnel_keepalive",
        "endpoint_p99_ms_direct_keepalive",
    ),
    "endpoint_rps_tunnel_vs_ssh_keepalive": (
        "endpoint_rps_tunnel_keepalive",
        "endpoint_rps_ssh_keepalive",
    ),
    "sse_p99_gap_tunnel_vs_direct": ("sse_gap_p99_ms_tunnel", "sse_gap_p99_ms_direct"),
}
"""Ours over the anchor's; the direct-mode one only when that route was measured."""
TARGETS = {
    "endpoint_rps_tunnel_vs_direct": (">=", 0.25),
    "endpoint_p99_tunnel_vs_direct": ("<=", 3.0),
    "endpoint_rps_tunnel_vs_ssh": (">=", 1.0),
    "endpoint_rps_tunnel_vs_direct_keepalive": (">=", 0.5),
    "endpoint_p99_tunnel_vs_direct_keepalive": ("<=", 3.0),
    "endpoint_rps_tunnel_vs_ssh_keepalive": (">=", 1.0),
    "sse_p99_gap_tunnel_vs_direct": ("<=", 2.0),
}
"""Issue 18's targets: the closing upstream (busybox httpd) and the keep-alive one."""
GREETING = "hello"
HTTP_PORT = 8080
KEEPALIVE_PORT = 8081
KEEPALIVE_SOURCE = Path(__file__).with_name("keepalive.c")
PAGE = "hello from levers9 " * 8
SSE_SCRIPT = """#!/bin/sh
printf 'Content-Type: text/event-stream\\r\\n\\r\\n'
i=0
while [ $i -lt "${QUERY_STRING:-10}" ]; do
  printf 'data: token %s\\n\\n' $i
  sleep 0.002
  i=$((i+1))
done
"""
"""The token stream: QUERY_STRING events, one every 2 ms, as httpd's CGI."""
SERVER = (
    f"mkdir -p /www/cgi-bin && echo '{PAGE}' > /www/index.html && "
    "printf '%s' \"$SSE\" > /www/cgi-bin/sse && chmod +x /www/cgi-bin/sse || exit 1; "
    f"httpd -f -p {HTTP_PORT} -h /www & httpd=$!; "
    f"keepalive {KEEPALIVE_PORT} '{PAGE}' & kept=$!; "
    "trap 'kill $httpd $kept; exit 0' TERM; echo ready; wait"
)
"""The files first, then the two servers. As PID 1 they would ignore SIGTERM and hold up every
stop (the agent's, on a SIGTERM of the benchmark, too) until the kill; the shell as PID 1 ends
them at once."""
CLUSTER_START_DEADLINE_S = 90.0
TASK_DEADLINE_S = 90.0
"""Bounds each step that waits on a task (warm-up pull, a first log, a server becoming ready)."""
LOAD_DEADLINE_S = 120.0
SWEEP_DEADLINE_S = 60.0
WARMUP_S = 0.5
READY_POLL_S = 0.05
ANCHOR_TABLE, ANCHOR_PREFIX, ANCHOR_POOL = "levers9_bench_e2e", "be", "169.254.96.0/20"
"""The anchor's container manager keeps out of the simulated nodes' names and addresses."""
IDLE_NODES = 6
"""Nodes in no pool, listed first: the simulated kubelet names each node's container network
(nft table, interface prefix, addresses) by its index, so ours get the last two (k6, k7) and
stay clear of the tests' k0, k1, ... when both run on one machine at the same time."""


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and what it saw."""


_STARTED = time.monotonic()


def _say(message: str) -> None:
    print(f"  [{time.monotonic() - _STARTED:5.1f} s] {message}", file=sys.stderr, flush=True)


# --- the anchor's bundle --------------------------------------------------------------------


async def prepare_runc_bundle(workdir: Path, image: str) -> Path:
    """A bundle for bare ``runc run`` of `image` running ``echo hello``: our container's config
    with a plain copy of its rootfs (`bench.containers`' bundle), the command swapped."""
    config = ContainerConfig(
        state_dir=workdir / "anchor-state",
        free_floor_bytes=0,
        allow_local_registries=True,
        network_table=ANCHOR_TABLE,
        network_prefix=ANCHOR_PREFIX,
        network_pool=ANCHOR_POOL,
    )
    async with open_container_manager(config) as manager:
        source = await manager.wait_settled(
            await manager.create(ContainerSpec(image=image, id="source", command=("sleep", "600")))
        )
        if source.state is not ContainerState.RUNNING:
            raise BenchError(f"the anchor's source container is {source.state}, not running")
        bundle = _bare_bundle(manager, "source", workdir)
        await manager.delete("source")
    config_path = bundle / "config.json"
    spec = json.loads(config_path.read_text())
    spec["process"]["args"] = ["echo", GREETING]
    spec["process"]["terminal"] = False
    config_path.write_text(json.dumps(spec))
    return bundle


# --- time to a line on a child's stdout -----------------------------------------------------


async def time_to_line(
    argv: Sequence[str], text: str, *, env: Mapping[str, str] | None = None
) -> float:
    """Seconds from starting `argv` to the line `text` on its stdout; then waits for it to
    exit and checks it succeeded. A cancelled wait kills the child."""
    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process,
                list(argv),
                env=env,
                cwd=REPO,
                stdin=b"",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                check=False,
            )
        )
        assert process.stdout is not None and process.stderr is not None
        errors = bytearray()

        async def drain_stderr() -> None:
            assert process.stderr is not None
            while chunk := await process.stderr.receive_some():
                errors.extend(chunk)
                del errors[:-4000]

        nursery.start_soon(drain_stderr)
        seen = b""
        elapsed: float | None = None
        while chunk := await process.stdout.receive_some():
            seen += chunk
            if elapsed is None and f"{text}\n".encode() in seen:
                elapsed = time.perf_counter() - began
    code = await process.wait()
    if elapsed is None or code != 0:
        raise BenchError(
            f"{argv[0]} ... {argv[-1]} exited {code} "
            f"{'without' if elapsed is None else 'after'} printing {text!r}; stdout "
            f"{seen[-500:]!r}, stderr {bytes(errors)[-1000:]!r}"
        )
    return elapsed


async def runc_first_log(runc_root: Path, bundle: Path, n: int) -> float:
    container_id = f"bench-e2e-{n}"
    try:
        return await time_to_line(
            ["runc", "--root", str(runc_root), "run", "--bundle", str(bundle), container_id],
            GREETING,
        )
    finally:
        await trio.run_process(
            ["runc", "--root", str(runc_root), "delete", "-f", container_id],
            check=False,
            capture_stdout=True,
            capture_stderr=True,
        )
        remove_cgroup(f"/levers9/{container_id}")


async def api_first_log(cluster: Cluster, image: str) -> float:
    """Create the task and read the first line of its followed log, on a fresh connection."""
    began = time.perf_counter()
    async with cluster.client() as client:
        task = await client.create_task(TaskRequest(image=image, command=("echo", GREETING)))
        async for line in client.task_logs(task.id, follow=True):
            elapsed = time.perf_counter() - began
            if line.text != GREETING:
                raise BenchError(f"task {task.id} logged {line.text!r} before {GREETING!r}")
            break
        else:
            raise BenchError(f"task {task.id}'s log ended without a line")
        done = await client.wait_task(task.id)
    if done.state != "succeeded":
        raise BenchError(f"task {task.id} ended {done.state}: {done}")
    return elapsed


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "control.cli", *args]


async def compile_as_installed() -> None:
    """Write the bytecode of our packages, as pip does for a wheel it installs, so the CLI is
    timed as a user runs it. With PYTHONDONTWRITEBYTECODE set (this machine kind sets it) an
    editable checkout has none, and every CLI run compiled its modules again (35 ms of 0.31 s
    measured)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    packages = [str(REPO / name) for name in ("agent", "control")]
    await trio.run_process(
        [sys.executable, "-m", "compileall", "-q", *packages], env=env, capture_stdout=True
    )


async def measure_first_logs(
    cluster: Cluster, image: str, bundle: Path, runc_root: Path, repeats: int
) -> dict[str, list[float]]:
    env = cluster.cli_env()
    async with cluster.client() as client:
        # The warm-up: the image is pulled and cached, the worker has run a container.
        warm = await client.create_task(TaskRequest(image=image, command=("echo", GREETING)))
        done = await client.wait_task(warm.id)
    if done.state != "succeeded":
        raise BenchError(f"the warm-up task ended {done.state}: {done}")
    await compile_as_installed()
    await time_to_line(_cli("run", image, "--", "echo", GREETING), GREETING, env=env)
    await runc_first_log(runc_root, bundle, -1)
    samples: dict[str, list[float]] = {"cli": [], "api": [], "runc": [], "startup": []}
    for n in range(repeats):
        samples["cli"].append(
            await time_to_line(_cli("run", image, "--", "echo", GREETING), GREETING, env=env)
        )
        samples["api"].append(await api_first_log(cluster, image))
        samples["runc"].append(await runc_first_log(runc_root, bundle, n))
        began = time.perf_counter()
        await trio.run_process(_cli("--version"), cwd=REPO, env=env, capture_stdout=True)
        samples["startup"].append(time.perf_counter() - began)
    return samples


# --- a followed log --------------------------------------------------------------------------


def _shim_time(stamp: str) -> float:
    """A CRI log line's time (RFC 3339, nanoseconds, UTC) as a Unix time."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


async def measure_followed_log(
    cluster: Cluster, image: str, lines: int, followers: int
) -> dict[str, float]:
    """`followers` clients follow one task's log through the API: the task says it is ready,
    is quiet for `LOG_QUIET_S`, then writes `lines` lines `LOG_EVERY_S` apart. The worker's
    CPU over the quiet part, and each line's delay from the shim's timestamp to a follower.
    The task has no cards, so it runs on the direct-mode worker."""
    every_us = int(LOG_EVERY_S * 1e6)
    script = (
        f"echo ready; sleep {LOG_QUIET_S:g}; i=0; "
        f"while [ $i -lt {lines} ]; do echo line; i=$((i+1)); usleep {every_us}; done"
    )
    agents = [psutil.Process(a.pid) for a in cluster.kubelet.agents() if a.node == "node-direct"]
    delays: list[float] = []
    ready = [trio.Event() for _ in range(followers)]
    async with cluster.client() as client:
        task = await client.create_task(TaskRequest(image=image, command=("sh", "-c", script)))

        async def follow(ready: trio.Event) -> None:
            async for line in client.task_logs(task.id, follow=True):
                if line.text == "ready":
                    ready.set()
                elif line.text == "line":
                    delays.append(time.time() - _shim_time(line.time))

        async with trio.open_nursery() as nursery:
            for each in ready:
                nursery.start_soon(follow, each)
            for each in ready:
                await each.wait()
            before, began = _cpu_s(agents), time.perf_counter()
            await trio.sleep(LOG_QUIET_S / 2)
            idle_cpu = (_cpu_s(agents) - before) / (time.perf_counter() - began)
        done = await client.wait_task(task.id)
    if done.state != "succeeded" or len(delays) != lines * followers:
        raise BenchError(
            f"the followed task ended {done.state} and {len(delays)} of "
            f"{lines * followers} lines reached its followers"
        )
    return {
        "log_delay_p50_ms": statistics.median(delays) * 1e3,
        "log_delay_p90_ms": percentile(delays, 90) * 1e3,
        "log_follow_idle_cpu_pct": idle_cpu * 100,
    }


# --- endpoint load --------------------------------------------------------------------------


@attrs.frozen
class LoadResult:
    requests: int
    errors: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    warmup_requests: int = 0
    """Requests of the untimed warm-up before, failed or not."""

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s


async def _endpoint_get(client: ControlClient, path: str) -> None:
    async with client.stream("GET", path) as response:
        body = await response.read()
    if response.status != 200 or not body.startswith(PAGE[:5].encode()):
        raise BenchError(f"GET {path} answered {response.status} {body[:80]!r}")


async def _direct_get(host: str, port: int) -> None:
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(b"GET /index.html HTTP/1.0\r\nHost: bench\r\n\r\n")
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    if not answer.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
        raise BenchError(f"GET http://{host}:{port}/index.html answered {answer[:80]!r}")


class _KeptConnection:
    """One HTTP/1.1 connection a load worker keeps, sending its GETs one after another."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._stream: trio.SocketStream | None = None
        self._buffered = b""

    async def get(self) -> None:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self._host, self._port)
            self._buffered = b""
        stream = self._stream
        try:
            await stream.send_all(b"GET /index.html HTTP/1.1\r\nHost: bench\r\n\r\n")
            while b"\r\n\r\n" not in self._buffered:
                self._buffered += await self._receive(stream)
            head, self._buffered = self._buffered.split(b"\r\n\r\n", 1)
            length = _content_length(head)
            while len(self._buffered) < length:
                self._buffered += await self._receive(stream)
            body, self._buffered = self._buffered[:length], self._buffered[length:]
        except BaseException:
            self._stream = None
            await stream.aclose()
            raise
        if not head.startswith(b"HTTP/1.1 200") or not body.startswith(PAGE[:5].encode()):
            raise BenchError(f"GET http://{self._host}:{self._port}/ answered {head[:80]!r}")

    @staticmethod
    async def _receive(stream: trio.SocketStream) -> bytes:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise BenchError("the keep-alive server closed a connection mid-answer")
        return chunk


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise BenchError(f"an answer without Content-Length: {head[:200]!r}")


def compile_keepalive(workdir: Path) -> bytes:
    """`keepalive.c` built static (it runs in the busybox image, which has no libc)."""
    binary = workdir / "keepalive"
    subprocess.run(
        ["gcc", "-O2", "-static", "-Wall", "-Werror", "-o", str(binary), str(KEEPALIVE_SOURCE)],
        check=True,
        capture_output=True,
    )
    return binary.read_bytes()


def server_image(keepalive: bytes) -> Image:
    """busybox with the keep-alive server as /bin/keepalive."""
    return build_image([{"bin/keepalive": File(keepalive, mode=0o755)}], base=busybox_image())


async def _load(spec: Mapping[str, Any]) -> LoadResult:
    """Run `spec`'s GETs from `concurrency` workers for `duration_s` (after a warm-up)."""
    concurrency = int(spec["concurrency"])
    keep = spec["kind"] == "direct_keepalive"

    async def run(get: Any, duration_s: float) -> LoadResult:
        latencies: list[float] = []
        errors = 0
        began = time.perf_counter()
        deadline = began + duration_s

        async def worker() -> None:
            nonlocal errors
            kept = _KeptConnection(spec["host"], int(spec["port"])) if keep else None
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                try:
                    await (kept.get() if kept is not None else get())
                except (BenchError, OSError, trio.BrokenResourceError) as exc:
                    errors += 1
                    if errors == 1:
                        print(f"load: first error: {exc}", file=sys.stderr, flush=True)
                    continue
                latencies.append(time.perf_counter() - started)

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - began
        if not latencies:
            raise BenchError(f"no request of {spec['kind']} succeeded ({errors} failed)")
        return LoadResult(
            requests=len(latencies),
            errors=errors,
            elapsed_s=elapsed,
            p50_ms=percentile(latencies, 50) * 1e3,
            p99_ms=percentile(latencies, 99) * 1e3,
        )

    if spec["kind"] in ("direct", "direct_keepalive"):
        get = functools.partial(_direct_get, spec["host"], int(spec["port"]))
        warm = await run(get, WARMUP_S)
        timed = await run(get, float(spec["duration_s"]))
        return attrs.evolve(timed, warmup_requests=warm.requests + warm.errors)
    env = os.environ
    async with open_control_client(
        env["LEVERS9_CONTROLPLANE"], env["LEVERS9_TOKEN"], env["LEVERS9_CA"]
    ) as client:
        get = functools.partial(_endpoint_get, client, spec["path"])
        warm = await run(get, WARMUP_S)
        timed = await run(get, float(spec["duration_s"]))
        return attrs.evolve(timed, warmup_requests=warm.requests + warm.errors)


async def _stream_gaps(spec: Mapping[str, Any]) -> dict[str, float]:
    """Read `spec`'s event stream to its end; the gaps between events as they arrived."""
    arrivals: list[float] = []

    def take(buffered: bytes) -> bytes:
        while b"\n\n" in buffered:
            _, buffered = buffered.split(b"\n\n", 1)
            arrivals.append(time.perf_counter())
        return buffered

    path = f"/cgi-bin/sse?{int(spec['events'])}"
    if spec["kind"] == "sse_direct":
        async with await trio.open_tcp_stream(spec["host"], int(spec["port"])) as stream:
            await stream.send_all(f"GET {path} HTTP/1.0\r\nHost: bench\r\n\r\n".encode())
            buffered = b""
            while b"\r\n\r\n" not in buffered:
                buffered += await stream.receive_some(65536)
            buffered = take(buffered.split(b"\r\n\r\n", 1)[1])
            while chunk := await stream.receive_some(65536):
                buffered = take(buffered + chunk)
    else:
        env = os.environ
        async with open_control_client(
            env["LEVERS9_CONTROLPLANE"], env["LEVERS9_TOKEN"], env["LEVERS9_CA"]
        ) as client:
            async with client.stream("GET", spec["base"] + path) as response:
                buffered = b""
                async for chunk in response.iter_chunks():
                    buffered = take(buffered + chunk)
    if len(arrivals) != int(spec["events"]):
        raise BenchError(f"{spec['kind']}: {len(arrivals)} events of {spec['events']} arrived")
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return {
        "events": float(len(arrivals)),
        "gap_p50_ms": percentile(gaps, 50) * 1e3,
        "gap_p99_ms": percentile(gaps, 99) * 1e3,
        "gap_max_ms": max(gaps) * 1e3,
    }


def load_generator_main() -> None:
    """The child: a load spec (JSON) on stdin, a `LoadResult` (JSON) on stdout, or the gaps of
    an event stream. The token comes in the environment, as the CLI takes it, never on the
    command line."""
    spec = json.loads(sys.stdin.read())
    if spec["kind"] in ("sse", "sse_direct"):
        print(json.dumps(trio.run(_stream_gaps, spec)))
        return
    result = trio.run(_load, spec)
    print(json.dumps(attrs.asdict(result)))


async def run_load(env: Mapping[str, str], spec: Mapping[str, Any]) -> LoadResult:
    return LoadResult(**await run_child(env, spec))


async def run_child(env: Mapping[str, str], spec: Mapping[str, Any]) -> dict[str, Any]:
    """This module as a child process (the load generator) doing `spec`; what it printed."""
    with trio.fail_after(LOAD_DEADLINE_S):
        done = await trio.run_process(
            [sys.executable, "-m", "bench.e2e", "--load-generator"],
            stdin=json.dumps(spec).encode(),
            env=env,
            cwd=REPO,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    if done.returncode != 0:
        raise BenchError(
            f"the load generator for {spec['kind']} exited {done.returncode}: "
            f"{done.stderr.decode(errors='replace')[-2000:]}"
        )
    if done.stderr:
        _say(done.stderr.decode(errors="replace").strip())
    result: dict[str, Any] = json.loads(done.stdout)
    return result


async def start_server(client: ControlClient, image: str, cards: int) -> TaskView:
    """A busybox httpd task with `cards` cards, once its endpoint answers."""
    task = await client.create_task(
        TaskRequest(
            image=image,
            command=("sh", "-c", SERVER),
            env={"SSE": SSE_SCRIPT},
            ports=(HTTP_PORT, KEEPALIVE_PORT),
            cards=cards,
        )
    )
    async for line in client.task_logs(task.id, follow=True):
        if line.text == "ready":
            break
    else:
        ended = await client.task(task.id)
        logs = [line.text async for line in client.task_logs(task.id, follow=False)]
        raise BenchError(f"the server task ended before it was ready: {ended}; its log: {logs}")
    for port in (HTTP_PORT, KEEPALIVE_PORT):
        path = f"/v1/tasks/{task.id}/ports/{port}/index.html"
        while True:  # the servers listen a moment after "ready"
            try:
                await _endpoint_get(client, path)
                break
            except Exception:
                await trio.sleep(READY_POLL_S)
    return await client.task(task.id)


def _cpu_s(processes: Sequence[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


@attrs.frozen
class EndpointResults:
    loads: dict[str, LoadResult]
    """Request loads by path: tunnel, direct, ssh, direct_mode."""
    cpu_us_per_request: dict[str, float]
    """CPU of the controlplane and the tunnel worker's agent together per request, by tunnel
    load: what bounds the route's rate where they share the cores with everything else."""
    streams: dict[str, dict[str, float]]
    """Event-stream gaps by path: tunnel, direct."""


async def measure_endpoints(
    cluster: Cluster, image: str, plan: Plan, workdir: Path
) -> EndpointResults:
    """The endpoint loads and token streams; `image` is `server_image`'s."""
    assert cluster.control is not None
    modes = {e.worker_id: e.mode for e in cluster.control.registry.entries()}
    env = cluster.cli_env()
    results: dict[str, LoadResult] = {}
    streams: dict[str, dict[str, float]] = {}
    cpu: dict[str, float] = {}
    async with cluster.client() as client:
        with trio.fail_after(TASK_DEADLINE_S):
            tunnel_task = await start_server(client, image, cards=2)
            direct_task = await start_server(client, image, cards=1) if plan.direct_mode else None
        if tunnel_task.worker is None or modes.get(tunnel_task.worker) != "tunnel":
            raise BenchError(f"the 2-card server landed on {tunnel_task.worker}, not the tunnel")
        worker = await cluster.control.registry.client_for(tunnel_task.worker)
        address = (await worker.container(tunnel_task.id)).address
        if address is None:
            raise BenchError(f"the worker reports no address for container {tunnel_task.id}")
        common = {"concurrency": plan.concurrency, "duration_s": plan.duration_s}
        # The controlplane runs in this process; the agent is the kubelet's child.
        ours = [psutil.Process()]
        ours += [psutil.Process(a.pid) for a in cluster.kubelet.agents() if a.node == "node-tunnel"]

        def route(task: TaskView, port: int = HTTP_PORT) -> dict[str, Any]:
            path = f"/v1/tasks/{task.id}/ports/{port}/index.html"
            return {"kind": "endpoint", "path": path, **common}

        (workdir / "ssh").mkdir(exist_ok=True)
        async with open_sshd(workdir / "ssh") as sshd:
            for suffix, kind, port in (
                ("", "direct", HTTP_PORT),
                ("_keepalive", "direct_keepalive", KEEPALIVE_PORT),
            ):
                server = "httpd" if port == HTTP_PORT else "keep-alive server"
                _say(f"endpoint, {server}: tunnel route, {plan.concurrency} streams")
                before = _cpu_s(ours)
                results[f"tunnel{suffix}"] = await run_load(env, route(tunnel_task, port))
                load = results[f"tunnel{suffix}"]
                served = load.requests + load.errors + load.warmup_requests
                cpu[f"tunnel{suffix}"] = (_cpu_s(ours) - before) / served * 1e6
                _say(f"endpoint, {server}: HTTP/1.1 straight to {address}:{port}")
                direct = {"kind": kind, "host": address, "port": port, **common}
                results[f"direct{suffix}"] = await run_load(env, direct)
                _say(f"endpoint, {server}: HTTP/1.1 through ssh -L to {address}:{port}")
                async with open_ssh_local_forward(sshd, address, port) as local_port:
                    through_ssh = {**direct, "host": "127.0.0.1", "port": local_port}
                    results[f"ssh{suffix}"] = await run_load(env, through_ssh)
        _say(f"token stream: {plan.sse_events} events through the tunnel route and direct")
        base = f"/v1/tasks/{tunnel_task.id}/ports/{HTTP_PORT}"
        streams["tunnel"] = await run_child(
            env, {"kind": "sse", "base": base, "events": plan.sse_events}
        )
        streams["direct"] = await run_child(
            env,
            {"kind": "sse_direct", "host": address, "port": HTTP_PORT, "events": plan.sse_events},
        )
        if direct_task is not None:
            if direct_task.worker is None or modes.get(direct_task.worker) != "direct":
                raise BenchError(f"the 1-card server landed on {direct_task.worker}, not direct")
            _say("endpoint: direct-mode route")
            results["direct_mode"] = await run_load(env, route(direct_task))
        for task in (tunnel_task, direct_task):
            if task is not None:
                await client.cancel_task(task.id)
    return EndpointResults(results, cpu, streams)


# --- the whole run --------------------------------------------------------------------------


@asynccontextmanager
async def open_bench_cluster(workdir: Path) -> AsyncIterator[Cluster]:
    running = start_kube_standin(workdir / "kube")
    try:
        async with open_cluster(
            workdir / "cluster",
            running.kube,
            nodes=[
                *((SimNode(f"idle-{n}", 1), "idle") for n in range(IDLE_NODES)),
                (SimNode("node-direct", 1), "direct"),
                (SimNode("node-tunnel", 2), "tunnel"),
            ],
            pools=[PoolSpec("direct"), PoolSpec("tunnel", tunnel=True)],
        ) as cluster:
            with trio.fail_after(CLUSTER_START_DEADLINE_S):
                await cluster.wait_workers(2)
            yield cluster
    finally:
        running.stop()
        with trio.CancelScope(shield=True), trio.move_on_after(SWEEP_DEADLINE_S):
            await sweep_left_containers(workdir)


async def sweep_left_containers(workdir: Path) -> None:
    """Stop what the agents left running (their containers outlive an agent that was killed
    before it finished stopping them): a container manager on each node's state directory
    recovers the containers and, on closing, stops them and removes their network."""
    for offset, name in enumerate(("node-direct", "node-tunnel")):
        index = IDLE_NODES + offset
        state = workdir / "cluster" / "kubelet" / "nodes" / name / "state"
        runc_root = state / "runc"
        if not runc_root.is_dir() or not any(runc_root.iterdir()):
            continue
        _say(f"stopping the containers the agent of {name} left")
        config = ContainerConfig(
            state_dir=state,
            free_floor_bytes=0,
            allow_local_registries=True,
            network_table=f"levers9_k{index}",
            network_prefix=f"k{index}",
            network_pool=f"169.254.{128 + 16 * index}.0/20",
        )
        async with open_container_manager(config):
            pass


def load_figures(load: LoadResult, name: str) -> dict[str, float]:
    """One endpoint load's figures, named after its path (`tunnel_keepalive`, `ssh`, ...)."""
    return {
        f"endpoint_rps_{name}": load.rps,
        f"endpoint_p99_ms_{name}": load.p99_ms,
        f"endpoint_p50_ms_{name}": load.p50_ms,
        f"endpoint_errors_{name}": float(load.errors),
    }


def stream_figures(gaps: Mapping[str, float], name: str) -> dict[str, float]:
    """One token stream's gaps between events, named after its path."""
    return {f"sse_gap_{q}_ms_{name}": gaps[f"gap_{q}_ms"] for q in ("p50", "p99", "max")}


async def run_benchmark(workdir: Path, plan: Plan) -> dict[str, dict[str, float]]:
    with running_registry(workdir / "registry") as registry:
        push(registry.url, "busybox", "latest", busybox_image())
        image = f"{registry.host}/busybox:latest"
        push(registry.url, "bench-server", "latest", server_image(compile_keepalive(workdir)))
        server = f"{registry.host}/bench-server:latest"
        _say("anchor: preparing a bare runc bundle of busybox")
        bundle = await prepare_runc_bundle(workdir, image)
        _say("cluster: starting a direct-mode and a tunnel-mode worker")
        async with open_bench_cluster(workdir) as cluster:
            _say(f"first log: {plan.first_logs} of CLI, API and bare runc, taking turns")
            with trio.fail_after(TASK_DEADLINE_S * (plan.first_logs + 2)):
                first = await measure_first_logs(
                    cluster, image, bundle, workdir / "runc", plan.first_logs
                )
            _say(f"followed log: {plan.log_lines} lines to {plan.log_followers} followers")
            with trio.fail_after(TASK_DEADLINE_S + LOG_QUIET_S + plan.log_lines * LOG_EVERY_S):
                followed = await measure_followed_log(
                    cluster, image, plan.log_lines, plan.log_followers
                )
            measured = await measure_endpoints(cluster, server, plan, workdir)
            loads = measured.loads
            _say("stopping the cluster")
    figures = {
        "first_log_s": statistics.median(first["cli"]),
        "first_log_p90_s": percentile(first["cli"], 90),
        "first_log_api_s": statistics.median(first["api"]),
        "first_log_api_p90_s": percentile(first["api"], 90),
        "cli_startup_s": statistics.median(first["startup"]),
        **followed,
        **stream_figures(measured.streams["tunnel"], "tunnel"),
    }
    anchors = {
        "runc_first_log_s": statistics.median(first["runc"]),
        "runc_first_log_p90_s": percentile(first["runc"], 90),
        **stream_figures(measured.streams["direct"], "direct"),
    }
    for name, load in loads.items():
        ours = name.startswith("tunnel") or name == "direct_mode"
        (figures if ours else anchors).update(load_figures(load, name))
    for name, cpu_us in measured.cpu_us_per_request.items():
        figures[f"endpoint_cpu_us_per_request_{name}"] = cpu_us
    ratios = ratios_of(RATIOS, figures, anchors)
    return {"figures": figures, "anchors": anchors, "ratios": ratios}


def render(report: Mapping[str, Mapping[str, float]]) -> str:
    table = render_sections(report["figures"], report["anchors"], report["ratios"])
    first = report["figures"]["first_log_s"]
    verdict = "ok" if first <= FIRST_LOG_TARGET_S else "MISSED"
    start = report["figures"]["cli_startup_s"]
    lines = [
        f"{table}\n",
        f"target: first_log_s <= {FIRST_LOG_TARGET_S:g} s "
        f"(median {first:.3f} s: {verdict}); the CLI's own start-up is cli_startup_s",
        f"target: cli_startup_s <= {CLI_START_TARGET_S:g} s (median {start:.3f} s: "
        f"{'ok' if start <= CLI_START_TARGET_S else 'MISSED'})",
    ]
    for name, (sense, bound) in TARGETS.items():
        value = report["ratios"].get(name)
        if value is None:
            continue
        met = value >= bound if sense == ">=" else value <= bound
        lines.append(f"target: {name} {sense} {bound:g} ({value:.3g}: {'ok' if met else 'MISSED'})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.e2e",
        description="First log and endpoint load on a loopback installation, against bare runc "
        "and direct HTTP, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help=f"measure less: {QUICK}")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    parser.add_argument("--load-generator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load_generator:
        load_generator_main()
        return
    plan = QUICK if args.quick else FULL
    tune_malloc()  # as levers9-control does: the controlplane runs in this process
    _say(f"plan: {plan}")
    with tempfile.TemporaryDirectory(prefix="levers9-bench-e2e-", dir="/var/tmp") as tmp:
        try:
            report = trio.run(run_until_sigterm, functools.partial(run_benchmark, Path(tmp), plan))
        except* Terminated:
            _say("terminated (SIGTERM); every process the run started was stopped")
            raise SystemExit(143) from None
    print(render(report))
    if args.json:
        write_report(
            args.json, figures=report["figures"], ratios=report["ratios"], anchors=report["anchors"]
        )


if __name__ == "__main__":
    main()
