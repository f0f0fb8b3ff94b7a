"""The agent's `/metrics`: parsed with prometheus-client's own parser and checked against what
the stand-in NVML was told, what the object store holds and what the containers are.

First the pure choice of samples, then the collector over the stand-in NVML and a real object
store, then a real agent scraped over loopback (with containers where this runs as root)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import h11
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent.daemon.config import ConfigError, MetricsConfig, load_config
from agent.daemon.metrics import (
    AgentCollector,
    AgentView,
    CardSample,
    agent_registry,
    metric_families,
    serve_agent_metrics,
)
from agent.daemon.run import run_agent
from agent.runtime.config import ContainerConfig
from agent.store.objects import ObjectStore, StoreStatistics
from control.api.server import Controlplane
from nvml import Readings
from nvml.standin import StandinProcess, nvlinked_node, standin_device
from sim.configs import control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config
from wire.metrics import render
from workerapi.models import CardInfo, CardState, ContainerSpec, ContainerState

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.nvml_fixtures", "tests.registry_fixtures"]

Labels = tuple[tuple[str, str], ...]
BOUNDED_LABELS = {"uuid", "index", "model", "type", "state", "worker", "mode", "version"}


def parse(text: str) -> dict[str, dict[Labels, float]]:
    """Sample name -> labels -> value, from the Prometheus text format."""
    found: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


def card(index: int, model: str = "NVIDIA A100-SXM4-80GB", **more: str) -> Labels:
    labels = {"uuid": standin_device(index).uuid, "index": str(index), "model": model, **more}
    return tuple(sorted(labels.items()))


def scrape_view(view: AgentView) -> dict[str, dict[Labels, float]]:
    class Fixed:
        def collect(self) -> list[object]:
            return list(metric_families(view))

    registry = agent_registry(Fixed())  # type: ignore[arg-type]
    body, _ = render(registry, "text/plain")
    return parse(body.decode())


# -- settings ------------------------------------------------------------------------------------


def worker_env(**extra: str) -> dict[str, str]:
    return {
        "LEVERS9_WORKER_ID": "w-1",
        "LEVERS9_WORKER_TOKEN": "agent-secret-token",
        "LEVERS9_CONTROLPLANE_URL": "https://cp.example.com:8443",
        **extra,
    }


def test_metrics_are_off_unless_a_port_is_set_and_on_loopback_unless_told() -> None:
    assert load_config(worker_env()).metrics is None
    assert load_config(worker_env(LEVERS9_METRICS_PORT="")).metrics is None
    assert load_config(worker_env(LEVERS9_METRICS_PORT="9400")).metrics == MetricsConfig(
        port=9400, host="127.0.0.1"
    )
    for given, host in (("0.0.0.0", "0.0.0.0"), ("[::1]", "::1"), ("node-1.lan", "node-1.lan")):
        env = worker_env(LEVERS9_METRICS_PORT="9400", LEVERS9_METRICS_HOST=given)
        config = load_config(env).metrics
        assert config is not None and config.host == host


@pytest.mark.parametrize(
    ("changes", "variable", "needle"),
    [
        ({"LEVERS9_METRICS_PORT": "metrics"}, "LEVERS9_METRICS_PORT", "must be a TCP port"),
        ({"LEVERS9_METRICS_PORT": "0"}, "LEVERS9_METRICS_PORT", "1 to 65535"),
        ({"LEVERS9_METRICS_PORT": "65536"}, "LEVERS9_METRICS_PORT", "not '65536'"),
        ({"LEVERS9_METRICS_PORT": "-1"}, "LEVERS9_METRICS_PORT", "must be a TCP port"),
        ({"LEVERS9_METRICS_PORT": "\uff19\uff14\uff10\uff10"}, "LEVERS9_METRICS_PORT", "TCP port"),
        (
            {"LEVERS9_METRICS_HOST": "0.0.0.0"},
            "LEVERS9_METRICS_HOST",
            "LEVERS9_METRICS_PORT is not",
        ),
        (
            {"LEVERS9_METRICS_PORT": "9400", "LEVERS9_METRICS_HOST": "a host"},
            "LEVERS9_METRICS_HOST",
            "IP address or a host name",
        ),
    ],
)
def test_metrics_settings_run_refuses_name_the_variable(
    changes: dict[str, str], variable: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(worker_env(**changes))
    assert refused.value.variable == variable
    assert variable in str(refused.value) and needle in str(refused.value)
    assert "agent-secret-token" not in str(refused.value)


# -- what the samples are ------------------------------------------------------------------------


def test_each_part_becomes_its_samples_and_unknown_readings_are_left_out() -> None:
    full = Readings(
        utilization_gpu_percent=90,
        utilization_memory_percent=30,
        memory_used_bytes=1 << 30,
        memory_total_bytes=80 << 30,
        temperature_celsius=70,
        power_watts=250.5,
        ecc_corrected_volatile=4,
        ecc_uncorrected_volatile=0,
    )
    partial = Readings(memory_used_bytes=0, memory_total_bytes=80 << 30)
    cards = (
        CardSample(standin_device(0).uuid, 0, "NVIDIA A100-SXM4-80GB", full),
        CardSample(standin_device(1).uuid, 1, "NVIDIA A100-SXM4-80GB", partial),
        CardSample(standin_device(2).uuid, 2, "NVIDIA A100-SXM4-80GB", None),
    )
    claim = (
        CardInfo(
            standin_device(0).uuid, 0, "NVIDIA A100-SXM4-80GB", 80 << 30, CardState.SERVING, "ok"
        ),
        CardInfo(
            standin_device(1).uuid, 1, "NVIDIA A100-SXM4-80GB", 80 << 30, CardState.REFUSED, "x"
        ),
    )
    view = AgentView(
        worker="w-7",
        mode="tunnel",
        version="1.2.3",
        cards=cards,
        xids={standin_device(0).uuid: 3},
        claim=claim,
        containers={ContainerState.RUNNING: 2, ContainerState.FAILED: 1},
        store=StoreStatistics(
            objects=3,
            bytes=12345,
            pinned=1,
            budget_bytes=1 << 20,
            free_bytes=0,
            evicted_objects=5,
            evicted_bytes=999,
        ),
        bucket_mounts=2,
    )
    found = scrape_view(view)
    assert found["levers9_agent_info"] == {
        (("mode", "tunnel"), ("version", "1.2.3"), ("worker", "w-7")): 1
    }
    assert found["levers9_gpu_utilization_percent"] == {card(0): 90}
    assert found["levers9_gpu_memory_utilization_percent"] == {card(0): 30}
    assert found["levers9_gpu_memory_used_bytes"] == {card(0): 1 << 30, card(1): 0}
    assert found["levers9_gpu_memory_total_bytes"] == {card(0): 80 << 30, card(1): 80 << 30}
    assert found["levers9_gpu_temperature_celsius"] == {card(0): 70}
    assert found["levers9_gpu_power_watts"] == {card(0): 250.5}
    assert found["levers9_gpu_ecc_errors_total"] == {
        card(0, type="corrected"): 4,
        card(0, type="uncorrected"): 0,
    }
    assert found["levers9_gpu_xid_errors_total"] == {card(0): 3}
    # Claimed: the worker's cards as the claim says; a card on the node it was not given is 0.
    assert found["levers9_gpu_claimed"] == {card(0): 1, card(1): 0, card(2): 0}
    assert found["levers9_containers"] == {
        (("state", state.value),): {"running": 2, "failed": 1}.get(state.value, 0)
        for state in ContainerState
    }
    assert found["levers9_store_bytes"] == {(): 12345}
    assert found["levers9_store_objects"] == {(): 3}
    assert found["levers9_store_evictions_total"] == {(): 5}
    assert found["levers9_store_evicted_bytes_total"] == {(): 999}
    assert found["levers9_bucket_mounts"] == {(): 2}
    assert {name for samples in found.values() for labels in samples for name, _ in labels} <= (
        BOUNDED_LABELS
    )


def test_parts_the_agent_does_not_run_are_not_reported() -> None:
    found = scrape_view(AgentView(worker="w-1", mode="direct", version="0"))
    assert "levers9_agent_info" in found
    for absent in ("levers9_gpu_claimed", "levers9_containers", "levers9_store_bytes"):
        assert absent not in found
    assert "levers9_bucket_mounts" not in found


# -- the cards, through the stand-in NVML ----------------------------------------------------------


async def http_get(port: int) -> str:
    """`GET /metrics` on loopback, as Prometheus asks for it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="GET",
            target="/metrics",
            headers=[("host", f"127.0.0.1:{port}"), ("accept", "text/plain;version=0.0.4")],
        )
        await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return body.decode()
            else:
                raise AssertionError(f"unexpected {event!r}")


