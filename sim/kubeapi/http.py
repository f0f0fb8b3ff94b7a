"""The stand-in's HTTPS server: discovery documents, routing of REST paths to the store,
list responses, watch streams, and `python -m sim.kubeapi` for a benchmark or a kubectl
session.

A watch is one chunked response of JSON lines on the connection's own thread (the server is a
`ThreadingHTTPServer`), which sleeps on the store's condition between changes: an open watch
costs one idle thread and holds up no other request. The store's faults are applied here too:
an armed request fault answers before the request reaches the store, and the watch faults
decide what each stream is sent (the store's `_next_events`) and when it ends.
"""

from __future__ import annotations

import json
import logging
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import trustme

from sim.kubeapi import protobuf
from sim.kubeapi.model import (
    ACCESS_REVIEW,
    APPS,
    BY_PATH,
    COORDINATION,
    KUBE_VERSION,
    POLICY,
    RBAC,
    RESOURCES,
    SUBJECT_REVIEW,
    VERBS,
    KubeError,
    Obj,
    Resource,
    Route,
    bad_request,
    json_body,
    not_found,
)
from sim.kubeapi.openapi import openapi_v3
from sim.kubeapi.rbac import subject_review
from sim.kubeapi.store import KubeStandin, RequestRecord, seed_jobs, synthetic_cluster
from sim.kubeapi.tables import table_of
from sim.kubeapi.watch import Event, Expired, Watcher, bookmark_line

_LIVENESS_S = 1.0
"""How often an idle watch looks whether its client has gone away."""

log = logging.getLogger(__name__)
_GROUPS = (
    APPS,
    "batch",
    RBAC,
    COORDINATION,
    POLICY,
    "authorization.k8s.io",
    "authentication.k8s.io",
)
"""The API groups served besides core, all at version v1, in discovery's order."""
_REVIEWS = {
    "authorization.k8s.io": ("selfsubjectaccessreviews", "SelfSubjectAccessReview"),
    "authentication.k8s.io": ("selfsubjectreviews", "SelfSubjectReview"),
}
"""Create-only kinds that are answered, never stored."""
_SUBRESOURCES = {
    "pods": (("status", ["get", "patch", "update"]), ("log", ["get"])),
    "jobs": (("status", ["get", "patch", "update"]),),
    "nodes": (("status", ["get", "patch", "update"]),),
    "namespaces": (("status", ["get", "patch", "update"]),),
    "deployments": (("status", ["get", "patch", "update"]), ("scale", ["get", "patch", "update"])),
}
_SCALE = {"group": "autoscaling", "version": "v1", "kind": "Scale"}
"""What discovery says a `scale` subresource speaks (kubectl's scale client needs it)."""


def _group_doc(group: str) -> Obj:
    version = {"groupVersion": f"{group}/v1", "version": "v1"}
    return {"name": group, "versions": [version], "preferredVersion": version}


def _resource_list(group: str) -> Obj:
    resources: list[Obj] = []
    for res in RESOURCES:
        if res.group != group:
            continue
        resources.append(
            {
                "name": res.plural,
                "singularName": res.singular,
                "namespaced": res.namespaced,
                "kind": res.kind,
                "verbs": VERBS,
                "shortNames": list(res.short_names),
            }
            | ({"categories": list(res.categories)} if res.categories else {})
        )
        for sub, verbs in _SUBRESOURCES.get(res.plural, ()):
            resources.append(
                {
                    "name": f"{res.plural}/{sub}",
                    "singularName": "",
                    "namespaced": res.namespaced,
                    "kind": res.kind,
                    "verbs": verbs,
                }
                | (_SCALE if sub == "scale" else {})
            )
    if group in _REVIEWS:
        plural, kind = _REVIEWS[group]
        resources.append(
            {
                "name": plural,
                "singularName": plural.removesuffix("s"),
                "namespaced": False,
                "kind": kind,
                "verbs": ["create"],
            }
        )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/v1" if group else "v1",
        "resources": resources,
    }


