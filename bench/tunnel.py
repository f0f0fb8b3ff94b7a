"""The tunnel benchmark: our two ways of reaching a worker against direct TCP and ``ssh -R``.

Four paths end at the same sink process (``bench.sink``) and are measured in the same run:

- ``tcp``: loopback TCP straight to the sink, the limit no tunnel can beat;
- ``ssh_R``: OpenSSH's ``ssh -R`` with its default cipher, through its own sshd: the job our
  tunnel mode does, done by the tool operators would otherwise reach for;
- ``tunnel``: our tunnel mode, an agent that dialed the controlplane (TLS, WebSocket, HTTP/2);
- ``direct``: our direct mode, the controlplane dialing the agent (TLS, HTTP/2).

On our paths the client is the controlplane itself, in this process, opening an HTTP/2 CONNECT
stream to the sink's address on the worker's side (`WorkerClient.connect_tcp`), as endpoint and
box-port traffic does. Each agent runs as its own process, configured only through the
environment as the worker Job configures it, just as ``ssh -R``'s client is a process of its own.

The design choice is to trust medians of interleaved repeats, not single runs: on a small
machine one path's figure moves a lot from run to run, so every measurement is repeated, the
paths take turns (their order rotates each repeat) and each figure is the median of its
repeats. ``figures`` holds ours (``tunnel.*``, ``direct.*``), ``anchors`` the anchors'
(``tcp.*``, ``ssh_R.*``), ``ratios`` ours divided by an anchor's.

``python -m bench.tunnel [--quick] --json FILE``; ``--profile DIR`` instead profiles our two
modes' uploads (cProfile in the agent processes and in this one) and prints where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import os
import pstats
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import attrs
import trio

from bench.anchors import (
    OpenStream,
    Plan,
    measure_connects,
    measure_download,
    measure_round_trips,
    measure_stream,
    measure_upload,
    open_sink_process,
    open_ssh_reverse_tunnel,
    open_sshd,
    percentile,
    tcp_opener,
)
from bench.report import render_table, write_report
from control.api.server import Controlplane
from control.config import ControlConfig, parse
from proc.malloc import tune_malloc
from sim.controlplane import run_controlplane
from wire.tls import make_self_signed

QUICK_PLAN = Plan(total_bytes=256 << 20, stream_counts=(1, 8), round_trips=2000, connects=50)
FULL_PLAN = Plan(total_bytes=1 << 30, stream_counts=(1, 8), round_trips=5000, connects=200)
QUICK_REPEATS = 3
FULL_REPEATS = 5

ANCHOR_PATHS = ("tcp", "ssh_R")
OUR_PATHS = ("tunnel", "direct")
PATHS = (*ANCHOR_PATHS, *OUR_PATHS)
"""Every path, as the prefix of its figures: ``tunnel.upload_1_streams_MBps``, ..."""

PATH_TITLES = {"tcp": "TCP", "ssh_R": "ssh -R", "tunnel": "tunnel", "direct": "direct"}

WARMUP_BYTES = 16 << 20
"""Moved untimed over each path before the first repeat: connections, windows and caches warm."""

AGENT_START_DEADLINE_S = 20.0
AGENT_STOP_GRACE_S = 5.0
"""An agent stops on SIGINT; under cProfile it writes its profile first, which takes a moment."""
MEASUREMENT_DEADLINE_S = 600.0
"""Bounds each single measurement, so a stalled path fails the run instead of hanging it."""
POLL_INTERVAL_S = 0.05
LOG_TAIL_BYTES = 2000
PROFILE_TOP = 25

_REPO_ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")


class BenchError(RuntimeError):
    """A part of the benchmark (controlplane, agent) did not start; the message says which."""


class Terminated(Exception):
    """SIGTERM arrived: the run stops, and every process it started is stopped first."""


# --- ratios and their targets ----------------------------------------------------------------


@attrs.frozen
class Ratio:
    """``ours``'s figure divided by ``anchor``'s; `target` bounds it from below (throughput)
    or above (latency), or is None for a ratio reported without a goal."""

    ours: str
    anchor: str
    target: float | None = None
    higher_is_better: bool = True

    def meets(self, value: float) -> bool | None:
        if self.target is None:
            return None
        return value >= self.target if self.higher_is_better else value <= self.target

    def describe_target(self) -> str:
        if self.target is None:
            return ""
        return f"{'>=' if self.higher_is_better else '<='} {self.target:g}"


RATIOS: dict[str, Ratio] = {
    "tunnel_vs_ssh_1": Ratio("tunnel.upload_1_streams_MBps", "ssh_R.upload_1_streams_MBps", 1.5),
    "tunnel_vs_ssh_8": Ratio("tunnel.upload_8_streams_MBps", "ssh_R.upload_8_streams_MBps", 1.5),
    "direct_vs_ssh_1": Ratio("direct.upload_1_streams_MBps", "ssh_R.upload_1_streams_MBps"),
    "direct_vs_ssh_8": Ratio("direct.upload_8_streams_MBps", "ssh_R.upload_8_streams_MBps"),
    "tunnel_vs_tcp_1": Ratio("tunnel.upload_1_streams_MBps", "tcp.upload_1_streams_MBps"),
    "tunnel_vs_tcp_8": Ratio("tunnel.upload_8_streams_MBps", "tcp.upload_8_streams_MBps"),
    "tunnel_vs_ssh_down_1": Ratio(
        "tunnel.download_1_streams_MBps", "ssh_R.download_1_streams_MBps", 1.5
    ),
    "tunnel_vs_ssh_down_8": Ratio(
        "tunnel.download_8_streams_MBps", "ssh_R.download_8_streams_MBps", 1.5
    ),
    "direct_vs_ssh_down_1": Ratio(
        "direct.download_1_streams_MBps", "ssh_R.download_1_streams_MBps"
    ),
    "rtt_p50_tunnel_vs_ssh": Ratio(
        "tunnel.rtt_p50_us", "ssh_R.rtt_p50_us", 1.5, higher_is_better=False
    ),
    "rtt_p99_tunnel_vs_ssh": Ratio("tunnel.rtt_p99_us", "ssh_R.rtt_p99_us", higher_is_better=False),
    "rtt_p50_direct_vs_ssh": Ratio("direct.rtt_p50_us", "ssh_R.rtt_p50_us", higher_is_better=False),
    "connect_p50_tunnel_vs_ssh": Ratio(
        "tunnel.connect_p50_ms", "ssh_R.connect_p50_ms", 0.03, higher_is_better=False
    ),
    "stream_p99_tunnel_vs_ssh": Ratio(
        "tunnel.stream_p99_us", "ssh_R.stream_p99_us", higher_is_better=False
    ),
    "stream_p99_direct_vs_ssh": Ratio(
        "direct.stream_p99_us", "ssh_R.stream_p99_us", higher_is_better=False
    ),
    "connect_p50_direct_vs_ssh": Ratio(
        "direct.connect_p50_ms", "ssh_R.connect_p50_ms", higher_is_better=False
    ),
    "connect_early_p50_tunnel_vs_ssh": Ratio(
        "tunnel.connect_early_p50_ms", "ssh_R.connect_early_p50_ms", higher_is_better=False
    ),
}
"""Every ratio the report holds; a plan without some stream count leaves its ratios out."""


def compute_ratios(figures: Mapping[str, float]) -> dict[str, float]:
    """Each of `RATIOS` whose two figures were measured (``figures`` holds every path's)."""
    ratios: dict[str, float] = {}
    for name, ratio in RATIOS.items():
        ours, anchor = figures.get(ratio.ours), figures.get(ratio.anchor)
        if ours is not None and anchor is not None and anchor > 0:
            ratios[name] = ours / anchor
    return ratios


# --- measuring, interleaved ------------------------------------------------------------------


def _throughput_figures(plan: Plan) -> list[tuple[str, str, int]]:
    """(figure name, direction, streams) for every throughput figure of `plan`, in the order
    they are measured."""
    return [
        (f"{direction}_{streams}_streams_MBps", direction, streams)
        for direction in ("upload", "download")
        for streams in plan.stream_counts
    ]


async def _throughput(open_stream: OpenStream, direction: str, streams: int, plan: Plan) -> float:
    measure = measure_upload if direction == "upload" else measure_download
    with trio.fail_after(MEASUREMENT_DEADLINE_S):
        return await measure(
            open_stream, streams=streams, total_bytes=plan.total_bytes, chunk_bytes=plan.chunk_bytes
        )


async def _latencies(open_stream: OpenStream, plan: Plan) -> dict[str, float]:
    with trio.fail_after(MEASUREMENT_DEADLINE_S):
        rtts = await measure_round_trips(
            open_stream, count=plan.round_trips, message_bytes=plan.message_bytes
        )
        connects = await measure_connects(
            open_stream, count=plan.connects, message_bytes=plan.message_bytes
        )
        early = await measure_connects(
            open_stream, count=plan.connects, message_bytes=plan.message_bytes, early=True
        )
        streamed = await measure_stream(
            open_stream, count=plan.stream_messages, message_bytes=plan.message_bytes
        )
    return {
        "rtt_p50_us": percentile(rtts, 50) * 1e6,
        "rtt_p99_us": percentile(rtts, 99) * 1e6,
        "connect_p50_ms": percentile(connects, 50) * 1e3,
        "connect_p99_ms": percentile(connects, 99) * 1e3,
        "connect_early_p50_ms": percentile(early, 50) * 1e3,
        "stream_p50_us": percentile(streamed, 50) * 1e6,
        "stream_p99_us": percentile(streamed, 99) * 1e6,
    }


def _warmup(plan: Plan) -> Plan:
    return attrs.evolve(plan, total_bytes=min(WARMUP_BYTES, plan.total_bytes))


def _rotated(paths: Sequence[str], by: int) -> list[str]:
    shift = by % len(paths)
    return [*paths[shift:], *paths[:shift]]


async def measure_interleaved(
    openers: Mapping[str, OpenStream],
    plan: Plan,
    repeats: int,
    *,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list[float]]:
    """Every figure of `plan` over every path of `openers`, `repeats` times: one measurement at
    a time (paths never share the CPU), each measurement taken over all paths in turn before
    the next, the order of paths rotating every repeat. Keys are ``<path>.<figure>``; values
    hold one sample per repeat.
    """
    if repeats < 1:
        raise ValueError(f"repeats is {repeats}; measure at least once")
    samples: dict[str, list[float]] = {}
    paths = list(openers)
    for path in paths:
        progress(f"warming up {PATH_TITLES.get(path, path)}")
        await _throughput(openers[path], "upload", 1, _warmup(plan))
    for repeat in range(repeats):
        order = _rotated(paths, repeat)
        for name, direction, streams in _throughput_figures(plan):
            for path in order:
                progress(f"repeat {repeat + 1}/{repeats}: {path}.{name}")
                value = await _throughput(openers[path], direction, streams, plan)
                samples.setdefault(f"{path}.{name}", []).append(value)
        for path in order:
            progress(f"repeat {repeat + 1}/{repeats}: {path} round trips, connects, a 1 kHz stream")
            for name, value in (await _latencies(openers[path], plan)).items():
                samples.setdefault(f"{path}.{name}", []).append(value)
    return samples


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


# --- our side: controlplane in this process, agents as processes ------------------------------


@attrs.frozen
class ControlplaneSetup:
    """What agents need to reach the controlplane: its CA and each worker's token."""

    ca_file: Path
    tokens: Mapping[str, str] = attrs.field(repr=False)


def make_controlplane_config(
    workdir: Path, worker_ids: Sequence[str]
) -> tuple[ControlConfig, ControlplaneSetup]:
    """A loopback controlplane config with a certificate made now (its own CA for the agents)
    and a fresh token per worker."""
    cert_key = make_self_signed("levers9-bench-controlplane", ["127.0.0.1", "localhost"])
    cert_file, key_file = workdir / "controlplane.pem", workdir / "controlplane-key.pem"
    cert_file.write_bytes(cert_key.cert_pem)
    key_file.touch(mode=0o600)
    key_file.write_bytes(cert_key.key_pem)
    tokens = {worker_id: secrets.token_urlsafe(24) for worker_id in worker_ids}
    config = parse(
        {
            "config": {
                "publicUrl": "https://127.0.0.1:0",
                "listen": "127.0.0.1:0",
                "tls": {"certFile": str(cert_file), "keyFile": str(key_file)},
                "worker": {"tokens": [{"workerId": k, "token": v} for k, v in tokens.items()]},
                "database": {"path": str(workdir / "tasks.db")},
            }
        }
    )
    return config, ControlplaneSetup(ca_file=cert_file, tokens=tokens)


def agent_environment(
    mode: str, worker_id: str, token: str, controlplane_port: int, ca_file: Path
) -> dict[str, str]:
    """This process's environment without our own LEVERS9_* settings, plus the agent's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERS9_")}
    env.update(
        LEVERS9_WORKER_ID=worker_id,
        LEVERS9_WORKER_TOKEN=token,
        LEVERS9_MODE=mode,
        LEVERS9_CONTROLPLANE_URL=f"https://127.0.0.1:{controlplane_port}",
        LEVERS9_CONTROLPLANE_CA=str(ca_file),
        LEVERS9_LISTEN="127.0.0.1:0",
        LEVERS9_ADVERTISE_HOST="127.0.0.1",
        LEVERS9_REGISTER_INTERVAL_S="30",
        LEVERS9_LOG_LEVEL="WARNING",
        LEVERS9_CONTAINERS="off",
        LEVERS9_LOOPBACK_CONNECT="on",  # the sink listens on the worker's loopback
    )
    return env


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as error:
        return f"(no log: {error})"
    return data[-LOG_TAIL_BYTES:].decode("utf-8", "replace").strip() or "(empty)"


async def _stop_agent(process: trio.Process) -> None:
    """SIGINT (a clean exit, which lets cProfile write), then SIGKILL after a grace period."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            with trio.move_on_after(AGENT_STOP_GRACE_S):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


@asynccontextmanager
async def open_agent_process(
    mode: str,
    worker_id: str,
    control: Controlplane,
    setup: ControlplaneSetup,
    workdir: Path,
    *,
    profile_path: Path | None = None,
) -> AsyncIterator[trio.Process]:
    """``levers9-agent run`` in its own process, serving `worker_id` in `mode`; waits until the
    controlplane can reach it, and stops it on exit (also when the body fails)."""
    command = [sys.executable]
    if profile_path is not None:
        command += ["-m", "cProfile", "-o", str(profile_path)]
    command += ["-m", "agent.daemon.cli", "run"]
    log_path = workdir / f"agent-{worker_id}.log"
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        process = await trio.lowlevel.open_process(
            command,
            env=agent_environment(
                mode, worker_id, setup.tokens[worker_id], control.port, setup.ca_file
            ),
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            cwd=_REPO_ROOT,
        )
    finally:
        os.close(log_fd)
    try:
        await _wait_reachable(control, worker_id, process, log_path)
        yield process
    finally:
        await _stop_agent(process)


async def _wait_reachable(
    control: Controlplane, worker_id: str, process: trio.Process, log_path: Path
) -> None:
    with trio.move_on_after(AGENT_START_DEADLINE_S):
        while process.returncode is None:
            with trio.move_on_after(POLL_INTERVAL_S):
                await control.registry.client_for(worker_id)
                return
    what = "timed out" if process.returncode is None else f"exited with {process.returncode}"
    raise BenchError(
        f"agent {worker_id} {what} before the controlplane could reach it; its log ends:\n"
        + _log_tail(log_path)
    )


def worker_opener(control: Controlplane, worker_id: str, sink_port: int) -> OpenStream:
    """An `OpenStream` that asks the registry for the worker's client, as every caller in the
    controlplane does, and opens a CONNECT stream to the sink on the worker's side: as the
    controlplane opens a forwarded connection's (`connect_tcp_early`: usable at once, as a
    connection through ``ssh -R`` is), or with `first` riding on the CONNECT, as the endpoint
    route sends a request's head."""

    async def open_stream(first: bytes = b"") -> trio.abc.Stream:
        client = await control.registry.client_for(worker_id)
        if first:
            return await client.connect_tcp("127.0.0.1", sink_port, first=first)
        return await client.connect_tcp_early("127.0.0.1", sink_port)

    return open_stream


@asynccontextmanager
async def open_our_paths(
    workdir: Path, sink_port: int, *, profile_dir: Path | None = None
) -> AsyncIterator[tuple[Controlplane, dict[str, OpenStream]]]:
    """A controlplane in this process and one agent process per mode; yields the controlplane
    and an opener per mode (keys `OUR_PATHS`)."""
    worker_ids = {mode: f"w-{mode}" for mode in OUR_PATHS}
    config, setup = make_controlplane_config(workdir, list(worker_ids.values()))
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, config)
        try:
            async with contextlib.AsyncExitStack() as agents:
                for mode, worker_id in worker_ids.items():
                    profile = profile_dir / f"{mode}-agent.prof" if profile_dir else None
                    await agents.enter_async_context(
                        open_agent_process(
                            mode, worker_id, control, setup, workdir, profile_path=profile
                        )
                    )
                yield (
                    control,
                    {
                        mode: worker_opener(control, worker_id, sink_port)
                        for mode, worker_id in worker_ids.items()
                    },
                )
        finally:
            nursery.cancel_scope.cancel()


