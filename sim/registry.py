"""Test images built without Docker, and real registries (Debian's docker-registry) to push them to.

Images are made in memory from busybox-static with tarfile, gzip, hashlib and json: layers are
deterministic (fixed mtimes, sorted entries, gzip without a timestamp), so a digest is the same
in every test session. They are pushed with plain distribution API calls (POST an upload, PUT
it with ?digest=, PUT the manifest) over httpx's sync client.

A registry runs as `docker-registry serve CONFIG.yml` on 127.0.0.1 with a port picked by the
kernel; variants: anonymous, htpasswd basic auth, and bearer tokens from a token server of our
own (ES256 JWTs whose `x5c` header carries a self-signed certificate, which is the registry's
`rootcertbundle`; distribution 2.8 verifies the chain and then the signature).

Test modules use the fixtures in `tests.registry_fixtures`; they import from here the image
builders (`build_image`, `image_from_tars`, `layer_tar`, the `File`/`Dir`/`Symlink`/
`Hardlink` entries) and `push` / `push_layer_tars` to add images of their own.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gzip
import hashlib
import io
import json
import re
import secrets
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from workerapi.reference import Platform

# The media types of the OCI image spec and Docker's v2 schema, written out here so that what
# the simulated registry serves is not derived from the agent's own parser.
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


def bearer_challenge(headers: Sequence[str]) -> dict[str, str] | None:
    """The parameters (realm, service, scope) of a `Bearer` WWW-Authenticate challenge."""
    for header in headers:
        scheme, _, rest = header.strip().partition(" ")
        if scheme.lower() == "bearer":
            return dict(_CHALLENGE_PARAM.findall(rest))
    return None


BUSYBOX = Path("/bin/busybox")
# Every entry gets this mtime, so layers (and their digests) are the same in every session.
EPOCH = 1_700_000_000
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ARCH = Platform.of_this_node().architecture


# -- layers -----------------------------------------------------------------------------------


@attrs.frozen
class File:
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


@attrs.frozen
class Dir:
    mode: int = 0o755
    uid: int = 0
    gid: int = 0


@attrs.frozen
class Symlink:
    target: str


@attrs.frozen
class Hardlink:
    target: str
    """Path of the file linked to, relative to the root (`data/keep.txt`)."""


Entry = bytes | File | Dir | Symlink | Hardlink


def whiteout(path: str) -> str:
    """The layer path that deletes `path` from the layers below (`data/.wh.a.txt`)."""
    head, _, name = path.strip("/").rpartition("/")
    return f"{head}/.wh.{name}" if head else f".wh.{name}"


def opaque(directory: str) -> str:
    """The layer path that hides everything below `directory` from the layers below."""
    return f"{directory.strip('/')}/.wh..wh..opq"


def layer_tar(files: Mapping[str, Entry]) -> bytes:
    """An uncompressed layer tar of `files` (path -> entry; bytes mean a 0644 root file).

    Missing parent directories are added (0755, root), entries are sorted (hard links last, as
    a tar needs a link's target earlier in the archive), and every mtime is fixed, so the same
    files always make the same bytes."""
    entries: dict[str, Entry] = {}
    for raw_path, entry in files.items():
        path = raw_path.strip("/")
        parts = path.split("/")
        for depth in range(1, len(parts)):
            entries.setdefault("/".join(parts[:depth]), Dir())
        entries[path] = entry
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(entries, key=lambda p: (isinstance(entries[p], Hardlink), p)):
            entry = entries[path]
            info = tarfile.TarInfo(path)
            info.mtime = EPOCH
            data = None
            if isinstance(entry, bytes):
                entry = File(entry)
            if isinstance(entry, File):
                info.type, info.mode, info.uid, info.gid = (
                    tarfile.REGTYPE,
                    entry.mode,
                    entry.uid,
                    entry.gid,
                )
                info.size = len(entry.data)
                data = io.BytesIO(entry.data)
            elif isinstance(entry, Dir):
                info.type, info.mode, info.uid, info.gid = (
                    tarfile.DIRTYPE,
                    entry.mode,
                    entry.uid,
                    entry.gid,
                )
            elif isinstance(entry, Symlink):
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target
            else:
                info.type, info.mode = tarfile.LNKTYPE, 0o644
                info.linkname = entry.target.strip("/")
            tar.addfile(info, data)
    return buffer.getvalue()


def gzip_bytes(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


# -- images -----------------------------------------------------------------------------------


def sha256_digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@attrs.frozen
class Blob:
    media_type: str
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")

    @property
    def digest(self) -> str:
        return sha256_digest(self.data)

    @property
    def size(self) -> int:
        return len(self.data)

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, **extra}


@attrs.frozen
class Image:
    """One image manifest with its config and layers (bottom first)."""

    manifest: Blob
    config: Blob
    layers: tuple[Blob, ...]
    diff_ids: tuple[str, ...]
    layer_tars: tuple[bytes, ...] = attrs.field(repr=False)
    """The uncompressed tars, for layering another image on top."""

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def blobs(self) -> tuple[Blob, ...]:
        return (self.config, *self.layers)


@attrs.frozen
class Index:
    """An OCI image index; `images[i]` runs on `platforms[i]`."""

    manifest: Blob
    images: tuple[Image, ...]
    platforms: tuple[Platform, ...]

    @property
    def digest(self) -> str:
        return self.manifest.digest


def image_from_tars(
    tars: Sequence[bytes],
    *,
    compress: bool = True,
    docker: bool = False,
    env: Sequence[str] = (PATH_ENV,),
    cmd: Sequence[str] | None = ("sh",),
    entrypoint: Sequence[str] | None = None,
    working_dir: str = "",
    user: str = "",
    exposed_ports: Sequence[str] = (),
    architecture: str = ARCH,
    layer_media_type: str | None = None,
) -> Image:
    """An image from uncompressed layer tars (bottom first), gzip-compressed unless told not.

    `docker=True` uses the Docker v2 media types; `layer_media_type` forces one (for tests
    of what a puller refuses). The tars are not checked: hostile ones are welcome."""
    if docker:
        manifest_type, config_type, layer_type = DOCKER_MANIFEST, DOCKER_CONFIG, DOCKER_LAYER_GZIP
        compress = True
    else:
        manifest_type, config_type = OCI_MANIFEST, OCI_CONFIG
        layer_type = OCI_LAYER_GZIP if compress else OCI_LAYER_TAR
    layer_type = layer_media_type or layer_type
    layers = tuple(Blob(layer_type, gzip_bytes(t) if compress else t) for t in tars)
    diff_ids = tuple(sha256_digest(t) for t in tars)
    run: dict[str, Any] = {"Env": list(env)}
    if cmd is not None:
        run["Cmd"] = list(cmd)
    if entrypoint is not None:
        run["Entrypoint"] = list(entrypoint)
    if working_dir:
        run["WorkingDir"] = working_dir
    if user:
        run["User"] = user
    if exposed_ports:
        run["ExposedPorts"] = {port: {} for port in exposed_ports}
    config = Blob(
        config_type,
        _json(
            {
                "architecture": architecture,
                "os": "linux",
                "created": "2023-11-14T22:13:20Z",
                "config": run,
                "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
            }
        ),
    )
    manifest = Blob(
        manifest_type,
        _json(
            {
                "schemaVersion": 2,
                "mediaType": manifest_type,
                "config": config.descriptor(),
                "layers": [layer.descriptor() for layer in layers],
            }
        ),
    )
    return Image(
        manifest=manifest, config=config, layers=layers, diff_ids=diff_ids, layer_tars=tuple(tars)
    )


def build_image(
    layers: Sequence[Mapping[str, Entry]], *, base: Image | None = None, **options: Any
) -> Image:
    """An image of `base`'s layers (if any) plus one layer per dict of files; `options` go to
    `image_from_tars` (cmd, env, entrypoint, user, ...)."""
    tars = [*(base.layer_tars if base else ()), *(layer_tar(files) for files in layers)]
    return image_from_tars(tars, **options)


def make_index(images: Sequence[tuple[Image, Platform]]) -> Index:
    manifest = Blob(
        OCI_INDEX,
        _json(
            {
                "schemaVersion": 2,
                "mediaType": OCI_INDEX,
                "manifests": [
                    image.manifest.descriptor(
                        platform={
                            "os": platform.os,
                            "architecture": platform.architecture,
                            **({"variant": platform.variant} if platform.variant else {}),
                        }
                    )
                    for image, platform in images
                ],
            }
        ),
    )
    return Index(
        manifest=manifest,
        images=tuple(image for image, _ in images),
        platforms=tuple(platform for _, platform in images),
    )


# Applets other tests rely on; the image links every applet this busybox has.
BUSYBOX_APPLETS_MUST = frozenset(
    {"sh", "ls", "cat", "echo", "sleep", "nc", "httpd", "id", "env", "mkdir", "rm", "true"}
    | {"false", "wc", "head", "dd", "top", "ps", "mount", "grep", "kill", "tail", "test"}
    | {"touch", "stat", "printf", "yes", "sync"}
)

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
GROUP = b"root:x:0:\nnobody:x:65534:\nnogroup:x:65534:\n"


@functools.cache
def busybox_files() -> Mapping[str, Entry]:
    """The files of a minimal busybox root: /bin/busybox with a symlink per applet."""
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    missing = BUSYBOX_APPLETS_MUST - set(applets)
    if missing:
        raise RuntimeError(f"{BUSYBOX} lacks applets the test images need: {sorted(missing)}")
    files: dict[str, Entry] = {
        name: Dir()
        for name in ("bin", "dev", "etc", "home", "proc", "sys", "usr", "usr/bin", "var")
    }
    files["tmp"] = Dir(0o1777)
    files["root"] = Dir(0o700)
    files["bin/busybox"] = File(BUSYBOX.read_bytes(), mode=0o755)
    for applet in applets:
        if applet != "busybox":
            files[f"bin/{applet}"] = Symlink("busybox")
    files["usr/bin/env"] = Symlink("/bin/busybox")
    files["etc/passwd"] = PASSWD
    files["etc/group"] = GROUP
    return files


@functools.cache
def busybox_image() -> Image:
    """`busybox:latest`: one gzip layer; Env PATH, Cmd ["sh"]."""
    return build_image([busybox_files()])


LAYERED_SECOND: Mapping[str, Entry] = {
    "data/a.txt": b"a\n",
    "data/keep.txt": b"keep\n",
    "data/dir/one.txt": b"one\n",
    "data/dir/sub/two.txt": b"two\n",
    "data/hard.txt": Hardlink("data/keep.txt"),
    "data/link": Symlink("keep.txt"),
    "data/owned.txt": File(b"owned\n", mode=0o640, uid=65534, gid=65534),
}
LAYERED_THIRD: Mapping[str, Entry] = {
    whiteout("data/a.txt"): b"",
    opaque("data/dir"): b"",
    "data/dir/new.txt": b"new\n",
}


@functools.cache
def layered_image() -> Image:
    """`layered:latest`: busybox, then a layer adding /data files (a hard link `hard.txt` to
    `keep.txt`, a symlink `link` -> keep.txt, `owned.txt` 0640 owned by 65534:65534, a
    directory `dir` with `one.txt` and `sub/two.txt`), then a layer that deletes /data/a.txt
    (whiteout) and makes /data/dir opaque with only `new.txt` in it.

    Unpacked, /data has keep.txt, hard.txt, link, owned.txt and dir/new.txt; not a.txt,
    dir/one.txt or dir/sub."""
    return build_image([LAYERED_SECOND, LAYERED_THIRD], base=busybox_image())


MULTI_PLATFORMS = (Platform("linux", "amd64"), Platform("linux", "arm64", "v8"))


@functools.cache
def multi_index() -> Index:
    """`multi:latest`: an OCI index; each platform's image is busybox plus /platform.txt
    holding its architecture (`amd64\\n` or `arm64\\n`)."""
    return make_index(
        [
            (
                build_image(
                    [{"platform.txt": f"{p.architecture}\n".encode()}],
                    base=busybox_image(),
                    architecture=p.architecture,
                ),
                p,
            )
            for p in MULTI_PLATFORMS
        ]
    )


@functools.cache
def dockerv2_image() -> Image:
    """`dockerv2:latest`: busybox with Docker v2 media types (its layer blob is busybox's)."""
    return build_image([busybox_files()], docker=True)


# -- pushing ----------------------------------------------------------------------------------


class TokenAuth(httpx.Auth):
    """Bearer token auth for pushes: on a challenge, get a token with basic credentials."""

    requires_response_body = True

    def __init__(self, username: str, password: str) -> None:
        self._basic = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        self._token: str | None = None

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self._token:
            request.headers["Authorization"] = f"Bearer {self._token}"
        response = yield request
        if response.status_code != 401:
            return
        bearer = bearer_challenge(response.headers.get_list("www-authenticate"))
        if bearer is None or "realm" not in bearer:
            return
        params = {k: v for k, v in bearer.items() if k in ("service", "scope")}
        token_response = yield httpx.Request(
            "GET", bearer["realm"], params=params, headers={"Authorization": self._basic}
        )
        if token_response.status_code != 200:
            return
        self._token = json.loads(token_response.content)["token"]
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


def _expect(response: httpx.Response, *statuses: int) -> httpx.Response:
    if response.status_code not in statuses:
        raise RuntimeError(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response


def push_blob(client: httpx.Client, repository: str, blob: Blob) -> None:
    if client.head(f"/v2/{repository}/blobs/{blob.digest}").status_code == 200:
        return
    started = _expect(client.post(f"/v2/{repository}/blobs/uploads/"), 202)
    location = client.base_url.join(started.headers["location"])
    _expect(
        client.put(
            location.copy_add_param("digest", blob.digest),
            content=blob.data,
            headers={"Content-Type": "application/octet-stream"},
        ),
        201,
    )


def push_manifest(client: httpx.Client, repository: str, reference: str, manifest: Blob) -> None:
    _expect(
        client.put(
            f"/v2/{repository}/manifests/{reference}",
            content=manifest.data,
            headers={"Content-Type": manifest.media_type},
        ),
        201,
    )


def push(
    url: str, repository: str, tag: str, target: Image | Index, *, auth: httpx.Auth | None = None
) -> str:
    """Push an image or index as `repository:tag`; returns its (top) manifest digest."""
    images = target.images if isinstance(target, Index) else (target,)
    with httpx.Client(base_url=url, auth=auth, timeout=60, trust_env=False) as client:
        for image in images:
            for blob in image.blobs:
                push_blob(client, repository, blob)
            if isinstance(target, Index):
                push_manifest(client, repository, image.digest, image.manifest)
        push_manifest(client, repository, tag, target.manifest)
    return target.digest


def push_layer_tars(
    url: str,
    repository: str,
    tag: str,
    tars: Sequence[bytes],
    *,
    base: Image | None = None,
    auth: httpx.Auth | None = None,
    **options: Any,
) -> Image:
    """Push an image made of arbitrary (even hostile) layer tars on top of `base`'s layers."""
    image = image_from_tars([*(base.layer_tars if base else ()), *tars], **options)
    push(url, repository, tag, image, auth=auth)
    return image


# -- the registry process ---------------------------------------------------------------------


def free_port() -> int:
    """A port the kernel just gave out; a registry that loses the race is started again."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define
class RunningRegistry:
    """A docker-registry process on loopback; `stop` kills it and waits for it."""

    host: str
    """`127.0.0.1:PORT`, the registry part of references."""
    process: subprocess.Popen[bytes]
    directory: Path
    auth: httpx.Auth | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def log_path(self) -> Path:
        return self.directory / "registry.log"

    def ref(self, name: str) -> str:
        return f"{self.host}/{name}"

    def push(self, repository: str, tag: str, target: Image | Index) -> str:
        return push(self.url, repository, tag, target, auth=self.auth)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Terminate a server a test started, and kill it if it does not end within 5 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _config(directory: Path, port: int, auth: Mapping[str, Any] | None) -> str:
    lines = [
        "version: 0.1",
        "log:",
        "  level: info",
        "  formatter: text",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {directory / 'data'}",
        "  delete:",
        "    enabled: true",
        "  maintenance:",
        "    uploadpurging:",
        "      enabled: false",
        "http:",
        f"  addr: 127.0.0.1:{port}",
        f"  secret: {secrets.token_hex(16)}",
    ]
    if auth:
        lines.append("auth:")
        for kind, settings in auth.items():
            lines.append(f"  {kind}:")
            lines.extend(f"    {key}: {json.dumps(value)}" for key, value in settings.items())
    return "\n".join(lines) + "\n"


def start_registry(
    directory: Path,
    *,
    auth: Mapping[str, Any] | None = None,
    push_auth: httpx.Auth | None = None,
    attempts: int = 5,
    ready_s: float = 10.0,
) -> RunningRegistry:
    """Start docker-registry under `directory` and wait until /v2/ answers (200 or 401)."""
    directory.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    for _ in range(attempts):
        port = free_port()
        config = directory / "config.yml"
        config.write_text(_config(directory, port, auth))
        with (directory / "registry.log").open("ab") as log_file:
            process = subprocess.Popen(
                ["docker-registry", "serve", str(config)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        registry = RunningRegistry(f"127.0.0.1:{port}", process, directory, push_auth)
        try:
            if _wait_ready(registry, ready_s):
                return registry
        except BaseException:
            registry.stop()
            raise
        registry.stop()
        problems.append(f"port {port}: exited {process.returncode}")
    raise RuntimeError(
        f"docker-registry did not start ({'; '.join(problems)}); log:\n{registry.log()[-2000:]}"
    )


def _wait_ready(registry: RunningRegistry, ready_s: float) -> bool:
    deadline = time.monotonic() + ready_s
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if registry.process.poll() is not None:
                return False
            try:
                if client.get(f"{registry.url}/v2/").status_code in (200, 401):
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.02)
    return False


@contextlib.contextmanager
def running_registry(directory: Path, **options: Any) -> Iterator[RunningRegistry]:
    registry = start_registry(directory, **options)
    try:
        yield registry
    finally:
        registry.stop()


def htpasswd(path: Path, users: Mapping[str, str]) -> Path:
    """An htpasswd file (bcrypt, as distribution requires); passwords go in on stdin."""
    lines = []
    for user, password in users.items():
        lines.append(
            subprocess.run(
                ["htpasswd", "-B", "-i", "-n", user],
                input=password,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
    path.write_text("\n".join(lines) + "\n")
    return path


# -- the token server -------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@attrs.define
class TokenServer:
    """A distribution token server on loopback: ES256 JWTs with an x5c header.

    `users` maps a name to (password, actions it may have on every repository). A request
    without credentials gets a token granting nothing; wrong credentials get 401. `field`
    is the JSON key the token comes in (`token` or `access_token`); `issued` records
    (user, scope) per token handed out."""

    directory: Path
    users: Mapping[str, tuple[str, frozenset[str]]]
    service: str = "levers9-test-registry"
    issuer: str = "levers9-test-issuer"
    field: str = "token"
    issued: list[tuple[str, str]] = attrs.field(factory=list)
    _key: ec.EllipticCurvePrivateKey = attrs.field(init=False)
    _certificate_der: bytes = attrs.field(init=False)
    _server: ThreadingHTTPServer | None = attrs.field(init=False, default=None)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "levers9 test token issuer")])
        now = datetime.now(UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1))
            .not_valid_after(now + timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self._certificate_der = certificate.public_bytes(serialization.Encoding.DER)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.certificate_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))

    @property
    def certificate_path(self) -> Path:
        return self.directory / "token-issuer.pem"

    @property
    def realm(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def registry_auth(self) -> dict[str, Any]:
        """The `auth:` section of the registry config that trusts this server."""
        return {
            "token": {
                "realm": self.realm,
                "service": self.service,
                "issuer": self.issuer,
                "rootcertbundle": str(self.certificate_path),
            }
        }

    def token(self, subject: str, access: list[dict[str, Any]]) -> str:
        header = {
            "typ": "JWT",
            "alg": "ES256",
            "x5c": [base64.b64encode(self._certificate_der).decode()],
        }
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": subject,
            "aud": self.service,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        signing_input = f"{_b64url(_json(header))}.{_b64url(_json(claims))}".encode()
        r, s = decode_dss_signature(self._key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        return f"{signing_input.decode()}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def _grant(self, user: str | None, scopes: list[str]) -> list[dict[str, Any]]:
        allowed = self.users[user][1] if user else frozenset()
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            granted = sorted(set(actions.split(",")) & allowed)
            if kind == "repository" and granted:
                access.append({"type": kind, "name": name, "actions": granted})
        return access

    def _answer(self, handler: BaseHTTPRequestHandler) -> tuple[int, dict[str, Any]]:
        url = urlsplit(handler.path)
        if url.path != "/token":
            return 404, {"error": "not found"}
        query = parse_qs(url.query)
        if query.get("service") != [self.service]:
            return 400, {"error": "unknown service"}
        user: str | None = None
        header = handler.headers.get("Authorization", "")
        if header:
            scheme, _, encoded = header.partition(" ")
            name, _, password = base64.b64decode(encoded).decode().partition(":")
            known = self.users.get(name)
            if (
                scheme.lower() != "basic"
                or known is None
                or not secrets.compare_digest(known[0], password)
            ):
                return 401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]}
            user = name
        scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
        for scope in scopes or [""]:
            self.issued.append((user or "", scope))
        return 200, {
            self.field: self.token(user or "", self._grant(user, scopes)),
            "expires_in": 300,
            "issued_at": datetime.now(UTC).isoformat(),
        }

    def start(self) -> TokenServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = server._answer(self)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # A test-only helper server; the agent itself never runs bare threads.
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="token-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextlib.contextmanager
def running_token_server(
    directory: Path, users: Mapping[str, tuple[str, frozenset[str]]]
) -> Iterator[TokenServer]:
    server = TokenServer(directory, users).start()
    try:
        yield server
    finally:
        server.stop()
