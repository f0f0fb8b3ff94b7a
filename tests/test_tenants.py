"""One workspace cannot load the controlplane the others share: per-workspace limits on tasks,
spec sizes, requests and watch streams, each refused with its status and the limit's name and
value; watch streams that send a page once, then only what changed, and end when unread."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest
import trio

from agent.daemon.config import load_container_config
from agent.runtime.images.guard import parse_fib_trie, parse_if_inet6
from agent.runtime.images.puller import ImagePuller
from agent.store.objects import ObjectStore
from control.api import watch
from control.api.server import Controlplane
from control.api.watch import apply_changes, page_changes
from control.config import (
    ConfigError,
    LimitOverrides,
    WorkerSettings,
    WorkspaceLimits,
    parse,
)
from control.kube.manifests import PoolSettings, job_manifest
from control.limits import (
    TenantGuard,
    TokenBucket,
    active_tasks_refusal,
    spec_bytes,
    spec_refusal,
    watch_refusal,
)
from control.models import TaskList, TaskState, TaskView
from control.tasks.store import TaskSpec
from sim.configs import Pki, make_pki
from sim.controlplane import run_controlplane
from wire.errors import ApiError, dumps
from workerapi.reference import local_registry_refusal

TOKEN_A = "tenant-a-token-0123456789"
TOKEN_B = "tenant-b-token-0123456789"
TOKEN_R = "tenant-r-token-0123456789"
SMALL = {
    "maxActiveTasks": 2,
    "maxSpecBytes": 2048,
    "maxEnv": 3,
    "maxEnvEntryBytes": 600,
    "maxWatchStreams": 1,
}

# -- the pure decisions ------------------------------------------------------------------------


def test_a_workspace_block_overrides_only_what_it_sets() -> None:
    defaults = WorkspaceLimits()
    mine = LimitOverrides(max_active_tasks=5).over(defaults)
    assert mine.max_active_tasks == 5 and mine.max_spec_bytes == defaults.max_spec_bytes
    config = parse(
        {
            "config": {
                "publicUrl": "https://cp",
                "tls": {"certFile": "c", "keyFile": "k"},
                "workspaceLimits": {"maxWatchStreams": 4},
                "workspaces": [{"name": "a", "limits": {"maxEnv": 7}}],
            }
        }
    )
    assert config.workspace_limits.max_watch_streams == 4
    assert config.workspaces[0].limits.over(config.workspace_limits).max_env == 7
    with pytest.raises(ConfigError, match="max_env must be 1 or more"):
        parse(
            {
                "config": {
                    "publicUrl": "https://cp",
                    "tls": {"certFile": "c", "keyFile": "k"},
                    "workspaces": [{"name": "a", "limits": {"maxEnv": 0}}],
                }
            }
        )


def test_a_spec_is_refused_past_each_size_limit_naming_it() -> None:
    limits = WorkspaceLimits(max_spec_bytes=100, max_env=2, max_env_entry_bytes=30)
    assert spec_refusal(TaskSpec(image="x", args=("a" * 50,), env={"A": "1"}), limits) is None
    assert spec_bytes(TaskSpec(image="x", command=("ab",), args=("c",), env={"K": "v"})) == 6
    too_many = spec_refusal(TaskSpec(image="x", env={"A": "", "B": "", "C": ""}), limits)
    assert too_many is not None and too_many.field == "env"
    assert "limit of 2 (maxEnv)" in too_many.message
    entry = spec_refusal(TaskSpec(image="x", env={"BIG": "v" * 40}), limits)
    assert entry is not None and "limit of 30 bytes (maxEnvEntryBytes)" in entry.message
    whole = spec_refusal(TaskSpec(image="x", args=("a" * 101,)), limits)
    assert whole is not None and "limit of 100 bytes (maxSpecBytes)" in whole.message
    assert whole.code.status == 400


def test_tasks_past_the_active_limit_and_streams_past_theirs_are_429() -> None:
    limits = WorkspaceLimits(max_active_tasks=3, max_watch_streams=2)
    assert active_tasks_refusal(2, limits) is None
    refused = active_tasks_refusal(3, limits)
    assert refused is not None and refused.code.status == 429
    assert "(maxActiveTasks) is 3" in refused.message and "cancel" in refused.message
    assert watch_refusal(1, limits) is None
    stream = watch_refusal(2, limits)
    assert stream is not None and stream.code.status == 429
    assert "(maxWatchStreams) is 2" in stream.message


def test_the_request_bucket_allows_a_burst_then_the_rate() -> None:
    bucket: TokenBucket | None = TokenBucket(3.0, 0.0)
    for _ in range(3):
        assert bucket is not None
        bucket = bucket.take(0.0, rate_per_s=2.0, burst=3)
    assert bucket is not None and bucket.take(0.0, 2.0, 3) is None
    later = bucket.take(0.5, 2.0, 3)
    assert later is not None and later.take(0.5, 2.0, 3) is None
    assert TokenBucket(0.0, 0.0).take(100.0, 2.0, 3) == TokenBucket(2.0, 100.0)


def test_watch_slots_count_until_released_or_dropped() -> None:
    guard, limits = TenantGuard(), WorkspaceLimits(max_watch_streams=2)
    first = guard.watch("k", limits)
    second = guard.watch("k", limits)
    with pytest.raises(Exception, match="maxWatchStreams"):
        guard.watch("k", limits)
    first.release()
    assert guard.open_watches("k") == 1
    del second  # a stream whose body never started gives its slot back too
    assert guard.open_watches("k") == 0


def view(task_id: str, state: TaskState = TaskState.PENDING) -> TaskView:
    return TaskView(id=task_id, workspace="a", state=state, image="busybox", created_at=1.0)


def test_a_page_change_names_only_the_tasks_that_changed_and_rebuilds_the_page() -> None:
    before = TaskList((view("t3"), view("t2"), view("t1")), next="t1")
    assert page_changes(before, before) is None
    after = TaskList((view("t4"), view("t3"), view("t2", TaskState.RUNNING)), next="t2")
    changes = page_changes(before, after)
    assert changes is not None
    assert [(c.index, c.task.id) for c in changes.changed] == [(0, "t4"), (2, "t2")]
    assert changes.removed == ("t1",) and changes.next == "t2"
    assert apply_changes(before, changes) == after
    emptied = page_changes(after, TaskList(()))
    assert emptied is not None and apply_changes(after, emptied) == TaskList(())


@pytest.mark.parametrize(
    "registry",
    ["127.0.0.1:5000", "[::1]", "169.254.169.254", "metadata.google.internal", "localhost:80"],
)
def test_a_registry_on_the_node_is_refused_as_written(registry: str) -> None:
    refused = local_registry_refusal(registry)
    assert refused is not None and registry in refused and "allowLocalRegistries" in refused


def test_a_registry_is_judged_by_every_address_it_resolved_to() -> None:
    assert local_registry_refusal("registry.example.com", ["203.0.113.9"]) is None
    assert local_registry_refusal("r.example", ["203.0.113.9", "127.0.0.2"]) is not None
    assert local_registry_refusal("r.example", ["::ffff:169.254.169.254"]) is not None
    own = local_registry_refusal("r.example", ["10.1.2.3"], own=["10.1.2.3"])
    assert own is not None and "the node itself" in own
    assert parse_fib_trie("  |-- 10.1.2.3\n     /32 host LOCAL\n  |-- 10.0.0.0\n") == {"10.1.2.3"}
    assert parse_if_inet6("00000000000000000000000000000001 01 80 10 80 lo\n") == {"::1"}


@pytest.mark.parametrize("allowed", [False, True])
def test_a_pool_that_allows_local_registries_tells_its_workers(allowed: bool) -> None:
    pool = {
        "name": "p",
        "kubernetes": {
            "flavor": "generic",
            "endpoint": "https://k",
            "caData": "",
            "image": "w",
            "allowLocalRegistries": allowed,
        },
    }
    settings = PoolSettings(name="p", namespace="n", image="w", allow_local_registries=allowed)
    job = job_manifest(settings, "node", 1, "job", "secret", "https://cp", token="t").job
    env = {
        e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (env.get("LEVERS9_ALLOW_LOCAL_REGISTRIES") == "1") is allowed
    worker = WorkerSettings(pools=(pool,))
    assert worker.allows_local_registries() is allowed
    parsed = load_container_config({"LEVERS9_ALLOW_LOCAL_REGISTRIES": "1" if allowed else "0"})
    assert parsed is not None and parsed.allow_local_registries is allowed


async def test_the_worker_refuses_a_name_resolving_to_loopback_whatever_listens_there(
    tmp_path: Path,
) -> None:
    store = ObjectStore(tmp_path / "state", budget_bytes=1 << 30, free_floor_bytes=0)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    open_port = listener.socket.getsockname()[1]
    closed = trio.socket.socket()
    await closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    reasons = []
    trio.socket.set_custom_hostname_resolver(LoopbackName())
    async with ImagePuller(store, refuse_local_registries=True) as puller:
        for port in (open_port, closed_port):
            with pytest.raises(ApiError) as info:
                await puller.pull(f"registry.test:{port}/x:1")
            assert info.value.code.status == 403 and info.value.field == "image"
            reasons.append(info.value.message.replace(str(port), "PORT"))
    assert reasons[0] == reasons[1] and "loopback" in reasons[0]
    async with ImagePuller(store) as puller:  # allowed: it is dialled (and nothing answers)
        with pytest.raises(ApiError) as info:
            await puller.pull(f"registry.test:{closed_port}/x:1")
        assert "refused:" not in info.value.message
    await listener.aclose()


class LoopbackName(trio.abc.HostnameResolver):
    """`registry.test` resolves to 127.0.0.1 (a name on loopback without touching /etc/hosts)."""

    async def getaddrinfo(
        self, host: bytes | None, port: bytes | str | int | None, *args: Any, **kwargs: Any
    ) -> Any:
        if host in (b"registry.test", "registry.test"):
            host = b"127.0.0.1"
        return await trio.to_thread.run_sync(
            lambda: socket.getaddrinfo(host, port, *args, **kwargs)
        )

    async def getnameinfo(self, sockaddr: Any, flags: int) -> Any:
        return await trio.to_thread.run_sync(socket.getnameinfo, sockaddr, flags)


# -- against a controlplane --------------------------------------------------------------------


@pytest.fixture
async def control(tmp_path: Path) -> AsyncIterator[tuple[Controlplane, Pki]]:
    pki = make_pki(tmp_path)
    config = parse(
        {
            "config": {
                "publicUrl": "https://127.0.0.1:0",
                "listen": "127.0.0.1:0",
                "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
                "database": {"path": str(tmp_path / "tasks.db")},
                "workspaces": [
                    {"name": "a", "tokens": [{"name": "a", "token": TOKEN_A}], "limits": SMALL},
                    {"name": "b", "tokens": [{"name": "b", "token": TOKEN_B}]},
                    {
                        "name": "r",
                        "tokens": [{"name": "r", "token": TOKEN_R}],
                        "limits": {"requestsPerS": 0.001, "requestBurst": 3},
                    },
                ],
            }
        }
    )
    async with trio.open_nursery() as nursery:
        running: Controlplane = await nursery.start(run_controlplane, config)
        yield running, pki
        nursery.cancel_scope.cancel()


def client(control: tuple[Controlplane, Pki], token: str) -> httpx.AsyncClient:
    running, pki = control
    return httpx.AsyncClient(
        http2=True,
        verify=ssl.create_default_context(cafile=str(pki.ca_file)),
        base_url=f"https://127.0.0.1:{running.port}",
        headers={"authorization": f"Bearer {token}"},
    )


async def test_each_limit_is_refused_through_the_api_with_its_status_and_words(
    control: tuple[Controlplane, Pki],
) -> None:
    async with client(control, TOKEN_A) as a:
        env = await a.post(
            "/v1/tasks", json={"image": "busybox", "env": {"A": "", "B": "", "C": "", "D": ""}}
        )
        assert env.status_code == 400 and "limit of 3 (maxEnv)" in env.json()["message"]
        entry = await a.post("/v1/tasks", json={"image": "busybox", "env": {"A": "x" * 700}})
        assert entry.status_code == 400 and "(maxEnvEntryBytes)" in entry.json()["message"]
        big = await a.post("/v1/tasks", json={"image": "busybox", "args": ["y" * 3000]})
        assert big.status_code == 400
        assert "limit of 2048 bytes (maxSpecBytes)" in big.json()["message"]
        for _ in range(2):
            assert (await a.post("/v1/tasks", json={"image": "busybox"})).status_code == 201
        third = await a.post("/v1/tasks", json={"image": "busybox"})
        assert third.status_code == 429 and third.json()["code"] == "RESOURCE_EXHAUSTED"
        assert "its limit (maxActiveTasks) is 2" in third.json()["message"]
        listed = (await a.get("/v1/tasks")).json()["tasks"]
        assert len(listed) == 2
        # An ended task no longer counts.
        assert (await a.post(f"/v1/tasks/{listed[0]['id']}/cancel")).status_code == 200
        assert (await a.post("/v1/tasks", json={"image": "busybox"})).status_code == 201
    async with client(control, TOKEN_B) as b:  # the other workspace is not affected
        assert (await b.post("/v1/tasks", json={"image": "busybox"})).status_code == 201
    async with client(control, TOKEN_B) as b:
        for image in ("127.0.0.1:5000/x", "[::1]/x", "169.254.169.254/x"):
            local = await b.post("/v1/tasks", json={"image": image})
            assert local.status_code == 400 and local.json()["field"] == "image"
            assert "allowLocalRegistries" in local.json()["message"]
    async with client(control, TOKEN_R) as r:
        statuses = [(await r.get("/v1/tasks")).status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429]
        refused = await r.get("/v1/tasks")
        assert "requests a second" in refused.json()["message"]
        assert "requestsPerS" in refused.json()["message"]


async def test_a_list_watch_sends_the_page_once_then_only_the_changed_task(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    store = running.dispatcher.store
    fat = ("z" * 1500,)
    first = await store.create("b", TaskSpec(image="busybox", args=fat))
    await store.create("b", TaskSpec(image="busybox", args=fat))
    async with client(control, TOKEN_B) as b, b.stream("GET", "/v1/tasks?watch=true") as response:
        lines = response.aiter_lines()
        page = await anext(lines)
        assert len(json.loads(page)["tasks"]) == 2
        running.dispatcher.changed()  # told of a change that changed nothing: nothing is sent
        third = await store.create("b", TaskSpec(image="busybox"))
        running.dispatcher.changed()
        with trio.fail_after(10):
            line = await anext(lines)
        changes = json.loads(line)
        assert [c["task"]["id"] for c in changes["changed"]] == [third.id]
        assert changes["changed"][0]["index"] == 0 and changes["removed"] == []
        assert len(line) < len(page) / 3
        await running.dispatcher.cancel("b", first.id)
        # The cancel wakes the scheduler, which gives the pending tasks their waiting reason
        # (a change of theirs too); every task sent changed since it was last sent.
        shown = {t["id"]: t for t in json.loads(page)["tasks"]} | {
            third.id: changes["changed"][0]["task"]
        }
        with trio.fail_after(10):
            while shown[first.id]["state"] != "cancelled":
                for change in json.loads(await anext(lines))["changed"]:
                    assert change["task"] != shown.get(change["task"]["id"])
                    shown[change["task"]["id"]] = change["task"]


async def test_a_task_watch_sends_the_task_again_only_when_it_changed(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    record = await running.dispatcher.store.create("b", TaskSpec(image="busybox"))
    async with (
        client(control, TOKEN_B) as b,
        b.stream("GET", f"/v1/tasks/{record.id}?watch=true") as response,
    ):
        lines = response.aiter_lines()
        assert json.loads(await anext(lines))["state"] == "pending"
        running.dispatcher.changed()
        await running.dispatcher.cancel("b", record.id)
        with trio.fail_after(10):
            assert json.loads(await anext(lines))["state"] == "cancelled"


async def open_unread_watch(
    control: tuple[Controlplane, Pki], token: str, path: str
) -> tuple[trio.SSLStream[trio.SocketStream], h2.connection.H2Connection]:
    """A watch on its own connection whose caller reads nothing: a 1 KiB stream window that is
    never given back."""
    running, pki = control
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    context.set_alpn_protocols(["h2"])
    tls = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", running.port),
        context,
        server_hostname="127.0.0.1",
    )
    await tls.do_handshake()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1024})
    conn.send_headers(
        1,
        [
            (":method", "GET"),
            (":scheme", "https"),
            (":authority", f"127.0.0.1:{running.port}"),
            (":path", path),
            ("authorization", f"Bearer {token}"),
        ],
        end_stream=True,
    )
    await tls.send_all(conn.data_to_send())
    return tls, conn


async def test_an_unread_watch_holds_a_slot_until_it_is_cut(
    control: tuple[Controlplane, Pki], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "WATCH_STALL_S", 1.0)
    running, _ = control
    for _ in range(2):
        await running.dispatcher.store.create("a", TaskSpec(image="busybox", args=("q" * 2000,)))
    tls, conn = await open_unread_watch(control, TOKEN_A, "/v1/tasks?watch=true")
    received, status, reset = 0, None, False
    async with client(control, TOKEN_A) as a:
        with trio.fail_after(5):
            while status is None:
                for event in conn.receive_data(await tls.receive_some()):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                await tls.send_all(conn.data_to_send())
        assert status == b"200"
        second = await a.get("/v1/tasks?watch=true")  # maxWatchStreams is 1
        assert second.status_code == 429 and "(maxWatchStreams) is 1" in second.json()["message"]
        with trio.fail_after(10):
            while not reset:
                for event in conn.receive_data(await tls.receive_some()):
                    if isinstance(event, h2.events.DataReceived):
                        received += len(event.data)  # read off the wire, never acknowledged
                    reset = reset or isinstance(event, h2.events.StreamReset)
                await tls.send_all(conn.data_to_send())
        assert received <= 1024 < len(dumps((await a.get("/v1/tasks")).json()))
        async with a.stream("GET", "/v1/tasks?watch=true") as again:
            assert again.status_code == 200  # its slot came free
    await tls.aclose()