async def test_cards_as_the_stand_in_reports_them(
    describe_node: DescribeNode, nursery: trio.Nursery
) -> None:
    describe_node(
        nvlinked_node(
            4,
            {
                0: {
                    "utilization_gpu_percent": 87,
                    "utilization_memory_percent": 41,
                    "memory_used_bytes": 7 << 30,
                    "temperature_celsius": 71,
                    "power_usage_mw": 312_500,
                    "ecc_corrected_volatile": 5,
                    "ecc_uncorrected_volatile": 2,
                    "xids": (79, 13),
                },
                1: {
                    "utilization_supported": False,
                    "temperature_celsius": None,
                    "power_usage_mw": None,
                    "ecc_uncorrected_volatile": None,
                    "xid_events_supported": False,
                },
                2: {"errors": {"nvmlDeviceGetUtilizationRates": "GPU_IS_LOST"}},
            },
        )
    )
    serve = functools.partial(
        serve_agent_metrics, worker="w-gpu", mode="direct", claim=None, manager=None
    )
    port = await nursery.start(serve, MetricsConfig(port=0))
    found = parse(await http_get(port))
    assert found["levers9_gpu_utilization_percent"] == {card(0): 87, card(3): 0}
    assert found["levers9_gpu_memory_utilization_percent"] == {card(0): 41, card(3): 0}
    assert found["levers9_gpu_memory_used_bytes"] == {card(0): 7 << 30, card(1): 0, card(3): 0}
    assert found["levers9_gpu_memory_total_bytes"] == dict.fromkeys(
        (card(0), card(1), card(3)), 80 << 30
    )
    assert found["levers9_gpu_temperature_celsius"] == {card(0): 71, card(3): 33}
    assert found["levers9_gpu_power_watts"] == {card(0): 312.5, card(3): 61}
    assert found["levers9_gpu_ecc_errors_total"] == {
        card(0, type="corrected"): 5,
        card(0, type="uncorrected"): 2,
        card(3, type="corrected"): 0,
        card(3, type="uncorrected"): 0,
    }
    # Card 1 offers no XID events, so it has no count; card 2 did not answer this time.
    assert found["levers9_gpu_xid_errors_total"] == {card(0): 2, card(2): 0, card(3): 0}
    assert "levers9_gpu_claimed" not in found  # the claim is not known here
    # Each XID is counted once, however often the cards are read.
    again = parse(await http_get(port))
    assert again["levers9_gpu_xid_errors_total"] == found["levers9_gpu_xid_errors_total"]