# --- the whole benchmark ---------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


async def run_benchmark(
    workdir: Path, plan: Plan, repeats: int, *, progress: Callable[[str], None] = _say
) -> dict[str, list[float]]:
    """Start the sink, sshd with ``ssh -R``, the controlplane and both agents, then measure
    every path interleaved; returns every sample (see `measure_interleaved`)."""
    async with (
        open_sink_process() as sink_port,
        open_sshd(workdir) as sshd,
        open_ssh_reverse_tunnel(sshd, sink_port) as ssh_port,
        open_our_paths(workdir, sink_port) as (_, ours),
    ):
        openers = {"tcp": tcp_opener(sink_port), "ssh_R": tcp_opener(ssh_port), **ours}
        return await measure_interleaved(openers, plan, repeats, progress=progress)


@attrs.frozen
class Report:
    figures: dict[str, float]
    anchors: dict[str, float]
    ratios: dict[str, float]
    samples: dict[str, list[float]]


def build_report(samples: Mapping[str, list[float]]) -> Report:
    every = medians(samples)
    return Report(
        figures={k: v for k, v in every.items() if k.split(".", 1)[0] in OUR_PATHS},
        anchors={k: v for k, v in every.items() if k.split(".", 1)[0] in ANCHOR_PATHS},
        ratios=compute_ratios(every),
        samples=dict(samples),
    )


