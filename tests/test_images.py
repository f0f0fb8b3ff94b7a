"""Image pulls: the pure decisions directly, and `ImagePuller` against real docker-registry
processes on loopback (anonymous, htpasswd and bearer-token auth).

Where a test needs to see or change traffic (count blob GETs, damage a blob in transit,
redirect to storage) it wraps httpx's real transport; the registry behind it is real."""

from __future__ import annotations

import base64
import collections
import functools
import logging
import platform
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from agent.runtime.images.auth import Challenge, RegistryCredentials, parse_challenges
from agent.runtime.images.manifests import (
    DOCKER_LAYER_GZIP,
    DOCKER_MANIFEST,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    Descriptor,
    ImageConfig,
    ImageIndex,
    choose_manifest,
    parse_image_config,
    parse_manifest,
)
from agent.runtime.images.puller import ImagePuller, PullProgress
from agent.store.objects import ObjectStore
from sim.registry import (
    MULTI_PLATFORMS,
    File,
    RunningRegistry,
    build_image,
    busybox_image,
    dockerv2_image,
    free_port,
    layered_image,
    multi_index,
    push,
    push_layer_tars,
)
from wire.errors import ApiError, ErrorCode
from workerapi.reference import DOCKER_HUB, ImageReference, Platform, registry_scheme

if TYPE_CHECKING:
    from tests.registry_fixtures import AuthRegistry, RegistryFactory, SharedRegistry

pytest_plugins = ["tests.registry_fixtures"]

DIGEST = "sha256:" + "ab" * 32
AMD64 = Platform("linux", "amd64")


# -- pure decisions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("busybox", DOCKER_HUB, "library/busybox", "latest", None),
        ("busybox:1.36", DOCKER_HUB, "library/busybox", "1.36", None),
        ("docker.io/busybox", DOCKER_HUB, "library/busybox", "latest", None),
        ("index.docker.io/team/app:v1", DOCKER_HUB, "team/app", "v1", None),
        ("team/app", DOCKER_HUB, "team/app", "latest", None),
        ("127.0.0.1:5000/busybox:latest", "127.0.0.1:5000", "busybox", "latest", None),
        (
            f"registry.example.com/team/app@{DIGEST}",
            "registry.example.com",
            "team/app",
            None,
            DIGEST,
        ),
        (f"registry.local/name:tag@{DIGEST}", "registry.local", "name", "tag", DIGEST),
        (f"host/name:tag@{DIGEST}", DOCKER_HUB, "host/name", "tag", DIGEST),
        ("localhost/app", "localhost", "app", "latest", None),
        ("localhost:5000/a/b-c/d__e.f:V1.2_x", "localhost:5000", "a/b-c/d__e.f", "V1.2_x", None),
        ("[::1]:5000/app:1", "[::1]:5000", "app", "1", None),
        ("Registry.Example.com/app", "Registry.Example.com", "app", "latest", None),
    ],
)
def test_references_parse_like_docker(
    text: str, registry: str, repository: str, tag: str | None, digest: str | None
) -> None:
    ref = ImageReference.parse(text)
    assert ref == ImageReference(registry, repository, tag, digest)
    assert ImageReference.parse(str(ref)) == ref


@pytest.mark.parametrize(
    ("text", "problem", "code"),
    [
        ("", "empty", ErrorCode.INVALID_ARGUMENT),
        (" busybox", "whitespace", ErrorCode.INVALID_ARGUMENT),
        ("Busybox", "lowercase", ErrorCode.INVALID_ARGUMENT),
        ("busybox:", "tag", ErrorCode.INVALID_ARGUMENT),
        ("busybox:-x", "tag", ErrorCode.INVALID_ARGUMENT),
        ("busybox:a:b", "repository name", ErrorCode.INVALID_ARGUMENT),
        ("a//b", "repository name", ErrorCode.INVALID_ARGUMENT),
        ("-busybox", "repository name", ErrorCode.INVALID_ARGUMENT),
        ("127.0.0.1:5000/", "repository name is missing", ErrorCode.INVALID_ARGUMENT),
        ("bad_host.io:5000/app", "registry", ErrorCode.INVALID_ARGUMENT),
        ("busybox@sha256:abc", "digest", ErrorCode.INVALID_ARGUMENT),
        ("busybox@sha512:" + "a" * 128, "sha512", ErrorCode.UNIMPLEMENTED),
        ("a" * 300, "longer than 255", ErrorCode.INVALID_ARGUMENT),
    ],
)
def test_bad_references_are_refused_naming_the_reference(
    text: str, problem: str, code: ErrorCode
) -> None:
    with pytest.raises(ApiError) as info:
        ImageReference.parse(text)
    assert info.value.code is code
    assert info.value.field == "image"
    assert repr(text) in info.value.message
    assert problem in info.value.message


