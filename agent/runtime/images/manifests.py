"""OCI and Docker media types, and the pure parsing of indexes, manifests and image configs:
the platform chosen, every descriptor checked before anything is fetched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from wire.errors import ErrorCode
from workerapi.reference import ANY_DIGEST_RE, DIGEST_RE, ImageError, Platform

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
LAYER_COMPRESSION: Mapping[str, str] = {
    OCI_LAYER_TAR: "none",
    OCI_LAYER_GZIP: "gzip",
    DOCKER_LAYER_GZIP: "gzip",
    # Non-distributable (foreign) layers are fetched from the registry like any other; one
    # that only lives at its `urls` is then NOT_FOUND there.
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}
"""Layer media types we can unpack, and how each is compressed."""
INDEX_MEDIA_TYPES = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
MANIFEST_MEDIA_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
CONFIG_MEDIA_TYPES = frozenset({OCI_CONFIG, DOCKER_CONFIG})
MANIFEST_ACCEPT = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_MANIFEST_LIST, DOCKER_MANIFEST))
# distribution refuses manifests over 4 MiB; a config is a few KiB even for big images.
MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 8 << 20
# An index may point at another index; real images nest at most once.
MAX_INDEX_DEPTH = 3


@attrs.frozen
class ImageConfig:
    """What the image's config says about how to run it."""

    env: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    exposed_ports: tuple[str, ...] = ()


@attrs.frozen
class Layer:
    digest: str
    media_type: str
    size: int

    @property
    def compression(self) -> str:
        """`gzip` or `none`; a pulled image only ever has layers we can unpack."""
        return LAYER_COMPRESSION[self.media_type]


@attrs.frozen
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None


@attrs.frozen
class ImageIndex:
    """An OCI index or Docker manifest list: one manifest per platform."""

    manifests: tuple[Descriptor, ...]


@attrs.frozen
class ImageManifest:
    config: Descriptor
    layers: tuple[Descriptor, ...]


def bad_manifest(what: str, problem: str) -> ImageError:
    return ImageError(
        ErrorCode.FAILED_PRECONDITION,
        f"the manifest of {what} is not usable: {problem}; check that it is a container image",
        field="image",
    )