def _figure_names(report: Report) -> list[str]:
    names: list[str] = []
    for key in (*report.anchors, *report.figures):
        name = key.split(".", 1)[1]
        if name not in names:
            names.append(name)
    return names


def _cell(report: Report, key: str) -> str:
    values = report.samples.get(key)
    if not values:
        return "-"
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.1f}"
    return f"{median:.1f} ({min(values):.0f}-{max(values):.0f})"


def render_report(report: Report) -> str:
    """The figures (median, and the range over repeats) and the ratios against their targets."""
    figures = render_table(
        [
            (name, *(_cell(report, f"{path}.{name}") for path in PATHS))
            for name in _figure_names(report)
        ],
        ("figure (median, min-max)", *(PATH_TITLES[path] for path in PATHS)),
    )
    rows: list[tuple[str, ...]] = []
    for name, value in report.ratios.items():
        ratio = RATIOS[name]
        met = ratio.meets(value)
        verdict = "" if met is None else ("ok" if met else "MISSED")
        rows.append((name, f"{value:.3f}", ratio.describe_target(), verdict))
    ratios = render_table(rows, ("ratio (ours / anchor)", "value", "target", ""))
    return f"{figures}\n\n{ratios}"


# --- profiling -------------------------------------------------------------------------------


async def profile_our_paths(
    workdir: Path, profile_dir: Path, plan: Plan, direction: str = "upload"
) -> dict[str, Path]:
    """Move `plan`'s bytes in `direction` (``upload`` or ``download``) once per stream count
    over each of our modes, with the agents under cProfile and this process profiled while each
    mode is measured; returns the profile files by name (``tunnel-agent``, ...)."""
    files: dict[str, Path] = {}
    async with (
        open_sink_process() as sink_port,
        open_our_paths(workdir, sink_port, profile_dir=profile_dir) as (_, ours),
    ):
        for mode, open_stream in ours.items():
            await _throughput(open_stream, direction, 1, _warmup(plan))
            profiler = cProfile.Profile()
            profiler.enable()
            try:
                for streams in plan.stream_counts:
                    mbps = await _throughput(open_stream, direction, streams, plan)
                    _say(f"{mode}: {direction} {streams} streams {mbps:.1f} MB/s (profiled)")
            finally:
                profiler.disable()
            path = profile_dir / f"{mode}-control.prof"
            profiler.dump_stats(path)
            files[f"{mode}-control"] = path
    # The agents wrote theirs on exit.
    for mode in ours:
        files[f"{mode}-agent"] = profile_dir / f"{mode}-agent.prof"
    return files


