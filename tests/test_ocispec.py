"""The OCI config generator: the security defaults, limits, mounts, user and the GPU merge.

Pure functions, so these tests need no runc; `tests/test_runc.py` shows runc accepts the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.gpus.edits import BindMount, CgroupRule, DeviceNode, Hook, SpecEdits
from agent.runtime.ocispec import (
    DEFAULT_CAPABILITIES,
    Bind,
    Limits,
    RuntimeSpec,
    exec_process,
    merge_env,
    oci_config,
    write_bundle,
)
from wire.errors import ApiError, ErrorCode

DOCKER_CAPS = {
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
}


def spec(**changes: Any) -> RuntimeSpec:
    fields: dict[str, Any] = {
        "container_id": "c-1",
        "rootfs": "/var/lib/levers9/c-1/rootfs",
        "args": ("python", "train.py"),
    }
    fields.update(changes)
    return RuntimeSpec(**fields)


def mount_at(config: dict[str, Any], destination: str) -> dict[str, Any]:
    matches = [m for m in config["mounts"] if m["destination"] == destination]
    assert len(matches) == 1, f"expected one mount at {destination}, got {matches}"
    found: dict[str, Any] = matches[0]
    return found


def env_of(config: dict[str, Any]) -> dict[str, str]:
    return dict(entry.partition("=")[::2] for entry in config["process"]["env"])


# -- isolation defaults ---------------------------------------------------------------------------


def test_container_gets_its_own_namespaces_and_a_new_network_by_default() -> None:
    namespaces = oci_config(spec())["linux"]["namespaces"]
    assert sorted(ns["type"] for ns in namespaces) == ["ipc", "mount", "network", "pid", "uts"]
    assert all("path" not in ns for ns in namespaces)


def test_container_joins_the_network_namespace_it_is_given() -> None:
    namespaces = oci_config(spec(netns_path="/run/netns/l9-c-1"))["linux"]["namespaces"]
    network = [ns for ns in namespaces if ns["type"] == "network"]
    assert network == [{"type": "network", "path": "/run/netns/l9-c-1"}]
    # Only the network namespace is joined; the rest stay private.
    assert all("path" not in ns for ns in namespaces if ns["type"] != "network")


def test_root_process_gets_dockers_default_capabilities_and_no_new_privileges() -> None:
    process = oci_config(spec())["process"]
    caps = process["capabilities"]
    assert set(DEFAULT_CAPABILITIES) == DOCKER_CAPS
    for kind in ("bounding", "effective", "permitted"):
        assert set(caps[kind]) == DOCKER_CAPS
    assert "CAP_SYS_ADMIN" not in caps["bounding"]
    assert not caps.get("inheritable") and not caps.get("ambient")
    assert process["noNewPrivileges"] is True


def test_non_root_process_starts_without_effective_capabilities() -> None:
    caps = oci_config(spec(uid=1000, gid=1000))["process"]["capabilities"]
    assert set(caps["bounding"]) == DOCKER_CAPS
    for kind in ("effective", "permitted", "inheritable", "ambient"):
        assert not caps.get(kind), kind


def test_kernel_interfaces_are_masked_or_read_only_as_in_docker() -> None:
    linux = oci_config(spec())["linux"]
    for path in (
        "/proc/kcore",
        "/proc/keys",
        "/proc/timer_list",
        "/proc/sched_debug",
        "/proc/acpi",
        "/proc/scsi",
        "/sys/firmware",
    ):
        assert path in linux["maskedPaths"]
    for path in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"):
        assert path in linux["readonlyPaths"]


def test_standard_filesystems_are_mounted_with_safe_options() -> None:
    config = oci_config(spec(shm_bytes=256 << 20))
    assert mount_at(config, "/proc")["type"] == "proc"
    dev = mount_at(config, "/dev")
    assert dev["type"] == "tmpfs" and "nosuid" in dev["options"]
    assert mount_at(config, "/dev/pts")["type"] == "devpts"
    assert "newinstance" in mount_at(config, "/dev/pts")["options"]
    shm = mount_at(config, "/dev/shm")
    assert shm["type"] == "tmpfs" and "size=262144k" in shm["options"]
    assert "noexec" in shm["options"]
    assert mount_at(config, "/dev/mqueue")["type"] == "mqueue"
    sys = mount_at(config, "/sys")
    assert sys["type"] == "sysfs" and "ro" in sys["options"]


def test_device_cgroup_denies_all_but_the_standard_devices() -> None:
    rules = oci_config(spec())["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    allowed = {(r["type"], r["major"], r.get("minor")) for r in rules[1:] if r["allow"]}
    assert allowed == {
        ("c", 1, 3),  # null
        ("c", 1, 5),  # zero
        ("c", 1, 7),  # full
        ("c", 1, 8),  # random
        ("c", 1, 9),  # urandom
        ("c", 5, 0),  # tty
        ("c", 5, 2),  # ptmx
        ("c", 136, None),  # pts/*
    }


def test_cgroup_path_is_absolute_under_levers9() -> None:
    s = spec(container_id="job-7")
    assert s.cgroups_path == "/levers9/job-7"
    assert oci_config(s)["linux"]["cgroupsPath"] == "/levers9/job-7"


# -- limits ---------------------------------------------------------------------------------------


def test_limits_become_cpu_quota_memory_without_swap_and_pids() -> None:
    resources = oci_config(spec(limits=Limits(cpu_millis=1500, memory_bytes=2 << 30, pids=512)))[
        "linux"
    ]["resources"]
    assert resources["cpu"]["quota"] == 150_000
    assert resources["cpu"]["period"] == 100_000
    assert resources["memory"] == {"limit": 2 << 30, "swap": 2 << 30}
    assert resources["pids"] == {"limit": 512}


def test_tiny_cpu_limit_is_raised_to_the_kernels_minimum_quota() -> None:
    cpu = oci_config(spec(limits=Limits(cpu_millis=1)))["linux"]["resources"]["cpu"]
    assert cpu["quota"] == 1_000


def test_no_limits_means_no_resource_entries_besides_devices() -> None:
    resources = oci_config(spec())["linux"]["resources"]
    assert set(resources) == {"devices"}


def test_open_files_limit_is_set() -> None:
    rlimits = oci_config(spec(nofile=65536))["process"]["rlimits"]
    assert rlimits == [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}]


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        (Limits(cpu_millis=0), "limits.cpuMillis"),
        (Limits(memory_bytes=-1), "limits.memoryBytes"),
        (Limits(pids=0), "limits.pids"),
    ],
)
def test_non_positive_limits_are_refused_naming_the_field(limits: Limits, field: str) -> None:
    with pytest.raises(ApiError) as caught:
        oci_config(spec(limits=limits))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == field


# -- process, user, hostname ----------------------------------------------------------------------


def test_process_has_the_given_args_env_cwd_and_user() -> None:
    config = oci_config(
        spec(
            args=("sh", "-c", "echo hi"),
            env=("A=1", "PATH=/opt/bin"),
            cwd="/work",
            uid=1000,
            gid=100,
            additional_gids=(27, 44),
            hostname="trainer",
        )
    )
    process = config["process"]
    assert process["args"] == ["sh", "-c", "echo hi"]
    assert env_of(config) == {"PATH": "/opt/bin", "A": "1"}
    assert process["cwd"] == "/work"
    assert process["user"] == {"uid": 1000, "gid": 100, "additionalGids": [27, 44]}
    assert config["hostname"] == "trainer"
    assert process["terminal"] is False


def test_a_default_path_is_given_when_the_image_has_none() -> None:
    assert env_of(oci_config(spec(env=("A=1",))))["PATH"].startswith("/usr/local/sbin:")


def test_env_layers_merge_by_name_the_later_winning_in_first_seen_order() -> None:
    image = ("PATH=/opt/bin", "A=1", "B=x=y")
    assert merge_env(image, ("A=2", "C=3")) == ["PATH=/opt/bin", "A=2", "B=x=y", "C=3"]
    # The merge adds nothing: the default PATH is the config's first layer, under the image's.
    assert merge_env(("A=1",)) == ["A=1"]
    assert env_of(oci_config(spec(env=tuple(merge_env(image)))))["PATH"] == "/opt/bin"


def test_hostname_defaults_to_the_container_id() -> None:
    assert oci_config(spec(container_id="abc"))["hostname"] == "abc"


def test_read_only_rootfs() -> None:
    assert oci_config(spec(readonly_rootfs=True))["root"] == {
        "path": "/var/lib/levers9/c-1/rootfs",
        "readonly": True,
    }


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"container_id": "../escape"}, "containerId"),
        ({"container_id": "a/b"}, "containerId"),
        ({"args": ()}, "args"),
        ({"cwd": "work"}, "cwd"),
        ({"uid": -1}, "uid"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as caught:
        oci_config(spec(**changes))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == field


# -- binds and /etc files -------------------------------------------------------------------------


def test_binds_are_recursive_private_by_default_and_read_only_when_asked() -> None:
    config = oci_config(
        spec(
            binds=(
                Bind("/data/in", "/in", read_only=True),
                Bind("/mnt/bucket", "/bucket", propagation="rslave"),
            )
        )
    )
    data = mount_at(config, "/in")
    assert data["type"] == "bind" and data["source"] == "/data/in"
    assert set(data["options"]) == {"rbind", "rprivate", "ro"}
    bucket = mount_at(config, "/bucket")
    assert set(bucket["options"]) == {"rbind", "rslave"}


def test_shared_propagation_is_refused() -> None:
    with pytest.raises(ApiError) as caught:
        oci_config(spec(binds=(Bind("/mnt/x", "/x", propagation="rshared"),)))
    assert caught.value.field == "binds[0].propagation"
    assert "rslave" in caught.value.message


def test_relative_bind_paths_are_refused() -> None:
    with pytest.raises(ApiError) as caught:
        oci_config(spec(binds=(Bind("/mnt/x", "x"),)))
    assert caught.value.field == "binds[0].destination"


def test_etc_files_are_bound_from_the_files_given() -> None:
    config = oci_config(
        spec(hosts_file="/s/hosts", resolv_conf="/s/resolv.conf", hostname_file="/s/hostname")
    )
    assert mount_at(config, "/etc/hosts")["source"] == "/s/hosts"
    assert mount_at(config, "/etc/resolv.conf")["source"] == "/s/resolv.conf"
    assert mount_at(config, "/etc/hostname")["source"] == "/s/hostname"
    assert not [m for m in oci_config(spec())["mounts"] if m["destination"].startswith("/etc/")]


# -- GPU fragment ---------------------------------------------------------------------------------


def gpu_edits() -> SpecEdits:
    return SpecEdits(
        devices=(
            DeviceNode(path="/dev/nvidia0", host_path="/dev/nvidia0", major=195, minor=0),
            DeviceNode(path="/dev/nvidiactl", host_path="/dev/nvidiactl", major=195, minor=255),
        ),
        cgroup_rules=(CgroupRule(major=195, minor=0), CgroupRule(major=195, minor=255)),
        mounts=(BindMount(source="/usr/lib/x/libcuda.so.1", destination="/usr/lib/libcuda.so.1"),),
        env=(("NVIDIA_VISIBLE_DEVICES", "GPU-1"),),
        search_paths=(("PATH", "/usr/local/nvidia/bin"),),
        hooks=(Hook(stage="createContainer", path="/usr/bin/nvidia-hook", args=("hook",)),),
    )


def test_gpu_fragment_adds_devices_rules_mounts_env_and_hooks() -> None:
    image_env = ("PATH=/usr/bin:/bin", "LANG=C")
    config = oci_config(spec(env=image_env, gpu=gpu_edits().oci_fragment(image_env)))
    devices = config["linux"]["devices"]
    assert [d["path"] for d in devices] == ["/dev/nvidia0", "/dev/nvidiactl"]
    rules = config["linux"]["resources"]["devices"]
    # The default deny comes first, the card rules after it, so they take effect.
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert {(r["major"], r.get("minor")) for r in rules if r.get("major") == 195} == {
        (195, 0),
        (195, 255),
    }
    assert rules.index(next(r for r in rules if r.get("major") == 195)) > 0
    libcuda = mount_at(config, "/usr/lib/libcuda.so.1")
    assert "ro" in libcuda["options"]
    # The standard mounts are still there.
    assert mount_at(config, "/proc")["type"] == "proc"
    env = env_of(config)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
    assert env["PATH"] == "/usr/local/nvidia/bin:/usr/bin:/bin"
    assert env["LANG"] == "C"
    assert len(config["process"]["env"]) == len(env), "no variable appears twice"
    assert config["hooks"] == {
        "createContainer": [{"path": "/usr/bin/nvidia-hook", "args": ["hook"]}]
    }


def test_gpu_fragment_as_a_literal_dict_is_merged_and_not_modified() -> None:
    fragment: dict[str, Any] = {
        "process": {"env": ["CUDA=1"]},
        "linux": {"devices": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]},
    }
    before = json.dumps(fragment, sort_keys=True)
    first = oci_config(spec(gpu=fragment))
    second = oci_config(spec(gpu=fragment))
    assert first == second
    assert json.dumps(fragment, sort_keys=True) == before
    assert first["linux"]["devices"] == fragment["linux"]["devices"]
    assert env_of(first)["CUDA"] == "1"


# -- exec and bundle ------------------------------------------------------------------------------


def test_exec_process_runs_like_the_main_process_with_its_own_args() -> None:
    s = spec(uid=1000, gid=1000, env=("A=1",), cwd="/work", gpu={"process": {"env": ["G=2"]}})
    process = exec_process(s, ["sh", "-c", "id"], env=("B=3", "A=9"))
    assert process["args"] == ["sh", "-c", "id"]
    assert process["user"] == {"uid": 1000, "gid": 1000}
    assert process["cwd"] == "/work"
    env = dict(entry.partition("=")[::2] for entry in process["env"])
    assert (env["A"], env["B"], env["G"]) == ("9", "3", "2")
    assert process["noNewPrivileges"] is True
    assert process["capabilities"] == oci_config(s)["process"]["capabilities"]
    assert process["terminal"] is False


def test_exec_process_with_a_terminal_sets_term() -> None:
    process = exec_process(spec(), ["sh"], cwd="/tmp", terminal=True)
    assert process["terminal"] is True
    assert "TERM=xterm" in process["env"]
    assert process["cwd"] == "/tmp"


def test_write_bundle_writes_config_with_an_absolute_rootfs(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    written = write_bundle(bundle, spec(rootfs="rootfs"))
    assert written == bundle / "config.json"
    config = json.loads(written.read_text())
    assert config["root"]["path"] == str(bundle / "rootfs")
    assert config["linux"]["cgroupsPath"] == "/levers9/c-1"
    assert [p.name for p in bundle.iterdir()] == ["config.json"]


def test_a_seccomp_filter_refuses_the_dangerous_calls_and_allows_the_rest() -> None:
    config = oci_config(RuntimeSpec(container_id="c1", rootfs="/r", args=("sh",)))
    seccomp = config["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ALLOW"
    refused = {name for rule in seccomp["syscalls"] for name in rule["names"]}
    assert {"unshare", "setns", "mount", "keyctl", "bpf", "userfaultfd", "clone3"} <= refused
    assert not refused & {"read", "write", "openat", "execve", "futex"}
