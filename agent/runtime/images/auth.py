"""Registry authentication: credentials, `WWW-Authenticate` challenges parsed as RFC 7235
writes them, and the token answers of Docker's token protocol (basic or bearer).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence

import attrs

MAX_TOKEN_BYTES = 1 << 20
# A token is refreshed this long before the registry would refuse it.
TOKEN_MARGIN_S = 10.0


@attrs.frozen
class RegistryCredentials:
    """Credentials for one pull; the password never shows in a repr."""

    username: str = ""
    password: str = attrs.field(default="", repr=False)


@attrs.frozen
class Challenge:
    """One `WWW-Authenticate` challenge: `scheme` lowercased, parameter names lowercased."""

    scheme: str
    params: Mapping[str, str]


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_CHALLENGE_PART_RE = re.compile(
    rf"\s*,?\s*(?:(?P<key>{_TOKEN})\s*=\s*(?:\"(?P<quoted>(?:[^\"\\]|\\.)*)\"|(?P<bare>[^,\s]*))"
    rf"|(?P<scheme>{_TOKEN}))"
)


def parse_challenges(values: Sequence[str]) -> list[Challenge]:
    """Parse `WWW-Authenticate` values into challenges (several may share one header)."""
    challenges: list[Challenge] = []
    for value in values:
        scheme: str | None = None
        params: dict[str, str] = {}
        position = 0
        while position < len(value):
            match = _CHALLENGE_PART_RE.match(value, position)
            if match is None or match.end() == position:
                break
            position = match.end()
            if match["scheme"] is not None:
                if scheme is not None:
                    challenges.append(Challenge(scheme, params))
                scheme, params = match["scheme"].lower(), {}
            elif scheme is not None:
                quoted = match["quoted"]
                raw = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else match["bare"]
                params[match["key"].lower()] = raw
        if scheme is not None:
            challenges.append(Challenge(scheme, params))
    return challenges


def basic_authorization(credentials: RegistryCredentials) -> str:
    raw = f"{credentials.username}:{credentials.password}".encode()
    return f"Basic {base64.b64encode(raw).decode('ascii')}"


def parse_token(body: bytes) -> tuple[str | None, float]:
    """`token` (or OAuth2's `access_token`) and its lifetime; 60 s when not given, as the
    token spec says."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, 0.0
    if not isinstance(data, dict):
        return None, 0.0
    token = data.get("token") or data.get("access_token")
    expires_in = data.get("expires_in")
    if not isinstance(expires_in, int | float) or isinstance(expires_in, bool) or expires_in < 60:
        expires_in = 60
    return (token if isinstance(token, str) and token else None), float(expires_in)
