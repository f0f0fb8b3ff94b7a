"""The kubelet PodResources client, against a real gRPC server on a unix socket."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.gpus.claim import GpuConfig, decide_claim, read_assignment
from agent.gpus.podresources import (
    ContainerDevices,
    ContainerResources,
    PodResources,
    PodResourcesError,
    PodResourcesUnavailableError,
    decode_list_response,
    encode_list_response,
    fetch_pod_resources,
    list_pod_resources,
    pod_devices,
)
from nvml import open_nvml
from nvml.standin import eight_card_node, standin_device
from workerapi.models import CardState

if TYPE_CHECKING:
    from tests.nvml_fixtures import DescribeNode

pytest_plugins = ["tests.nvml_fixtures"]

UUID = [standin_device(i).uuid for i in range(8)]

OURS = PodResources(
    name="levers9-worker-node-a",
    namespace="levers9",
    containers=(
        ContainerResources(
            name="agent",
            devices=(
                ContainerDevices("nvidia.com/gpu", (UUID[2], UUID[3])),
                ContainerDevices("example.com/nic", ("eth9",)),
            ),
        ),
        ContainerResources(name="sidecar"),
    ),
)
NEIGHBOUR = PodResources(
    name="training-0",
    namespace="team-a",
    containers=(ContainerResources("main", (ContainerDevices("nvidia.com/gpu", (UUID[0],)),)),),
)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are limited to about 100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="l9pr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


Serve = Callable[[Sequence[PodResources] | None], Path]


@pytest.fixture
def kubelet(short_dir: Path) -> Iterator[Serve]:
    """Starts a gRPC server answering v1 PodResourcesLister/List with the given pods (None: a
    server that does not offer the service) on a unix socket; stops it afterwards."""
    servers: list[grpc.Server] = []

    def serve(pods: Sequence[PodResources] | None) -> Path:
        socket = short_dir / "kubelet.sock"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        if pods is not None:
            answer = encode_list_response(pods)

            def list_pods(request: bytes, context: grpc.ServicerContext) -> bytes:
                return answer

            handler = grpc.unary_unary_rpc_method_handler(
                list_pods, request_deserializer=bytes, response_serializer=bytes
            )
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler}),)
            )
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        servers.append(server)
        return socket

    yield serve
    for server in servers:
        server.stop(None).wait()


def test_the_kubelet_lists_pods_and_their_devices(kubelet: Serve) -> None:
    socket = kubelet([NEIGHBOUR, OURS])
    pods = list_pod_resources(socket)
    assert pods == (NEIGHBOUR, OURS)
    assert pod_devices(pods, pod_name="levers9-worker-node-a", namespace="levers9") == (
        UUID[2],
        UUID[3],
    )
    assert pod_devices(pods, pod_name="levers9-worker-node-a", namespace="other") is None


async def test_fetch_from_trio(kubelet: Serve) -> None:
    socket = kubelet([OURS])
    assert await fetch_pod_resources(socket) == (OURS,)


def test_a_missing_socket_says_what_to_mount(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesUnavailableError, match="mount the node's"):
        list_pod_resources(tmp_path / "kubelet.sock")


def test_a_kubelet_without_the_service(kubelet: Serve) -> None:
    socket = kubelet(None)
    with pytest.raises(PodResourcesError, match="does not offer PodResources v1 List"):
        list_pod_resources(socket)


def test_a_socket_nobody_listens_on(short_dir: Path) -> None:
    import socket as sockets

    path = short_dir / "kubelet.sock"
    listener = sockets.socket(sockets.AF_UNIX)
    listener.bind(str(path))
    listener.close()  # the file stays; nothing answers
    with pytest.raises(PodResourcesUnavailableError, match="did not answer"):
        list_pod_resources(path)


def test_fields_we_do_not_use_are_skipped() -> None:
    # ContainerResources also carries cpu_ids (packed varints, field 3), memory (4) and
    # topology inside ContainerDevices (3); a decoder for the few fields we read must skip them.
    def field(number: int, payload: bytes) -> bytes:
        return bytes([number << 3 | 2, len(payload)]) + payload

    devices = field(1, b"nvidia.com/gpu") + field(2, b"nvidia0") + field(3, field(1, b"\x08\x00"))
    container = field(1, b"main") + field(2, devices) + field(3, b"\x02\x04") + bytes([4 << 3, 7])
    pod = field(1, b"p") + field(2, b"ns") + field(3, container)
    (decoded,) = decode_list_response(field(1, pod))
    assert decoded.containers[0].devices[0].device_ids == ("nvidia0",)


@pytest.mark.parametrize("garbage", [b"\x0a\x05ab", b"\x0b", b"\x0a\x02\x0a\x80", b"\xff" * 11])
def test_a_malformed_answer_is_our_error(garbage: bytes) -> None:
    with pytest.raises(PodResourcesError, match="could not be decoded"):
        decode_list_response(garbage)


names = st.text(max_size=40)


@given(
    st.lists(
        st.builds(
            PodResources,
            name=names,
            namespace=names,
            containers=st.lists(
                st.builds(
                    ContainerResources,
                    name=names,
                    devices=st.lists(
                        st.builds(
                            ContainerDevices,
                            resource_name=names,
                            device_ids=st.lists(names, max_size=3).map(tuple),
                        ),
                        max_size=3,
                    ).map(tuple),
                ),
                max_size=3,
            ).map(tuple),
        ),
        max_size=4,
    )
)
def test_encode_and_decode_agree(pods: list[PodResources]) -> None:
    assert decode_list_response(encode_list_response(pods)) == tuple(pods)


# -- where the claim gets its cards from ----------------------------------------------------------


def test_the_claim_uses_the_kubelets_answer_first(
    kubelet: Serve, describe_node: DescribeNode
) -> None:
    describe_node(eight_card_node())
    config = GpuConfig(podresources_socket=kubelet([NEIGHBOUR, OURS]))
    environ = {
        "POD_NAME": "levers9-worker-node-a",
        "POD_NAMESPACE": "levers9",
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    assignment = read_assignment(config, environ)
    assert assignment.source == "kubelet PodResources (pod levers9/levers9-worker-node-a)"
    with open_nvml() as nvml:
        claim = decide_claim(assignment, nvml.snapshot())
    assert [(c.index, c.state) for c in claim.cards] == [
        (2, CardState.SERVING),
        (3, CardState.SERVING),
    ]


def test_without_our_pod_in_the_answer_the_environment_is_used(kubelet: Serve) -> None:
    config = GpuConfig(podresources_socket=kubelet([NEIGHBOUR]))
    environ = {"POD_NAME": "x", "POD_NAMESPACE": "levers9", "NVIDIA_VISIBLE_DEVICES": "1,2"}
    assignment = read_assignment(config, environ)
    assert assignment.source == "NVIDIA_VISIBLE_DEVICES"
    assert [r.index for r in assignment.refs] == [1, 2]
    assert "does not list pod levers9/x" in assignment.notes[0]


def test_without_pod_name_the_kubelets_answer_cannot_be_matched(kubelet: Serve) -> None:
    config = GpuConfig(podresources_socket=kubelet([OURS]))
    assignment = read_assignment(config, {"NVIDIA_VISIBLE_DEVICES": "0"})
    assert assignment.source == "NVIDIA_VISIBLE_DEVICES"
    assert "POD_NAME" in assignment.notes[0]