@pytest.mark.parametrize(
    ("registry", "insecure", "scheme"),
    [
        ("127.0.0.1:5000", (), "http"),
        ("127.9.9.9", (), "http"),
        ("localhost:5000", (), "http"),
        ("[::1]:5000", (), "http"),
        ("registry.example.com", (), "https"),
        ("10.0.0.5:5000", (), "https"),
        ("10.0.0.5:5000", ("10.0.0.5:5000",), "http"),
        ("mirror.lan:5000", ("mirror.lan",), "http"),
        ("mirror.lan:5000", ("other.lan",), "https"),
    ],
)
def test_plain_http_only_for_loopback_and_insecure(
    registry: str, insecure: tuple[str, ...], scheme: str
) -> None:
    assert registry_scheme(registry, insecure) == scheme


def test_challenges_parse_with_quoted_commas_and_several_schemes() -> None:
    assert parse_challenges(
        [
            'Bearer realm="https://auth.example.com/token",service="registry.example.com",'
            'scope="repository:a/b:pull,push"',
            'Basic realm="x", Bearer realm="y",error="insufficient_scope"',
        ]
    ) == [
        Challenge(
            "bearer",
            {
                "realm": "https://auth.example.com/token",
                "service": "registry.example.com",
                "scope": "repository:a/b:pull,push",
            },
        ),
        Challenge("basic", {"realm": "x"}),
        Challenge("bearer", {"realm": "y", "error": "insufficient_scope"}),
    ]


def _entry(architecture: str, variant: str | None = None, n: int = 0) -> Descriptor:
    return Descriptor(
        media_type=DOCKER_MANIFEST,
        digest=f"sha256:{n:064x}",
        size=10,
        platform=Platform("linux", architecture, variant),
    )


def test_platform_choice_prefers_exact_variant_and_lists_what_exists() -> None:
    index = ImageIndex(
        (
            _entry("amd64", n=1),
            _entry("arm", "v6", 2),
            _entry("arm", "v7", 3),
            _entry("arm64", "v8", 4),
        )
    )
    assert choose_manifest(index, AMD64, what="x").digest.endswith("1")
    assert choose_manifest(index, Platform("linux", "arm", "v7"), what="x").digest.endswith("3")
    assert choose_manifest(index, Platform("linux", "arm64"), what="x").digest.endswith("4")
    with pytest.raises(ApiError) as info:
        choose_manifest(index, Platform("linux", "s390x"), what="image x")
    assert info.value.code is ErrorCode.NOT_FOUND
    assert "linux/s390x" in info.value.message
    assert "linux/amd64, linux/arm/v6, linux/arm/v7, linux/arm64/v8" in info.value.message


