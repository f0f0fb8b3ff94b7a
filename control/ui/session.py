"""The dashboard's session: a token in a cookie, and the checks a cookie needs that a bearer
header does not.

A browser sends its cookies by itself, so a request carrying one may have been made by another
site's page. The token a user signs in with is kept in a `__Host-` cookie (HttpOnly: no script
reads it; Secure; SameSite=Strict: no other site's request carries it; Path=/ and no Domain),
never in a URL, the page or local storage. On top of SameSite, every state-changing request
authenticated by the cookie must carry a CSRF header whose value only a page of ours knows (a
keyed hash of the token, put in the page's `<meta>`), and an Origin, when the browser sends
one, naming this host. A cookie is taken only for the API and the dashboard: never for a
task's endpoint (a container's page would run with the user's session on our origin), a
CONNECT, or a worker's routes.

Everything here is pure: headers in, a token or a reason out.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import urllib.parse
from collections.abc import Mapping

COOKIE = "__Host-levers9-session"
CSRF_HEADER = "x-levers9-csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_COOKIE_VALUE = re.compile(r"[!#-+\--:<-\[\]-~]{1,512}")
"""RFC 6265's cookie-octet: what a token must be made of to travel in a cookie unquoted."""
_ENDPOINT = re.compile(r"^/v1/tasks/[^/]+/ports/")


def cookie_safe(token: str) -> bool:
    """Whether the token can be kept in the session cookie as it is."""
    return _COOKIE_VALUE.fullmatch(token) is not None


def session_cookie(token: str) -> str:
    """The Set-Cookie value that signs a browser in (for the browser's session only)."""
    return f"{COOKIE}={token}; Path=/; Secure; HttpOnly; SameSite=Strict"


def cleared_cookie() -> str:
    """The Set-Cookie value that signs it out."""
    return f"{COOKIE}=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0"


def cookie_token(headers: Mapping[str, str]) -> str | None:
    """The session token of the request's cookie header, if it has one."""
    for crumb in headers.get("cookie", "").split(";"):
        name, _, value = crumb.strip().partition("=")
        if name == COOKIE and value:
            return value
    return None


def csrf_token(token: str) -> str:
    """What the page sends back on state-changing requests: a keyed hash of the session token,
    which tells nothing of the token and which another site cannot compute."""
    return hmac.new(b"levers9 dashboard csrf", token.encode(), hashlib.sha256).hexdigest()


def cookie_allowed(method: str, path: str) -> bool:
    """Whether a request may be authenticated by the session cookie at all."""
    if method == "CONNECT":
        return False
    if path.startswith("/v1/"):
        return _ENDPOINT.match(path) is None and not path.startswith("/v1/workers/")
    return path == "/metrics" or (path.startswith("/ui/") and path != "/ui/signin")


def same_origin(headers: Mapping[str, str]) -> bool:
    """Whether a state-changing request came from one of our own pages: the browser's
    Sec-Fetch-Site when it sends one, else its Origin naming this host; a client that sends
    neither is not a browser (it has no cookie to be tricked with)."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = headers.get("origin")
    if origin is None:
        return True
    try:
        host = urllib.parse.urlsplit(origin).netloc
    except ValueError:
        return False
    return host == headers.get(":authority", headers.get("host", ""))


def csrf_refusal(headers: Mapping[str, str], token: str) -> str | None:
    """Why a cookie-authenticated request may not change anything, or None when it may."""
    method = headers.get(":method", "")
    if method in SAFE_METHODS:
        return None
    if not same_origin(headers):
        return "this request came from another site's page; use the dashboard itself"
    given = headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(given.encode(), csrf_token(token).encode()):
        return (
            f"missing or wrong {CSRF_HEADER} header; reload the dashboard, or call the API "
            "with an Authorization: Bearer header instead of the session cookie"
        )
    return None
