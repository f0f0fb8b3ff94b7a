"""Workspace buckets in real containers: moto with enforced credentials over TLS, rclone over
FUSE, runc. What a container of workspace A sees: A's bucket at its path, nothing of B's, and
no credential anywhere it can look."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from agent.runtime.config import ContainerConfig
from agent.runtime.manager import ContainerManager, open_container_manager
from sim.s3 import s3_credentials
from wire.errors import ApiError, ErrorCode
from workerapi.models import ContainerSpec, ContainerStatus, VolumeSpec

if TYPE_CHECKING:
    from sim.s3 import S3Server
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.registry_fixtures", "tests.s3_fixtures"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
    reason="bucket mounts need root and /dev/fuse (CI runs as root)",
)


@pytest.fixture
async def manager(tmp_path: Path, s3_server: S3Server) -> AsyncIterator[ContainerManager]:
    config = ContainerConfig(
        state_dir=tmp_path / "state",
        object_budget_bytes=1 << 30,
        free_floor_bytes=0,
        bucket_ca_file=str(s3_server.ca_file),
        allow_local_registries=True,
    )
    async with open_container_manager(config) as m:
        yield m


def volume(server: S3Server, user: str, bucket: str, path: str, **kw: object) -> VolumeSpec:
    workspace = server.users[user].name
    return VolumeSpec(
        workspace=workspace,
        url=f"s3://{bucket}/",
        mount_path=path,
        s3=s3_credentials(server, server.users[user]),
        **kw,  # type: ignore[arg-type]
    )


async def finished(manager: ContainerManager, spec: ContainerSpec) -> ContainerStatus:
    container = await manager.wait_settled(await manager.create(spec))
    with trio.fail_after(60):
        await container.finished.wait()
    return container.status()


async def texts(manager: ContainerManager, container_id: str) -> list[str]:
    return [line.text async for line in manager.log_lines(container_id, follow=False)]


def secrets_of(server: S3Server) -> list[str]:
    return [u.secret_access_key for u in server.users.values()]


async def test_a_container_reads_and_writes_its_workspace_bucket(
    manager: ContainerManager, registry: SharedRegistry, s3_server: S3Server
) -> None:
    user = s3_server.users["a"]
    s3_server.client(user=user).put_object(Bucket=user.bucket, Key="in.txt", Body=b"from-s3\n")
    status = await finished(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="bucket-rw",
            command=("sh", "-c", "cat /data/in.txt && echo from-container > /data/out.txt"),
            volumes=(volume(s3_server, "a", user.bucket, "/data"),),
        ),
    )
    assert status.exit_code == 0, await texts(manager, "bucket-rw")
    assert await texts(manager, "bucket-rw") == ["from-s3"]
    # Durable when the container has ended: the upload finished before the stop returned.
    body = s3_server.client(user=user).get_object(Bucket=user.bucket, Key="out.txt")["Body"]
    assert body.read() == b"from-container\n"
    assert manager.volumes is not None
    assert manager.volumes.statistics().mounts == ()  # the last holder's end unmounted it


async def test_a_container_sees_nothing_of_another_workspace_and_no_credentials(
    manager: ContainerManager, registry: SharedRegistry, s3_server: S3Server, tmp_path: Path
) -> None:
    b = s3_server.users["b"]
    await manager.wait_settled(
        await manager.create(
            ContainerSpec(
                image=registry.busybox,
                id="workspace-b",
                command=("sleep", "600"),
                volumes=(volume(s3_server, "b", b.bucket, "/b-data"),),
            )
        )
    )
    a = s3_server.users["a"]
    look = (
        "mount | grep -c fuse; "
        "ls /; "
        "echo rclones=$(ps -o comm | grep -c rclone); "
        "env; cat /proc/*/environ /proc/*/cmdline 2>/dev/null | tr '\\0' '\\n'; true"
    )
    status = await finished(
        manager,
        ContainerSpec(
            image=registry.busybox,
            id="workspace-a",
            command=("sh", "-c", look),
            volumes=(volume(s3_server, "a", a.bucket, "/a-data", read_only=True),),
        ),
    )
    assert status.exit_code == 0
    lines = await texts(manager, "workspace-a")
    assert lines[0] == "1"  # one FUSE mount: its own bucket
    assert "a-data" in lines and "b-data" not in lines
    assert "rclones=0" in lines
    # Every process's environment and argv inside the container, and the shell's env.
    seen = "\n".join(lines)
    for secret in secrets_of(s3_server):
        assert secret not in seen
    assert "RCLONE" not in seen
    # Nor on the node: not in any process's argv, nor in a file under the agent's directory.
    for secret in secrets_of(s3_server):
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    assert secret.encode() not in (proc / "cmdline").read_bytes()
                except OSError:
                    pass
        for path in manager.config.state_dir.rglob("*"):
            if path.is_file() and not path.is_symlink() and "/volumes/" not in str(path):
                assert secret.encode() not in path.read_bytes(), path
        for record in manager.root.glob("*/record.json"):
            assert secret not in record.read_text()
    await manager.stop("workspace-b", grace_s=0)


async def test_credentials_of_one_workspace_on_another_bucket_fail_the_create(
    manager: ContainerManager, registry: SharedRegistry, s3_server: S3Server
) -> None:
    b = s3_server.users["b"]
    with pytest.raises(ApiError) as err:
        await manager.wait_settled(
            await manager.create(
                ContainerSpec(
                    image=registry.busybox,
                    id="wrong-bucket",
                    command=("true",),
                    volumes=(volume(s3_server, "a", b.bucket, "/data"),),
                )
            )
        )
    assert err.value.code is ErrorCode.PERMISSION_DENIED
    assert b.bucket in err.value.message
    assert "denied" in err.value.message.lower()
    for secret in secrets_of(s3_server):
        assert secret not in err.value.message
    assert manager.volumes is not None
    assert manager.volumes.statistics().mounts == ()
    assert manager.get("wrong-bucket").status().state == "failed"


async def test_a_bad_volume_spec_names_the_field(
    manager: ContainerManager, registry: SharedRegistry, s3_server: S3Server
) -> None:
    a = s3_server.users["a"]
    with pytest.raises(ApiError) as err:
        await manager.create(
            ContainerSpec(
                image=registry.busybox,
                volumes=(volume(s3_server, "a", a.bucket, "relative/path"),),
            )
        )
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert err.value.field == "volumes[0].mountPath"
