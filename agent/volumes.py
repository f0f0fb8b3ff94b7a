"""Workspace buckets as directories: one rclone FUSE mount per (workspace, bucket, credentials).

Why this module exists: a container may ask for its workspace's bucket (`s3://` or `gs://`)
at a path of its own. The container manager calls `Volumes.acquire` before the container
starts and binds the returned host path into it (`rbind`, `rslave`), and calls
`Volumes.release` after the container ended. Everything about rclone lives here; the manager
never sees a credential after handing the spec over.

Design choices:

- **Pure decisions, thin I/O.** URL parsing, validation, the mount key, rclone's environment
  and argv, the reading of rclone's JSON log lines, the wording of probe errors, mountinfo
  parsing and the sweep plan are plain functions, tested without processes. `Volumes` carries
  them out: rclone processes, its remote-control API (httpx on loopback) and mount(2).
- **Credentials reach rclone only through its environment** (`RCLONE_S3_*`, `RCLONE_GCS_*`,
  with `RCLONE_CONFIG` pointing at nothing). They are never in argv, never in a file, never in
  a log line or an error message: every text that came from rclone is scrubbed of the mount's
  secrets before it is logged or reported. They stay in memory so a mount whose rclone died
  can be made again.
- **Sharing by key.** The key is (workspace, scheme, bucket, prefix, mode, a keyed hash of the
  credentials and endpoint under a per-process random key): two containers of one workspace
  with the same bucket and credentials share one rclone; other workspaces never do. The
  directories are named by a hash of the key, so no path tells anything about a secret.
  Read-only volumes run rclone with `--read-only` and so are a mount of their own.
- **Probe before use.** rclone connects lazily (a mount with wrong keys "works" and then
  every access fails with EIO), so before each mount a short-lived `rclone lsjson` lists a
  random name under the prefix with the same environment: one small request however large
  the bucket, and few retries, so an unreachable endpoint is named in a moment. Its error
  lines give the reason (access denied, no such bucket, endpoint unreachable...).
- **Remounts reach running containers.** Each mount's directory `P` is bound onto itself and
  made a shared mount; the FUSE mount at `P/volume` is therefore shared too, and a container
  that bound it with `rslave` holds a slave copy. When rclone dies its mount is left where it
  is, and the new rclone's mount is bound *on top of it*: a mount made on a shared mount
  propagates to its slaves, so the container's path shows the new mount (unmounting the dead
  one first would not propagate, the container's copy would stay dead). rclone itself always
  mounts at a private staging directory first, because it refuses a mount point whose
  filesystem is dead (`stat` fails with ENOTCONN).
- **Durable when released.** rclone 1.60 with `--vfs-write-back 0s` uploads synchronously
  inside the FUSE release of the file: that upload is invisible to `vfs/stats` and a failure is
  not retried. A write-back of 1 ms puts each closed file on rclone's write-back queue, which
  `vfs/stats` counts (`uploadsInProgress`, `uploadsQueued`) and which retries failures. `release`
  first makes a FUSE round trip (so every file close the kernel already queued has reached
  rclone), then polls `vfs/stats` until nothing is uploading and everything still queued has
  failed at least once; failures come from rclone's `failed to upload` log lines, are sent as
  events when they happen and returned by `release`. rclone logs (JSON) to a file in the
  mount's private cache directory, which a task follows: with a pipe, rclone (Go) would die
  of SIGPIPE at its next log line once the agent is gone, under containers that outlive it.
- **Leftovers of a dead agent** (mounts under the root, rclone processes) are found from
  `/proc/self/mountinfo` and the process table by `sweep`, which unmounts and kills them; the
  manager decides what else to do, since credentials do not survive a restart.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import stat
import subprocess
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import httpx
import trio

from agent.backoff import (
    Backoff,
    BackoffState,
    next_delay,
    record_connected,
    record_disconnect,
    record_failure,
)
from agent.models import ApiError, ErrorCode, GcsCredentials, S3Credentials, VolumeSpec

# /proc/self/mountinfo is read the same way for rootfs overlays and for bucket mounts.
from agent.rootfs import MountEntry, parse_mountinfo

__all__ = [
    "GcsCredentials",
    "MountStatistics",
    "MountedVolume",
    "S3Credentials",
    "VolumeError",
    "VolumeOptions",
    "VolumeSpec",
    "Volumes",
    "VolumesStatistics",
    "bucket_url_of",
    "validate_volume",
]

log = logging.getLogger("levers9.volumes")

EventCallback = Callable[[tuple[str, ...], str], None]

_PROCESS_KEY = secrets.token_bytes(32)
"""Keys the credential hashes; new in every process, so a hash says nothing after a restart."""

_RC_USER = "levers9"
_GCS_ENDPOINT = "https://storage.googleapis.com"
_PROBE_PREFIX = ".levers9-probe-"
_BARRIER_PREFIX = ".levers9-barrier-"
_SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MAX_LINE_BYTES = 64 * 1024
_MAX_REASON_CHARS = 200


class VolumeError(ApiError):
    """A volume could not be mounted, probed or released; the message names the bucket."""


# -- specs ------------------------------------------------------------------------------------


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
_FORBIDDEN_MOUNT_PATHS = frozenset(
    {
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/proc",
        "/run",
        "/sbin",
        "/sys",
        "/tmp",
        "/usr",
        "/var",
    }
)
_FORBIDDEN_MOUNT_TREES = ("/proc", "/sys", "/dev")


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
    if not path.startswith("/"):
        raise _invalid("mountPath", f"mount path {path!r} must be absolute (start with /)")
    if "\x00" in path or any(part in (".", "..") for part in path.split("/")):
        raise _invalid("mountPath", f"mount path {path!r} must not contain '.', '..' or NUL")
    normal = str(PurePosixPath(path))
    if normal in _FORBIDDEN_MOUNT_PATHS or any(
        normal.startswith(tree + "/") for tree in _FORBIDDEN_MOUNT_TREES
    ):
        raise _invalid(
            "mountPath",
            f"mount path {path!r} would hide a system directory; choose a path of its own "
            "such as /data or /workspace/bucket",
        )


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


# -- keys, environment, argv: pure -------------------------------------------------------------


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


def _probe_name() -> str:
    return f"{_PROBE_PREFIX}{secrets.token_hex(6)}"


def rclone_remote(spec: VolumeSpec) -> str:
    """rclone's on-the-fly remote for the volume (`:s3:bucket/prefix`); its config is env."""
    parsed = bucket_url_of(spec)
    backend = "gcs" if spec.gcs is not None and spec.gcs.service_account_json else "s3"
    path = f"{parsed.bucket}/{parsed.prefix}".rstrip("/")
    return f":{backend}:{path}"


