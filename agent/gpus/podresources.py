"""Which devices the kubelet gave this pod, from the kubelet's PodResources API.

Why: a privileged pod sees every card on the node, so NVML alone cannot say which of them
Kubernetes accounted to this worker. The kubelet can: its PodResources service (gRPC on the unix
socket `/var/lib/kubelet/pod-resources/kubelet.sock`, mounted into the worker's pod) lists every
pod with the device ids each container was given. This works with any device plugin, including
GKE's, which sets no NVIDIA_VISIBLE_DEVICES.

This module is the one adapter for that service. It speaks gRPC through grpcio's generic
`unary_unary` with a small hand-written protobuf codec for the few messages of v1 `List` (no
generated code to keep in step), and translates grpc's errors into `PodResourcesError`.
The call blocks; `fetch_pod_resources` runs it in a thread for trio callers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import grpc
import trio

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
LIST_METHOD = "/v1.PodResourcesLister/List"
GPU_RESOURCE = "nvidia.com/gpu"

# A backstop, not a policy: callers bound the wait with trio; this only makes sure an abandoned
# thread's call ends too.
_CALL_DEADLINE_S = 30.0
_MAX_RESPONSE_BYTES = 16 << 20  # the kubelet's own limit for this service


class PodResourcesError(Exception):
    """The kubelet's PodResources service could not tell us the pod's devices."""


class PodResourcesUnavailableError(PodResourcesError):
    """The service is not reachable: socket not mounted, or the kubelet is not answering."""


@attrs.frozen
class ContainerDevices:
    resource_name: str
    device_ids: tuple[str, ...]


@attrs.frozen
class ContainerResources:
    name: str
    devices: tuple[ContainerDevices, ...] = ()


@attrs.frozen
class PodResources:
    name: str
    namespace: str
    containers: tuple[ContainerResources, ...] = ()


# -- protobuf wire format, only what v1 List needs ------------------------------------------------

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _DecodeError(ValueError):
    pass


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise _DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise _DecodeError("varint longer than 64 bits")


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for each field of one message; unknown ones included."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise _DecodeError("field number 0")
        value: int | bytes
        if wire_type == _VARINT:
            value, pos = _read_varint(data, pos)
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            if pos + size > len(data):
                raise _DecodeError("truncated fixed-size field")
            value, pos = int.from_bytes(data[pos : pos + size], "little"), pos + size
        elif wire_type == _LENGTH_DELIMITED:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise _DecodeError("truncated length-delimited field")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise _DecodeError(f"unsupported wire type {wire_type}")
        yield number, wire_type, value


def _nested(fields: Iterator[tuple[int, int, int | bytes]], wanted: int) -> Iterator[bytes]:
    """The length-delimited values of field `wanted`."""
    for number, wire_type, value in fields:
        if number == wanted:
            if wire_type != _LENGTH_DELIMITED or not isinstance(value, bytes):
                raise _DecodeError(f"field {wanted} is not length-delimited")
            yield value


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise _DecodeError("a string field is not UTF-8") from exc


def _decode_container_devices(data: bytes) -> ContainerDevices:
    resource, ids = "", []
    for number, wire_type, value in _fields(data):
        if wire_type == _LENGTH_DELIMITED and isinstance(value, bytes):
            if number == 1:
                resource = _text(value)
            elif number == 2:
                ids.append(_text(value))
    return ContainerDevices(resource_name=resource, device_ids=tuple(ids))


def _decode_container(data: bytes) -> ContainerResources:
    name, devices = "", []
    for number, wire_type, value in _fields(data):
        if wire_type == _LENGTH_DELIMITED and isinstance(value, bytes):
            if number == 1:
                name = _text(value)
            elif number == 2:
                devices.append(_decode_container_devices(value))
    return ContainerResources(name=name, devices=tuple(devices))


def _decode_pod(data: bytes) -> PodResources:
    name = namespace = ""
    containers = []
    for number, wire_type, value in _fields(data):
        if wire_type == _LENGTH_DELIMITED and isinstance(value, bytes):
            if number == 1:
                name = _text(value)
            elif number == 2:
                namespace = _text(value)
            elif number == 3:
                containers.append(_decode_container(value))
    return PodResources(name=name, namespace=namespace, containers=tuple(containers))


def decode_list_response(data: bytes) -> tuple[PodResources, ...]:
    """Decodes a v1 ListPodResourcesResponse. Raises PodResourcesError on malformed input."""
    try:
        return tuple(_decode_pod(pod) for pod in _nested(_fields(data), 1))
    except _DecodeError as exc:
        raise PodResourcesError(
            f"the kubelet's PodResources answer could not be decoded ({exc})"
        ) from exc


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def encode_list_response(pods: Sequence[PodResources]) -> bytes:
    """Encodes a v1 ListPodResourcesResponse (what a kubelet sends; tests serve it)."""
    out = bytearray()
    for pod in pods:
        body = _field(1, pod.name.encode()) + _field(2, pod.namespace.encode())
        for container in pod.containers:
            inner = _field(1, container.name.encode())
            for devices in container.devices:
                entry = _field(1, devices.resource_name.encode())
                for device_id in devices.device_ids:
                    entry += _field(2, device_id.encode())
                inner += _field(2, entry)
            body += _field(3, inner)
        out += _field(1, body)
    return bytes(out)


# -- the call -------------------------------------------------------------------------------------


def _describe_rpc_error(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return None, str(exc)


def _empty_request(_request: None) -> bytes:
    return b""  # ListPodResourcesRequest has no fields


def _raw(data: bytes) -> bytes:
    return data


def list_pod_resources(socket: Path = DEFAULT_SOCKET) -> tuple[PodResources, ...]:
    """Every pod the kubelet lists, with its containers' devices. Blocks.

    Raises PodResourcesUnavailableError when the socket is not mounted or the kubelet does not
    answer, PodResourcesError for any other failure; grpc's exceptions do not leave.
    """
    if not socket.exists():
        raise PodResourcesUnavailableError(
            f"the kubelet's PodResources socket {socket} is not there; mount the node's "
            "/var/lib/kubelet/pod-resources into the worker pod to learn its cards from the kubelet"
        )
    options = [("grpc.max_receive_message_length", _MAX_RESPONSE_BYTES)]
    with grpc.insecure_channel(f"unix://{socket.absolute()}", options=options) as channel:
        call: grpc.UnaryUnaryMultiCallable[None, bytes] = channel.unary_unary(
            LIST_METHOD,
            request_serializer=_empty_request,
            response_deserializer=_raw,  # decoded below, where our errors are raised
        )
        try:
            answer = call(None, timeout=_CALL_DEADLINE_S)
        except grpc.RpcError as exc:
            code, details = _describe_rpc_error(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise PodResourcesUnavailableError(
                    f"the kubelet did not answer on {socket} ({details}); check that the "
                    "kubelet runs and that the socket is the node's own, mounted read-only"
                ) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise PodResourcesError(
                    f"the kubelet on {socket} does not offer PodResources v1 List ({details}); "
                    "it needs Kubernetes 1.20 or later"
                ) from None
            name = code.name if code else "an error"
            raise PodResourcesError(
                f"the kubelet on {socket} answered List with {name} ({details})"
            ) from None
    return decode_list_response(answer)


async def fetch_pod_resources(socket: Path = DEFAULT_SOCKET) -> tuple[PodResources, ...]:
    """`list_pod_resources` for trio code: runs in a thread, abandoned if the caller cancels."""
    return await trio.to_thread.run_sync(list_pod_resources, socket, abandon_on_cancel=True)


def pod_devices(
    pods: Sequence[PodResources], *, pod_name: str, namespace: str, resource: str = GPU_RESOURCE
) -> tuple[str, ...] | None:
    """The ids of `resource` devices given to any container of the named pod, in order.

    None when the kubelet does not list that pod at all (a wrong POD_NAME / POD_NAMESPACE).
    """
    for pod in pods:
        if pod.name == pod_name and pod.namespace == namespace:
            ids: list[str] = []
            for container in pod.containers:
                for devices in container.devices:
                    if devices.resource_name == resource:
                        ids.extend(i for i in devices.device_ids if i not in ids)
            return tuple(ids)
    return None
