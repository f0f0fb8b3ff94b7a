"""The fake cloud's OAuth 2.0 token endpoint: a service-account key that the stand-in `gcloud`
made is exchanged here for an access token, as at https://oauth2.googleapis.com/token.

A GKE pool's controlplane signs a JWT with its key (google-auth's service-account flow, an
RS256 `jwt-bearer` grant) and posts it to the key's `token_uri`. The stand-in keeps only each
key's public half, as Google does, so this endpoint checks what Google checks: the signature
with the key the JWT names (`kid`), that the key is still listed for its service account
(`iss`), the audience (Google's endpoint, which google-auth always names, or this one) and
the expiry. It answers with a fresh access token and
hands it to `grant(service_account_email, token)`: a test gives it to the Kubernetes API
stand-in that plays the GKE cluster, so the cluster accepts exactly the tokens Google would
have issued for a live key. Keys point here when the state's `gcp.tokenUri` names this endpoint
before they are made (`running_token_endpoint` sets it).

It is plain HTTP on loopback: google-auth posts to any `token_uri` it is given.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sim.cloud.standin import GOOGLE_TOKEN_URI, read_state, write_state

JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
TOKEN_LIFETIME_S = 3600
CLOCK_SKEW_S = 60

Grant = Callable[[str, str], None]


class GrantRefused(Exception):
    """The assertion is not one Google would take; the message is Google's error_description."""

    def __init__(self, description: str, error: str = "invalid_grant") -> None:
        super().__init__(description)
        self.error = error


def _b64url(part: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (binascii.Error, ValueError):
        raise GrantRefused("Invalid JWT: not base64url") from None


def check_assertion(assertion: str, state: dict[str, Any], audience: str, now: float) -> str:
    """The service account whose live key signed `assertion` for `audience`, or GrantRefused
    saying why not."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    parts = assertion.split(".")
    if len(parts) != 3:
        raise GrantRefused("Invalid JWT: not three dot-separated parts")
    try:
        header = json.loads(_b64url(parts[0]))
        claims = json.loads(_b64url(parts[1]))
    except ValueError:
        raise GrantRefused("Invalid JWT: not JSON") from None
    if header.get("alg") != "RS256":
        raise GrantRefused(f"Invalid JWT: alg {header.get('alg')!r} is not RS256")
    email = claims.get("iss")
    account = state["gcp"]["serviceAccounts"].get(email)
    if account is None:
        raise GrantRefused("Invalid grant: account not found")
    key = next((k for k in account["keys"] if k["id"] == header.get("kid")), None)
    if key is None or "publicKey" not in key:
        raise GrantRefused("Invalid JWT Signature.")
    public = serialization.load_pem_public_key(key["publicKey"].encode())
    assert isinstance(public, rsa.RSAPublicKey)
    try:
        public.verify(
            _b64url(parts[2]),
            f"{parts[0]}.{parts[1]}".encode(),
            padding.PKCS1v15(),
            hashes.SHA256(),
        )
    except InvalidSignature:
        raise GrantRefused("Invalid JWT Signature.") from None
    # google-auth signs for Google's endpoint whatever the key's token_uri says.
    if claims.get("aud") not in (audience, GOOGLE_TOKEN_URI):
        raise GrantRefused(f"Invalid JWT: audience {claims.get('aud')!r} is not {audience!r}")
    expiry, issued = claims.get("exp"), claims.get("iat")
    if not isinstance(expiry, int | float) or not isinstance(issued, int | float):
        raise GrantRefused("Invalid JWT: exp and iat are required")
    if expiry < now - CLOCK_SKEW_S or issued > now + CLOCK_SKEW_S or expiry - issued > 3600:
        raise GrantRefused(
            "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable "
            "timeframe. Check your iat and exp values in the JWT claim."
        )
    if not claims.get("scope"):
        raise GrantRefused("Invalid OAuth scope or ID token audience provided.", "invalid_scope")
    return str(email)


class _Handler(BaseHTTPRequestHandler):
    server: _TokenServer

    def log_message(self, format: str, *args: Any) -> None:
        return  # quiet: a test reads the answers, not a log on stderr

    def _answer(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if urllib.parse.urlsplit(self.path).path != "/token":
            self._answer(HTTPStatus.NOT_FOUND, {"error": "not_found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        form = urllib.parse.parse_qs(self.rfile.read(length).decode())
        grant_type = form.get("grant_type", [""])[0]
        if grant_type != JWT_BEARER:
            self._answer(
                HTTPStatus.BAD_REQUEST,
                {"error": "unsupported_grant_type", "error_description": grant_type},
            )
            return
        try:
            email = check_assertion(
                form.get("assertion", [""])[0],
                read_state(self.server.state_dir),
                self.server.uri,
                time.time(),
            )
        except GrantRefused as exc:
            self._answer(
                HTTPStatus.BAD_REQUEST, {"error": exc.error, "error_description": str(exc)}
            )
            return
        token = "ya29.standin-" + secrets.token_urlsafe(32)
        self.server.grant(email, token)
        self._answer(
            HTTPStatus.OK,
            {"access_token": token, "expires_in": TOKEN_LIFETIME_S, "token_type": "Bearer"},
        )


class _TokenServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state_dir: Path, grant: Grant) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state_dir = state_dir
        self.grant = grant
        self.uri = f"http://127.0.0.1:{self.server_address[1]}/token"


@contextmanager
def running_token_endpoint(state_dir: Path, grant: Grant) -> Iterator[str]:
    """Serve the token endpoint for the fake cloud in `state_dir` until the block ends; sets
    the state's `gcp.tokenUri`, so keys made from now on name it. Yields its URI."""
    server = _TokenServer(state_dir, grant)
    state = read_state(state_dir)
    state["gcp"]["tokenUri"] = server.uri
    write_state(state_dir, state)
    thread = threading.Thread(target=server.serve_forever, name="oauth-standin", daemon=True)
    thread.start()
    try:
        yield server.uri
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