def endpoint_label(spec: VolumeSpec) -> str:
    if spec.s3 is not None:
        return spec.s3.endpoint or f"AWS S3 ({spec.s3.region})"
    return "Google Cloud Storage"


def rclone_environment(
    spec: VolumeSpec, *, rc_password: str | None, home: str, search_path: str = _SEARCH_PATH
) -> dict[str, str]:
    """rclone's whole environment: its backend configuration, credentials included.

    Nothing is inherited from the agent's environment (an `AWS_CA_BUNDLE` or `AWS_*` keys
    there would change what rclone does); the config file points at nothing, so rclone reads
    no file for its configuration."""
    env = {"PATH": search_path, "HOME": home, "RCLONE_CONFIG": "/nonexistent"}
    if rc_password is not None:
        env.update({"RCLONE_RC_USER": _RC_USER, "RCLONE_RC_PASS": rc_password})
    if spec.s3 is not None:
        s3 = spec.s3
        env.update(
            {
                "RCLONE_S3_PROVIDER": "AWS" if s3.endpoint is None else "Other",
                "RCLONE_S3_ENV_AUTH": "false",
                "RCLONE_S3_REGION": s3.region,
                "RCLONE_S3_NO_CHECK_BUCKET": "true",
                # AWS wants virtual-hosted names; other stores mostly only know paths.
                "RCLONE_S3_FORCE_PATH_STYLE": "false" if s3.endpoint is None else "true",
                "RCLONE_S3_ACCESS_KEY_ID": s3.access_key_id,
                "RCLONE_S3_SECRET_ACCESS_KEY": s3.secret_access_key,
            }
        )
        if s3.endpoint is not None:
            env["RCLONE_S3_ENDPOINT"] = s3.endpoint
        if s3.session_token is not None:
            env["RCLONE_S3_SESSION_TOKEN"] = s3.session_token
    elif spec.gcs is not None:
        gcs = spec.gcs
        if gcs.service_account_json:
            env.update(
                {
                    "RCLONE_GCS_SERVICE_ACCOUNT_CREDENTIALS": gcs.service_account_json,
                    # Buckets with uniform access refuse per-object ACLs.
                    "RCLONE_GCS_BUCKET_POLICY_ONLY": "true",
                }
            )
        else:
            # HMAC keys go through GCS's S3-compatible XML API; rclone 1.60 has no GCS
            # provider for s3, "Other" with Google's endpoint does the same.
            env.update(
                {
                    "RCLONE_S3_PROVIDER": "Other",
                    "RCLONE_S3_ENV_AUTH": "false",
                    "RCLONE_S3_ENDPOINT": _GCS_ENDPOINT,
                    "RCLONE_S3_REGION": "auto",
                    "RCLONE_S3_NO_CHECK_BUCKET": "true",
                    "RCLONE_S3_FORCE_PATH_STYLE": "true",
                    "RCLONE_S3_ACCESS_KEY_ID": gcs.hmac_access_id or "",
                    "RCLONE_S3_SECRET_ACCESS_KEY": gcs.hmac_secret or "",
                }
            )
    return env


def _seconds(value: float) -> str:
    return f"{max(value, 0.001):g}s"


def rclone_argv(
    rclone: str,
    remote: str,
    mount_point: Path,
    *,
    name: str,
    cache_dir: Path,
    read_only: bool,
    options: VolumeOptions,
    ca_file: Path | None = None,
) -> list[str]:
    """`rclone mount` with nothing secret in it (argv is world-readable in /proc)."""
    argv = [
        rclone,
        "mount",
        remote,
        str(mount_point),
        "--devname",
        f"levers9-{name}",
        "--allow-other",
        "--vfs-cache-mode",
        "writes",
        # 1 ms, not 0 s: see the module docstring (0 s uploads inside the FUSE release,
        # invisible to vfs/stats and never retried).
        "--vfs-write-back",
        "1ms",
        "--vfs-cache-max-age",
        _seconds(options.cache_max_age_s),
        "--dir-cache-time",
        _seconds(options.dir_cache_s),
        "--cache-dir",
        str(cache_dir),
        # Multipart uploads break on moto and buy nothing below 5 GiB.
        "--s3-upload-cutoff",
        "5G",
        "--contimeout",
        _seconds(options.connect_timeout_s),
        # Reads: no MD5 over every byte read (a quarter of rclone's CPU on a sequential read,
        # measured +25% read throughput); TLS already guards the bytes in transit. Uploads are
        # still checked: the store verifies the Content-MD5 rclone sends with each PUT.
        "--no-checksum",
        "--rc",
        "--rc-addr",
        "127.0.0.1:0",
        "--use-json-log",
        "--log-level",
        "INFO",
        "--stats",
        "0",
    ]
    if ca_file is not None:
        argv += ["--ca-cert", str(ca_file)]
    if read_only:
        argv.append("--read-only")
    return argv


