"""Pure parts of a volume: bucket URLs, the checks on a spec, and the keys that decide when
two volumes share one mount (workspace, bucket, credentials digest).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

# /proc/self/mountinfo is read the same way for rootfs overlays and for bucket mounts.
from wire.backoff import (
    Backoff,
)
from wire.errors import ApiError, ErrorCode
from workerapi.models import GcsCredentials, VolumeSpec
from workerapi.validation import canonical_mount_path

EventCallback = Callable[[tuple[str, ...], str], None]
_PROCESS_KEY = secrets.token_bytes(32)
"""Keys the credential hashes; new in every process, so a hash says nothing after a restart."""


class VolumeError(ApiError):
    """A volume could not be mounted, probed or released; the message names the bucket."""


@attrs.frozen
class BucketUrl:
    scheme: str
    """`s3` or `gs`"""
    bucket: str
    prefix: str
    """Without leading or trailing slash; empty for the whole bucket."""

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")


_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_PREFIX_SEGMENT = re.compile(r"[A-Za-z0-9._=+@-]+")
_WORKSPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def _invalid(field: str, message: str) -> VolumeError:
    return VolumeError(ErrorCode.INVALID_ARGUMENT, message, field=field)


def parse_bucket_url(url: str) -> BucketUrl:
    """`s3://bucket/some/prefix` -> its parts; errors name the field `url`."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("s3", "gs"):
        raise _invalid(
            "url",
            f"volume url {url!r} must start with s3:// or gs:// followed by the bucket name",
        )
    bucket, _, prefix = rest.partition("/")
    pattern = _S3_BUCKET if scheme == "s3" else _GCS_BUCKET
    if not pattern.fullmatch(bucket):
        raise _invalid(
            "url",
            f"volume url {url!r} has no valid bucket name (3-63 lowercase letters, digits, "
            "dots and hyphens, starting and ending with a letter or digit)",
        )
    segments = [segment for segment in prefix.split("/") if segment]
    for segment in segments:
        if segment in (".", "..") or not _PREFIX_SEGMENT.fullmatch(segment):
            raise _invalid(
                "url",
                f"volume url {url!r} has a prefix part {segment!r} that is not allowed; use "
                "letters, digits and . _ - = + @ between slashes, no '.' or '..'",
            )
    return BucketUrl(scheme, bucket, "/".join(segments))


def _check_endpoint(endpoint: str) -> None:
    scheme, sep, rest = endpoint.partition("://")
    host_port = rest.split("/", 1)[0]
    host = host_port.rsplit(":", 1)[0] if host_port.count(":") == 1 else host_port
    if not sep or scheme not in ("https", "http") or not host_port:
        raise _invalid(
            "s3.endpoint",
            f"endpoint {endpoint!r} is not a URL; give https://host[:port]",
        )
    if "@" in host_port or any(mark in rest for mark in "?#"):
        raise _invalid(
            "s3.endpoint",
            "the endpoint must be https://host[:port] without user, query or fragment; "
            "credentials go in the credential fields",
        )
    if scheme == "http" and host not in ("127.0.0.1", "localhost", "[::1]"):
        raise _invalid(
            "s3.endpoint",
            f"endpoint {endpoint!r} is plain http; use https (plain http is accepted only on "
            "this machine's loopback)",
        )


def _check_secret(field: str, value: str | None, what: str) -> None:
    if not value:
        raise _invalid(field, f"{what} is empty; give the workspace's {what}")
    if "\x00" in value:
        raise _invalid(field, f"{what} contains a NUL character; it cannot be passed to rclone")


def bucket_url_of(spec: VolumeSpec) -> BucketUrl:
    return parse_bucket_url(spec.url)


def validate_volume(spec: VolumeSpec) -> BucketUrl:
    """Check every field; errors are INVALID_ARGUMENT naming the field (camelCase)."""
    if not _WORKSPACE.fullmatch(spec.workspace):
        raise _invalid(
            "workspace",
            f"workspace {spec.workspace!r} must be 1-128 letters, digits, '.', '_' or '-'",
        )
    parsed = parse_bucket_url(spec.url)
    _check_mount_path(spec.mount_path)
    if parsed.scheme == "s3":
        if spec.gcs is not None:
            raise _invalid("gcs", "an s3:// volume takes s3 credentials, not gcs ones")
        if spec.s3 is None:
            raise _invalid("s3", f"volume {parsed} needs s3 credentials (access key id and secret)")
        _check_secret("s3.accessKeyId", spec.s3.access_key_id, "access key id")
        _check_secret("s3.secretAccessKey", spec.s3.secret_access_key, "secret access key")
        if spec.s3.session_token is not None:
            _check_secret("s3.sessionToken", spec.s3.session_token, "session token")
        if spec.s3.endpoint is not None:
            _check_endpoint(spec.s3.endpoint)
        if not _REGION.fullmatch(spec.s3.region):
            raise _invalid(
                "s3.region",
                f"region {spec.s3.region!r} is not a region name (like us-east-1)",
            )
    else:
        if spec.s3 is not None:
            raise _invalid("s3", "a gs:// volume takes gcs credentials, not s3 ones")
        if spec.gcs is None:
            raise _invalid(
                "gcs",
                f"volume {parsed} needs gcs credentials (a service-account key or HMAC keys)",
            )
        _check_gcs(spec.gcs)
    return parsed