@pytest.mark.parametrize(
    ("machine", "architecture", "variant"),
    [("x86_64", "amd64", None), ("aarch64", "arm64", None), ("armv7l", "arm", "v7")],
)
def test_node_platform_uses_oci_names(
    monkeypatch: pytest.MonkeyPatch, machine: str, architecture: str, variant: str | None
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert Platform.of_this_node() == Platform("linux", architecture, variant)


def test_schema1_manifests_are_unimplemented() -> None:
    body = b'{"schemaVersion": 1, "name": "x", "fsLayers": []}'
    with pytest.raises(ApiError) as info:
        parse_manifest(body, "application/vnd.docker.distribution.manifest.v1+prettyjws", what="x")
    assert info.value.code is ErrorCode.UNIMPLEMENTED


def test_image_config_tolerates_nulls_and_sorts_ports() -> None:
    body = (
        b'{"config": {"Env": null, "Cmd": null, "Entrypoint": ["/init"], "User": "1000:1000",'
        b' "ExposedPorts": {"8080/tcp": {}, "53/udp": {}}}, "rootfs": {"diff_ids": []}}'
    )
    config, diff_ids = parse_image_config(body, what="x")
    assert config == ImageConfig(
        env=(),
        entrypoint=("/init",),
        cmd=(),
        user="1000:1000",
        exposed_ports=("53/udp", "8080/tcp"),
    )
    assert diff_ids == ()


def test_credentials_repr_hides_the_password() -> None:
    text = repr(RegistryCredentials("alice", "hunter2-secret"))
    assert "alice" in text
    assert "hunter2" not in text


# -- helpers ----------------------------------------------------------------------------------


Rewrite = Callable[[httpx.Request, httpx.Response, bytes], httpx.Response | None]


class Body(httpx.AsyncByteStream):
    """A body the puller streams as it would a network one."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def respond(status: int, headers: Mapping[str, str], body: bytes = b"") -> httpx.Response:
    return httpx.Response(status, headers=headers, stream=Body(body))


class Recording(httpx.AsyncBaseTransport):
    """The real transport, with every request recorded and responses optionally rewritten."""

    def __init__(self, rewrite: Rewrite | None = None) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests: list[httpx.Request] = []
        self.rewrite = rewrite

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        response = await self.inner.handle_async_request(request)
        if self.rewrite is None:
            return response
        body = b"".join([chunk async for chunk in response.aiter_raw()])
        await response.aclose()
        replaced = self.rewrite(request, response, body)
        return replaced or respond(response.status_code, response.headers, body)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def gets(self, kind: str) -> collections.Counter[str]:
        """GETs per digest (`kind` is `blobs` or `manifests`)."""
        return collections.Counter(
            r.url.path.rsplit("/", 1)[1]
            for r in self.requests
            if r.method == "GET" and f"/{kind}/" in r.url.path
        )


def replaced_body(response: httpx.Response, body: bytes) -> httpx.Response:
    headers = {
        k: v
        for k, v in response.headers.items()
        if k.lower() not in ("content-length", "docker-content-digest")
    }
    return respond(response.status_code, headers, body)


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(tmp_path / "state", budget_bytes=4 << 30, free_floor_bytes=0)


async def pull_error(puller: ImagePuller, reference: str, **options: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        await puller.pull(reference, **options)  # type: ignore[arg-type]
    return info.value


# -- pulls ------------------------------------------------------------------------------------


async def test_pull_anonymous_stores_every_blob_and_reads_the_config(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    expected = busybox_image()
    progress = PullProgress()
    async with ImagePuller(store) as puller:
        image = await puller.pull(registry.busybox, progress=progress)
    assert image.reference == registry.busybox
    assert image.manifest_digest == expected.digest
    assert image.config_digest == expected.config.digest
    assert [layer.digest for layer in image.layers] == [b.digest for b in expected.layers]
    assert image.layers[0].media_type == OCI_LAYER_GZIP
    assert image.diff_ids == expected.diff_ids
    assert image.config.cmd == ("sh",)
    assert any(e.startswith("PATH=") for e in image.config.env)
    for digest in image.blobs:
        assert store.contains(digest)
        await store.verify(digest)
    assert progress.phase == "done"
    assert progress.total_bytes == expected.config.size + sum(b.size for b in expected.layers)
    assert progress.done_bytes == progress.total_bytes


async def test_progress_rises_while_bytes_arrive(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    progress = PullProgress()
    seen: list[tuple[str, int, int]] = []

    def watch(request: httpx.Request, response: httpx.Response, body: bytes) -> None:
        seen.append((progress.phase, progress.done_bytes, progress.total_bytes))

    # One download at a time: each blob GET then sees the blobs before it fully counted.
    async with ImagePuller(store, transport=Recording(watch), max_concurrent_downloads=1) as puller:
        await puller.pull(registry.layered, progress=progress)
    total = progress.total_bytes
    assert seen[0] == ("resolving", 0, 0)
    downloading = [done for phase, done, _ in seen if phase == "downloading"]
    assert len(downloading) >= 3
    assert any(0 < done < total for done in downloading)
    assert progress.done_bytes == total


async def test_pull_by_digest_and_pinned_digest_must_match(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    expected = busybox_image()
    pinned = f"{registry.host}/busybox@{expected.digest}"
    async with ImagePuller(store) as puller:
        image = await puller.pull(pinned)
        assert image.manifest_digest == expected.digest
        assert image.reference == pinned
        # A digest the repository does not have (it belongs to another repository).
        error = await pull_error(puller, f"{registry.host}/busybox:latest@{layered_image().digest}")
    assert error.code is ErrorCode.NOT_FOUND
    assert f"{registry.host}/busybox:latest@{layered_image().digest}" in error.message


async def test_a_registry_serving_other_content_for_a_digest_is_refused(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    store = ObjectStore(tmp_path / "state", budget_bytes=1 << 30, free_floor_bytes=0)
    wanted = busybox_image().digest

    def swap(
        request: httpx.Request, response: httpx.Response, body: bytes
    ) -> httpx.Response | None:
        if request.url.path.endswith(f"/manifests/{wanted}"):
            return replaced_body(response, dockerv2_image().manifest.data)
        return None

    async with ImagePuller(store, transport=Recording(swap)) as puller:
        error = await pull_error(puller, f"{registry.host}/busybox@{wanted}")
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert wanted in error.message
    assert not store.contains(dockerv2_image().digest)
    assert not store.contains(busybox_image().layers[0].digest)


async def test_an_index_resolves_to_this_nodes_platform(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    index = multi_index()
    for wanted, image in zip(MULTI_PLATFORMS, index.images, strict=True):
        async with ImagePuller(store, platform=Platform("linux", wanted.architecture)) as puller:
            pulled = await puller.pull(registry.multi)
        assert pulled.index_digest == index.digest
        assert pulled.manifest_digest == image.digest
        assert pulled.layers[-1].digest == image.layers[-1].digest
        assert index.digest in pulled.blobs
        assert store.contains(index.digest)
    async with ImagePuller(store, platform=Platform("linux", "s390x")) as puller:
        error = await pull_error(puller, registry.multi, policy="always")
    assert error.code is ErrorCode.NOT_FOUND
    assert "linux/amd64, linux/arm64/v8" in error.message
    assert registry.multi in error.message


async def test_config_settings_reach_the_pulled_image(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    image = build_image(
        [{"srv/app": File(b"#!/bin/sh\n", mode=0o755)}],
        base=busybox_image(),
        entrypoint=["/srv/app"],
        cmd=["--port", "8080"],
        env=["PATH=/bin", "MODE=test"],
        working_dir="/srv",
        user="65534:65534",
        exposed_ports=["8080/tcp"],
    )
    push(registry.url, "configured", "v1", image)
    async with ImagePuller(store) as puller:
        pulled = await puller.pull(registry.server.ref("configured:v1"))
    assert pulled.config == ImageConfig(
        env=("PATH=/bin", "MODE=test"),
        entrypoint=("/srv/app",),
        cmd=("--port", "8080"),
        working_dir="/srv",
        user="65534:65534",
        exposed_ports=("8080/tcp",),
    )
    assert pulled.diff_ids == image.diff_ids
    assert len(pulled.layers) == 2


async def test_an_unreadable_tag_index_costs_only_a_registry_round_trip(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    async with ImagePuller(store) as puller:
        first = await puller.pull(registry.busybox)
    index = store.root / "images" / "tags.json"
    assert registry.busybox in index.read_text()
    index.write_text("{not json")
    transport = Recording()
    async with ImagePuller(store, transport=transport) as puller:
        again = await puller.pull(registry.busybox)
    assert again == first
    assert transport.gets("manifests") == {"latest": 1}
    assert not transport.gets("blobs")


async def test_docker_v2_media_types(store: ObjectStore, registry: SharedRegistry) -> None:
    async with ImagePuller(store) as puller:
        image = await puller.pull(registry.dockerv2)
    assert image.manifest_digest == dockerv2_image().digest
    assert image.layers[0].media_type == DOCKER_LAYER_GZIP
    assert image.layers[0].compression == "gzip"
    assert image.config.cmd == ("sh",)


async def test_zstd_layers_are_refused_before_any_blob_is_fetched(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    push_layer_tars(
        registry.url,
        "zstd-test",
        "latest",
        [b"\0" * 1024],
        compress=False,
        layer_media_type=OCI_LAYER_ZSTD,
    )
    transport = Recording()
    async with ImagePuller(store, transport=transport) as puller:
        error = await pull_error(puller, registry.server.ref("zstd-test:latest"))
    assert error.code is ErrorCode.UNIMPLEMENTED
    assert "zstd" in error.message
    assert not transport.gets("blobs")


async def test_unknown_repository_and_tag_are_not_found(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    async with ImagePuller(store) as puller:
        for reference in (
            registry.server.ref("no-such-repo:latest"),
            registry.server.ref("busybox:nope"),
        ):
            error = await pull_error(puller, reference)
            assert error.code is ErrorCode.NOT_FOUND
            assert reference in error.message


async def test_registry_down_is_unavailable_naming_host_and_port(store: ObjectStore) -> None:
    address = f"127.0.0.1:{free_port()}"
    async with ImagePuller(store) as puller:
        error = await pull_error(puller, f"{address}/busybox:latest")
    assert error.code is ErrorCode.UNAVAILABLE
    assert error.code.retryable
    assert address in error.message


async def test_bad_policy_is_invalid(store: ObjectStore, registry: SharedRegistry) -> None:
    async with ImagePuller(store) as puller:
        error = await pull_error(puller, registry.busybox, policy="sometimes")
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "pullPolicy"


# -- auth -------------------------------------------------------------------------------------


async def test_basic_auth_right_wrong_and_missing(
    store: ObjectStore, basic_registry: AuthRegistry
) -> None:
    host = basic_registry.server.host
    async with ImagePuller(store) as puller:
        missing = await pull_error(puller, basic_registry.busybox)
        wrong = await pull_error(puller, basic_registry.busybox, credentials=basic_registry.wrong)
        image = await puller.pull(basic_registry.busybox, credentials=basic_registry.credentials)
        # A right pull before does not let wrong credentials through after.
        again = await pull_error(
            puller, basic_registry.busybox, credentials=basic_registry.wrong, policy="always"
        )
        # Nor a pinned digest that is here: `always` asks the registry for it too.
        pinned = f"{basic_registry.server.host}/busybox@{image.manifest_digest}"
        by_digest = await pull_error(puller, pinned, policy="always")
    assert image.manifest_digest == busybox_image().digest
    for error in (missing, wrong, again, by_digest):
        assert error.code is ErrorCode.UNAUTHENTICATED
        assert host in error.message
    assert "requires credentials" in missing.message
    assert "rejected the credentials of user 'alice'" in wrong.message


async def test_bearer_token_auth_right_wrong_denied_and_cached(
    store: ObjectStore, token_registry: AuthRegistry
) -> None:
    tokens = token_registry.token_server
    assert tokens is not None and token_registry.denied is not None
    host = token_registry.server.host
    async with ImagePuller(store) as puller:
        anonymous = await pull_error(puller, token_registry.busybox)
        wrong = await pull_error(puller, token_registry.busybox, credentials=token_registry.wrong)
        denied = await pull_error(puller, token_registry.busybox, credentials=token_registry.denied)
        before = len(tokens.issued)
        image = await puller.pull(token_registry.busybox, credentials=token_registry.credentials)
        assert len(tokens.issued) == before + 1
        # The token is reused for its lifetime: an `always` pull asks the registry, not the
        # token server.
        await puller.pull(
            token_registry.busybox, credentials=token_registry.credentials, policy="always"
        )
        assert len(tokens.issued) == before + 1
        again = await pull_error(
            puller, token_registry.busybox, credentials=token_registry.wrong, policy="always"
        )
    assert image.manifest_digest == busybox_image().digest
    assert anonymous.code is ErrorCode.UNAUTHENTICATED
    assert wrong.code is ErrorCode.UNAUTHENTICATED
    assert again.code is ErrorCode.UNAUTHENTICATED
    assert denied.code is ErrorCode.PERMISSION_DENIED
    assert "'bob'" in denied.message
    for error in (anonymous, wrong, denied, again):
        assert host in error.message


async def test_tokens_in_access_token_field_are_used(
    tmp_path: Path, token_registry: AuthRegistry
) -> None:
    tokens = token_registry.token_server
    assert tokens is not None
    store = ObjectStore(tmp_path / "state", budget_bytes=1 << 30, free_floor_bytes=0)
    tokens.field = "access_token"
    try:
        async with ImagePuller(store) as puller:
            image = await puller.pull(
                token_registry.busybox, credentials=token_registry.credentials
            )
    finally:
        tokens.field = "token"
    assert image.manifest_digest == busybox_image().digest


async def test_credentials_appear_in_no_repr_error_log_or_file(
    tmp_path: Path,
    basic_registry: AuthRegistry,
    token_registry: AuthRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "state"
    store = ObjectStore(root, budget_bytes=1 << 30, free_floor_bytes=0)
    secrets_seen: list[str] = []
    texts: list[str] = []
    async with ImagePuller(store) as puller:
        for auth in (basic_registry, token_registry):
            for credentials in (auth.credentials, auth.wrong):
                secrets_seen.append(credentials.password)
                secrets_seen.append(
                    base64.b64encode(
                        f"{credentials.username}:{credentials.password}".encode()
                    ).decode()
                )
            await puller.pull(auth.busybox, credentials=auth.credentials, policy="always")
            error = await pull_error(puller, auth.busybox, credentials=auth.wrong, policy="always")
            texts += [str(error), repr(error), error.message]
        texts.append(repr(puller))
    texts.append(caplog.text)
    files = [p.read_bytes() for p in root.rglob("*") if p.is_file()]
    assert files
    for secret in secrets_seen:
        for text in texts:
            assert secret not in text
        for data in files:
            assert secret.encode() not in data


async def test_authorization_is_not_sent_to_a_storage_redirect_on_another_host(
    store: ObjectStore, basic_registry: AuthRegistry
) -> None:
    """Blob GETs are redirected to "storage" at localhost (another origin than 127.0.0.1),
    which serves the blob it fetched from the registry itself."""
    server = basic_registry.server
    storage: list[httpx.Request] = []
    blobs: dict[str, bytes] = {b.digest: b.data for b in busybox_image().blobs}
    port = server.host.rsplit(":", 1)[1]

    def redirect(
        request: httpx.Request, response: httpx.Response, body: bytes
    ) -> httpx.Response | None:
        if request.url.host == "127.0.0.1" and "/blobs/" in request.url.path:
            digest = request.url.path.rsplit("/", 1)[1]
            return respond(307, {"Location": f"http://localhost:{port}/storage/{digest}"})
        if request.url.host == "localhost":
            storage.append(request)
            return respond(200, {}, blobs[request.url.path.rsplit("/", 1)[1]])
        return None

    async with ImagePuller(store, transport=Recording(redirect)) as puller:
        image = await puller.pull(basic_registry.busybox, credentials=basic_registry.credentials)
    assert image.manifest_digest == busybox_image().digest
    assert len(storage) == 2
    assert all("authorization" not in r.headers for r in storage)


async def test_redirects_to_plain_http_elsewhere_are_refused(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    def redirect(
        request: httpx.Request, response: httpx.Response, body: bytes
    ) -> httpx.Response | None:
        if "/blobs/" in request.url.path:
            return respond(307, {"Location": "http://storage.example.com/blob"})
        return None

    transport = Recording(redirect)
    async with ImagePuller(store, transport=transport) as puller:
        error = await pull_error(puller, registry.busybox)
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "storage.example.com" in error.message
    assert all(r.url.host == "127.0.0.1" for r in transport.requests)


# -- single flight, cache, corruption ---------------------------------------------------------


async def test_concurrent_pulls_fetch_each_blob_once(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    transport = Recording()
    progresses = [PullProgress() for _ in range(5)]
    references = [
        registry.busybox,
        registry.busybox,
        registry.dockerv2,
        registry.layered,
        registry.layered,
    ]
    async with ImagePuller(store, transport=transport) as puller:
        async with trio.open_nursery() as nursery:
            for reference, progress in zip(references, progresses, strict=True):
                nursery.start_soon(functools.partial(puller.pull, reference, progress=progress))
    blobs = transport.gets("blobs")
    # busybox, dockerv2 and layered share the busybox layer.
    assert busybox_image().layers[0].digest in blobs
    assert set(blobs.values()) == {1}
    assert len(blobs) == len(
        {b.digest for i in (busybox_image(), dockerv2_image(), layered_image()) for b in i.blobs}
    )
    for progress in progresses:
        assert progress.done_bytes == progress.total_bytes > 0


async def test_if_not_present_never_contacts_a_stopped_registry(
    tmp_path: Path, registry_factory: RegistryFactory
) -> None:
    server: RunningRegistry = registry_factory()
    expected = busybox_image()
    server.push("busybox", "latest", expected)
    root = tmp_path / "state"
    reference = server.ref("busybox:latest")
    pinned = server.ref(f"busybox@{expected.digest}")
    store = ObjectStore(root, budget_bytes=1 << 30, free_floor_bytes=0)
    async with ImagePuller(store) as puller:
        first = await puller.pull(reference)
    server.stop()
    # A new puller and store on the same root, as after an agent restart.
    store = ObjectStore(root, budget_bytes=1 << 30, free_floor_bytes=0)
    transport = Recording()
    async with ImagePuller(store, transport=transport) as puller:
        assert await puller.pull(reference) == first
        assert (await puller.pull(pinned)).manifest_digest == first.manifest_digest
        assert transport.requests == []
        error = await pull_error(puller, reference, policy="always")
    assert error.code is ErrorCode.UNAVAILABLE
    assert server.host in error.message


async def test_always_follows_a_moved_tag(store: ObjectStore, registry: SharedRegistry) -> None:
    reference = registry.server.ref("moving:latest")
    push(registry.url, "moving", "latest", busybox_image())
    async with ImagePuller(store) as puller:
        first = await puller.pull(reference)
        push(registry.url, "moving", "latest", layered_image())
        cached = await puller.pull(reference)
        moved = await puller.pull(reference, policy="always")
        after = await puller.pull(reference)
    assert first.manifest_digest == cached.manifest_digest == busybox_image().digest
    assert moved.manifest_digest == after.manifest_digest == layered_image().digest


async def test_a_corrupt_blob_in_the_store_is_fetched_again(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    root = tmp_path / "state"
    layer = busybox_image().layers[0].digest
    store = ObjectStore(root, budget_bytes=1 << 30, free_floor_bytes=0)
    async with ImagePuller(store) as puller:
        await puller.pull(registry.busybox)
    path = store.path_of(layer)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    store = ObjectStore(root, budget_bytes=1 << 30, free_floor_bytes=0)
    transport = Recording()
    async with ImagePuller(store, transport=transport) as puller:
        await puller.pull(registry.busybox)
    assert transport.gets("blobs") == {layer: 1}
    await store.verify(layer)


async def test_a_blob_damaged_in_transit_is_fetched_once_more(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    layer = busybox_image().layers[0].digest
    damaged: list[int] = []

    def damage_once(
        request: httpx.Request, response: httpx.Response, body: bytes
    ) -> httpx.Response | None:
        if request.url.path.endswith(f"/blobs/{layer}") and not damaged:
            damaged.append(1)
            data = bytearray(body)
            data[100] ^= 0xFF
            return replaced_body(response, bytes(data))
        return None

    transport = Recording(damage_once)
    progress = PullProgress()
    async with ImagePuller(store, transport=transport) as puller:
        await puller.pull(registry.busybox, progress=progress)
    assert transport.gets("blobs")[layer] == 2
    assert progress.done_bytes == progress.total_bytes
    await store.verify(layer)


async def test_a_blob_damaged_every_time_fails_the_pull(
    store: ObjectStore, registry: SharedRegistry
) -> None:
    image = build_image([{"always-damaged.txt": b"x" * 4096}])
    push(registry.url, "damaged", "latest", image)
    layer = image.layers[0].digest

    def damage(
        request: httpx.Request, response: httpx.Response, body: bytes
    ) -> httpx.Response | None:
        if request.url.path.endswith(f"/blobs/{layer}"):
            data = bytearray(body)
            data[-1] ^= 0xFF
            return replaced_body(response, bytes(data))
        return None

    transport = Recording(damage)
    async with ImagePuller(store, transport=transport) as puller:
        error = await pull_error(puller, registry.server.ref("damaged:latest"))
    assert error.code is ErrorCode.UNAVAILABLE
    assert layer in error.message
    assert transport.gets("blobs")[layer] == 2
    assert not store.contains(layer)
