"""Containers end to end on this machine: real runc, a real registry, overlayfs, veth and
nftables, driven through the container manager and through the worker API.

Each test uses its own state directory; `clean_after` checks that a container that is gone
left nothing behind (no runc state, no rootfs mount, no network, no cgroup).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
import trio
import trio.testing

from agent.daemon.routes import WorkerState, build_router
from agent.daemon.run import idle_for, run_agent
from agent.gpus.claim import Card, Claim, GpuConfig
from agent.gpus.edits import discover_node_files
from agent.gpus.ledger import CardLedger
from agent.runtime.config import ContainerConfig
from agent.runtime.manager import ContainerManager, open_container_manager
from agent.runtime.records import ContainerRecord, Gpus
from agent.runtime.rootfs import overlay_mounts_under
from agent.runtime.routes import add_container_routes, resolve_container
from agent.runtime.runc import wait_exit
from control.api.server import Controlplane
from sim.configs import control_config, make_pki, read_line
from sim.controlplane import run_controlplane
from sim.registry import Image, push_layer_tars
from sim.workers import agent_config
from tests.cgroups import read_cgroup_limits
from tests.leftovers import assert_nothing_left
from tests.netns_hosts import open_test_host, policy_route, probe, serve
from wire.connection import Http2Connection
from wire.errors import ApiError, ErrorCode, dumps, loads
from wire.service import Service, bearer_auth
from workerapi.client import WorkerClient, open_worker_client
from workerapi.exec import run_exec
from workerapi.models import (
    CardState,
    ContainerSpec,
    ContainerStatus,
    ExecRequest,
    LogLine,
    RegistryAuth,
    Resources,
    SnapshotInfo,
)

if TYPE_CHECKING:
    from tests.nvml_fixtures import MakeDevDir
    from tests.registry_fixtures import AuthRegistry, RegistryFactory, SharedRegistry

pytest_plugins = ["tests.registry_fixtures", "tests.nvml_fixtures"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")

TOKEN = "container-test-token"


def state_config(tmp_path: Path, **changes: object) -> ContainerConfig:
    values: dict[str, object] = {
        "state_dir": tmp_path / "state",
        "object_budget_bytes": 1 << 30,
        "free_floor_bytes": 0,
        "log_max_bytes": 1 << 20,
        "allow_local_registries": True,  # the test registry listens on loopback
    }
    values.update(changes)
    return ContainerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[ContainerManager]:
    async with open_container_manager(state_config(tmp_path)) as m:
        yield m


async def run_to_end(manager: ContainerManager, spec: ContainerSpec) -> ContainerStatus:
    container = await manager.wait_settled(await manager.create(spec))
    with trio.fail_after(30):
        await container.finished.wait()
    return container.status()


async def logs_of(manager: ContainerManager, container_id: str) -> list[LogLine]:
    return [line async for line in manager.log_lines(container_id, follow=False)]


# -- running ---------------------------------------------------------------------------------------


async def test_runs_a_command_and_keeps_its_logs_and_exit_code(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    status = await run_to_end(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="logs-and-exit",
            command=("sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"),
        ),
    )
    assert status.state == "exited"
    assert status.exit_code == 3
    assert not status.oom_killed
    lines = {(line.stream, line.text) for line in await logs_of(manager, "logs-and-exit")}
    assert ("stdout", "to-stdout") in lines
    assert ("stderr", "to-stderr") in lines
    await assert_nothing_left(manager, "logs-and-exit")


async def test_a_layered_image_shows_its_deletions_and_opaque_dirs(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    await run_to_end(
        manager,
        ContainerSpec(
            image=registry.layered,
            id="layered",
            command=(
                "sh",
                "-c",
                "ls /data; echo --; ls /data/dir; stat -c '%a %u' /data/owned.txt",
            ),
        ),
    )
    texts = [line.text for line in await logs_of(manager, "layered")]
    assert texts == [
        "dir",
        "hard.txt",
        "keep.txt",
        "link",
        "owned.txt",
        "--",
        "new.txt",
        "640 65534",
    ]


async def test_image_settings_user_workdir_and_env_reach_the_process(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    await run_to_end(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="settings",
            command=("sh", "-c", 'echo "$(id -u):$(id -g) $(pwd) $GREETING $(hostname)"'),
            user="nobody",
            workdir="/tmp",
            env={"GREETING": "hello"},
        ),
    )
    texts = [line.text for line in await logs_of(manager, "settings")]
    assert texts == ["65534:65534 /tmp hello settings"]


async def test_out_of_memory_is_reported(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    status = await run_to_end(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="oom",
            command=("sh", "-c", "head -c 256m /dev/zero | tail"),
            resources=Resources(memory_bytes=32 << 20),
        ),
    )
    assert status.exit_code == 137
    assert status.oom_killed


async def test_limits_are_applied_to_the_cgroup(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    container = await manager.wait_settled(
        await manager.create(
            ContainerSpec(
                image=registry.busybox,
                id="limits",
                command=("sleep", "600"),
                resources=Resources(cpu_millis=500, memory_bytes=64 << 20, pids=40),
            )
        )
    )
    limits = read_cgroup_limits(container.cgroups_path)
    assert limits["memory_bytes"] == 64 << 20
    assert limits["cpu_quota_us"] == 50_000
    assert limits["cpu_period_us"] == 100_000
    assert limits["pids_max"] == 40
    await manager.stop("limits", grace_s=0)
    await assert_nothing_left(manager, "limits")


async def test_stop_signals_then_kills_after_the_grace_period(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    polite = await manager.wait_settled(
        await manager.create(
            ContainerSpec(image=registry.busybox, id="polite", command=("sleep", "600"))
        )
    )
    stubborn = await manager.wait_settled(
        await manager.create(
            ContainerSpec(
                image=registry.busybox,
                id="stubborn",
                command=("sh", "-c", "trap '' TERM; while true; do sleep 1; done"),
            )
        )
    )
    await manager.stop("polite", grace_s=30)
    # sleep as PID 1 has no TERM handler, so the kernel ignores TERM: only KILL ends it.
    assert polite.status().exit_code in (143, 137)
    await manager.stop("stubborn", grace_s=0.5)
    assert stubborn.status().exit_code == 137
    assert stubborn.status().state == "exited"
    await manager.delete("stubborn")
    with pytest.raises(ApiError) as err:
        manager.get("stubborn")
    assert err.value.code is ErrorCode.NOT_FOUND
    assert not (manager.root / "stubborn").exists()


async def test_logs_follow_while_the_container_runs(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    await manager.wait_settled(
        await manager.create(
            ContainerSpec(
                image=registry.busybox,
                id="follow",
                command=("sh", "-c", "for i in 1 2 3; do echo line-$i; sleep 0.2; done"),
            )
        )
    )
    seen = []
    with trio.fail_after(30):
        async for line in manager.log_lines("follow", follow=True):
            seen.append(line.text)
    assert seen == ["line-1", "line-2", "line-3"]


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make_spec", "code", "needle"),
    [
        (lambda r: ContainerSpec(image=f"{r.host}/no-such-image:latest"), "NOT_FOUND", "no-such"),
        (
            lambda r: ContainerSpec(image=f"{r.host}/busybox:no-such-tag"),
            "NOT_FOUND",
            "no-such-tag",
        ),
        (
            lambda r: ContainerSpec(image=r.busybox, command=("/no/such/program",)),
            "INVALID_ARGUMENT",
            "/no/such/program",
        ),
        (
            lambda r: ContainerSpec(image=r.busybox, resources=Resources(memory_bytes=1 << 50)),
            "RESOURCE_EXHAUSTED",
            "resources.memoryBytes",
        ),
        (lambda r: ContainerSpec(image=r.busybox, id="Bad_Id"), "INVALID_ARGUMENT", "Bad_Id"),
        (lambda r: ContainerSpec(image=r.busybox, user="ghost"), "INVALID_ARGUMENT", "ghost"),
    ],
)
async def test_bad_input_is_named_and_leaves_nothing(
    manager: ContainerManager,
    registry: SharedRegistry,
    make_spec: Callable[[SharedRegistry], ContainerSpec],
    code: str,
    needle: str,
) -> None:
    spec = make_spec(registry)
    if spec.id is None:
        spec = attrs.evolve(spec, id="bad-input")
    assert spec.id is not None
    with pytest.raises(ApiError) as err:
        await manager.wait_settled(await manager.create(spec))
    assert err.value.code.name == code
    assert needle in err.value.message
    await assert_nothing_left(manager, spec.id)
    # Refused up front (nothing made), or recorded as failed with the reason.
    states = {c.id: c.status() for c in manager.all()}
    if spec.id in states:
        assert states[spec.id].state == "failed"
        assert states[spec.id].error == err.value.message


async def test_registry_down_and_wrong_credentials_are_named(
    manager: ContainerManager, basic_registry: AuthRegistry, registry_factory: RegistryFactory
) -> None:
    wrong = basic_registry.wrong
    with pytest.raises(ApiError) as err:
        await manager.wait_settled(
            await manager.create(
                ContainerSpec(
                    image=basic_registry.busybox,
                    id="wrong-creds",
                    registry_auth=RegistryAuth(username=wrong.username, password=wrong.password),
                )
            )
        )
    assert err.value.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED)
    assert wrong.password not in err.value.message
    record = (manager.root / "wrong-creds" / "record.json").read_text()
    assert wrong.password not in record
    await assert_nothing_left(manager, "wrong-creds")

    down = registry_factory()
    address = down.host
    down.stop()
    with pytest.raises(ApiError) as err:
        await manager.wait_settled(
            await manager.create(ContainerSpec(image=f"{address}/busybox:latest", id="down"))
        )
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert address in err.value.message


async def test_a_hostile_layer_is_refused(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo("../../../../tmp/levers9-escaped")
        member.size = 5
        tar.addfile(member, io.BytesIO(b"owned"))
    base = registry.images["busybox"]
    assert isinstance(base, Image)
    push_layer_tars(registry.url, "hostile", "latest", [buffer.getvalue()], base=base)
    reference = f"{registry.host}/hostile:latest"
    with pytest.raises(ApiError) as err:
        await manager.wait_settled(
            await manager.create(ContainerSpec(image=reference, id="hostile", command=("true",)))
        )
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert "levers9-escaped" in err.value.message
    assert not Path("/tmp/levers9-escaped").exists()
    await assert_nothing_left(manager, "hostile")


# -- exec, ports and the worker API ----------------------------------------------------------------


@pytest.fixture
async def worker(manager: ContainerManager) -> AsyncIterator[WorkerClient]:
    """A worker API client wired to a service holding `manager`, over memory streams."""
    from agent.store.routes import add_object_routes

    router = build_router(WorkerState(worker_id="w-test", mode="direct"))
    add_object_routes(router, manager.store)
    add_container_routes(router, manager)
    service = Service(
        router,
        program="worker",
        authenticate=bearer_auth(TOKEN),
        resolve_name=lambda host, port: resolve_container(manager, host, port),
    )
    server_side, client_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        conn = Http2Connection(server_side, client_side=False, handler=service)
        nursery.start_soon(conn.run)
        async with open_worker_client(client_side, token=TOKEN) as client:
            yield client
        nursery.cancel_scope.cancel()


async def test_exec_without_and_with_a_tty(
    manager: ContainerManager, worker: WorkerClient, registry: SharedRegistry
) -> None:
    await manager.wait_settled(
        await manager.create(
            ContainerSpec(image=registry.busybox, id="exec", command=("sleep", "600"))
        )
    )
    out: dict[int, bytes] = {1: b"", 2: b""}

    async def collect(channel: int, data: bytes) -> None:
        out[channel] += data

    async def stdin() -> AsyncIterator[bytes]:
        yield b"from stdin\n"

    ws = await worker.open_exec("exec")
    code = await run_exec(
        ws,
        ExecRequest(command=("sh", "-c", "cat; echo oops >&2; exit 5")),
        stdin=stdin(),
        on_output=collect,
    )
    assert code == 5
    assert out[1] == b"from stdin\n"
    assert out[2] == b"oops\n"

    out = {1: b"", 2: b""}
    ws = await worker.open_exec("exec")
    code = await run_exec(
        ws,
        ExecRequest(command=("sh", "-c", "tty; stty size"), tty=True, rows=33, cols=101),
        on_output=collect,
    )
    assert code == 0
    assert b"/dev/pts/" in out[1]
    assert b"33 101" in out[1]
    await manager.stop("exec", grace_s=0)


async def test_a_port_is_reached_through_connect_and_not_from_the_node(
    manager: ContainerManager, worker: WorkerClient, registry: SharedRegistry
) -> None:
    container = await manager.wait_settled(
        await manager.create(
            ContainerSpec(
                image=registry.busybox,
                id="web",
                command=(
                    "sh",
                    "-c",
                    "mkdir -p /www && echo hello-from-web > /www/index.html && "
                    "exec httpd -f -p 8080 -h /www",
                ),
                ports=(8080,),
            )
        )
    )
    address = container.status().address
    assert address is not None and address.startswith("169.254.")
    with trio.fail_after(20):
        while True:
            try:
                stream = await worker.connect_tcp("web", 8080)
            except ApiError as exc:
                # httpd may not listen yet: the worker says it cannot reach the port.
                assert exc.code is ErrorCode.UNAVAILABLE
                await trio.sleep(0.1)
                continue
            await stream.send_all(b"GET /index.html HTTP/1.0\r\n\r\n")
            body = b""
            while chunk := await stream.receive_some(65536):
                body += chunk
            await stream.aclose()
            if b"hello-from-web" in body:
                break
            await trio.sleep(0.1)
    # Only the ports the container declared.
    with pytest.raises(ApiError) as undeclared:
        await worker.connect_tcp("web", 7000)
    assert undeclared.value.code is ErrorCode.PERMISSION_DENIED
    assert undeclared.value.message == (
        "container web declares ports 8080; CONNECT to 7000 is refused; add it to the task's ports"
    )
    # Not published on the node's own addresses.
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", 8080)
    with pytest.raises(ApiError) as err:
        await worker.connect_tcp("no-such-container", 8080)
    assert err.value.code is ErrorCode.NOT_FOUND
    await manager.stop("web", grace_s=0)


async def test_metadata_address_is_unreachable_from_a_container(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    """A test host of our own holds 169.254.169.254; the node reaches it, a container not."""
    async with open_test_host(
        "l9t-cmeta", "l9tcmeta", "198.18.2.0/30", extra=("169.254.169.254",)
    ) as host:
        async with serve(host.netns, "169.254.169.254", 80):
            async with policy_route(
                "169.254.169.254",
                host.host_ifname,
                sources=("198.18.2.1", "169.254.128.0/17"),
                table=7920,
                priority=7920,
            ):
                assert (await probe(None, ["169.254.169.254:80"], source="198.18.2.1"))[
                    "169.254.169.254:80"
                ] is not None
                status = await run_to_end(
                    manager,
                    ContainerSpec(
                        image=registry.busybox,
                        id="meta",
                        command=(
                            "sh",
                            "-c",
                            "if nc -w 2 169.254.169.254 80 </dev/null; then echo reached; "
                            "else echo blocked; fi",
                        ),
                    ),
                )
    assert status.exit_code == 0
    said = [line.text for line in await logs_of(manager, "meta") if line.stream == "stdout"]
    assert said == ["blocked"]


# -- snapshots -------------------------------------------------------------------------------------


async def test_snapshot_restores_into_a_new_container(
    manager: ContainerManager, worker: WorkerClient, registry: SharedRegistry, tmp_path: Path
) -> None:
    await run_to_end(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="writer",
            command=("sh", "-c", "mkdir /work && echo kept > /work/state.txt && rm /etc/group"),
        ),
    )
    snapshot = await worker.call("POST", "/v1/containers/writer/snapshot", None, SnapshotInfo)
    assert snapshot is not None
    assert manager.store.contains(snapshot.digest)

    # Restore on this worker...
    await run_to_end(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="reader",
            snapshot=snapshot.digest,
            command=("sh", "-c", "cat /work/state.txt; test -e /etc/group || echo no-group"),
        ),
    )
    assert [line.text for line in await logs_of(manager, "reader")] == ["kept", "no-group"]

    # ...and on another one, after copying the snapshot through the objects API.
    async with open_container_manager(state_config(tmp_path / "other")) as other:
        with pytest.raises(ApiError) as err:
            await other.wait_settled(
                await other.create(
                    ContainerSpec(image=registry.busybox, id="far", snapshot=snapshot.digest)
                )
            )
        assert err.value.code is ErrorCode.NOT_FOUND
        await other.store.ingest(worker.get_object(snapshot.digest), digest=snapshot.digest)
        await run_to_end(
            other,
            ContainerSpec(
                image=registry.busybox,
                id="far2",
                snapshot=snapshot.digest,
                command=("cat", "/work/state.txt"),
            ),
        )
        assert [line.text for line in await logs_of(other, "far2")] == ["kept"]


async def test_there_is_no_process_checkpoint_route(
    manager: ContainerManager, worker: WorkerClient, registry: SharedRegistry
) -> None:
    # Checkpoint restore is the filesystem snapshot above; the process checkpoint route (CRIU,
    # which this kernel does not run) is gone, and asking for it is like asking for any route
    # that does not exist. The container is left as it was.
    await manager.wait_settled(
        await manager.create(
            ContainerSpec(image=registry.busybox, id="ckpt", command=("sleep", "600"))
        )
    )
    answers: list[tuple[ErrorCode, str]] = []
    for path in ("/v1/containers/ckpt/checkpoint", "/v1/containers/ckpt/no-such-thing"):
        with pytest.raises(ApiError) as err:
            await worker.call("POST", path)
        answers.append((err.value.code, err.value.message.replace(path, "PATH")))
    assert answers[0] == answers[1] == (ErrorCode.NOT_FOUND, "no such route: POST PATH")
    assert (await worker.container("ckpt")).state == "running"
    await manager.stop("ckpt", grace_s=0)


# -- recovery --------------------------------------------------------------------------------------

_AGENT = textwrap.dedent(
    """
    import sys, trio
    from pathlib import Path
    from agent.runtime.config import ContainerConfig
    from agent.runtime.manager import open_container_manager
    from workerapi.models import ContainerSpec

    async def main():
        config = ContainerConfig(
            state_dir=Path(sys.argv[1]), free_floor_bytes=0, allow_local_registries=True
        )
        async with open_container_manager(config) as manager:
            for cid, command in (
                ("survivor", ["sh", "-c", "echo before; sleep 3; echo after; sleep 600"]),
                ("short", ["sh", "-c", "sleep 1; exit 7"]),
            ):
                await manager.wait_settled(
                    await manager.create(ContainerSpec(image=sys.argv[2], id=cid, command=command))
                )
            print("ready", flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


async def test_containers_survive_an_agent_killed_with_sigkill(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    config = state_config(tmp_path)
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _AGENT, str(config.state_dir), registry.busybox],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert process.stdout is not None
        with trio.fail_after(60):
            assert await read_line(process.stdout) == b"ready\n"
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()
    # "short" ends while no agent runs: its shim, which outlives the agent, records its exit.
    with trio.fail_after(10):
        await wait_exit(config.state_dir / "containers" / "short" / "exit.json")

    async with open_container_manager(config) as manager:
        survivor = manager.get("survivor")
        short = manager.get("short")
        with trio.fail_after(10):
            await short.finished.wait()
        assert short.status().exit_code == 7
        await assert_nothing_left(manager, "short")
        assert survivor.status().state == "running"
        with trio.fail_after(20):
            seen = []
            async for line in manager.log_lines("survivor", follow=True):
                seen.append(line.text)
                if line.text == "after":
                    break
        assert seen == ["before", "after"]
        await manager.stop("survivor", grace_s=0)
        assert survivor.status().exit_code == 137
        await assert_nothing_left(manager, "survivor")


async def test_a_restarted_agent_cleans_what_no_container_owns(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    config = state_config(tmp_path)
    async with open_container_manager(config) as manager:
        await manager.wait_settled(
            await manager.create(
                ContainerSpec(image=registry.busybox, id="orphan", command=("sleep", "600"))
            )
        )
        # The record goes (as if lost); the runtime's pieces stay.
        (manager.root / "orphan" / "record.json").unlink()
        manager._containers.clear()
    # A clean shutdown stopped nothing it did not know; a new agent finds and removes the rest.
    async with open_container_manager(config) as manager:
        await assert_nothing_left(manager, "orphan")


# -- cards -----------------------------------------------------------------------------------------


def _card(index: int) -> Card:
    return Card(
        uuid=f"GPU-test-{index}",
        index=index,
        minor=index,
        model="Stand-in A100",
        memory_total_bytes=80 << 30,
        pci_bus_id=f"00000000:0{index}:00.0",
        state=CardState.SERVING,
        reason="serving",
    )


async def test_a_container_gets_only_its_cards_and_gives_them_back(
    tmp_path: Path, registry: SharedRegistry, make_dev_dir: MakeDevDir, driver_dir: Path
) -> None:
    gpu_config = GpuConfig(dev_dir=make_dev_dir(range(2)), driver_dir=driver_dir, cdi_dirs=())
    claim = Claim(source="test", driver_version="550.54.15", cards=(_card(0), _card(1)))
    gpus = Gpus(
        ledger=CardLedger.for_claim(claim),
        files=discover_node_files(gpu_config),
        config=gpu_config,
    )
    async with open_container_manager(state_config(tmp_path), gpus=gpus) as manager:
        one = await manager.wait_settled(
            await manager.create(
                ContainerSpec(
                    image=registry.busybox,
                    id="one-card",
                    cards=1,
                    command=(
                        "sh",
                        "-c",
                        "ls /dev | grep nvidia; echo visible=$NVIDIA_VISIBLE_DEVICES; "
                        "ls /usr/local/nvidia/bin; sleep 600",
                    ),
                )
            )
        )
        assert one.status().cards == ("GPU-test-0",)
        with pytest.raises(ApiError) as err:
            await manager.wait_settled(
                await manager.create(ContainerSpec(image=registry.busybox, id="two-cards", cards=2))
            )
        assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "1 of this worker's 2 are free" in err.value.message
        texts = []
        with trio.fail_after(20):
            async for line in manager.log_lines("one-card", follow=True):
                texts.append(line.text)
                if line.text == "nvidia-smi":
                    break
        assert "nvidia0" in texts
        assert "nvidia1" not in texts
        assert "nvidiactl" in texts
        assert "visible=GPU-test-0" in texts
        assert "nvidia-smi" in texts
        await manager.stop("one-card", grace_s=0)
        assert gpus.ledger.free_count() == 2
        two = await manager.wait_settled(
            await manager.create(
                ContainerSpec(image=registry.busybox, id="two-cards", cards=2, command=("true",))
            )
        )
        assert two.status().cards == ("GPU-test-0", "GPU-test-1")


async def test_a_restarted_agent_stops_containers_whose_cards_are_shared_or_gone(
    tmp_path: Path, registry: SharedRegistry, make_dev_dir: MakeDevDir, driver_dir: Path
) -> None:
    gpu_config = GpuConfig(dev_dir=make_dev_dir(range(4)), driver_dir=driver_dir, cdi_dirs=())
    files = discover_node_files(gpu_config)

    def gpus_for(*cards: Card) -> Gpus:
        claim = Claim(source="test", driver_version="550.54.15", cards=cards)
        return Gpus(ledger=CardLedger.for_claim(claim), files=files, config=gpu_config)

    names = ("keeper", "twin", "moved", "busy")
    try:
        # An agent that leaves its containers running when it ends, as a killed one does.
        async with open_container_manager(
            state_config(tmp_path, stop_on_shutdown=False), gpus=gpus_for(*map(_card, range(4)))
        ) as manager:
            for name in names:
                await manager.wait_settled(
                    await manager.create(
                        ContainerSpec(
                            image=registry.busybox, id=name, cards=1, command=("sleep", "600")
                        )
                    )
                )
            assert [manager.get(n).status().cards for n in names] == [
                (f"GPU-test-{i}",) for i in range(4)
            ]
        # Two records name card 0 ...
        twin = tmp_path / "state" / "containers" / "twin" / "record.json"
        record = loads(twin.read_bytes(), ContainerRecord)
        twin.write_bytes(dumps(attrs.evolve(record, cards=("GPU-test-0",))))
        # ... and the restarted worker is not given card 2, and card 3 does not serve now.
        refused = attrs.evolve(_card(3), state=CardState.REFUSED, reason="a process runs on it")
        gpus = gpus_for(_card(0), _card(1), refused)
        async with open_container_manager(state_config(tmp_path), gpus=gpus) as manager:
            keeper, twin_status, moved, busy = (manager.get(n).status() for n in names)
            assert (keeper.state, busy.state) == ("running", "running")
            assert (twin_status.state, twin_status.error_code) == ("failed", "UNAVAILABLE")
            assert twin_status.error is not None
            assert "card GPU-test-0 is named by running containers keeper and twin" in (
                twin_status.error
            )
            assert (moved.state, moved.error_code) == ("failed", "UNAVAILABLE")
            assert moved.error is not None and "card GPU-test-2" in moved.error
            assert any("card GPU-test-3" in event for event in busy.events)
            await assert_nothing_left(manager, "twin")
            await assert_nothing_left(manager, "moved")
            # Card 0 stays with keeper and card 3 with busy; card 1 is free again.
            assert gpus.ledger.in_use() == {"GPU-test-0", "GPU-test-3"}
            container = await manager.wait_settled(
                await manager.create(
                    ContainerSpec(
                        image=registry.busybox, id="next", cards=1, command=("sleep", "600")
                    )
                )
            )
            assert container.status().cards == ("GPU-test-1",)
    finally:
        # Stops whatever an earlier failure left running.
        async with open_container_manager(state_config(tmp_path)):
            pass


# -- through the agent and the controlplane --------------------------------------------------------


async def test_the_agent_runs_containers_for_the_controlplane_through_its_tunnel(
    tmp_path: Path, registry: SharedRegistry, nursery: trio.Nursery
) -> None:
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    config = attrs.evolve(
        agent_config(pki, control.port, mode="tunnel"), containers=state_config(tmp_path)
    )
    nursery.start_soon(run_agent, config)
    with trio.fail_after(30):
        worker = await control.registry.client_for("w-tunnel")
    status = await worker.create_container(
        ContainerSpec(
            image=registry.busybox,
            id="via-tunnel",
            command=("sh", "-c", "echo through-the-tunnel; sleep 600"),
        )
    )
    assert status.state == "running"
    assert status.pull is not None and status.pull.done_bytes == status.pull.total_bytes > 0
    assert [c.id for c in await worker.containers()] == ["via-tunnel"]
    output: list[bytes] = []

    async def collect(channel: int, data: bytes) -> None:
        output.append(data)

    ws = await worker.open_exec("via-tunnel")
    try:
        code = await run_exec(ws, ExecRequest(command=("hostname",)), on_output=collect)
    finally:
        await ws.aclose()
    assert (code, b"".join(output)) == (0, b"via-tunnel\n")
    async with contextlib.aclosing(worker.container_logs("via-tunnel", follow=True)) as lines:
        async for line in lines:
            assert line.text == "through-the-tunnel"
            break
    stopped = await worker.stop_container("via-tunnel", grace_s=0)
    assert stopped.exit_code == 137
    await worker.delete_container("via-tunnel")
    with pytest.raises(ApiError) as err:
        await worker.container("via-tunnel")
    assert err.value.code is ErrorCode.NOT_FOUND


def test_a_worker_is_idle_from_the_moment_it_has_no_container() -> None:
    assert idle_for(1, None, 10.0) is None
    assert idle_for(0, None, 10.0) == 10.0
    assert idle_for(0, 10.0, 25.0) == 10.0
    assert idle_for(2, 10.0, 25.0) is None


async def test_an_idle_worker_winds_down_by_itself(
    tmp_path: Path, registry: SharedRegistry, nursery: trio.Nursery
) -> None:
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    config = attrs.evolve(
        agent_config(pki, control.port, mode="tunnel"),
        containers=state_config(tmp_path),
        idle_s=1.0,
    )
    with trio.fail_after(60):
        # Returns on its own (the process would exit 0): no container for a second.
        await run_agent(config)
    assert not [m for m in overlay_mounts_under(tmp_path / "state" / "containers")]


async def test_seccomp_refuses_what_a_workload_has_no_business_doing(
    manager: ContainerManager, registry: SharedRegistry
) -> None:
    script = (
        "unshare -U true 2>/dev/null && echo userns-made || echo userns-refused; "
        "mount -t tmpfs none /mnt 2>/dev/null && echo mounted || echo mount-refused; "
        "echo work > /tmp/f && cat /tmp/f; (sleep 0.1 &) ; wait; echo threads-ok"
    )
    await run_to_end(
        manager,
        ContainerSpec(image=registry.busybox, id="seccomp", command=("sh", "-c", script)),
    )
    said = [line.text for line in await logs_of(manager, "seccomp") if line.stream == "stdout"]
    assert said == ["userns-refused", "mount-refused", "work", "threads-ok"]