def summarise_profile(path: Path, top: int = PROFILE_TOP) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue()


# --- command line ----------------------------------------------------------------------------


async def run_until_sigterm(async_fn: Callable[[], Awaitable[T]]) -> T:
    """`async_fn`'s result, or `Terminated` once SIGTERM arrives. Python's default for SIGTERM
    is to die at once, which would leave the agents, sshd and ssh running; cancelling instead
    runs every cleanup."""
    results: list[T] = []
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    raise Terminated("SIGTERM: stopped, and stopped what it had started")

            async def body() -> None:
                results.append(await async_fn())
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(body)
    return results[0]


def _run(async_fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return trio.run(run_until_sigterm, async_fn)
    except* Terminated:
        _say("terminated (SIGTERM); every process the run started was stopped")
        raise SystemExit(128 + signal.SIGTERM) from None


def _plan_from(args: argparse.Namespace) -> tuple[Plan, int]:
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    repeats = QUICK_REPEATS if args.quick else FULL_REPEATS
    if args.total_mib is not None:
        plan = attrs.evolve(plan, total_bytes=args.total_mib << 20)
    if args.round_trips is not None:
        plan = attrs.evolve(plan, round_trips=args.round_trips)
    if args.stream_messages is not None:
        plan = attrs.evolve(plan, stream_messages=args.stream_messages)
    if args.connects is not None:
        plan = attrs.evolve(plan, connects=args.connects)
    if args.repeats is not None:
        repeats = args.repeats
    return plan, repeats


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tunnel",
        description="Our tunnel and direct modes against direct TCP and ssh -R, in one run.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"measure less: {QUICK_PLAN.total_bytes >> 20} MiB per measurement, not "
        f"{FULL_PLAN.total_bytes >> 20} MiB",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    parser.add_argument("--total-mib", type=_positive, help="bytes each throughput figure moves")
    parser.add_argument("--round-trips", type=_positive, help="round trips per path and repeat")
    parser.add_argument("--connects", type=_positive, help="connects per path and repeat")
    parser.add_argument(
        "--stream-messages", type=_positive, help="messages at 1 kHz per path and repeat"
    )
    parser.add_argument("--repeats", type=_positive, help="how often each figure is measured")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="instead: profile our two modes' transfers (agents and controlplane) into DIR",
    )
    parser.add_argument(
        "--profile-direction",
        choices=("upload", "download"),
        default="upload",
        help="which transfers --profile profiles",
    )
    args = parser.parse_args(argv)
    plan, repeats = _plan_from(args)
    tune_malloc()  # as levers9-control does: the controlplane's side runs in this process
    with tempfile.TemporaryDirectory(prefix="levers9-bench-tunnel-") as workdir:
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            files = _run(
                functools.partial(
                    profile_our_paths,
                    Path(workdir),
                    args.profile.resolve(),
                    plan,
                    args.profile_direction,
                )
            )
            for name, path in files.items():
                print(f"=== {name}: {path}\n{summarise_profile(path)}")
            return
        _say(f"plan: {plan}, {repeats} repeats")
        samples = _run(functools.partial(run_benchmark, Path(workdir), plan, repeats))
    report = build_report(samples)
    print(render_report(report))
    if args.json:
        write_report(
            args.json, figures=report.figures, ratios=report.ratios, anchors=report.anchors
        )
    missing = [name for name in RATIOS if name not in report.ratios]
    if missing:
        _say(f"ratios not measured with this plan: {', '.join(missing)}")


if __name__ == "__main__":
    main()