def rclone_probe_argv(
    rclone: str, remote: str, *, options: VolumeOptions, ca_file: Path | None = None
) -> list[str]:
    """`rclone lsjson` of `remote` with few retries; nothing secret in it either."""
    argv = [
        rclone,
        "lsjson",
        remote,
        "--low-level-retries",
        "2",
        "--retries",
        "1",
        "--contimeout",
        _seconds(options.connect_timeout_s),
        "--use-json-log",
        "--log-level",
        "ERROR",
    ]
    if ca_file is not None:
        argv += ["--ca-cert", str(ca_file)]
    return argv


def scrub(text: str, secrets_: Iterable[str | None]) -> str:
    """`text` with every secret replaced; applied to whatever came from rclone or a server."""
    for secret in sorted((s for s in secrets_ if s and len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, "[redacted]")
    return text


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


# -- rclone's log lines: pure ------------------------------------------------------------------


@attrs.frozen
class RcServing:
    port: int


@attrs.frozen
class UploadFailed:
    name: str
    reason: str


@attrs.frozen
class UploadSucceeded:
    name: str


@attrs.frozen
class RcloneFailure:
    """An error-level line; kept (scrubbed) to explain an exit."""

    message: str


RcloneLine = RcServing | UploadFailed | UploadSucceeded | RcloneFailure

_SERVING = re.compile(r"Serving remote control on https?://127\.0\.0\.1:(\d+)/")
_FAILED_UPLOAD = re.compile(
    r"vfs cache: failed to upload try #\d+, will retry in [^:]+: (.*)", re.S
)

_REASONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"NoSuchBucket|directory not found"), "no such bucket (NoSuchBucket)"),
    (re.compile(r"AccessDenied|AllAccessDisabled|Forbidden"), "access denied (AccessDenied)"),
    (
        re.compile(r"SignatureDoesNotMatch"),
        "the secret does not match the access key (SignatureDoesNotMatch)",
    ),
    (
        re.compile(r"InvalidAccessKeyId|InvalidClientTokenId|UnrecognizedClient"),
        "unknown access key (InvalidAccessKeyId)",
    ),
    (
        re.compile(r"ExpiredToken|InvalidToken|TokenRefreshRequired"),
        "session token expired or invalid (ExpiredToken)",
    ),
    (re.compile(r"invalid_grant|oauth2"), "the service-account key was refused"),
    (re.compile(r"x509|certificate"), "the endpoint's TLS certificate is not trusted"),
    (
        re.compile(
            r"connection refused|no such host|i/o timeout|dial tcp|send request failed|"
            r"network is unreachable|connection reset|no route to host|context deadline"
        ),
        "endpoint unreachable",
    ),
    (re.compile(r"QuotaExceeded|SlowDown|TooManyRequests"), "rate limited by the store"),
    (re.compile(r"EntityTooLarge"), "the file is too large for one upload"),
)


def describe_failure(text: str) -> str:
    """A short reason for an rclone/S3 error text: a known phrase, else its first line."""
    for pattern, reason in _REASONS:
        if pattern.search(text):
            return reason
    first = text.strip().splitlines()[0] if text.strip() else "unknown error"
    # rclone nests errors as "what: why: ..."; the innermost part is the informative one.
    first = first.rsplit("remote: ", 1)[-1]
    return first[:_MAX_REASON_CHARS]


def parse_rclone_line(raw: bytes) -> RcloneLine | None:
    """One line of rclone's `--use-json-log` output -> what it means to us, or None."""
    try:
        record = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()
        # Go panics and fatal errors before logging is set up are plain text.
        return RcloneFailure(text[:_MAX_REASON_CHARS]) if text else None
    if not isinstance(record, dict):
        return None
    message = str(record.get("msg", ""))
    level = str(record.get("level", ""))
    name = str(record.get("object", ""))
    serving = _SERVING.search(message)
    if serving:
        return RcServing(int(serving.group(1)))
    failed = _FAILED_UPLOAD.match(message)
    if failed:
        return UploadFailed(name, describe_failure(failed.group(1)))
    if message.startswith("vfs cache: upload succeeded"):
        return UploadSucceeded(name)
    if level in ("error", "critical", "fatal") and "Unmounted rclone mount" not in message:
        return RcloneFailure(message[:_MAX_REASON_CHARS])
    return None


def uploads_settled(in_progress: int, queued: int, failing: int) -> bool:
    """Nothing uploading, and whatever waits in the queue is waiting to retry a failure."""
    return in_progress == 0 and queued <= failing


# -- probe errors: pure -----------------------------------------------------------------------


def probe_error(spec: VolumeSpec, text: str) -> VolumeError:
    """The error for a failed probe list (rclone's error lines): names the bucket, the
    endpoint and the reason."""
    parsed = bucket_url_of(spec)
    where = endpoint_label(spec)
    bucket = parsed.bucket
    credentials = "s3" if spec.s3 is not None else "gcs"
    reason = describe_failure(text)
    if reason.startswith("no such bucket"):
        return VolumeError(
            ErrorCode.NOT_FOUND,
            f"bucket {bucket!r} does not exist at {where} (no such bucket); check the bucket "
            "name in the volume's url",
            field="url",
        )
    if reason.startswith("access denied"):
        return VolumeError(
            ErrorCode.PERMISSION_DENIED,
            f"access denied to bucket {bucket!r} at {where}: the workspace's credentials may "
            f"not list {parsed}; grant them list and object access on it",
            field=credentials,
        )
    if reason.startswith("the secret does not match"):
        return VolumeError(
            ErrorCode.UNAUTHENTICATED,
            f"credentials for bucket {bucket!r} were refused by {where}: {reason}; check the "
            "workspace's secret access key",
            field=f"{credentials}.secretAccessKey" if credentials == "s3" else credentials,
        )
    if reason.startswith(("unknown access key", "session token", "the service-account key")):
        return VolumeError(
            ErrorCode.UNAUTHENTICATED,
            f"credentials for bucket {bucket!r} were refused by {where}: {reason}",
            field=credentials,
        )
    if reason in ("endpoint unreachable", "the endpoint's TLS certificate is not trusted"):
        return VolumeError(
            ErrorCode.UNAVAILABLE,
            f"bucket {bucket!r}: {reason} ({where}); check the endpoint and that this node "
            "can reach it",
            field=f"{credentials}.endpoint" if credentials == "s3" else credentials,
        )
    return VolumeError(
        ErrorCode.UNAVAILABLE,
        f"listing bucket {bucket!r} at {where} failed: {reason}",
        field="url",
    )