def _descriptor(data: Any, what: str, where: str) -> Descriptor:
    if not isinstance(data, dict):
        raise bad_manifest(what, f"{where} is not an object")
    media_type = data.get("mediaType")
    digest = data.get("digest")
    size = data.get("size")
    if not isinstance(media_type, str):
        raise bad_manifest(what, f"{where} has no mediaType")
    if not isinstance(digest, str) or not ANY_DIGEST_RE.fullmatch(digest):
        raise bad_manifest(what, f"{where} has no valid digest")
    if not DIGEST_RE.fullmatch(digest):
        raise ImageError(
            ErrorCode.UNIMPLEMENTED,
            f"{what}: {where} uses digest {digest!r}; only sha256 digests are supported",
            field="image",
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad_manifest(what, f"{where} has no valid size")
    platform = None
    raw = data.get("platform")
    if isinstance(raw, dict):
        os_name, architecture = raw.get("os"), raw.get("architecture")
        variant = raw.get("variant")
        if isinstance(os_name, str) and isinstance(architecture, str):
            platform = Platform(
                os=os_name,
                architecture=architecture,
                variant=variant if isinstance(variant, str) and variant else None,
            )
    return Descriptor(media_type=media_type, digest=digest, size=size, platform=platform)


def parse_manifest(
    body: bytes, content_type: str | None, *, what: str
) -> ImageIndex | ImageManifest:
    """Parse an index or image manifest (OCI or Docker v2); `what` names it in errors."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad_manifest(what, "it is not JSON") from None
    if not isinstance(data, dict):
        raise bad_manifest(what, "it is not a JSON object")
    media_type = data.get("mediaType")
    if not isinstance(media_type, str) or not media_type:
        media_type = (content_type or "").partition(";")[0].strip()
    if data.get("schemaVersion") == 1 or "fsLayers" in data:
        raise ImageError(
            ErrorCode.UNIMPLEMENTED,
            f"{what} has a Docker schema 1 manifest, which is not supported; push the image "
            "again with a current tool",
            field="image",
        )
    if data.get("schemaVersion") != 2:
        raise bad_manifest(what, "schemaVersion is not 2")
    if media_type in INDEX_MEDIA_TYPES or (
        media_type not in MANIFEST_MEDIA_TYPES and "manifests" in data
    ):
        manifests = data.get("manifests")
        if not isinstance(manifests, list):
            raise bad_manifest(what, "the index has no manifests list")
        return ImageIndex(
            tuple(_descriptor(m, what, f"manifests[{i}]") for i, m in enumerate(manifests))
        )
    if media_type in MANIFEST_MEDIA_TYPES or "layers" in data:
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise bad_manifest(what, "it has no layers list")
        return ImageManifest(
            config=_descriptor(data.get("config"), what, "config"),
            layers=tuple(
                _descriptor(layer, what, f"layers[{i}]") for i, layer in enumerate(layers)
            ),
        )
    raise bad_manifest(what, f"media type {media_type or 'unknown'!r} is not an image manifest")


def check_image_manifest(manifest: ImageManifest, *, what: str) -> tuple[Layer, ...]:
    """The manifest's layers, refusing what we cannot unpack before anything is fetched."""
    if manifest.config.media_type not in CONFIG_MEDIA_TYPES:
        raise bad_manifest(
            what, f"its config has media type {manifest.config.media_type!r}, not an image config"
        )
    if manifest.config.size > MAX_CONFIG_BYTES:
        raise bad_manifest(what, f"its config is larger than {MAX_CONFIG_BYTES} bytes")
    layers = []
    for index, descriptor in enumerate(manifest.layers):
        media_type = descriptor.media_type
        if media_type not in LAYER_COMPRESSION:
            if "zstd" in media_type:
                problem = "is zstd-compressed, which this agent cannot unpack yet"
                advice = "use a gzip-compressed variant of the image"
            else:
                problem = f"has media type {media_type!r}, which is not a layer we can unpack"
                advice = "use a standard OCI or Docker image"
            raise ImageError(
                ErrorCode.UNIMPLEMENTED,
                f"layer {index} ({descriptor.digest}) of {what} {problem}; {advice}",
                field="image",
            )
        layers.append(Layer(digest=descriptor.digest, media_type=media_type, size=descriptor.size))
    return tuple(layers)


def choose_manifest(index: ImageIndex, platform: Platform, *, what: str) -> Descriptor:
    """The index entry for `platform`: same os and architecture; the variant must match when
    both name one, and an exact variant (or none) is preferred."""
    candidates = [
        d
        for d in index.manifests
        if d.platform is not None
        and d.platform.os == platform.os
        and d.platform.architecture == platform.architecture
        and (platform.variant is None or d.platform.variant in (None, platform.variant))
    ]
    for descriptor in candidates:
        assert descriptor.platform is not None
        if descriptor.platform.variant == platform.variant:
            return descriptor
    if candidates:
        return candidates[0]
    offered = sorted(
        {str(d.platform) for d in index.manifests if d.platform and d.platform.os != "unknown"}
    )
    raise ImageError(
        ErrorCode.NOT_FOUND,
        f"{what} has no manifest for this node's platform {platform} (it has: "
        f"{', '.join(offered) or 'none'}); use an image built for {platform}",
        field="image",
    )


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return ()


def parse_image_config(body: bytes, *, what: str) -> tuple[ImageConfig, tuple[str, ...]]:
    """The run settings and the layers' diff_ids out of an image config JSON."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad_manifest(what, "its config is not JSON") from None
    if not isinstance(data, dict):
        raise bad_manifest(what, "its config is not a JSON object")
    config = data.get("config") or {}
    if not isinstance(config, dict):
        raise bad_manifest(what, "its config's 'config' is not an object")
    rootfs = data.get("rootfs")
    diff_ids = _strings(rootfs.get("diff_ids")) if isinstance(rootfs, dict) else ()
    if not all(DIGEST_RE.fullmatch(d) for d in diff_ids):
        raise bad_manifest(what, "its config has a diff_id that is not a sha256 digest")
    ports = config.get("ExposedPorts")
    working_dir = config.get("WorkingDir")
    user = config.get("User")
    return (
        ImageConfig(
            env=_strings(config.get("Env")),
            entrypoint=_strings(config.get("Entrypoint")),
            cmd=_strings(config.get("Cmd")),
            working_dir=working_dir if isinstance(working_dir, str) else "",
            user=user if isinstance(user, str) else "",
            exposed_ports=tuple(sorted(ports)) if isinstance(ports, dict) else (),
        ),
        diff_ids,
    )
