"""Image references (`registry/repository:tag@digest`) parsed as Docker does, which
registries are reached over plain HTTP, and the platform (`linux/amd64`) an image is chosen for.
"""

from __future__ import annotations

import ipaddress
import platform as platform_module
import re
from collections.abc import Iterable

import attrs

from wire.errors import ApiError, ErrorCode

DOCKER_HUB = "registry-1.docker.io"
"""Where Docker Hub's registry API lives; `busybox` means `registry-1.docker.io/library/busybox`."""
_DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", DOCKER_HUB})
PULL_POLICIES = ("if-not-present", "always")
_NAME_MAX = 255
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_REGISTRY_RE = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]{{1,5}})?"
)
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
DIGEST_RE = re.compile(r"sha256:[a-f0-9]{64}")
ANY_DIGEST_RE = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+")


class ImageError(ApiError):
    """A pull failed; the message names the image or registry and what to do about it."""


_ARCHITECTURES = {
    "x86_64": ("amd64", None),
    "amd64": ("amd64", None),
    "aarch64": ("arm64", None),
    "arm64": ("arm64", None),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i386": ("386", None),
    "i686": ("386", None),
}
"""`uname -m` → OCI's architecture and variant."""


@attrs.frozen
class Platform:
    """An image platform as an OCI index names it (`os`, `architecture`, `variant`): what a
    worker picks from an index, and what the simulated registry writes into one."""

    os: str
    architecture: str
    variant: str | None = None

    @classmethod
    def of_this_node(cls) -> Platform:
        machine = platform_module.machine().lower()
        architecture, variant = _ARCHITECTURES.get(machine, (machine, None))
        return cls(os="linux", architecture=architecture, variant=variant)

    def __str__(self) -> str:
        text = f"{self.os}/{self.architecture}"
        return f"{text}/{self.variant}" if self.variant else text


@attrs.frozen
class ImageReference:
    """A parsed image reference: `registry/repository[:tag][@digest]`, Docker Hub normalised."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> ImageReference:
        """Parse `text` as Docker does: no registry means Docker Hub (`library/` for one-part
        names), neither tag nor digest means tag `latest`. Errors name the reference."""
        return parse_reference(text)

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    @property
    def scope(self) -> str:
        """The token scope that lets us pull this repository."""
        return f"repository:{self.repository}:pull"


def _invalid(text: str, problem: str) -> ImageError:
    return ImageError(
        ErrorCode.INVALID_ARGUMENT,
        f"image reference {text!r} is not valid: {problem}",
        field="image",
    )


def parse_reference(text: str) -> ImageReference:
    """See `ImageReference.parse`."""
    if not text or not text.strip():
        raise _invalid(text, "it is empty; give an image such as busybox:latest")
    if text != text.strip() or any(c.isspace() for c in text):
        raise _invalid(text, "it contains whitespace; remove it")
    name, at, digest = text.partition("@")
    if at and not DIGEST_RE.fullmatch(digest):
        if ANY_DIGEST_RE.fullmatch(digest) and not digest.startswith("sha256:"):
            raise ImageError(
                ErrorCode.UNIMPLEMENTED,
                f"image reference {text!r} uses digest algorithm "
                f"{digest.partition(':')[0]!r}; only sha256 digests are supported",
                field="image",
            )
        raise _invalid(
            text, "the digest after '@' must be sha256: followed by 64 lowercase hex digits"
        )
    slash = name.find("/")
    first = name[:slash] if slash >= 0 else ""
    if slash >= 0 and (
        "." in first or ":" in first or first == "localhost" or first.lower() != first
    ):
        registry, remainder = first, name[slash + 1 :]
        if not _REGISTRY_RE.fullmatch(registry):
            raise _invalid(text, f"registry {registry!r} is not a valid host[:port]")
    else:
        registry, remainder = DOCKER_HUB, name
    repository, colon, tag = remainder.rpartition(":")
    if not colon or "/" in tag:
        repository, tag = remainder, ""
    elif not _TAG_RE.fullmatch(tag):
        raise _invalid(
            text,
            "the tag must be 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' "
            "or '-'",
        )
    if not repository:
        raise _invalid(text, "the repository name is missing")
    if not _REPOSITORY_RE.fullmatch(repository):
        problem = "the repository name must be lowercase letters and digits"
        if repository.lower() != repository:
            problem = "the repository name must be lowercase"
        raise _invalid(
            text,
            f"{problem}, parts separated by '/' and joined by '.', '_', '__' or '-'",
        )
    if registry in _DOCKER_HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in repository:
            repository = f"library/{repository}"
    if len(registry) + 1 + len(repository) > _NAME_MAX:
        raise _invalid(text, f"the name is longer than {_NAME_MAX} characters")
    return ImageReference(
        registry=registry,
        repository=repository,
        tag=tag or (None if at else "latest"),
        digest=digest or None,
    )


def host_of(address: str) -> str:
    """`host` out of `host[:port]` (brackets kept off an IPv6 literal)."""
    if address.startswith("["):
        return address[1 : address.find("]")]
    return address.rpartition(":")[0] if ":" in address else address


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def registry_scheme(registry: str, insecure_registries: Iterable[str] = ()) -> str:
    """Plain HTTP only for loopback registries and those configured as insecure."""
    insecure = set(insecure_registries)
    host = host_of(registry)
    if is_loopback(host) or registry in insecure or host in insecure:
        return "http"
    return "https"


def registry_address(registry: str, scheme: str) -> str:
    """`host:port` for messages, with the scheme's default port filled in."""
    if registry.endswith("]") or ":" not in registry or registry.count(":") > 1:
        return f"{registry}:{443 if scheme == 'https' else 80}"
    return registry


METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata", "metadata.goog"})
"""Cloud metadata servers by name (each resolves to 169.254.169.254, refused by address too)."""
ALLOW_LOCAL_SETTING = "allowLocalRegistries: true on the pool (LEVERS9_ALLOW_LOCAL_REGISTRIES=1)"


def _local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_link_local or address.is_unspecified


def local_registry_refusal(
    registry: str,
    resolved: Iterable[str] = (),
    own: Iterable[str] = (),
) -> str | None:
    """Why a worker may not pull from `registry` (`host[:port]`), or None. Pure.

    A workspace names any registry it likes, and with hostNetwork a worker's loopback is the
    node's: a registry on loopback, on a link-local address (the cloud's metadata server) or
    on one of the node's `own` addresses would let a task probe the node's ports. The host is
    judged as written and by every address it `resolved` to; the reason is the same whatever
    is listening there, so it tells nothing about the port."""
    host = host_of(registry).lower().rstrip(".")
    why = None
    if host == "localhost" or host.endswith(".localhost") or host in METADATA_HOSTS:
        why = "a name for this node or its metadata server"
    mine = {ipaddress.ip_address(a) for a in own}
    for text in (host, *resolved):
        try:
            address = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        if _local(address):
            why = why or "a loopback or link-local address"
        elif address in mine:
            why = why or "an address of the node itself"
    if why is None:
        return None
    return (
        f"image registry {registry} is refused: it is {why}, which workers do not pull from "
        f"(an operator allows it with {ALLOW_LOCAL_SETTING}); use a registry elsewhere"
    )
