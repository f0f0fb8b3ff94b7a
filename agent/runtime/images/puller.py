"""Pulling container images from OCI distribution registries into the object store.

This module is the one adapter between the agent and image registries (the distribution v2
HTTP API): httpx errors, HTTP statuses, auth challenges and registry error bodies are turned
into `ApiError`s here and nowhere else. What can be decided without I/O is a pure function with
its own unit tests: reference parsing, the http/https choice, challenge parsing, manifest and
config parsing, the platform choice in an index, and which layer formats we can unpack. The
`ImagePuller` only carries those decisions out.

Everything a pull fetches (index, manifest, config, layers) is stored in the content-addressed
`ObjectStore` and checked against its digest, so a registry can never hand us content other
than what the manifest names. Blobs are streamed into the store (a 1 GiB layer never sits in
memory) and fetched at most once at a time per process: concurrent pulls that need the same
blob wait on one download (single-flight keyed by digest) and see its progress.

Tags are resolved through a small on-disk index (`<root>/images/tags.json`, reference ->
digest) so that a container start with the `if-not-present` policy whose image is already here
never talks to the registry. Credentials live only in the call that uses them: they are never
written to disk or logged, the token cache is keyed by a keyed hash of them, and no error
message carries them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import ssl
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import attrs
import httpx
import trio

from agent.runtime.images.auth import (
    MAX_TOKEN_BYTES,
    TOKEN_MARGIN_S,
    Challenge,
    RegistryCredentials,
    basic_authorization,
    parse_challenges,
    parse_token,
)
from agent.runtime.images.guard import GuardedBackend
from agent.runtime.images.manifests import (
    MANIFEST_ACCEPT,
    MAX_INDEX_DEPTH,
    MAX_MANIFEST_BYTES,
    Descriptor,
    ImageConfig,
    ImageManifest,
    Layer,
    bad_manifest,
    check_image_manifest,
    choose_manifest,
    parse_image_config,
    parse_manifest,
)
from agent.runtime.images.tags import TagIndex
from agent.store.objects import ObjectCorrupt, ObjectStore
from wire.errors import ApiError, ErrorCode
from workerapi.digests import DigestMismatch
from workerapi.reference import (
    DIGEST_RE,
    PULL_POLICIES,
    ImageError,
    ImageReference,
    Platform,
    is_loopback,
    registry_address,
    registry_scheme,
)

log = logging.getLogger("levers9.images")
_CLOSE_S = 5.0
"""How long giving a response's connection back may take, whatever the caller's cancellation."""


async def _close_response(response: httpx.Response) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_S):
        await response.aclose()


_MAX_ERROR_BYTES = 64 << 10
_MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Transfers may take long, but a connection that says nothing for this long is dead.
_TIMEOUT = httpx.Timeout(60.0, connect=30.0, pool=None)
_USER_AGENT = "levers9-agent"


class _Truncated(ImageError):
    """A blob's body ended before its size; fetched again once, like a digest mismatch."""


@attrs.frozen
class PulledImage:
    reference: str
    """The normalised reference that was pulled (`str(ImageReference)`)."""
    manifest_digest: str
    """The image manifest for this node's platform (not the index)."""
    config_digest: str
    config: ImageConfig
    layers: tuple[Layer, ...]
    """Bottom layer first."""
    diff_ids: tuple[str, ...]
    """Digests of the uncompressed layers, in the order of `layers`."""
    index_digest: str | None = None
    """The index (manifest list) the reference named, when it named one."""

    @property
    def blobs(self) -> tuple[str, ...]:
        """Every object this image needs in the store (index, manifest, config, layers)."""
        found = [self.index_digest] if self.index_digest else []
        found += [self.manifest_digest, self.config_digest]
        found += [layer.digest for layer in self.layers]
        return tuple(dict.fromkeys(found))


@attrs.define
class PullProgress:
    """How far a pull is, for the container status: phase is `resolving` (finding the
    manifests), `downloading` (bytes are the config and layer sizes) or `done`."""

    phase: str = "resolving"
    done_bytes: int = 0
    total_bytes: int = 0