def _discovery(path: str) -> Obj | None:
    if path == "/version":
        return KUBE_VERSION
    if path.startswith("/openapi/"):
        return openapi_v3(path, _GROUPS)
    if path == "/api":
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
        }
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group_doc(group) for group in _GROUPS],
        }
    if path == "/api/v1":
        return _resource_list("")
    for group in _GROUPS:
        if path == f"/apis/{group}":
            return {"kind": "APIGroup", "apiVersion": "v1", **_group_doc(group)}
        if path == f"/apis/{group}/v1":
            return _resource_list(group)
    return None


def _route(path: str) -> Route | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis" and parts[1] in _GROUPS and parts[2] == "v1":
        group, rest = parts[1], parts[3:]
    else:
        return None
    ns = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    res = BY_PATH.get((group, "v1", rest[0]))
    if res is None or (ns and not res.namespaced):
        return None
    name = rest[1] if len(rest) > 1 else ""
    sub = rest[2] if len(rest) > 2 else ""
    if sub not in ("", "status") and (res.plural, sub) not in (
        ("pods", "log"),
        ("deployments", "scale"),
    ):
        return None
    return Route(res, ns, name, sub)


@attrs.frozen
class _OpenWatch:
    """A registered watch with its parameters, before its response starts."""

    watcher: Watcher
    timeout_s: int | None
    bookmarks: bool
    as_table: bool


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer
    timeout = 60

    def setup(self) -> None:
        super().setup()
        # The handshake runs here, on the connection's thread, so a slow client cannot stall
        # the accept loop.
        conn = self.connection
        # Without it, Nagle holds a small write (a watch event, a response after its headers)
        # until the client's delayed ACK of the previous one: 40 ms each.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(conn, ssl.SSLSocket):
            conn.do_handshake()
        with self.server.conn_lock:
            self.server.conns.add(conn)

    def finish(self) -> None:
        with self.server.conn_lock:
            self.server.conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("kube stand-in: " + format, *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        kube = self.server.kube
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        route = _route(path)
        verb = _verb(method, route, query)
        status = 500
        content_type = "application/json"
        payload = b""
        headers: Mapping[str, str] = {}
        opened: _OpenWatch | None = None
        try:
            if path in (ACCESS_REVIEW, SUBJECT_REVIEW) and method == "POST":
                # Every authenticated user may ask what it may do and who it is.
                user, denied = kube._authenticate(self.headers.get("Authorization"))
            else:
                user, denied = kube._authorize(
                    self.headers.get("Authorization"),
                    verb,
                    route.res if route else None,
                    route.namespace if route else "",
                    route.name if route else "",
                    route.sub if route else "",
                )
            name = _object_name(route, verb, body)
            fault = kube._take_fault(verb, path, name)
            if fault is not None:
                error = fault.error(route.res if route else None, name)
                if error is not None:
                    raise error
                time.sleep(fault.delay_s)
            if route is None and method == "POST" and path == ACCESS_REVIEW:
                review = kube._access_review(user, denied, body)
                status, payload = 201, json.dumps(review).encode()
            elif route is None and method == "POST" and path == SUBJECT_REVIEW:
                status, payload = 201, json.dumps(subject_review(user)).encode()
            elif route is not None and route.sub == "log":
                status, payload = 200, kube._pod_log(method, route)
                content_type = "text/plain"
            elif route is not None and verb == "watch":
                status, opened = 200, self._open_watch(kube, route, query)
            else:
                status, payload = self._answer(kube, method, path, route, query, body)
        except KubeError as err:
            status, payload, headers = err.code, json.dumps(err.status()).encode(), err.headers
        except Exception:
            log.exception("kube stand-in failed on %s %s", method, path)
            status = 500
            bug = KubeError(500, "InternalError", "Internal error occurred: stand-in bug")
            payload = json.dumps(bug.status()).encode()
        # Recorded before the answer goes out, so a client holding its answer finds it counted
        # (a watch as soon as it is open).
        record = RequestRecord(
            method, verb, path, url.query, status, route.res.plural if route else ""
        )
        with kube._lock:
            kube.requests.append(record)
        if opened is not None:
            self._watch(kube, opened)
        else:
            self._send(status, payload, headers, content_type)

    def _open_watch(self, kube: KubeStandin, route: Route, query: Mapping[str, str]) -> _OpenWatch:
        """Checks a watch's parameters (`KubeError` 400) and registers it with the store."""
        timeout_s = _timeout_seconds(query.get("timeoutSeconds", ""))
        bookmarks = _flag(query, "allowWatchBookmarks")
        as_table = "as=Table" in (self.headers.get("Accept") or "")
        watcher = kube._open_watch(route.res, route.namespace, query, self.connection)
        return _OpenWatch(watcher, timeout_s, bookmarks, as_table)

    def _watch(self, kube: KubeStandin, opened: _OpenWatch) -> None:
        """Streams a watch until `timeoutSeconds`, an expired history (an ERROR event), the
        watch fault `end_at_once`, the client leaving or `drop_watches` (then without the final
        chunk)."""
        try:
            self.send_response(200, "OK")
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache, private")
            self.end_headers()
            if self._stream(kube, opened):
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.close_connection = True
        except OSError:
            # The client went away mid-write (or `drop_watches` cut the connection).
            self.close_connection = True
        finally:
            kube._close_watch(opened.watcher)

    def _stream(self, kube: KubeStandin, opened: _OpenWatch) -> bool:
        """Writes the watch's events; True when it ends cleanly, False when it was dropped or
        its client has gone."""
        watcher, timeout_s, bookmarks = opened.watcher, opened.timeout_s, opened.bookmarks
        res = watcher.selection.res

        def lines(events: list[Event]) -> bytes:
            if not opened.as_table:
                return b"".join(e.line() for e in events)
            return b"".join(
                json.dumps(
                    {
                        "type": e.type,
                        "object": table_of(
                            res, [e.obj], {"resourceVersion": e.obj["metadata"]["resourceVersion"]}
                        ),
                    }
                ).encode()
                + b"\n"
                for e in events
            )

        started = time.monotonic()
        deadline = started + timeout_s if timeout_s else math.inf
        next_bookmark = started + kube.bookmark_interval_s if bookmarks else math.inf
        while True:
            now = time.monotonic()
            if now >= deadline or kube.watch_faults.end_at_once:
                return True
            if now >= next_bookmark:
                rv = kube._bookmark_rv(watcher)
                if rv is not None:
                    self._chunk(bookmark_line(res, rv))
                next_bookmark = now + kube.bookmark_interval_s
            try:
                events = kube._next_events(watcher, min(deadline, next_bookmark, now + _LIVENESS_S))
            except Expired as gone:
                self._chunk(gone.line())
                return True
            if events is None:
                return False
            if events:
                self._chunk(lines(events))
            elif select.select([self.connection], [], [], 0)[0]:
                # Readable while nothing was asked of it: the client closed its end.
                return False

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _answer(
        self,
        kube: KubeStandin,
        method: str,
        path: str,
        route: Route | None,
        query: Mapping[str, str],
        body: bytes,
    ) -> tuple[int, bytes]:
        if route is None:
            doc = _discovery(path) if method == "GET" else None
            if doc is None:
                raise KubeError(404, "NotFound", "the server could not find the requested resource")
            return 200, json.dumps(doc).encode()
        res, ns, name, sub = route.res, route.namespace, route.name, route.sub
        # kubectl asks for server-side printing; without it, it would show NAME and AGE only.
        as_table = "as=Table" in (self.headers.get("Accept") or "") and not sub
        if method == "GET" and not name:
            return 200, kube._list(res, ns, query, as_table)
        if sub == "scale" and method in ("GET", "PUT", "PATCH"):
            if method == "PATCH":
                _check_patch_type(self.headers.get("Content-Type") or "", body)
            scale = kube._scale(method, res, ns, name, json_body(body) if body else {})
            return 200, json.dumps(scale).encode()
        if method == "GET":
            stored = kube._store[res.plural].get((ns, name))
            if stored is None:
                raise not_found(res, name)
            if as_table:
                meta = {"resourceVersion": stored.obj["metadata"]["resourceVersion"]}
                return 200, json.dumps(table_of(res, [stored.obj], meta)).encode()
            return 200, stored.raw
        content_type = self.headers.get("Content-Type") or ""
        if method == "DELETE" and name:
            policy = _delete_policy(res, query, _body_object(content_type, body) if body else {})
            deleted = kube._delete(res, ns, name, policy)
            done = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {
                    "name": name,
                    "kind": res.plural,
                    "uid": deleted["metadata"]["uid"],
                }
                | ({"group": res.group} if res.group else {}),
            }
            return 200, json.dumps(done).encode()
        if method == "PATCH":
            _check_patch_type(content_type, body)
            obj = json_body(body)
        else:
            obj = _body_object(content_type, body)
        if method == "POST" and not name:
            if res.namespaced and not ns:
                raise KubeError(405, "MethodNotAllowed", "create needs a namespace in the path")
            dry_run = query.get("dryRun") == "All"
            return 201, json.dumps(kube._create(res, ns, obj, dry_run=dry_run)).encode()
        if method == "PUT" and name:
            return 200, json.dumps(kube._replace(res, ns, name, obj, sub)).encode()
        if method == "PATCH" and name:
            media = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            strategic = media == "application/strategic-merge-patch+json"
            patched = kube._patch(res, ns, name, obj, sub, strategic=strategic)
            return 200, json.dumps(patched).encode()
        raise KubeError(405, "MethodNotAllowed", f"{method} is not supported on {path}")

    def _send(
        self,
        status: int,
        payload: bytes,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-cache, private")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)


def _object_name(route: Route | None, verb: str, body: bytes) -> str:
    """The name of the object a request addresses: the one in its path or, for a create, the
    body's `metadata.name` ("" when it names none, or its body is not an object)."""
    if route is None or route.name or verb != "create":
        return route.name if route else ""
    try:
        meta = json_body(body).get("metadata")
    except KubeError:
        return ""
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else ""


def _verb(method: str, route: Route | None, query: Mapping[str, str]) -> str:
    if method == "GET":
        if route is not None and not route.name:
            return "watch" if _flag(query, "watch") else "list"
        return "get"
    if method == "DELETE" and route is not None and not route.name:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


_PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/apply-patch+yaml",
    "application/strategic-merge-patch+json",
)