def _check_mount_path(path: str) -> None:
    try:
        canonical_mount_path(path)
    except ValueError as exc:
        raise _invalid("mountPath", str(exc)) from None


def _check_gcs(gcs: GcsCredentials) -> None:
    has_json = gcs.service_account_json is not None
    has_hmac = gcs.hmac_access_id is not None or gcs.hmac_secret is not None
    if has_json == has_hmac:
        raise _invalid(
            "gcs",
            "give either a service-account key (serviceAccountJson) or HMAC keys "
            "(hmacAccessId and hmacSecret), exactly one of the two",
        )
    if has_json:
        _check_secret("gcs.serviceAccountJson", gcs.service_account_json, "service-account key")
        try:
            document = json.loads(gcs.service_account_json or "")
        except ValueError:
            document = None
        if not isinstance(document, dict) or "private_key" not in document:
            # The value is never quoted back: it is a secret.
            raise _invalid(
                "gcs.serviceAccountJson",
                "the service-account key is not a JSON key file with a private_key; "
                "paste the JSON key file downloaded for the service account",
            )
    else:
        _check_secret("gcs.hmacAccessId", gcs.hmac_access_id, "HMAC access id")
        _check_secret("gcs.hmacSecret", gcs.hmac_secret, "HMAC secret")


@attrs.frozen
class MountedVolume:
    """What the manager binds into a container: `host_path` at the spec's mount path."""

    spec_url: str
    host_path: Path
    read_only: bool
    key: str


@attrs.frozen
class MountStatistics:
    key: str
    workspace: str
    url: str
    host_path: Path
    read_only: bool
    holders: tuple[str, ...]
    pid: int | None
    """rclone's process id; None while it is being restarted."""
    remounts: int
    failed_uploads: int


@attrs.frozen
class VolumesStatistics:
    mounts: tuple[MountStatistics, ...]

    @property
    def holders(self) -> int:
        return len({holder for mount in self.mounts for holder in mount.holders})


@attrs.frozen
class VolumeOptions:
    """Policy for mounts; every duration is in seconds."""

    dir_cache_s: float = 5.0
    """How long rclone trusts a directory listing; objects written by others show after this."""
    cache_max_age_s: float = 60.0
    """How long an uploaded file's data stays in the local write cache."""
    start_timeout_s: float = 30.0
    """From starting rclone to its FUSE mount and control API being up."""
    probe_timeout_s: float = 30.0
    """The probe's list request; an endpoint that does not answer within this is unreachable."""
    connect_timeout_s: float = 15.0
    upload_poll_s: float = 0.05
    stop_grace_s: float = 10.0
    """How long rclone may take to exit by itself after its mount is gone."""
    shutdown_drain_s: float = 10.0
    """On shutdown, how long pending uploads may take before the mounts go anyway."""
    teardown_timeout_s: float = 40.0
    log_poll_min_s: float = 0.01
    log_poll_max_s: float = 0.2
    log_max_bytes: int = 8 << 20
    """rclone's log file is emptied (once read) when it grows past this."""
    remount_backoff: Backoff = Backoff(initial_s=0.2, factor=2.0, cap_s=30.0, stable_s=60.0)


def credentials_digest(spec: VolumeSpec, key: bytes = _PROCESS_KEY) -> str:
    """A keyed hash of the credentials and where they are used; never the secret itself."""
    material: dict[str, Any] = {"s3": None, "gcs": None}
    if spec.s3 is not None:
        material["s3"] = attrs.asdict(spec.s3)
    if spec.gcs is not None:
        material["gcs"] = attrs.asdict(spec.gcs)
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, key=key, digest_size=16).hexdigest()


def mount_key(spec: VolumeSpec, key: bytes = _PROCESS_KEY) -> str:
    """Mounts with equal keys are shared: same workspace, bucket, prefix, mode and credentials."""
    parsed = bucket_url_of(spec)
    mode = "ro" if spec.read_only else "rw"
    return f"{spec.workspace}|{parsed}|{mode}|{credentials_digest(spec, key)}"


def mount_name(key_text: str, serial: int, key: bytes = _PROCESS_KEY) -> str:
    """The directory name of one mount: a serial and a keyed hash, nothing readable."""
    digest = hashlib.blake2b(key_text.encode(), key=key, digest_size=8).hexdigest()
    return f"{serial:05d}-{digest}"


def spec_secrets(spec: VolumeSpec) -> tuple[str, ...]:
    values: list[str | None] = []
    if spec.s3 is not None:
        values += [spec.s3.access_key_id, spec.s3.secret_access_key, spec.s3.session_token]
    if spec.gcs is not None:
        values += [spec.gcs.service_account_json, spec.gcs.hmac_access_id, spec.gcs.hmac_secret]
        try:
            document = json.loads(spec.gcs.service_account_json or "null")
        except ValueError:
            document = None
        if isinstance(document, dict):
            values += [
                str(document.get("private_key") or ""),
                str(document.get("private_key_id") or ""),
            ]
    return tuple(value for value in values if value)