def _registry_errors(body: bytes) -> list[str]:
    """The `code`s out of a distribution error body, if it is one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    errors = data.get("errors") if isinstance(data, dict) else None
    if not isinstance(errors, list):
        return []
    return [e["code"] for e in errors if isinstance(e, dict) and isinstance(e.get("code"), str)]


def status_error(status: int, codes: Sequence[str], *, address: str, what: str) -> ImageError:
    """The error for a registry answer other than 200 (401 is handled by the auth flow)."""
    detail = f" ({', '.join(codes)})" if codes else ""
    if status == 404:
        return ImageError(
            ErrorCode.NOT_FOUND,
            f"{what} was not found in registry {address}{detail}; check the repository name, "
            "tag and digest",
            field="image",
        )
    if status == 403:
        return ImageError(
            ErrorCode.PERMISSION_DENIED,
            f"registry {address} denied access to {what}{detail}; ask for read access",
            field="image",
        )
    if status == 429:
        return ImageError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"registry {address} is rate-limiting pulls{detail}; retry later",
            field="image",
        )
    return ImageError(
        ErrorCode.UNAVAILABLE,
        f"registry {address} answered HTTP {status}{detail} for {what}; retry later",
        field="image",
    )


def _unreachable(address: str, exc: httpx.HTTPError) -> ImageError:
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        reason = f"timed out ({type(exc).__name__})"
    return ImageError(
        ErrorCode.UNAVAILABLE,
        f"registry {address} is unreachable: {reason}; check that it runs and the address is "
        "right, then retry",
        field="image",
    )


def _digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@attrs.define(eq=False)
class _Flight:
    """One blob being made present (verified or downloaded); others wait on `done`."""

    done: trio.Event = attrs.field(factory=trio.Event)
    listeners: list[Callable[[int], None]] = attrs.field(factory=list)
    received: int = 0
    error: ApiError | None = None
    abandoned: bool = False

    def report(self, received: int) -> None:
        self.received = received
        for listener in list(self.listeners):
            listener(received)


@attrs.frozen
class _Session:
    """What one pull needs to talk to its registry."""

    ref: ImageReference
    base_url: str
    address: str
    credentials: RegistryCredentials | None = attrs.field(repr=False)
    credentials_id: str = attrs.field(repr=False)


class _Tracker:
    """Sums per-blob byte counts into the pull's progress (a retried blob starts over)."""

    def __init__(self, progress: PullProgress, sizes: Mapping[str, int]) -> None:
        self._progress = progress
        self._sizes = sizes
        self._counts: dict[str, int] = {}
        progress.total_bytes = sum(sizes.values())
        progress.done_bytes = 0

    def listener(self, digest: str) -> Callable[[int], None]:
        def update(received: int) -> None:
            self._counts[digest] = min(received, self._sizes[digest])
            self._progress.done_bytes = sum(self._counts.values())

        return update