def _check_patch_type(content_type: str, body: bytes) -> None:
    """Accepts a JSON merge patch and a strategic merge patch (what kubectl and Helm send for
    the built-in kinds; `sim.kubeapi.patches`). A JSON patch (RFC 6902, a list of operations)
    and server-side apply are not modelled: 415. An object sent as a JSON patch is taken as a
    merge patch: the official client labels every dict body so (a real apiserver refuses it),
    and tests of the stand-in rely on it."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        return
    if media == "application/json-patch+json" and body.lstrip()[:1] in (b"{", b""):
        return
    if media in _PATCH_TYPES:
        raise KubeError(
            415,
            "UnsupportedMediaType",
            f"the kube stand-in does not apply {media} patches; send a JSON merge patch "
            "(application/merge-patch+json) or a strategic merge patch",
        )
    raise KubeError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(_PATCH_TYPES)}",
    )


def _body_object(content_type: str, body: bytes) -> Obj:
    """A POST, PUT or DELETE body: JSON, or protobuf (which client-go's typed clients send when
    configured to, as Helm's are) of a kind `sim.kubeapi.protobuf` decodes; 415 otherwise."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media != protobuf.MEDIA_TYPE:
        return json_body(body)
    try:
        return protobuf.decode(body)
    except protobuf.Unsupported as exc:
        raise KubeError(
            415,
            "UnsupportedMediaType",
            f"the kube stand-in cannot decode this protobuf body ({exc}); send JSON",
        ) from None


def _flag(query: Mapping[str, str], name: str) -> bool:
    """A boolean parameter as the apiserver parses it (Go's `strconv.ParseBool`: the official
    Python client sends `watch=True`)."""
    return query.get(name, "") in ("1", "t", "T", "true", "TRUE", "True")


def _timeout_seconds(text: str) -> int | None:
    """A watch's `timeoutSeconds`: None when absent or 0 (no limit here; a real apiserver picks
    a random one of 30 to 60 minutes)."""
    if not text:
        return None
    try:
        seconds = int(text)
    except ValueError:
        seconds = -1
    if seconds < 0:
        raise bad_request(f"timeoutSeconds must be a whole number of seconds, not {text!r}")
    return seconds or None


def _delete_policy(res: Resource, query: Mapping[str, str], options: Obj) -> str:
    policy = query.get("propagationPolicy") or options.get("propagationPolicy")
    if policy is None and (query.get("orphanDependents") or options.get("orphanDependents")):
        policy = "Orphan"
    if policy is None:
        # batch/v1 Jobs still default to orphaning their pods when deleted through the API.
        policy = "Orphan" if res.plural == "jobs" else "Background"
    if policy not in ("Orphan", "Background", "Foreground"):
        raise bad_request(f"propagationPolicy {policy!r} is not Orphan, Background or Foreground")
    return str(policy)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    kube: KubeStandin
    conns: set[socket.socket]
    conn_lock: threading.Lock


@attrs.define
class RunningKubeStandin:
    """A started server; `stop()` closes the listener and every open connection."""

    kube: KubeStandin
    _httpd: _HTTPServer
    _thread: threading.Thread

    def stop(self) -> None:
        self.kube.drop_watches()
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._httpd.conn_lock:
            conns = list(self._httpd.conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join()


def start_kube_standin(directory: Path, token: str | None = None) -> RunningKubeStandin:
    """Serves a fresh stand-in over TLS on 127.0.0.1, port chosen by the kernel; writes the CA
    to `directory/ca.pem`. Call `stop()` on the result."""
    directory.mkdir(parents=True, exist_ok=True)
    kube = KubeStandin(directory, token)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost", "kubernetes.default.svc")
    kube.ca_pem = ca.cert_pem.bytes()
    kube.ca_path.write_bytes(kube.ca_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
    httpd.socket = context.wrap_socket(
        httpd.socket, server_side=True, do_handshake_on_connect=False
    )
    httpd.kube = kube
    httpd.conns = set()
    httpd.conn_lock = threading.Lock()
    kube.url = f"https://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="kube-standin", daemon=True
    )
    thread.start()
    return RunningKubeStandin(kube, httpd, thread)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m sim.kubeapi DIR [--nodes N --pods-per-node M]`: serves a synthetic
    cluster, writes DIR/kubeconfig, prints {"url", "kubeconfig"} as one JSON line and serves
    until stdin closes."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m sim.kubeapi")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--pods-per-node", type=int, default=0)
    parser.add_argument(
        "--seed-jobs",
        metavar="FILE",
        type=Path,
        help="JSON lines of [job, secret-or-null]: Jobs held as created, their pods running "
        "(e.g. the workers a reconcile pass would have left)",
    )
    parser.add_argument(
        "--bookmark-interval-s",
        type=float,
        default=60.0,
        help="seconds between a watch's BOOKMARK events (an apiserver's: about a minute)",
    )
    args = parser.parse_args(argv)
    running = start_kube_standin(args.directory)
    running.kube.bookmark_interval_s = args.bookmark_interval_s
    try:
        synthetic_cluster(running.kube, args.nodes, args.pods_per_node)
        if args.seed_jobs is not None:
            with args.seed_jobs.open() as lines:
                seed_jobs(running.kube, (tuple(json.loads(line)) for line in lines if line.strip()))
        kubeconfig = running.kube.write_kubeconfig(args.directory / "kubeconfig")
        print(json.dumps({"url": running.kube.url, "kubeconfig": str(kubeconfig)}), flush=True)
        sys.stdin.read()
    finally:
        running.stop()


if __name__ == "__main__":
    main()