# -- mountinfo and the sweep plan: pure --------------------------------------------------------


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def sweep_targets(
    entries: Sequence[MountEntry], root: Path, keep: Collection[Path] = ()
) -> list[Path]:
    """Mount points under `root` to unmount, deepest first, except those under `keep`."""
    seen: dict[Path, None] = {}
    for entry in entries:
        point = entry.mount_point
        if point == root or not _is_under(point, root):
            continue
        if any(_is_under(point, kept) for kept in keep):
            continue
        seen[point] = None
    return sorted(seen, key=lambda path: (-len(path.parts), str(path)))


def is_mounted(entries: Sequence[MountEntry], path: Path) -> bool:
    return any(entry.mount_point == path for entry in entries)


# -- the kernel's mount calls: the one place mount(2) is used ----------------------------------

_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_SHARED = 1 << 20
_MNT_DETACH = 2


class _Kernel:
    """mount(2) and umount2(2) through libc; errors are OSError naming the path."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
        ]
        self._libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def _mount(self, source: Path | None, target: Path, flags: int) -> None:
        source_bytes = os.fsencode(source) if source is not None else None
        if self._libc.mount(source_bytes, os.fsencode(target), None, flags, None) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(target))

    def bind(self, source: Path, target: Path) -> None:
        self._mount(source, target, _MS_BIND)

    def make_shared_mount(self, path: Path) -> None:
        """Bind `path` onto itself and give it a peer group of its own."""
        self._mount(path, path, _MS_BIND)
        self._mount(None, path, _MS_PRIVATE)
        self._mount(None, path, _MS_SHARED)

    def unmount(self, path: Path, *, lazy: bool) -> bool:
        """True if something was unmounted, False if nothing is mounted at `path`."""
        if self._libc.umount2(os.fsencode(path), _MNT_DETACH if lazy else 0) == 0:
            return True
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(code, os.strerror(code), str(path))

    def unmount_all(self, path: Path) -> int:
        """Detach every mount stacked at `path` (a detach takes the stack above with it)."""
        count = 0
        for _ in range(64):
            if not self.unmount(path, lazy=True):
                break
            count += 1
        return count


def _read_mountinfo() -> list[MountEntry]:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
        return parse_mountinfo(file.read())


# -- mounts ------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Generation:
    """One rclone process of a mount; a remount is a new generation."""

    number: int
    process: trio.Process
    staging: Path
    log_path: Path
    client: httpx.AsyncClient
    rc_port: int | None = None
    rc_ready: trio.Event = attrs.Factory(trio.Event)
    exited: trio.Event = attrs.Factory(trio.Event)
    ready: bool = False
    stopped: bool = False
    last_error: str | None = None

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code is None:
            return "rclone is running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"rclone was killed by {name}"
        detail = f": {self.last_error}" if self.last_error else ""
        return f"rclone exited with status {code}{detail}"


@attrs.define(eq=False)
class _Mount:
    key: str
    name: str
    spec: VolumeSpec = attrs.field(repr=False)
    url: BucketUrl
    directory: Path
    """`P`: bound onto itself and shared; `host_path` is inside it."""
    host_path: Path
    cache_dir: Path
    staging_root: Path
    rc_password: str = attrs.field(repr=False)
    secrets: tuple[str, ...] = attrs.field(repr=False)
    holders: set[str] = attrs.Factory(set)
    generation: _Generation | None = None
    generations: int = 0
    remounts: int = 0
    failed_uploads: dict[str, str] = attrs.Factory(dict)
    close_requested: bool = False
    wake: trio.Event = attrs.Factory(trio.Event)
    closed: trio.Event = attrs.Factory(trio.Event)
    directory_shared: bool = False

    def volume(self) -> MountedVolume:
        return MountedVolume(
            spec_url=self.spec.url,
            host_path=self.host_path,
            read_only=self.spec.read_only,
            key=self.key,
        )

    def label(self) -> str:
        return f"{self.url} (workspace {self.spec.workspace})"

    def scrub(self, text: str) -> str:
        return scrub(text, (*self.secrets, self.rc_password))


class Volumes:
    """The node's bucket mounts: acquire/release by holder (a container), shared by key.

    Run it in a nursery (`await nursery.start(volumes.run)`); it owns every rclone process and
    the tasks that read their logs and restart them, and unmounts everything when cancelled.
    `on_event(holders, message)` hears what holders should know (a remount, a failed
    upload); messages never contain a secret.
    """

    def __init__(
        self,
        root: Path,
        *,
        rclone: str = "rclone",
        on_event: EventCallback | None = None,
        ca_file: Path | None = None,
        options: VolumeOptions | None = None,
    ) -> None:
        self._root = Path(root)
        self._rclone = rclone
        self._on_event = on_event
        self._ca_file = ca_file
        self._options = options or VolumeOptions()
        self._kernel = _Kernel()
        self._nursery: trio.Nursery | None = None
        self._mounts: dict[str, _Mount] = {}
        self._live: dict[str, _Mount] = {}
        """Every mount instance with directories (starting, serving or closing), by name."""
        self._locks: dict[str, trio.Lock] = {}
        self._serial = 0

    # -- public ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; then every mount is drained (briefly) and unmounted."""
        if self._nursery is not None:
            raise RuntimeError("Volumes.run is already running")
        await trio.to_thread.run_sync(self._make_root)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def acquire(self, spec: VolumeSpec, holder: str) -> MountedVolume:
        """Mount `spec`'s bucket for `holder`, or share the mount that has the same key.

        A new mount is probed (one list request) before this returns; a failure is a
        `VolumeError` naming the bucket and the reason, and leaves no mount behind."""
        validate_volume(spec)
        key = mount_key(spec)
        lock = self._locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                mount = self._mounts.get(key)
                if mount is None:
                    mount = await self._start_mount(spec, key)
                    self._mounts[key] = mount
                mount.holders.add(holder)
                return mount.volume()
        finally:
            if lock.statistics().tasks_waiting == 0 and not lock.locked():
                self._locks.pop(key, None)

    async def release(self, holder: str) -> list[str]:
        """`holder` is done (its container ended): wait until what was written through its
        mounts is in the bucket, unmount those no one else holds, and return the problems
        (failed uploads, each naming the file and the bucket); an empty list means durable."""
        mounts = [mount for mount in self._mounts.values() if holder in mount.holders]
        for mount in mounts:
            mount.holders.discard(holder)
        found: list[tuple[_Mount, list[str]]] = []
        try:
            for mount in mounts:
                found.append((mount, await self._wait_uploaded(mount)))
        finally:
            # Also when cancelled: a mount no one holds must not stay behind.
            for mount in mounts:
                if not mount.holders:
                    self._request_close(mount)
        problems: list[str] = []
        for mount, mount_problems in found:
            suffix = ""
            if mount.close_requested:
                await mount.closed.wait()
                suffix = "; the volume is unmounted, so this data was not saved"
            problems += [
                f"{problem}{suffix}" if problem.startswith("upload of") else problem
                for problem in mount_problems
            ]
        return problems

    async def wait_uploaded(self, holder: str) -> list[str]:
        """Wait until what was written through `holder`'s mounts is uploaded (or has failed);
        return the failures. `release` does this before it unmounts."""
        problems: list[str] = []
        for mount in [m for m in self._mounts.values() if holder in m.holders]:
            problems += await self._wait_uploaded(mount)
        return problems

    async def sweep(self) -> list[Path]:
        """Unmount what a previous agent left under the root and kill its rclone processes.

        Returns the mount points that were unmounted. Mounts of this instance are left alone."""
        keep = [mount.directory for mount in self._live.values()]
        keep += [mount.staging_root for mount in self._live.values()]
        keep_pids = {
            mount.generation.process.pid
            for mount in self._live.values()
            if mount.generation is not None
        }
        return await trio.to_thread.run_sync(self._sweep_sync, keep, keep_pids)

    def statistics(self) -> VolumesStatistics:
        mounts = []
        for mount in self._mounts.values():
            generation = mount.generation
            alive = generation is not None and not generation.exited.is_set()
            mounts.append(
                MountStatistics(
                    key=mount.key,
                    workspace=mount.spec.workspace,
                    url=str(mount.url),
                    host_path=mount.host_path,
                    read_only=mount.spec.read_only,
                    holders=tuple(sorted(mount.holders)),
                    pid=generation.process.pid if alive and generation is not None else None,
                    remounts=mount.remounts,
                    failed_uploads=len(mount.failed_uploads),
                )
            )
        return VolumesStatistics(tuple(mounts))

    # -- starting ---------------------------------------------------------------------------

    def _make_root(self) -> None:
        for sub in ("mounts", "cache", "staging"):
            (self._root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self._root / "cache", 0o700)

    async def _start_mount(self, spec: VolumeSpec, key: str) -> _Mount:
        nursery = self._nursery
        if nursery is None:
            raise VolumeError(
                ErrorCode.FAILED_PRECONDITION,
                "volumes are not running (Volumes.run has not started or has ended)",
            )
        self._serial += 1
        name = mount_name(key, self._serial)
        directory = self._root / "mounts" / name
        mount = _Mount(
            key=key,
            name=name,
            spec=spec,
            url=bucket_url_of(spec),
            directory=directory,
            host_path=directory / "volume",
            cache_dir=self._root / "cache" / name,
            staging_root=self._root / "staging" / name,
            rc_password=secrets.token_urlsafe(32),
            secrets=spec_secrets(spec),
        )
        try:
            await nursery.start(self._supervise, mount)
        except RuntimeError as exc:
            if "closed" not in str(exc):
                raise
            raise VolumeError(
                ErrorCode.UNAVAILABLE, "volumes are shutting down; no new mounts"
            ) from None
        log.info("mounted %s at %s", mount.label(), mount.host_path)
        return mount

    async def _supervise(
        self, mount: _Mount, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Owns one mount: starts it, restarts rclone when it dies, tears it down at the end."""
        self._live[mount.name] = mount
        try:
            await trio.to_thread.run_sync(self._prepare_directories, mount)
            await self._start_generation(mount)
            task_status.started()
            await self._watch(mount)
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self._options.teardown_timeout_s):
                    await self._teardown(mount)
                self._live.pop(mount.name, None)
                mount.closed.set()

    def _prepare_directories(self, mount: _Mount) -> None:
        try:
            mount.host_path.mkdir(parents=True)
            mount.cache_dir.mkdir(mode=0o700)
            mount.staging_root.mkdir()
        except OSError as exc:
            raise VolumeError(
                ErrorCode.INTERNAL,
                f"could not make the directories for {mount.url} under {self._root} "
                f"({exc.strerror})",
            ) from None
        try:
            self._kernel.make_shared_mount(mount.directory)
        except OSError as exc:
            raise VolumeError(
                ErrorCode.INTERNAL,
                f"could not make {mount.directory} a shared mount for {mount.url} ({exc}); "
                "the agent must run as root",
            ) from None
        mount.directory_shared = True

    async def _start_generation(self, mount: _Mount) -> None:
        """Start rclone at a fresh staging directory, wait for it, probe the bucket and bind
        its mount onto the host path (on top of a dead one, if any)."""
        await self._probe(mount)
        mount.generations += 1
        staging = mount.staging_root / str(mount.generations)
        await trio.to_thread.run_sync(staging.mkdir)
        argv = rclone_argv(
            self._rclone,
            rclone_remote(mount.spec),
            staging,
            name=mount.name,
            cache_dir=mount.cache_dir,
            read_only=mount.spec.read_only,
            options=self._options,
            ca_file=self._ca_file,
        )
        env = rclone_environment(
            mount.spec, rc_password=mount.rc_password, home=str(mount.cache_dir)
        )
        # rclone logs to a file, not a pipe: Go exits on SIGPIPE when it writes to a broken
        # stderr, so with a pipe every mount would die at its next log line once the agent
        # is gone, under containers that outlive the agent. The file is in the mount's
        # private cache directory (0700, removed on unmount); rclone never logs secrets.
        log_path = mount.cache_dir / f"rclone-{mount.generations}.log"
        try:
            log_fd = await trio.to_thread.run_sync(
                os.open, log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            try:
                process = await trio.lowlevel.open_process(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log_fd,
                    start_new_session=True,
                )
            finally:
                os.close(log_fd)
        except OSError as exc:
            await trio.to_thread.run_sync(_remove_dir, staging)
            raise VolumeError(
                ErrorCode.UNAVAILABLE,
                f"could not start rclone ({self._rclone}) for {mount.url}: {exc.strerror}",
            ) from None
        generation = _Generation(
            number=mount.generations,
            process=process,
            staging=staging,
            log_path=log_path,
            client=httpx.AsyncClient(
                auth=httpx.BasicAuth(_RC_USER, mount.rc_password),
                trust_env=False,
                timeout=httpx.Timeout(60.0, connect=5.0),
            ),
        )
        mount.generation = generation
        assert self._nursery is not None
        self._nursery.start_soon(self._follow_log, mount, generation)
        try:
            await self._wait_started(mount, generation)
            await trio.to_thread.run_sync(self._bind_generation, mount, generation)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._stop_generation(mount, generation)
            raise
        generation.ready = True

    async def _wait_started(self, mount: _Mount, generation: _Generation) -> None:
        with trio.move_on_after(self._options.start_timeout_s) as scope:
            while True:
                if generation.exited.is_set():
                    raise VolumeError(
                        ErrorCode.UNAVAILABLE,
                        f"rclone could not mount {mount.url}: {generation.describe_exit()}",
                    )
                if generation.rc_ready.is_set() and is_mounted(
                    _read_mountinfo(), generation.staging
                ):
                    break
                await trio.sleep(0.01)
        if scope.cancelled_caught:
            raise VolumeError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"rclone did not mount {mount.url} within {self._options.start_timeout_s:g} s",
            )
        # The FUSE mount answers (rclone serves the root without the network).
        with trio.move_on_after(self._options.start_timeout_s) as scope:
            try:
                await trio.to_thread.run_sync(os.stat, generation.staging, abandon_on_cancel=True)
            except OSError as exc:
                raise VolumeError(
                    ErrorCode.UNAVAILABLE,
                    f"the FUSE mount of {mount.url} does not answer ({exc.strerror})",
                ) from None
        if scope.cancelled_caught:
            raise VolumeError(
                ErrorCode.DEADLINE_EXCEEDED, f"the FUSE mount of {mount.url} does not answer"
            )

    async def _probe(self, mount: _Mount) -> None:
        """List a random name under the prefix with a short-lived `rclone lsjson`, before any
        mount exists: credentials, bucket and endpoint are all checked by one small listing
        however large the bucket. Its own process because retries are fixed when rclone makes
        its S3 client: the mount keeps rclone's ten low-level retries (a blip in the store must
        not fail a container's read), while the probe gives up after two, so an unreachable
        endpoint is reported in a moment, not after a minute and a half of backoff."""
        remote = f"{rclone_remote(mount.spec)}/{_probe_name()}"
        argv = rclone_probe_argv(self._rclone, remote, options=self._options, ca_file=self._ca_file)
        env = rclone_environment(mount.spec, rc_password=None, home=str(mount.cache_dir))
        with trio.move_on_after(self._options.probe_timeout_s):
            try:
                done = await trio.run_process(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            except OSError as exc:
                raise VolumeError(
                    ErrorCode.UNAVAILABLE,
                    f"could not start rclone ({self._rclone}) for {mount.url}: {exc.strerror}",
                ) from None
            if done.returncode == 0:
                return
            errors = [
                line.message
                for line in map(parse_rclone_line, done.stderr.splitlines())
                if isinstance(line, RcloneFailure)
            ]
            raise probe_error(mount.spec, mount.scrub("\n".join(errors)))
        raise VolumeError(
            ErrorCode.UNAVAILABLE,
            f"bucket {mount.url.bucket!r}: endpoint unreachable ({endpoint_label(mount.spec)} "
            f"did not answer a list within {self._options.probe_timeout_s:g} s)",
            field="url",
        )

    def _bind_generation(self, mount: _Mount, generation: _Generation) -> None:
        try:
            self._kernel.bind(generation.staging, mount.host_path)
        except OSError as exc:
            raise VolumeError(
                ErrorCode.INTERNAL,
                f"could not bind the mount of {mount.url} to {mount.host_path} ({exc.strerror})",
            ) from None
        # The host path holds it now; the staging directory is only rclone's name for it.
        try:
            self._kernel.unmount(generation.staging, lazy=True)
            generation.staging.rmdir()
        except OSError as exc:
            log.warning("staging mount %s left behind: %s", generation.staging, exc.strerror)

    async def _rc(
        self, mount: _Mount, generation: _Generation, method: str, body: Mapping[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """One remote-control call; transport errors become VolumeError (UNAVAILABLE)."""
        if generation.rc_port is None:
            raise VolumeError(ErrorCode.UNAVAILABLE, f"rclone for {mount.url} has no control API")
        try:
            response = await generation.client.post(
                f"http://127.0.0.1:{generation.rc_port}/{method}", json=dict(body)
            )
        except httpx.HTTPError as exc:
            raise VolumeError(
                ErrorCode.UNAVAILABLE,
                f"rclone for {mount.url} did not answer its control API ({type(exc).__name__})",
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = {}
        return response.status_code, data if isinstance(data, dict) else {}

    async def _follow_log(self, mount: _Mount, generation: _Generation) -> None:
        """Follow rclone's JSON log file until rclone exits; nothing of it is logged raw.

        Polls (quickly while lines come, up to `log_poll_max_s` when idle). A file that has
        grown past `log_max_bytes` and was read to its end is truncated; rclone appends
        (O_APPEND), so it carries on at the start (a line written in between is lost)."""
        options = self._options
        pending = b""
        idle_s = options.log_poll_min_s
        fd = -1
        try:
            fd = await trio.to_thread.run_sync(os.open, generation.log_path, os.O_RDONLY)
            while True:
                exited = generation.process.poll() is not None
                # A read of a regular file the page cache holds: no need for a thread.
                chunk = os.read(fd, 65536)
                if chunk:
                    idle_s = options.log_poll_min_s
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    if len(pending) > _MAX_LINE_BYTES:
                        pending = b""
                    for line in lines:
                        self._handle_line(mount, generation, line)
                    continue
                if exited:
                    break
                if os.lseek(fd, 0, os.SEEK_CUR) > options.log_max_bytes:
                    os.truncate(generation.log_path, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                await trio.sleep(idle_s)
                idle_s = min(idle_s * 2, options.log_poll_max_s)
        except OSError as exc:
            log.warning("reading rclone's log for %s: %s", mount.label(), exc.strerror)
        finally:
            if fd >= 0:
                os.close(fd)
            if generation.process.poll() is not None:
                generation.exited.set()
                mount.wake.set()

    def _handle_line(self, mount: _Mount, generation: _Generation, raw: bytes) -> None:
        parsed = parse_rclone_line(raw[:_MAX_LINE_BYTES])
        if isinstance(parsed, RcServing):
            if generation.rc_port is None:
                generation.rc_port = parsed.port
                generation.rc_ready.set()
        elif isinstance(parsed, UploadFailed):
            name, reason = mount.scrub(parsed.name), mount.scrub(parsed.reason)
            first = name not in mount.failed_uploads
            mount.failed_uploads[name] = reason
            if first:
                message = f"upload of {name!r} to {mount.url} failed: {reason}; retrying"
                log.warning("%s (workspace %s)", message, mount.spec.workspace)
                self._emit(mount, message)
        elif isinstance(parsed, UploadSucceeded):
            name = mount.scrub(parsed.name)
            if mount.failed_uploads.pop(name, None) is not None:
                self._emit(mount, f"upload of {name!r} to {mount.url} succeeded after all")
        elif isinstance(parsed, RcloneFailure):
            generation.last_error = mount.scrub(parsed.message)

    def _emit(self, mount: _Mount, message: str) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(tuple(sorted(mount.holders)), message)
        except Exception:
            log.exception("volume event handler failed")

    # -- watching and remounting ------------------------------------------------------------

    async def _watch(self, mount: _Mount) -> None:
        """Until a close is asked for: when rclone dies, mount again (with backoff)."""
        state = BackoffState()
        record_connected(state, trio.current_time())
        while True:
            await mount.wake.wait()
            mount.wake = trio.Event()
            if mount.close_requested:
                return
            generation = mount.generation
            if generation is None or not generation.exited.is_set():
                continue
            why = generation.describe_exit()
            log.warning("mount of %s stopped: %s; remounting", mount.label(), why)
            self._emit(mount, f"the mount of {mount.url} stopped ({why}); remounting")
            record_disconnect(self._options.remount_backoff, state, trio.current_time())
            while True:
                delay = next_delay(
                    self._options.remount_backoff, state, secrets.randbelow(1000) / 1000
                )
                if await self._sleep_unless_closing(mount, delay):
                    return
                try:
                    await self._start_generation(mount)
                except (VolumeError, OSError) as exc:
                    record_failure(state)
                    why = exc.message if isinstance(exc, VolumeError) else str(exc.strerror)
                    log.warning("remounting %s failed: %s", mount.label(), why)
                    self._emit(mount, f"remounting {mount.url} failed: {why}; retrying")
                    continue
                record_connected(state, trio.current_time())
                mount.remounts += 1
                log.info("remounted %s at %s", mount.label(), mount.host_path)
                self._emit(
                    mount,
                    f"the mount of {mount.url} is back; files that were open when it stopped "
                    "must be opened again",
                )
                break

    async def _sleep_unless_closing(self, mount: _Mount, seconds: float) -> bool:
        """Sleep; True (at once) if a close is asked for meanwhile."""
        with trio.move_on_after(seconds):
            while not mount.close_requested:
                await mount.wake.wait()
                mount.wake = trio.Event()
        return mount.close_requested

    # -- uploads ----------------------------------------------------------------------------

    async def _wait_uploaded(self, mount: _Mount) -> list[str]:
        generation = mount.generation
        if generation is None or not generation.ready or generation.exited.is_set():
            return [
                *self._upload_problems(mount),
                f"{mount.url}: rclone is not running (being restarted), so pending uploads "
                "could not be confirmed",
            ]
        await self._fuse_barrier(mount)
        settled_polls = 0
        while settled_polls < 2:
            try:
                status, body = await self._rc(mount, generation, "vfs/stats", {})
            except VolumeError as exc:
                return [*self._upload_problems(mount), f"{mount.url}: {exc.message}"]
            if status != 200:
                return [
                    *self._upload_problems(mount),
                    f"{mount.url}: rclone's vfs/stats answered {status}",
                ]
            cache = body.get("diskCache") or {}
            settled = uploads_settled(
                int(cache.get("uploadsInProgress", 0)),
                int(cache.get("uploadsQueued", 0)),
                len(mount.failed_uploads),
            )
            settled_polls = settled_polls + 1 if settled else 0
            await trio.sleep(self._options.upload_poll_s)
        return self._upload_problems(mount)

    def _upload_problems(self, mount: _Mount) -> list[str]:
        return [
            f"upload of {name!r} to {mount.url} failed: {reason}"
            for name, reason in sorted(mount.failed_uploads.items())
        ]

    async def _fuse_barrier(self, mount: _Mount) -> None:
        """One FUSE round trip: rclone reads requests in order, so once this is answered it
        has taken every file release the kernel queued before (a release queues the upload)."""
        probe = mount.host_path / f"{_BARRIER_PREFIX}{secrets.token_hex(6)}"
        with trio.move_on_after(5):
            try:
                await trio.to_thread.run_sync(os.stat, probe, abandon_on_cancel=True)
            except OSError:
                pass

    # -- closing ----------------------------------------------------------------------------

    def _request_close(self, mount: _Mount) -> None:
        if mount.close_requested:
            return
        mount.close_requested = True
        if self._mounts.get(mount.key) is mount:
            del self._mounts[mount.key]
        mount.wake.set()

    async def _teardown(self, mount: _Mount) -> None:
        """Shielded and bounded by the caller: drain, unmount, stop rclone, remove dirs."""
        if self._mounts.get(mount.key) is mount:
            del self._mounts[mount.key]
        generation = mount.generation
        if generation is not None and generation.ready and not mount.close_requested:
            # Shutdown: give pending uploads a moment; release() has already waited.
            with trio.move_on_after(self._options.shutdown_drain_s):
                problems = await self._wait_uploaded(mount)
                for problem in problems:
                    log.warning("at shutdown: %s", problem)
        mount.close_requested = True
        await trio.to_thread.run_sync(self._unmount_directories, mount)
        if generation is not None:
            await self._stop_generation(mount, generation)
        await trio.to_thread.run_sync(self._remove_directories, mount)
        log.info("unmounted %s", mount.label())

    def _unmount_directories(self, mount: _Mount) -> None:
        try:
            self._kernel.unmount_all(mount.host_path)
            if mount.directory_shared:
                self._kernel.unmount_all(mount.directory)
        except OSError as exc:
            log.warning("unmounting %s: %s", mount.directory, exc.strerror)

    async def _stop_generation(self, mount: _Mount, generation: _Generation) -> None:
        """rclone exits by itself once its mount is gone; else TERM, then KILL."""
        if generation.stopped:
            return
        generation.stopped = True
        process = generation.process
        try:
            if is_mounted(await trio.to_thread.run_sync(_read_mountinfo), generation.staging):
                await trio.to_thread.run_sync(self._kernel.unmount_all, generation.staging)
            with trio.move_on_after(self._options.stop_grace_s):
                await process.wait()
                return
            process.terminate()
            with trio.move_on_after(5):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await process.wait()
            with trio.CancelScope(shield=True):
                await generation.client.aclose()

    def _remove_directories(self, mount: _Mount) -> None:
        for path in (mount.cache_dir, mount.directory, mount.staging_root):
            remove_tree(path)

    # -- sweep ------------------------------------------------------------------------------

    def _sweep_sync(self, keep: list[Path], keep_pids: set[int]) -> list[Path]:
        targets = sweep_targets(_read_mountinfo(), self._root, keep)
        unmounted: list[Path] = []
        for path in targets:
            try:
                # fusermount3 -u is for users without CAP_SYS_ADMIN; as root umount2 is the
                # same call. A busy or dead mount is detached lazily instead.
                try:
                    done = self._kernel.unmount(path, lazy=False)
                except OSError:
                    done = self._kernel.unmount(path, lazy=True)
                if done:
                    self._kernel.unmount_all(path)
                    unmounted.append(path)
            except OSError as exc:
                log.warning("sweep: could not unmount %s: %s", path, exc.strerror)
        killed = _kill_rclone_under(self._root, self._rclone, keep_pids)
        for sub in ("mounts", "cache", "staging"):
            base = self._root / sub
            if not base.is_dir():
                continue
            for child in base.iterdir():
                if any(_is_under(child, kept) for kept in keep) or child.name in self._live:
                    continue
                remove_tree(child)
        if unmounted or killed:
            log.info(
                "sweep: unmounted %d leftover mount(s), stopped %d rclone process(es)",
                len(unmounted),
                killed,
            )
        return unmounted


def _remove_dir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc.strerror)


def remove_tree(path: Path) -> bool:
    """Remove `path` and what is below it, never crossing into another filesystem.

    Not `shutil.rmtree`: were a bucket still mounted somewhere below (an unmount that failed),
    rmtree would walk into the mount and delete the bucket's objects. A directory whose device
    differs, or that cannot be looked at (a dead FUSE mount), is left with its parents."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("not removing %s: %s", path, exc.strerror)
        return False
    if not stat.S_ISDIR(top.st_mode):
        path.unlink(missing_ok=True)
        return True
    removed = True
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        log.warning("not removing %s: %s", path, exc.strerror)
        return False
    for entry in entries:
        child = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                if entry.stat(follow_symlinks=False).st_dev != top.st_dev:
                    log.warning("not removing %s: a filesystem is still mounted there", child)
                    removed = False
                    continue
                removed = remove_tree(child) and removed
            else:
                child.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("not removing %s: %s", child, exc.strerror)
            removed = False
    if removed:
        try:
            path.rmdir()
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc.strerror)
            removed = False
    return removed


def _kill_rclone_under(root: Path, rclone: str, keep_pids: Collection[int]) -> int:
    """Stop rclone mount processes whose arguments name a path under `root`."""
    import psutil

    names = {os.path.basename(rclone), "rclone"}
    victims = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if process.pid in keep_pids or len(cmdline) < 2:
            continue
        if os.path.basename(cmdline[0]) not in names or cmdline[1] != "mount":
            continue
        if any(_is_under(Path(arg), root) for arg in cmdline[2:] if arg.startswith("/")):
            victims.append(process)
    for process in victims:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(victims, timeout=5)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(victims)
