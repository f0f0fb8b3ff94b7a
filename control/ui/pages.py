"""The dashboard's routes: the sign-in page, the application shell, static files, errors.

The pages hold no data of their own: the shell's script reads everything through the same
`/v1/` API the CLI calls, with the session cookie in place of a bearer header, so a page can
show no more than its token may read (`control.ui.session` says which routes take the cookie).
What is rendered here is the shell (who is signed in and the session's CSRF value, in
`<meta>`), the sign-in form with its error, and the 404 page; every one, and every JSON error
under `/ui/` (`error_headers`), is served with a strict Content-Security-Policy (scripts and
styles from our own static files only, nothing inline, no framing) and not cached; the static
files are shipped in the wheel, never fetched from elsewhere. Signing in makes a session
(`control.ui.sessions`) and signing out deletes it.
"""

from __future__ import annotations

import hashlib
import html
import importlib.resources
import string
import urllib.parse
from collections.abc import Callable, Mapping

import attrs

from control.ui.session import (
    cleared_cookie,
    cookie_safe,
    cookie_session,
    csrf_token,
    same_origin,
    session_cookie,
)
from control.ui.sessions import SessionStore
from wire.errors import ApiError, ErrorCode
from wire.service import BytesResponse, Request, Router

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "same-origin"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
)
TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".html": "text/html; charset=utf-8",
}
MAX_FORM_BYTES = 8192


def error_headers(path: str) -> tuple[tuple[str, str], ...]:
    """What an error answer (JSON) carries besides its type: under `/ui/`, what the pages
    carry, so a refusal is no weaker a page than the pages; elsewhere nothing more."""
    if path == "/ui" or path.startswith("/ui/"):
        return (*SECURITY_HEADERS, ("cache-control", "no-store"))
    return ()


@attrs.frozen
class StaticFile:
    body: bytes
    content_type: str
    etag: str


def load_static() -> dict[str, StaticFile]:
    """The files under `control/ui/static`, read once: name → body, type and ETag."""
    out = {}
    root = importlib.resources.files("control.ui") / "static"
    for entry in root.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if suffix in TYPES and entry.is_file():
            body = entry.read_bytes()
            digest = hashlib.sha256(body).hexdigest()[:20]
            out[entry.name] = StaticFile(body, TYPES[suffix], f'"{digest}"')
    return out


def render(template: str, **values: str) -> bytes:
    """A page from its template, every value HTML-escaped."""
    return (
        string.Template(template)
        .substitute({k: html.escape(v, quote=True) for k, v in values.items()})
        .encode()
    )


def page(
    body: bytes, status: int = 200, headers: tuple[tuple[str, str], ...] = ()
) -> BytesResponse:
    return BytesResponse(
        body,
        TYPES[".html"],
        status=status,
        headers=(*SECURITY_HEADERS, ("cache-control", "no-store"), *headers),
    )


def redirect(location: str, headers: tuple[tuple[str, str], ...] = ()) -> BytesResponse:
    return BytesResponse(
        b"", TYPES[".html"], status=303, headers=(("location", location), *headers)
    )


def who(principal: str) -> tuple[str, str]:
    """(kind, name) of a signed-in principal: `workspace` or `operator`."""
    kind, _, name = principal.partition(":")
    return ("operator" if kind == "api" else "workspace"), name


def add_ui_routes(
    router: Router, identify: Callable[[str], str | None], sessions: SessionStore, title: str
) -> None:
    """The dashboard's routes. `identify(token)` is the API's own authentication: the
    principal a token stands for (`api:NAME` or `ws:NAME`), or None; `sessions` keeps the
    sessions signing in makes."""
    files = load_static()
    templates = {name: f.body.decode() for name, f in files.items() if name.endswith(".html")}

    def signin_page(error: str = "", status: int = 200) -> BytesResponse:
        return page(render(templates["signin.html"], title=title, error=error), status)

    def not_found_page(what: str) -> BytesResponse:
        return page(render(templates["notfound.html"], title=title, what=what), 404)

    async def shell(request: Request) -> BytesResponse:
        if not request.principal:
            return redirect("/ui/signin")
        session_id = cookie_session(request.headers)
        kind, name = who(request.principal)
        return page(
            render(
                templates["app.html"],
                title=title,
                kind=kind,
                name=name,
                csrf=csrf_token(session_id) if session_id else "",
            )
        )

    async def signin_form(request: Request) -> BytesResponse:
        return signin_page()

    async def signin(request: Request) -> BytesResponse:
        headers = {**request.headers, ":authority": request.authority}
        if not same_origin(headers):
            return signin_page("This sign-in came from another site's page.", 403)
        form = _form(await request.body(MAX_FORM_BYTES))
        token = form.get("token", "").strip()
        if not token:
            return signin_page("Paste a workspace or operator token.", 401)
        principal = identify(token) if cookie_safe(token) else None
        if principal is None or not principal.startswith(("api:", "ws:")):
            return signin_page(
                "That token is not a workspace or operator token of this controlplane. "
                "Check it with `levers9 login`, or ask your operator for one.",
                401,
            )
        previous = cookie_session(request.headers)
        if previous is not None:
            await sessions.revoke(previous)
        session_id = await sessions.create(principal)
        return redirect("/ui/", (("set-cookie", session_cookie(session_id)),))

    async def signout(request: Request) -> BytesResponse:
        # The origin was checked before any handler (`Controlplane._session_principal`);
        # checked again here so that no route table can make signing out a cross-site act.
        headers = {**request.headers, ":authority": request.authority}
        if not same_origin(headers):
            raise ApiError(
                ErrorCode.PERMISSION_DENIED,
                "this sign-out came from another site's page; use the dashboard itself",
            )
        session_id = cookie_session(request.headers)
        if session_id is not None:
            await sessions.revoke(session_id)
        return redirect("/ui/signin", (("set-cookie", cleared_cookie()),))

    async def static(request: Request) -> BytesResponse:
        name = request.params["name"]
        found = files.get(name)
        if found is None or name.endswith(".html"):
            return not_found_page(f"/ui/static/{name}")
        if request.headers.get("if-none-match") == found.etag:
            return BytesResponse(b"", found.content_type, 304, (("etag", found.etag),))
        return BytesResponse(
            found.body,
            found.content_type,
            headers=(
                *SECURITY_HEADERS,
                ("etag", found.etag),
                ("cache-control", "no-cache"),
            ),
        )

    async def unknown(request: Request) -> BytesResponse:
        return not_found_page(request.path)

    router.add("GET", "/ui", shell, public=True)
    router.add("GET", "/ui/signin", signin_form, public=True)
    router.add("POST", "/ui/signin", signin, public=True)
    router.add("POST", "/ui/signout", signout, public=True)
    router.add("GET", "/ui/static/{name}", static, public=True)
    router.add("GET", "/ui/{rest...}", unknown, public=True)

    async def favicon(request: Request) -> BytesResponse:
        icon = files["icon.svg"]
        return BytesResponse(icon.body, icon.content_type, headers=SECURITY_HEADERS)

    router.add("GET", "/favicon.ico", favicon, public=True)


def _form(body: bytes) -> Mapping[str, str]:
    try:
        return dict(urllib.parse.parse_qsl(body.decode(), max_num_fields=8))
    except (UnicodeDecodeError, ValueError):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, "the sign-in form must be URL-encoded text"
        ) from None
