"""Request bodies in the apiserver's protobuf encoding, decoded for the few kinds clients send so.

client-go's typed clients may send built-in kinds as `application/vnd.kubernetes.protobuf`
(Helm's do, for the Secrets its releases are stored in, and for the DeleteOptions that delete
them); an apiserver decodes them, so the stand-in must. The encoding is a 4-byte magic
(`k8s\\0`) and a `runtime.Unknown` message: the TypeMeta (apiVersion, kind) and the object's
own message as raw bytes.

Design choices:
- A hand-written reader of the protobuf wire format and, per kind, a table of field numbers
  (from `k8s.io/api`'s generated.proto) to JSON names and value shapes; no generated code, no
  protobuf dependency. Only Secret, ConfigMap and DeleteOptions (with ObjectMeta, OwnerReference
  and Time) are tabled: any other kind is `Unsupported`, which the server answers with 415.
- Go's generated marshallers write every non-pointer field, empty or not; the decoded object
  leaves out empty strings, zero numbers, false, empty maps and the zero Time, as JSON's
  `omitempty` would.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sim.kubeapi.model import Obj

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
_MAGIC = b"k8s\x00"
_ZERO_TIME_S = -62135596800
"""Go's zero `time.Time` in Unix seconds (0001-01-01), which an unset timestamp is sent as."""


class Unsupported(Exception):
    """A body that is not protobuf the stand-in can decode (its message says what)."""


_Field = tuple[str, str]
"""(JSON name, shape): string, bytes, int, bool, time, map, bytesmap, strings, or a message
name from `_MESSAGES`; a message or `strings` shape is a list when prefixed with `*`."""

_MESSAGES: Mapping[str, Mapping[int, _Field]] = {
    "Unknown": {1: ("typeMeta", "TypeMeta"), 2: ("raw", "bytes")},
    "TypeMeta": {1: ("apiVersion", "string"), 2: ("kind", "string")},
    "ObjectMeta": {
        1: ("name", "string"),
        2: ("generateName", "string"),
        3: ("namespace", "string"),
        5: ("uid", "string"),
        6: ("resourceVersion", "string"),
        7: ("generation", "int"),
        8: ("creationTimestamp", "time"),
        9: ("deletionTimestamp", "time"),
        10: ("deletionGracePeriodSeconds", "int"),
        11: ("labels", "map"),
        12: ("annotations", "map"),
        13: ("ownerReferences", "*OwnerReference"),
        14: ("finalizers", "strings"),
    },
    "OwnerReference": {
        1: ("kind", "string"),
        3: ("name", "string"),
        4: ("uid", "string"),
        5: ("apiVersion", "string"),
        6: ("controller", "bool"),
        7: ("blockOwnerDeletion", "bool"),
    },
    "Time": {1: ("seconds", "int"), 2: ("nanos", "int")},
    "Secret": {
        1: ("metadata", "ObjectMeta"),
        2: ("data", "bytesmap"),
        3: ("type", "string"),
        4: ("stringData", "map"),
        5: ("immutable", "bool"),
    },
    "ConfigMap": {
        1: ("metadata", "ObjectMeta"),
        2: ("data", "map"),
        3: ("binaryData", "bytesmap"),
        4: ("immutable", "bool"),
    },
    "DeleteOptions": {
        1: ("gracePeriodSeconds", "int"),
        2: ("preconditions", "Preconditions"),
        3: ("orphanDependents", "bool"),
        4: ("propagationPolicy", "string"),
        5: ("dryRun", "strings"),
    },
    "Preconditions": {1: ("uid", "string"), 2: ("resourceVersion", "string")},
    "MapEntry": {1: ("key", "string"), 2: ("value", "bytes")},
}
_KINDS = frozenset({"Secret", "ConfigMap", "DeleteOptions"})


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise Unsupported("the protobuf body ends inside a number")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one message: an int for a varint or fixed field,
    bytes for a length-delimited one."""
    fields: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            fields.append((number, value))
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise Unsupported("the protobuf body ends inside a field")
            fields.append((number, data[pos : pos + size]))
            pos += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            fields.append((number, int.from_bytes(data[pos : pos + width], "little")))
            pos += width
        else:
            raise Unsupported(f"protobuf wire type {wire} is not decoded")
    return fields


def _signed(value: int) -> int:
    """A varint read as Go's int64 (negative numbers take ten bytes, two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _time(raw: bytes) -> str | None:
    parts = _message("Time", raw)
    seconds = int(parts.get("seconds", 0))
    if seconds == _ZERO_TIME_S or not parts:
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _value(shape: str, value: int | bytes) -> Any:
    if shape == "int":
        return _signed(value) if isinstance(value, int) else 0
    if shape == "bool":
        return bool(value)
    if not isinstance(value, bytes):
        raise Unsupported(f"a {shape} field holds a number")
    if shape == "bytes":
        return value
    if shape in ("string", "strings", "*string"):
        return value.decode()
    if shape == "time":
        return _time(value)
    return _message(shape.lstrip("*"), value)


def _message(name: str, data: bytes) -> Obj:
    table = _MESSAGES[name]
    obj: Obj = {}
    for number, raw in _fields(data):
        if number not in table:
            continue
        key, shape = table[number]
        if shape in ("map", "bytesmap"):
            if not isinstance(raw, bytes):
                raise Unsupported(f"{key} holds a number")
            entry = _message("MapEntry", raw)
            value: bytes = entry.get("value", b"")
            decoded = base64.b64encode(value).decode() if shape == "bytesmap" else value.decode()
            obj.setdefault(key, {})[str(entry.get("key", ""))] = decoded
        elif shape.startswith("*") or shape == "strings":
            obj.setdefault(key, []).append(_value(shape, raw))
        else:
            obj[key] = _value(shape, raw)
    return {k: v for k, v in obj.items() if v not in ("", 0, False, None, {}, [])}


def decode(body: bytes) -> Obj:
    """The JSON-shaped object a protobuf request body holds; `Unsupported` when it is not one
    (no magic) or its kind is not one the stand-in decodes."""
    if not body.startswith(_MAGIC):
        raise Unsupported("the body does not start with the protobuf magic k8s\\0")
    envelope = _message("Unknown", body[len(_MAGIC) :])
    type_meta = envelope.get("typeMeta") or {}
    kind = str(type_meta.get("kind") or "")
    if kind not in _KINDS:
        raise Unsupported(f"the stand-in decodes no {kind or 'untyped'} object from protobuf")
    obj = _message(kind, envelope.get("raw", b""))
    if kind in ("Secret", "ConfigMap"):
        obj.setdefault("metadata", {})
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}
