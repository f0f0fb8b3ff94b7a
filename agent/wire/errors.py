"""Errors on the wire, and the one cattrs converter for JSON bodies.

`ApiError` carries a stable `ErrorCode` (sorted by what the caller can do, one HTTP status
each) and a message naming the thing. `structure`/`loads` turn a structuring failure into an
INVALID_ARGUMENT that names the field, so bad input is refused at the edge.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

T = TypeVar("T")


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


CONVERTER = make_converter()


def structure(data: Any, cls: type[T]) -> T:
    """Structure wire data into `cls`; failures become INVALID_ARGUMENT naming the field."""
    try:
        return CONVERTER.structure(data, cls)
    except Exception as exc:
        problems = cattrs.transform_error(exc, path="body")
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
    """Serialise an attrs model (or plain data) to compact JSON bytes."""
    return json.dumps(unstructure(value), separators=(",", ":")).encode()


def loads(body: bytes, cls: type[T]) -> T:
    """Parse JSON bytes into `cls`; malformed JSON and bad fields are INVALID_ARGUMENT."""
    try:
        data = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(ErrorCode.INVALID_ARGUMENT, f"body is not valid JSON ({exc})") from None
    return structure(data, cls)


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
