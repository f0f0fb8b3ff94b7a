"""The pure parts of running the images: the pod's runtime config (`sim.pods`) and the image
build's commands and report (`sim.images`). `make image-test` runs them for real."""

from __future__ import annotations

from pathlib import Path

from sim import images
from sim.pods import (
    ALL_CAPABILITIES,
    ImageConfig,
    Mount,
    container_argv,
    container_env,
    pod_config,
    privileged_capabilities,
)

IMAGE = ImageConfig(
    entrypoint=("levers9-agent",),
    cmd=("run",),
    env=("PATH=/opt/levers9/bin:/usr/bin", "LEVERS9_SHIM_BINARY=/x"),
    working_dir="/",
)


def test_args_replace_cmd_and_command_replaces_the_entrypoint() -> None:
    assert container_argv(IMAGE, (), ()) == ["levers9-agent", "run"]
    assert container_argv(IMAGE, (), ("self-check",)) == ["levers9-agent", "self-check"]
    assert container_argv(IMAGE, ("sh",), ("-c", "true")) == ["sh", "-c", "true"]


def test_the_pods_env_goes_over_the_images() -> None:
    env = container_env(IMAGE, {"LEVERS9_SHIM_BINARY": "/y", "LEVERS9_MODE": "direct"})
    assert env == [
        "PATH=/opt/levers9/bin:/usr/bin",
        "LEVERS9_SHIM_BINARY=/y",
        "LEVERS9_MODE=direct",
    ]
    bare = ImageConfig((), (), (), "/")
    assert container_env(bare, {})[0].startswith("PATH=/usr/local/sbin:")


def test_a_privileged_host_network_pod_shares_the_nodes_network_and_binds_its_volumes() -> None:
    config = pod_config(
        IMAGE,
        argv=["levers9-agent", "run"],
        env=["A=1"],
        mounts=[Mount(Path("/nodes/n1/dev"), "/dev"), Mount(Path("/ca.pem"), "/ca.pem", True)],
        host_network=True,
        hostname="pod-1",
        cgroups_path="/levers9-sim/pod-1",
    )
    namespaces = {n["type"] for n in config["linux"]["namespaces"]}
    assert namespaces == {"pid", "ipc", "mount"}
    assert "hostname" not in config
    assert config["process"]["capabilities"]["bounding"] == list(ALL_CAPABILITIES)
    assert config["linux"]["resources"]["devices"] == [{"allow": True, "access": "rwm"}]
    by_destination = {m["destination"]: m for m in config["mounts"]}
    assert by_destination["/dev"]["source"] == "/nodes/n1/dev"
    assert "ro" in by_destination["/ca.pem"]["options"]
    assert "rw" in by_destination["/sys"]["options"]
    # /dev/pts and /dev/shm go over the bound /dev, not under it.
    order = [m["destination"] for m in config["mounts"]]
    assert order.index("/dev") < order.index("/dev/pts")
    assert by_destination["/dev"]["type"] == "bind"


def test_a_restricted_pod_has_its_own_network_user_and_read_only_root() -> None:
    config = pod_config(
        IMAGE,
        argv=["levers9-control", "serve"],
        env=[],
        mounts=[],
        host_network=False,
        hostname="control-0",
        cgroups_path="/levers9-sim/control-0",
        capabilities=(),
        user=(10001, 10001),
        read_only_root=True,
    )
    assert {"network", "uts"} <= {n["type"] for n in config["linux"]["namespaces"]}
    assert config["hostname"] == "control-0"
    assert config["process"]["user"] == {"uid": 10001, "gid": 10001}
    assert config["process"]["noNewPrivileges"] is True
    assert config["root"]["readonly"] is True
    assert config["process"]["capabilities"]["effective"] == []
    dev = [m for m in config["mounts"] if m["destination"] == "/dev"]
    assert dev and dev[0]["type"] == "tmpfs"


def test_privileged_capabilities_are_those_the_node_may_hand_out() -> None:
    everything = (1 << len(ALL_CAPABILITIES)) - 1
    assert privileged_capabilities(everything) == list(ALL_CAPABILITIES)
    without_sys_resource = everything & ~(1 << 24)
    caps = privileged_capabilities(without_sys_resource)
    assert "CAP_SYS_RESOURCE" not in caps
    assert len(caps) == len(ALL_CAPABILITIES) - 1
    assert ALL_CAPABILITIES[21] == "CAP_SYS_ADMIN"


def test_the_base_is_named_by_its_recipe() -> None:
    recipe = images.BaseRecipe()
    assert recipe.tag.startswith("localhost/levers9-base:bookworm-")
    assert images.BaseRecipe(packages=(*recipe.packages, "curl")).tag != recipe.tag
    argv = recipe.mmdebstrap_argv(Path("/tmp/base.tar"))
    assert argv[:2] == ["mmdebstrap", "--variant=minbase"]
    assert "--include=ca-certificates,netbase,tzdata,python3,python3-venv" in argv
    assert argv[-2:] == ["bookworm", "/tmp/base.tar"]


def test_a_build_passes_the_base_and_the_ca_bundle_as_a_secret(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.crt"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    argv = images.build_argv(
        "worker", "localhost/base:x", "localhost/levers9/worker:t", ca_bundle=bundle
    )
    assert argv[:4] == ["buildah", "bud", "--isolation", "chroot"]
    assert "PYTHON_BASE=localhost/base:x" in argv
    assert f"id=build-ca,src={bundle}" in argv
    # The Dockerfiles' pip steps are the ones that mount it.
    for dockerfile in images.IMAGES.values():
        text = (images.REPO / dockerfile).read_text()
        assert f"--mount=type=secret,id={images.BUILD_CA_SECRET}" in text
    assert argv[-3:] == ["-t", "localhost/levers9/worker:t", str(images.REPO)]
    release = images.build_argv("control", None, "localhost/levers9/control:t")
    assert not any(item.startswith("PYTHON_BASE=") for item in release)
    assert images.build_ca_bundle({"PIP_CERT": str(bundle)}) == bundle
    assert images.build_ca_bundle({"PIP_CERT": str(tmp_path / "missing")}) is None


def test_the_report_counts_the_manifests_layers() -> None:
    manifest = {
        "config": {"size": 1000},
        "layers": [
            {"digest": "sha256:" + "a" * 64, "size": 2_000_000},
            {"digest": "sha256:" + "b" * 64, "size": 3_000_000},
        ],
    }
    report = images.image_report("worker", "localhost/levers9/worker:t", manifest, 12.0)
    assert report.size_bytes == 5_001_000
    assert len(report.layers) == 2
    lines = report.lines()
    assert lines[0].startswith("worker: localhost/levers9/worker:t  5.0 MB in 2 layers ")
    assert lines[1].strip().startswith("sha256:aaaaaaaaaaa")
