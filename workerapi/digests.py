"""Object digests as the API names them (`sha256:<hex>`), and the errors about them."""

from __future__ import annotations

import re

import attrs

from wire.errors import ApiError, ErrorCode

DIGEST_PREFIX = "sha256:"
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def parse_digest(text: str, *, field: str = "digest") -> str:
    """`sha256:<64 lowercase hex>` as given, or INVALID_ARGUMENT naming `field`."""
    if not isinstance(text, str) or not _DIGEST_RE.fullmatch(text):
        shown = text[:80] if isinstance(text, str) else type(text).__name__
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"{field} must be 'sha256:' followed by 64 lowercase hex digits, not {shown!r}",
            field=field,
        )
    return text


@attrs.frozen
class StoredObject:
    digest: str
    size: int


class DigestMismatch(ApiError):
    """Content given for an object does not hash to the digest it was given under."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(
            ErrorCode.INVALID_ARGUMENT,
            f"content has digest {actual}, expected {expected}",
            field="digest",
        )
        self.expected = expected
        self.actual = actual
