"""The dashboard's session: a random id in a cookie, and the checks a cookie needs that a bearer
header does not.

Why a session id and not the token: a cookie is copied more easily than a token is typed (a
shared profile, a backup, a proxy's log), and signing out must end what was copied. So signing
in with a token makes a session of its own, a random id (`secrets.token_urlsafe(32)`) kept in
the cookie; the database (`control.ui.sessions`) holds only the id's SHA-256, who it stands
for and until when, so every replica honours it and signing out on any of them deletes it.
Neither the token nor the id is ever stored.

A browser sends its cookies by itself, so a request carrying one may have been made by another
site's page. The id is kept in a `__Host-` cookie (HttpOnly: no script reads it; Secure;
SameSite=Strict: no other site's request carries it; Path=/ and no Domain), never in a URL,
the page or local storage. On top of SameSite, every state-changing request authenticated by
the cookie must carry a CSRF header whose value only a page of ours knows: a keyed hash of the
session id (the id, 256 random bits, is the key), put in the page's `<meta>`; it differs per
session, tells nothing of the id and cannot be computed from the database. And every
state-changing request under `/ui/`, with a cookie or without (signing out is one), must come
from our own origin, scheme included. A cookie is taken only for the API and the dashboard:
never for a task's endpoint (a container's page would run with the user's session on our
origin), a CONNECT, or a worker's routes; an endpoint's request loses our cookie and its
response may not set it (`without_session_cookie`, `sets_session_cookie`).

Everything here is pure: headers in, a session id or a reason out.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import urllib.parse
from collections.abc import Mapping

import attrs

COOKIE = "__Host-levers9-session"
CSRF_HEADER = "x-levers9-csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_COOKIE_VALUE = re.compile(r"[!#-+\--:<-\[\]-~]{1,512}")
"""RFC 6265's cookie-octet: what a value must be made of to travel in a cookie unquoted."""
_ENDPOINT = re.compile(r"^/v1/tasks/[^/]+/ports/")
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")
"""What `new_session_id` makes: 32 bytes, URL-safe base64 without padding."""
TOUCH_EVERY_MAX_S = 60.0
"""A session's `last seen` is written at most this often (and at most every tenth of the idle
limit): a write per dashboard request would cost the database more than the idle limit gains."""


def cookie_safe(token: str) -> bool:
    """Whether the token can be pasted in the sign-in form as it is."""
    return _COOKIE_VALUE.fullmatch(token) is not None


def new_session_id() -> str:
    return secrets.token_urlsafe(32)


def session_hash(session_id: str) -> str:
    """What the database keeps of a session id."""
    return hashlib.sha256(session_id.encode()).hexdigest()


def session_cookie(session_id: str) -> str:
    """The Set-Cookie value that signs a browser in (for the browser's session only; the
    server ends it sooner, `SessionLimits`)."""
    return f"{COOKIE}={session_id}; Path=/; Secure; HttpOnly; SameSite=Strict"


def cleared_cookie() -> str:
    """The Set-Cookie value that signs it out."""
    return f"{COOKIE}=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0"


def cookie_session(headers: Mapping[str, str]) -> str | None:
    """The session id of the request's cookie header, if it has one of the shape we make."""
    for crumb in headers.get("cookie", "").split(";"):
        name, _, value = crumb.strip().partition("=")
        if name == COOKIE and _SESSION_ID.fullmatch(value):
            return value
    return None


def csrf_token(session_id: str) -> str:
    """What the page sends back on state-changing requests: HMAC-SHA256 keyed with the session
    id, so one per session, which another site (or a reader of the database) cannot compute."""
    return hmac.new(session_id.encode(), b"levers9 dashboard csrf", hashlib.sha256).hexdigest()


def cookie_allowed(method: str, path: str) -> bool:
    """Whether a request may be authenticated by the session cookie at all."""
    if method == "CONNECT":
        return False
    if path.startswith("/v1/"):
        return _ENDPOINT.match(path) is None and not path.startswith("/v1/workers/")
    return path == "/metrics" or (path.startswith("/ui/") and path != "/ui/signin")


def same_origin(headers: Mapping[str, str]) -> bool:
    """Whether a state-changing request came from one of our own pages: the browser's
    Sec-Fetch-Site, when it sends one, must say same-origin, and its Origin, when it sends one,
    must name this scheme and host (`https://` where `:scheme` is not given: the public
    endpoint speaks TLS only); a client that sends neither is not a browser (it has no cookie
    to be tricked with)."""
    site = headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        return False
    origin = headers.get("origin")
    if origin is None:
        return True
    try:
        parts = urllib.parse.urlsplit(origin)
    except ValueError:
        return False
    scheme = headers.get(":scheme", "https")
    authority = headers.get(":authority", headers.get("host", ""))
    return (
        bool(authority)
        and parts.scheme.lower() == scheme.lower()
        and parts.netloc.lower() == authority.lower()
        and parts.path in ("", "/")
    )


def origin_refusal(headers: Mapping[str, str]) -> str | None:
    """Why a state-changing request may not go on, whatever authenticates it, or None."""
    if headers.get(":method", "") in SAFE_METHODS or same_origin(headers):
        return None
    return "this request came from another site's page; use the dashboard itself"


def csrf_refusal(headers: Mapping[str, str], session_id: str) -> str | None:
    """Why a cookie-authenticated request may not change anything, or None when it may."""
    if headers.get(":method", "") in SAFE_METHODS:
        return None
    refused = origin_refusal(headers)
    if refused is not None:
        return refused
    given = headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(given.encode(), csrf_token(session_id).encode()):
        return (
            f"missing or wrong {CSRF_HEADER} header; reload the dashboard, or call the API "
            "with an Authorization: Bearer header instead of the session cookie"
        )
    return None


# -- lifetimes -------------------------------------------------------------------------------


@attrs.frozen
class SessionLimits:
    """`max_s`: how long a session lasts from sign-in, used or not; `idle_s`: how long it
    lasts unused."""

    max_s: float
    idle_s: float


@attrs.frozen
class SessionRow:
    """One session as stored (its id's hash is the key)."""

    principal: str
    created_at: float
    last_seen_at: float
    expires_at: float


def session_live(row: SessionRow, now: float, limits: SessionLimits) -> bool:
    """Whether a stored session still signs its browser in."""
    return now < row.expires_at and now < row.last_seen_at + limits.idle_s


def touch_due(row: SessionRow, now: float, limits: SessionLimits) -> bool:
    """Whether a request now should write the session's `last seen`."""
    return now - row.last_seen_at >= min(TOUCH_EVERY_MAX_S, limits.idle_s / 10)


# -- endpoints -------------------------------------------------------------------------------


def without_session_cookie(cookie_header: str) -> str:
    """The request's cookie header for a task's endpoint: every cookie but our session's (an
    app served through the endpoint keeps its own cookies; ours is the user's session and the
    task's code must never see it). Empty when nothing is left."""
    kept = [
        crumb.strip()
        for crumb in cookie_header.split(";")
        if crumb.strip() and crumb.strip().partition("=")[0].strip() != COOKIE
    ]
    return "; ".join(kept)


def sets_session_cookie(set_cookie: str) -> bool:
    """Whether an endpoint's Set-Cookie would set (or clear, or shadow) our session cookie:
    the same name, compared without case (browsers match the `__Host-` prefix so)."""
    name = set_cookie.partition(";")[0].partition("=")[0].strip()
    return name.lower() == COOKIE.lower()