async def test_no_driver_means_no_card_metrics_and_the_rest_still_served(
    describe_node: DescribeNode, nursery: trio.Nursery
) -> None:
    describe_node({"init_error": "DRIVER_NOT_LOADED", "devices": []})
    serve = functools.partial(
        serve_agent_metrics, worker="w-none", mode="tunnel", claim=(), manager=None
    )
    port = await nursery.start(serve, MetricsConfig(port=0))
    text = await http_get(port)
    info = parse(text)["levers9_agent_info"]
    assert info == {(("mode", "tunnel"), ("version", "0.1.0"), ("worker", "w-none")): 1}
    assert "levers9_gpu_" not in text  # not even an empty family's HELP and TYPE


async def test_a_taken_port_is_tried_again_until_it_is_free(
    describe_node: DescribeNode, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """As when a worker is rolled onto a node whose previous worker still holds the port."""
    caplog.set_level(logging.INFO, logger="levers9.agent")
    describe_node(nvlinked_node(1))
    holder = trio.socket.socket()
    await holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    serve = functools.partial(
        serve_agent_metrics, worker="w-rolled", mode="direct", claim=None, manager=None
    )
    assert await nursery.start(serve, MetricsConfig(port=port, bind_retry_s=0.01)) is None
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"127.0.0.1:{port} is taken" in warning.getMessage()
    holder.close()
    with trio.fail_after(30):
        while True:
            try:
                text = await http_get(port)
                break
            except OSError:  # not listening yet
                await trio.sleep(0.01)
    assert parse(text)["levers9_gpu_memory_total_bytes"] == {card(0): 80 << 30}
    assert metrics_port(caplog) == port


# -- the object store ----------------------------------------------------------------------------


async def chunks_of(data: bytes) -> AsyncIterator[bytes]:
    yield data


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


async def test_store_bytes_objects_and_evictions_are_what_the_store_holds(
    tmp_path: Path,
) -> None:
    first, second = b"a" * 3000, b"b" * 2000
    store = ObjectStore(tmp_path, budget_bytes=4000, free_floor_bytes=0)
    registry = agent_registry(AgentCollector(worker="w-1", mode="direct", store=store))

    def scrape() -> dict[str, dict[Labels, float]]:
        return parse(render(registry, "")[0].decode())

    assert scrape()["levers9_store_bytes"] == {(): 0}
    await store.ingest(chunks_of(first), digest=digest_of(first))
    found = scrape()
    assert found["levers9_store_bytes"] == {(): len(first)}
    assert found["levers9_store_objects"] == {(): 1}
    assert found["levers9_store_evictions_total"] == {(): 0}
    # Over the budget: the least recently used object (the first) goes.
    await store.ingest(chunks_of(second), digest=digest_of(second))
    assert not store.contains(digest_of(first))
    found = scrape()
    assert found["levers9_store_bytes"] == {(): len(second)}
    assert found["levers9_store_objects"] == {(): 1}
    assert found["levers9_store_evictions_total"] == {(): 1}
    assert found["levers9_store_evicted_bytes_total"] == {(): len(first)}
    assert found["levers9_store_budget_bytes"] == {(): 4000}
    store.close()


# -- a running agent -------------------------------------------------------------------------------


def metrics_port(caplog: pytest.LogCaptureFixture) -> int:
    """The port the agent said (once) it serves /metrics on."""
    [port] = [
        record.__dict__["metrics_port"]
        for record in caplog.records
        if "metrics_port" in record.__dict__ and record.levelno == logging.INFO
    ]
    return int(port)


@pytest.fixture
def gpu_node(describe_node: DescribeNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cards given to the pod; something that is not ours runs on the second."""
    describe_node(nvlinked_node(2, {1: {"processes": (StandinProcess(pid=424242),)}}))
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")


@pytest.mark.usefixtures("gpu_node")
async def test_a_running_agent_serves_its_metrics(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="levers9.agent")
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    config = attrs.evolve(
        agent_config(pki, control.port, mode="tunnel"),
        containers=None,
        metrics=MetricsConfig(port=0),
    )
    await nursery.start(run_agent, config)
    found = parse(await http_get(metrics_port(caplog)))
    assert found["levers9_agent_info"] == {
        (("mode", "tunnel"), ("version", "0.1.0"), ("worker", "w-tunnel")): 1
    }
    assert found["levers9_gpu_claimed"] == {card(0): 1, card(1): 0}
    assert found["levers9_gpu_memory_total_bytes"] == {card(0): 80 << 30, card(1): 80 << 30}
    assert "levers9_containers" not in found  # this agent runs none


@pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")
@pytest.mark.usefixtures("gpu_node")
async def test_a_running_agent_counts_its_containers_and_objects(
    tmp_path: Path,
    registry: SharedRegistry,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="levers9.agent")
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    config = attrs.evolve(
        agent_config(pki, control.port, mode="tunnel"),
        containers=ContainerConfig(
            state_dir=tmp_path / "state",
            object_budget_bytes=1 << 30,
            free_floor_bytes=0,
            log_max_bytes=1 << 20,
            allow_local_registries=True,
        ),
        metrics=MetricsConfig(port=0),
    )
    await nursery.start(run_agent, config)
    port = metrics_port(caplog)
    with trio.fail_after(30):
        worker = await control.registry.client_for("w-tunnel")

    def states(found: Mapping[str, dict[Labels, float]]) -> dict[str, float]:
        return {
            dict(labels)["state"]: value for labels, value in found["levers9_containers"].items()
        }

    before = parse(await http_get(port))
    assert states(before) == dict.fromkeys((s.value for s in ContainerState), 0)
    assert before["levers9_store_objects"] == {(): 0}
    assert before["levers9_bucket_mounts"] == {(): 0}

    status = await worker.create_container(
        ContainerSpec(image=registry.busybox, id="counted", command=("sleep", "600"))
    )
    assert status.state == "running"
    running = parse(await http_get(port))
    assert [c.state for c in await worker.containers()] == ["running"]
    assert states(running) == {**states(before), "running": 1}
    assert running["levers9_store_objects"][()] > 0  # the image's blobs

    data = os.urandom(12345)
    await worker.put_object(digest_of(data), chunks_of(data), size=len(data))
    assert await worker.has_object(digest_of(data)) == len(data)
    after = parse(await http_get(port))
    assert after["levers9_store_bytes"][()] - running["levers9_store_bytes"][()] == len(data)
    assert after["levers9_store_objects"][()] - running["levers9_store_objects"][()] == 1

    await worker.stop_container("counted", grace_s=0)
    assert states(parse(await http_get(port)))["exited"] == 1
    await worker.delete_container("counted")
    assert states(parse(await http_get(port))) == states(before)
