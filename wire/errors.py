"""Errors on the wire, and the one cattrs converter for JSON bodies.

`ApiError` carries a stable `ErrorCode` (sorted by what the caller can do, one HTTP status
each) and a message naming the thing. `structure`/`loads` turn a structuring failure into an
INVALID_ARGUMENT that names the field, so bad input is refused at the edge.

The edge is strict, because whoever holds a token chooses every byte of a body:

- `decode_json` bounds the nesting depth before the decoder runs (a cheap pre-scan, so a
  thousand `[` are a 400, not a RecursionError) and refuses the non-finite numbers Python's
  decoder takes (`Infinity`, `NaN`, `1e999`): they are not JSON, and one stored would make
  every answer that carries it invalid JSON. `dumps` never writes one (`allow_nan=False`).
- `CONVERTER` takes each type only from its own JSON kind (`strict_hooks`): a string from a
  string, an integer from an integer (not `true`), a number from a finite number, a list
  from an array, a bool from a bool; cattrs' defaults would call `str()`, `int()` or
  `tuple()` on anything, storing `"sh -c id"` as a list of characters.
"""

from __future__ import annotations

import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import (
    homogenous_tuple_structure_factory,
    is_mapping,
    is_sequence,
    list_structure_factory,
    mapping_structure_factory,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

T = TypeVar("T")

MAX_JSON_DEPTH = 32
"""How deeply a request body's arrays and objects may nest; ours need 5."""


class ErrorCode(enum.Enum):
    """Stable error codes, sorted by what the caller can do; each maps to one HTTP status."""

    INVALID_ARGUMENT = 400
    UNAUTHENTICATED = 401
    PERMISSION_DENIED = 403
    NOT_FOUND = 404
    ALREADY_EXISTS = 409
    FAILED_PRECONDITION = 412
    RESOURCE_EXHAUSTED = 429
    INTERNAL = 500
    UNIMPLEMENTED = 501
    UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504

    @property
    def status(self) -> int:
        return self.value

    @property
    def retryable(self) -> bool:
        return self in (
            ErrorCode.UNAVAILABLE,
            ErrorCode.RESOURCE_EXHAUSTED,
            ErrorCode.DEADLINE_EXCEEDED,
        )

    @classmethod
    def from_status(cls, status: int) -> ErrorCode:
        for code in cls:
            if code.value == status:
                return code
        if 400 <= status < 500:
            return cls.INVALID_ARGUMENT
        return cls.INTERNAL


class ApiError(Exception):
    """An error the API reports to its caller: a stable code and a message naming the thing."""

    def __init__(self, code: ErrorCode, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field

    def to_body(self) -> ErrorBody:
        return ErrorBody(code=self.code.name, message=self.message, field=self.field)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def make_converter() -> cattrs.Converter:
    """One converter per wire boundary: camelCase keys, unknown keys refused, enums by value."""
    converter = cattrs.Converter(forbid_extra_keys=True)

    def unstructure_factory(cls: type[Any]) -> Callable[[Any], Any]:
        overrides = {a.name: override(rename=_camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_unstructure_fn(cls, converter, **overrides)  # type: ignore[arg-type]

    def structure_factory(cls: type[Any]) -> Callable[[Any, Any], Any]:
        overrides = {a.name: override(rename=_camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_structure_fn(
            cls,
            converter,
            _cattrs_forbid_extra_keys=True,
            **overrides,  # type: ignore[arg-type]
        )

    converter.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    converter.register_structure_hook_factory(attrs.has, structure_factory)
    return converter


class WrongKind(ValueError):
    """A value of the wrong JSON kind for its field; the message says what was expected."""


def describe(type_: Any) -> str:
    """What a field of `type_` takes, in a JSON user's words ("a list of strings")."""
    if type_ is str:
        return "a string"
    if type_ is bool:
        return "true or false"
    if type_ is int:
        return "an integer"
    if type_ is float:
        return "a number"
    if isinstance(type_, type) and issubclass(type_, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in type_)
    args = typing.get_args(type_)
    origin = typing.get_origin(type_)
    if origin in (typing.Union, types.UnionType):
        kinds = [describe(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or null" if type(None) in args else "")
    if is_sequence(type_) and args:
        return "a list of " + _plural(describe(args[0]))
    if is_mapping(type_) and len(args) == 2:
        return "an object of " + _plural(describe(args[1]))
    return "an object"


def _plural(kind: str) -> str:
    for article in ("a ", "an "):
        if kind.startswith(article) and " " not in kind[len(article) :]:
            return kind[len(article) :] + "s"
    return kind


def kind_of(value: Any) -> str:
    """The JSON kind of a decoded value, as a refusal names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _wrong(value: Any, type_: Any) -> WrongKind:
    return WrongKind(f"expected {describe(type_)}, not {kind_of(value)}")


def _strict_str(value: Any, type_: type[str]) -> str:
    if not isinstance(value, str):
        raise _wrong(value, type_)
    # A str subclass here is an enum (StrEnum): structured by value, as cattrs does.
    return value if type_ is str else type_(value)


def _strict_int(value: Any, type_: type[int]) -> int:
    if type(value) is not int:
        raise _wrong(value, type_)
    return value if type_ is int else type_(value)


def _strict_float(value: Any, type_: type[float]) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _wrong(value, type_)
    return float(value)


def _strict_bool(value: Any, type_: type[bool]) -> bool:
    if not isinstance(value, bool):
        raise _wrong(value, type_)
    return value


def strict_hooks(converter: cattrs.Converter) -> cattrs.Converter:
    """Make `converter` take each type only from its own JSON kind (see the module's doc)."""
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(bool, _strict_bool)

    def sequence_factory(type_: Any) -> Callable[[Any, Any], Any]:
        origin = typing.get_origin(type_) or type_
        if origin is tuple:
            base = homogenous_tuple_structure_factory(type_, converter)
        else:
            base = list_structure_factory(type_, converter)

        def structure_sequence(value: Any, t: Any) -> Any:
            if not isinstance(value, list | tuple):
                raise _wrong(value, type_)
            return base(value, t)

        return structure_sequence

    def mapping_factory(type_: Any) -> Callable[[Any, Any], Any]:
        base = mapping_structure_factory(type_, converter)

        def structure_mapping(value: Any, t: Any) -> Any:
            if not isinstance(value, Mapping):
                raise _wrong(value, type_)
            return base(value, t)

        return structure_mapping

    def is_homogeneous_sequence(type_: Any) -> bool:
        args = typing.get_args(type_)
        if typing.get_origin(type_) is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return False  # a fixed-shape tuple: cattrs' own hook
        return is_sequence(type_)

    converter.register_structure_hook_factory(is_homogeneous_sequence, sequence_factory)
    converter.register_structure_hook_factory(is_mapping, mapping_factory)

    def object_factory(type_: Any) -> Callable[[Any, Any], Any]:
        overrides = {a.name: override(rename=_camel(a.name)) for a in attrs.fields(type_)}
        base = make_dict_structure_fn(
            type_,
            converter,
            _cattrs_forbid_extra_keys=True,
            **overrides,  # type: ignore[arg-type]
        )

        def structure_object(value: Any, t: Any) -> Any:
            if not isinstance(value, Mapping):
                raise _wrong(value, type_)
            return base(value, t)

        return structure_object

    converter.register_structure_hook_factory(attrs.has, object_factory)
    return converter


CONVERTER = strict_hooks(make_converter())
"""The wire's converter: the controlplane's API and the worker API, both directions."""


def _problem(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, WrongKind):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def structure(data: Any, cls: type[T]) -> T:
    """Structure wire data into `cls`; failures become INVALID_ARGUMENT naming the field."""
    try:
        return CONVERTER.structure(data, cls)
    except Exception as exc:
        problems = cattrs.transform_error(exc, path="body", format_exception=_problem)
        first = problems[0] if problems else f"body is invalid ({exc})"
        what, _, where = first.partition(" @ ")
        field = camel_path(where.removeprefix("body").lstrip(".")) if where else ""
        if field:
            message = f"field {field!r}: {what}"
        else:
            message = f"body: {what}"
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more problem(s))"
        raise ApiError(ErrorCode.INVALID_ARGUMENT, message, field=field or None) from None


def camel_path(path: str) -> str:
    return ".".join(_camel(part) for part in path.split("."))


def unstructure(value: Any) -> Any:
    return CONVERTER.unstructure(value)


def dumps(value: Any) -> bytes:
    """Serialise an attrs model (or plain data) to compact JSON bytes. A non-finite number
    is a ValueError, never the invalid JSON `Infinity`: a caller that may hold one from
    before the edge refused them maps it first (`control.tasks.store` reads it as absent)."""
    return json.dumps(unstructure(value), separators=(",", ":"), allow_nan=False).encode()


class NonFinite:
    """Where a body had `Infinity`, `-Infinity`, `NaN` or a number too large for a float:
    kept by `decode_json` as this marker so the refusal can name the field it was in."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body`'s arrays and objects nest deeper than `max_depth`. Pure and cheap: the
    strings are cut out and only the brackets kept (both at C speed), then innermost pairs
    are removed a level at a round; what still holds a pair after `max_depth` rounds is
    deeper. Malformed JSON is left for the decoder to refuse."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if re.search(rb"[\[{]{%d}" % (max_depth + 1), brackets):
        return True  # that many opened in a row, closed or not
    for _ in range(max_depth):
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == brackets:
            return False
        brackets = shorter
    return b"[]" in brackets or b"{}" in brackets


def _finite_float(text: str) -> float | NonFinite:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(text)


def decode_json(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A request body as plain data, or INVALID_ARGUMENT: nested deeper than `max_depth`,
    not JSON, or (without the field: see `loads`) holding a non-finite number."""
    if too_deep(body, max_depth):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"body nests arrays and objects deeper than {max_depth} levels",
        )
    found: list[NonFinite] = []

    def constant(text: str) -> NonFinite:
        found.append(NonFinite(text))
        return found[-1]

    def number(text: str) -> float | NonFinite:
        value = _finite_float(text)
        if isinstance(value, NonFinite):
            found.append(value)
        return value

    try:
        data = json.loads(body, parse_constant=constant, parse_float=number)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"body is not valid JSON ({exc})") from None
    if found:
        where = _path_of(data, found[0], "")
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            (f"field {where!r}: " if where else "body: ")
            + f"{found[0].text} is not a number JSON allows; give a finite number",
            field=where or None,
        )
    return data


def _path_of(data: Any, target: object, path: str) -> str:
    """The dotted path (`volumes[0].mountPath`) of `target` in decoded JSON, '' if absent."""
    if data is target:
        return path or "body"
    if isinstance(data, dict):
        for key, value in data.items():
            found = _path_of(value, target, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = _path_of(value, target, f"{path}[{i}]")
            if found:
                return found
    return ""


def loads(body: bytes, cls: type[T]) -> T:
    """Parse JSON bytes into `cls`; malformed JSON and bad fields are INVALID_ARGUMENT."""
    return structure(decode_json(body) if body else {}, cls)


@attrs.frozen
class ErrorBody:
    code: str
    message: str
    field: str | None = None


def exception_leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(exception_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