def _ssl_context(ca_file: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ImageError(
            ErrorCode.FAILED_PRECONDITION,
            f"registry CA file {ca_file!r} cannot be used ({exc}); fix the registry CA setting",
        ) from None


async def _single(body: bytes) -> AsyncIterator[bytes]:
    yield body


class ImagePuller:
    """Pulls images into an `ObjectStore`. One per agent: the single-flight map, the token
    cache and the HTTP connection pool are per puller. Close it (`async with` or `aclose`).

    `transport` replaces httpx's own (tests wrap the real one to count requests).
    `refuse_local_registries`: registries on the node are refused before they are dialled
    (`agent.runtime.images.guard`); the worker's containers set it unless its pool allows them."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        platform: Platform | None = None,
        insecure_registries: tuple[str, ...] = (),
        ca_file: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_concurrent_downloads: int = 4,
        state_dir: Path | None = None,
        refuse_local_registries: bool = False,
    ) -> None:
        self.store = store
        self.platform = platform or Platform.of_this_node()
        self.insecure_registries = tuple(insecure_registries)
        if transport is None:
            transport = httpx.AsyncHTTPTransport(verify=_ssl_context(ca_file))
            if refuse_local_registries:
                # Every dial (registry, token realm, blob redirect) resolves and is judged
                # first (`guard`); httpx has no public seam for the network backend.
                pool = transport._pool
                pool._network_backend = GuardedBackend(pool._network_backend)
        # No proxies or .netrc from the environment: credentials come from the caller only.
        self._client = httpx.AsyncClient(
            transport=transport,
            follow_redirects=False,
            trust_env=False,
            timeout=_TIMEOUT,
            headers={"User-Agent": _USER_AGENT},
        )
        self.tags = TagIndex((state_dir or store.root) / "images" / "tags.json")
        self._resolved: dict[str, PulledImage] = {}
        """Reference → what it resolved to, for `if-not-present` starts of a known image."""
        self._flights: dict[str, _Flight] = {}
        self._verified: set[str] = set()
        self._tokens: dict[tuple[str, str, str], tuple[str, float]] = {}
        self._basic_registries: set[str] = set()
        self._credentials_key = secrets.token_bytes(32)
        self._downloads = trio.CapacityLimiter(max_concurrent_downloads)

    def __repr__(self) -> str:
        return (
            f"ImagePuller(platform={self.platform}, "
            f"insecure_registries={self.insecure_registries!r})"
        )

    async def __aenter__(self) -> ImagePuller:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- the pull ------------------------------------------------------------------------------

    async def pull(
        self,
        reference: str,
        *,
        credentials: RegistryCredentials | None = None,
        policy: str = "if-not-present",
        progress: PullProgress | None = None,
    ) -> PulledImage:
        """Make `reference`'s image for this node's platform present in the store.

        `if-not-present` resolves a tag already pulled from the tag index and never talks to
        the registry when every blob is here; `always` asks the registry what the tag names
        now. A digest-pinned reference needs the registry only for blobs that are missing."""
        if policy not in PULL_POLICIES:
            raise ImageError(
                ErrorCode.INVALID_ARGUMENT,
                f"pull policy must be one of {', '.join(PULL_POLICIES)}, not {policy!r}",
                field="pullPolicy",
            )
        ref = ImageReference.parse(reference)
        progress = progress if progress is not None else PullProgress()
        progress.phase = "resolving"
        known = self._resolved.get(str(ref)) if policy == "if-not-present" else None
        if known is not None and all(self.store.contains(d) for d in known.blobs):
            # Resolved by this puller before and every blob still here: a cached start asks
            # neither the registry nor the disk's tag index.
            total = sum(layer.size for layer in known.layers)
            progress.done_bytes = progress.total_bytes = total
            progress.phase = "done"
            return known
        # The pull's own pins keep what it has stored from eviction by its later ingests.
        # They are dropped without a checkpoint before returning, so a caller that pins
        # `blobs` straight away leaves no gap.
        owner = f"pull:{secrets.token_hex(8)}"
        try:
            image = await self._pull(ref, credentials, policy, progress, owner)
        finally:
            self.store.unpin_owner(owner)
        self._resolved[str(ref)] = image
        return image

    async def _pull(
        self,
        ref: ImageReference,
        credentials: RegistryCredentials | None,
        policy: str,
        progress: PullProgress,
        owner: str,
    ) -> PulledImage:
        session = self._session(ref, credentials)
        what = f"image {ref}"
        top, body, cached = await self._top_manifest(session, ref, policy, owner, what)
        index_digest, manifest_digest, parsed = await self._platform_manifest(
            session, top, body, owner, what
        )
        layers = check_image_manifest(parsed, what=what)

        config_descriptor = parsed.config
        sizes = {config_descriptor.digest: config_descriptor.size}
        for layer in layers:
            sizes.setdefault(layer.digest, layer.size)
        tracker = _Tracker(progress, sizes)
        progress.phase = "downloading"
        descriptors = [config_descriptor, *parsed.layers]
        for descriptor in descriptors:
            self.store.pin(descriptor.digest, owner)
        fetched = await self._ensure_blobs(session, descriptors, tracker)

        config_body = await self._config_body(session, config_descriptor, tracker, what)
        config, diff_ids = parse_image_config(config_body, what=what)
        if len(diff_ids) != len(layers):
            raise bad_manifest(
                what, f"its config lists {len(diff_ids)} diff_ids for {len(layers)} layers"
            )
        if ref.tag is not None and ref.digest is None and not cached:
            # A tag resolved from the index already maps to `top`: nothing to write.
            await self.tags.put(str(ref), top)
        image = PulledImage(
            reference=str(ref),
            manifest_digest=manifest_digest,
            config_digest=config_descriptor.digest,
            config=config,
            layers=layers,
            diff_ids=diff_ids,
            index_digest=index_digest,
        )
        for digest in image.blobs:
            if self.store.contains(digest):
                self.store.touch(digest)
        progress.done_bytes = progress.total_bytes
        progress.phase = "done"
        log.info(
            "pulled %s",
            ref,
            extra={
                "manifest_digest": manifest_digest,
                "tag_from_cache": cached,
                "fetched_blobs": fetched,
                "total_bytes": progress.total_bytes,
            },
        )
        return image

    async def _top_manifest(
        self, session: _Session, ref: ImageReference, policy: str, owner: str, what: str
    ) -> tuple[str, bytes, bool]:
        """The manifest (or index) `ref` names, pinned: its digest, its bytes, and whether its
        tag was resolved from the tag index rather than the registry."""
        top: str | None = ref.digest
        cached = False
        if top is None and policy == "if-not-present":
            top = await self.tags.get(str(ref))
            cached = top is not None
        if top is not None:
            self.store.pin(top, owner)
        # `always` asks the registry even for a digest it holds: that is also how a caller
        # proves it may pull an image someone else's credentials brought here.
        trust_local = top is not None and policy != "always"
        body = await self._local_manifest(top) if trust_local and top is not None else None
        if body is None:
            top, body = await self._fetch_manifest(session, ref.digest or ref.tag or "", what)
            self.store.pin(top, owner)
            cached = False
        assert top is not None
        return top, body, cached

    async def _platform_manifest(
        self, session: _Session, top: str, body: bytes, owner: str, what: str
    ) -> tuple[str | None, str, ImageManifest]:
        """The image manifest for this node's platform, following indexes down from `top`:
        the first index's digest (None without one), the manifest's digest and the manifest."""
        index_digest: str | None = None
        manifest_digest, manifest_body = top, body
        for _ in range(MAX_INDEX_DEPTH):
            parsed = parse_manifest(manifest_body, None, what=what)
            if isinstance(parsed, ImageManifest):
                return index_digest, manifest_digest, parsed
            index_digest = index_digest or manifest_digest
            chosen = choose_manifest(parsed, self.platform, what=what)
            manifest_digest = chosen.digest
            self.store.pin(manifest_digest, owner)
            local = await self._local_manifest(manifest_digest)
            if local is None:
                _, local = await self._fetch_manifest(session, manifest_digest, what)
            manifest_body = local
        raise bad_manifest(what, f"its indexes nest deeper than {MAX_INDEX_DEPTH}")

    async def _config_body(
        self, session: _Session, descriptor: Descriptor, tracker: _Tracker, what: str
    ) -> bytes:
        """The image config's bytes from the store, fetched once more if found damaged."""
        config_body = await self._local_blob(descriptor.digest)
        if config_body is None:
            # Found damaged on reading (and discarded): fetch it once more.
            await self._ensure_blobs(session, [descriptor], tracker)
            config_body = await self._local_blob(descriptor.digest)
            if config_body is None:
                raise ImageError(
                    ErrorCode.UNAVAILABLE,
                    f"the config of {what} could not be read back intact; retry",
                    field="image",
                )
        return config_body

    # -- manifests -----------------------------------------------------------------------------

    async def _local_blob(self, digest: str) -> bytes | None:
        """A small blob's bytes from the store, if present and intact (else it is discarded)."""
        if not self.store.contains(digest):
            return None
        try:
            body = await trio.to_thread.run_sync(self.store.path_of(digest).read_bytes)
        except FileNotFoundError:
            return None
        if _digest_of(body) != digest:
            log.warning("object %s is corrupt; fetching it again", digest)
            self.store.discard(digest)
            self._verified.discard(digest)
            return None
        return body

    async def _local_manifest(self, digest: str) -> bytes | None:
        size = self.store.size_of(digest)
        if size is None or size > MAX_MANIFEST_BYTES:
            return None
        return await self._local_blob(digest)

    async def _fetch_manifest(
        self, session: _Session, reference: str, what: str
    ) -> tuple[str, bytes]:
        """GET a manifest by tag or digest, check its digest, and store it."""
        path = f"/v2/{session.ref.repository}/manifests/{reference}"
        response = await self._open(session, path, {"Accept": MANIFEST_ACCEPT})
        try:
            await self._check_status(session, response, what)
            body = await self._read_capped(session, response, MAX_MANIFEST_BYTES, what)
        finally:
            await _close_response(response)
        digest = _digest_of(body)
        expected = reference if reference.startswith("sha256:") else None
        advertised = response.headers.get("docker-content-digest")
        if advertised and DIGEST_RE.fullmatch(advertised) and expected is None:
            expected = advertised
        if expected is not None and digest != expected:
            raise ImageError(
                ErrorCode.FAILED_PRECONDITION,
                f"registry {session.address} returned a manifest for {what} whose digest is "
                f"{digest}, not {expected}; the registry is serving different content than "
                "asked for",
                field="image",
            )
        await self.store.ingest(_single(body), digest=digest, size=len(body))
        self._verified.add(digest)
        return digest, body

    async def _read_capped(
        self, session: _Session, response: httpx.Response, limit: int, what: str
    ) -> bytes:
        chunks: list[bytes] = []
        total = 0
        try:
            async for chunk in response.aiter_bytes():
                total += len(chunk)
                if total > limit:
                    raise ImageError(
                        ErrorCode.FAILED_PRECONDITION,
                        f"registry {session.address} sent more than {limit} bytes for {what}; "
                        "that is not a manifest we accept",
                        field="image",
                    )
                chunks.append(chunk)
        except httpx.HTTPError as exc:
            raise _unreachable(session.address, exc) from None
        return b"".join(chunks)

    # -- blobs ---------------------------------------------------------------------------------

    async def _ensure_blobs(
        self, session: _Session, descriptors: Sequence[Descriptor], tracker: _Tracker
    ) -> int:
        """Make every descriptor's blob present, a few at a time; returns how many were
        downloaded. The first failure cancels the rest and is raised as itself."""
        unique = list({d.digest: d for d in descriptors}.values())
        errors: list[ApiError] = []
        downloaded = [0]

        async def one(descriptor: Descriptor, cancel: trio.CancelScope) -> None:
            try:
                if await self._ensure_blob(
                    session, descriptor, tracker.listener(descriptor.digest)
                ):
                    downloaded[0] += 1
            except ApiError as exc:
                errors.append(exc)
                cancel.cancel()
            except OSError as exc:
                errors.append(
                    ImageError(
                        ErrorCode.INTERNAL,
                        f"blob {descriptor.digest} of image {session.ref} could not be stored: "
                        f"{exc.strerror or exc}",
                        field="image",
                    )
                )
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            for descriptor in unique:
                nursery.start_soon(one, descriptor, nursery.cancel_scope)
        if errors:
            raise errors[0]
        return downloaded[0]

    async def _ensure_blob(
        self, session: _Session, descriptor: Descriptor, listener: Callable[[int], None]
    ) -> bool:
        """Present and intact afterwards; True if this call downloaded it. Waits on another
        pull's flight for the same digest instead of fetching it twice."""
        digest = descriptor.digest
        while True:
            flight = self._flights.get(digest)
            if flight is None:
                break
            flight.listeners.append(listener)
            listener(flight.received)
            await flight.done.wait()
            if flight.abandoned:
                continue
            if flight.error is not None:
                raise ImageError(flight.error.code, flight.error.message, field=flight.error.field)
            return False
        flight = _Flight()
        flight.listeners.append(listener)
        self._flights[digest] = flight
        try:
            downloaded = await self._make_present(session, descriptor, flight)
        except ApiError as exc:
            # Auth failures belong to this pull's credentials; others may do better.
            if exc.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED):
                flight.abandoned = True
            else:
                flight.error = exc
            raise
        except BaseException:
            flight.abandoned = True
            raise
        finally:
            del self._flights[digest]
            flight.done.set()
        return downloaded

    async def _make_present(
        self, session: _Session, descriptor: Descriptor, flight: _Flight
    ) -> bool:
        digest = descriptor.digest
        if self.store.contains(digest):
            if digest in self._verified:
                flight.report(descriptor.size)
                return False
            try:
                await self.store.verify(digest)
            except ObjectCorrupt:
                log.warning("object %s is corrupt; fetching it again", digest)
            except ApiError as exc:
                # Gone between the look and the read (evicted): fetch it like a missing one.
                if exc.code is not ErrorCode.NOT_FOUND:
                    raise
            else:
                self._verified.add(digest)
                flight.report(descriptor.size)
                return False
        for attempt in (1, 2):
            flight.report(0)
            try:
                async with self._downloads:
                    await self._download(session, descriptor, flight)
            except (DigestMismatch, _Truncated):
                if attempt == 2:
                    raise ImageError(
                        ErrorCode.UNAVAILABLE,
                        f"blob {digest} of image {session.ref} from registry "
                        f"{session.address} arrived damaged twice (wrong digest or cut short); "
                        "the registry's copy may be damaged, or the connection is bad",
                        field="image",
                    ) from None
                log.warning("blob %s arrived damaged; fetching it once more", digest)
            else:
                break
        self._verified.add(digest)
        return True

    async def _download(self, session: _Session, descriptor: Descriptor, flight: _Flight) -> None:
        what = f"blob {descriptor.digest} of image {session.ref}"
        path = f"/v2/{session.ref.repository}/blobs/{descriptor.digest}"
        # identity: the digest is over the bytes as stored, never a transfer encoding of them.
        response = await self._open(session, path, {"Accept-Encoding": "identity"})
        try:
            await self._check_status(session, response, what)
            await self.store.ingest(
                self._chunks(session, response, descriptor, flight),
                digest=descriptor.digest,
                size=descriptor.size,
            )
        finally:
            await _close_response(response)

    async def _chunks(
        self,
        session: _Session,
        response: httpx.Response,
        descriptor: Descriptor,
        flight: _Flight,
    ) -> AsyncIterator[bytes]:
        received = 0
        stream = response.aiter_raw()
        while True:
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                break
            except httpx.HTTPError as exc:
                raise _unreachable(session.address, exc) from None
            received += len(chunk)
            if received > descriptor.size:
                raise ImageError(
                    ErrorCode.UNAVAILABLE,
                    f"registry {session.address} sent more than the {descriptor.size} bytes "
                    f"the manifest gives for blob {descriptor.digest} of image {session.ref}",
                    field="image",
                )
            flight.report(received)
            yield chunk
        if received < descriptor.size:
            raise _Truncated(
                ErrorCode.UNAVAILABLE,
                f"registry {session.address} sent {received} of the {descriptor.size} bytes of "
                f"blob {descriptor.digest} of image {session.ref}",
                field="image",
            )

    # -- HTTP and auth -------------------------------------------------------------------------

    def _session(self, ref: ImageReference, credentials: RegistryCredentials | None) -> _Session:
        scheme = registry_scheme(ref.registry, self.insecure_registries)
        if credentials is not None and not (credentials.username or credentials.password):
            credentials = None
        credentials_id = ""
        if credentials is not None:
            credentials_id = hmac.new(
                self._credentials_key,
                f"{credentials.username}\0{credentials.password}".encode(),
                hashlib.sha256,
            ).hexdigest()
        return _Session(
            ref=ref,
            base_url=f"{scheme}://{ref.registry}",
            address=registry_address(ref.registry, scheme),
            credentials=credentials,
            credentials_id=credentials_id,
        )

    def _plain_http_allowed(self, host: str, port: int | None) -> bool:
        insecure = set(self.insecure_registries)
        return is_loopback(host) or host in insecure or f"{host}:{port}" in insecure

    def _authorization(self, session: _Session) -> str | None:
        key = (session.ref.registry, session.ref.scope, session.credentials_id)
        token = self._tokens.get(key)
        if token is not None:
            if token[1] > trio.current_time():
                return f"Bearer {token[0]}"
            del self._tokens[key]
        if session.credentials is not None and session.ref.registry in self._basic_registries:
            return basic_authorization(session.credentials)
        return None

    async def _send(
        self, address: str, url: httpx.URL, headers: Mapping[str, str]
    ) -> httpx.Response:
        request = self._client.build_request("GET", url, headers=headers)
        try:
            return await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _unreachable(address, exc) from None

    async def _open(
        self, session: _Session, path: str, headers: Mapping[str, str]
    ) -> httpx.Response:
        """GET `path` from the session's registry, authenticating as challenged (once) and
        following redirects; the caller closes the streamed response."""
        url = httpx.URL(session.base_url + path)
        retried = False
        while True:
            sent = dict(headers)
            authorization = self._authorization(session)
            if authorization is not None:
                sent["Authorization"] = authorization
            response = await self._send(session.address, url, sent)
            if response.status_code != 401:
                break
            challenges = parse_challenges(response.headers.get_list("www-authenticate"))
            await _close_response(response)
            self._tokens.pop(
                (session.ref.registry, session.ref.scope, session.credentials_id), None
            )
            if retried:
                raise self._rejected(session, challenges)
            await self._authenticate(session, challenges)
            retried = True
        try:
            return await self._follow_redirects(session, response, sent)
        except BaseException:
            await _close_response(response)
            raise

    async def _follow_redirects(
        self, session: _Session, response: httpx.Response, headers: Mapping[str, str]
    ) -> httpx.Response:
        """Registries send blob GETs on to storage; the Authorization header goes only to
        the origin it was meant for."""
        for _ in range(_MAX_REDIRECTS):
            if response.status_code not in _REDIRECTS:
                return response
            location = response.headers.get("location")
            origin = response.url
            await response.aclose()
            if not location:
                raise ImageError(
                    ErrorCode.UNAVAILABLE,
                    f"registry {session.address} redirected without a Location",
                    field="image",
                )
            url = origin.join(location)
            if url.scheme not in ("http", "https") or (
                url.scheme == "http" and not self._plain_http_allowed(url.host, url.port)
            ):
                raise ImageError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"registry {session.address} redirected to {url.scheme}://{url.host}, "
                    "which is not HTTPS; list that host as an insecure registry if it is trusted",
                    field="image",
                )
            if (url.scheme, url.host, url.port) != (origin.scheme, origin.host, origin.port):
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            address = registry_address(url.netloc.decode("ascii"), url.scheme)
            response = await self._send(address, url, headers)
        raise ImageError(
            ErrorCode.UNAVAILABLE,
            f"registry {session.address} redirected more than {_MAX_REDIRECTS} times",
            field="image",
        )

    async def _check_status(self, session: _Session, response: httpx.Response, what: str) -> None:
        if response.status_code == 200:
            return
        try:
            body = await self._read_capped(session, response, _MAX_ERROR_BYTES, what)
        except ImageError:
            body = b""
        raise status_error(
            response.status_code, _registry_errors(body), address=session.address, what=what
        )

    async def _authenticate(self, session: _Session, challenges: Sequence[Challenge]) -> None:
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            await self._fetch_token(session, by_scheme["bearer"])
        elif "basic" in by_scheme:
            if session.credentials is None:
                raise self._needs_credentials(session)
            self._basic_registries.add(session.ref.registry)
        else:
            offered = ", ".join(sorted(by_scheme)) or "none"
            raise ImageError(
                ErrorCode.UNIMPLEMENTED,
                f"registry {session.address} asks for authentication scheme(s) {offered}; only "
                "basic and bearer tokens are supported",
                field="image",
            )

    def _needs_credentials(self, session: _Session) -> ImageError:
        return ImageError(
            ErrorCode.UNAUTHENTICATED,
            f"registry {session.address} requires credentials to pull {session.ref} (or the "
            "repository does not exist); give registry credentials",
            field="image",
        )

    def _bad_credentials(self, session: _Session) -> ImageError:
        assert session.credentials is not None
        return ImageError(
            ErrorCode.UNAUTHENTICATED,
            f"registry {session.address} rejected the credentials of user "
            f"{session.credentials.username!r}; check the username and password",
            field="image",
        )

    def _rejected(self, session: _Session, challenges: Sequence[Challenge]) -> ImageError:
        """Still 401 after authenticating: who we are is known but not enough, or wrong."""
        if session.credentials is None:
            return self._needs_credentials(session)
        bearer = next((c for c in challenges if c.scheme == "bearer"), None)
        if bearer is not None and bearer.params.get("error") == "insufficient_scope":
            return ImageError(
                ErrorCode.PERMISSION_DENIED,
                f"user {session.credentials.username!r} may not pull {session.ref} from registry "
                f"{session.address} (or the repository does not exist); ask for read access",
                field="image",
            )
        return self._bad_credentials(session)

    async def _fetch_token(self, session: _Session, challenge: Challenge) -> None:
        realm = challenge.params.get("realm", "")
        try:
            url = httpx.URL(realm)
        except httpx.InvalidURL:
            url = httpx.URL("")
        if url.scheme not in ("http", "https") or not url.host:
            raise ImageError(
                ErrorCode.UNAVAILABLE,
                f"registry {session.address} asks for a token from an unusable realm {realm!r}",
                field="image",
            )
        address = registry_address(url.netloc.decode("ascii"), url.scheme)
        if (
            session.credentials is not None
            and url.scheme == "http"
            and not self._plain_http_allowed(url.host, url.port)
        ):
            raise ImageError(
                ErrorCode.FAILED_PRECONDITION,
                f"registry {session.address} asks for credentials over plain HTTP at token "
                f"server {address}; refusing to send them (list it as insecure if trusted)",
                field="image",
            )
        params = {"scope": challenge.params.get("scope") or session.ref.scope}
        if "service" in challenge.params:
            params["service"] = challenge.params["service"]
        headers = {}
        if session.credentials is not None:
            headers["Authorization"] = basic_authorization(session.credentials)
        response = await self._send(address, url.copy_merge_params(params), headers)
        try:
            token_session = attrs.evolve(session, address=address)
            if response.status_code == 401:
                raise (
                    self._bad_credentials(session)
                    if session.credentials is not None
                    else self._needs_credentials(session)
                )
            if response.status_code == 403:
                raise ImageError(
                    ErrorCode.PERMISSION_DENIED,
                    f"token server {address} of registry {session.address} refused to let "
                    f"this user pull {session.ref}; ask for read access",
                    field="image",
                )
            if response.status_code != 200:
                raise ImageError(
                    ErrorCode.UNAVAILABLE,
                    f"token server {address} of registry {session.address} answered HTTP "
                    f"{response.status_code}; retry later",
                    field="image",
                )
            body = await self._read_capped(token_session, response, MAX_TOKEN_BYTES, "a token")
        finally:
            await _close_response(response)
        token, expires_in = parse_token(body)
        if token is None:
            raise ImageError(
                ErrorCode.UNAVAILABLE,
                f"token server {address} of registry {session.address} sent no token",
                field="image",
            )
        expires_at = trio.current_time() + max(expires_in - TOKEN_MARGIN_S, 1.0)
        self._tokens[(session.ref.registry, session.ref.scope, session.credentials_id)] = (
            token,
            expires_at,
        )
