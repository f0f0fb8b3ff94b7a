"""deploy/attach-gke-pool.sh run for real, with bash, against stand-in cloud CLIs.

The stand-ins (tests/cloud_standins) keep one fake GCP project, AWS account and EKS cluster
and log every call, so these tests check what an operator relies on: the first run creates
what is missing, a rerun creates nothing and only copies the image again, replaced EKS nodes
are appended and nothing is removed, the printed block loads with the controlplane's own
loader, and the service-account key is nowhere but the private values file.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trustme
import yaml

from control.kube.pools import Flavor, GkeCredentials, load_pools
from sim.cloud.standin import read_calls, read_state, set_autopilot, write_state

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "attach-gke-pool.sh"
STANDINS = REPO / "sim" / "cloud"
BASH = shutil.which("bash") or "/bin/bash"
# The script's own python3: the system one when there is one (what gcloud ships with),
# so a snippet that needs more than the standard library fails here too.
SCRIPT_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable

PROJECT = "levers9-gpu-test"
REGION = "us-central1"
CLUSTER = "gpu-one"
CLUSTER_ID = "4f1c2d3e9a8b7c6d5e4f30211203948576abcdef0123456789abcdef01234567"
NODE_TAG = f"gke-{CLUSTER}-{CLUSTER_ID[:8]}-node"
ENDPOINT_IP = "34.118.20.30"
EKS_CONTEXT = "arn:aws:eks:us-east-1:123456789012:cluster/levers9-control"
EKS_CLUSTER = "levers9-control"
AWS_REGION = "us-east-1"
VPC = "vpc-0a1b2c3d4e5f60718"
WORKER_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/levers9/worker:latest"
WORKER_COPY = f"{REGION}-docker.pkg.dev/{PROJECT}/levers9/worker:latest"
POOL = f"gke-{CLUSTER}"
SA_EMAIL = f"levers9-controlplane@{PROJECT}.iam.gserviceaccount.com"
FIREWALL = f"levers9-controlplane-to-{CLUSTER}"
OFFICE = "203.0.113.0/24"
NODE_IPS = ["54.210.1.5", "54.210.2.6"]
NAT_IP = "3.5.6.7"
EGRESS = [f"{ip}/32" for ip in [*NODE_IPS, NAT_IP]]


def _node(name: str, internal: str, external: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": internal},
                {"type": "ExternalIP", "address": external},
                {"type": "InternalDNS", "address": f"{name}.ec2.internal"},
                {"type": "Hostname", "address": f"{name}.ec2.internal"},
            ],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _gpu_pool(name: str, kind: str, count: int, tags: list[str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "machineType": "a2-highgpu-1g",
        "accelerators": [{"acceleratorCount": str(count), "acceleratorType": kind}],
    }
    if tags:
        config["tags"] = tags
    return {"name": name, "config": config, "initialNodeCount": 1, "status": "RUNNING"}


def _world_state(ca_data: str) -> dict[str, Any]:
    cluster = {
        "name": CLUSTER,
        "id": CLUSTER_ID,
        "location": REGION,
        "status": "RUNNING",
        "currentMasterVersion": "1.30.5-gke.1014001",
        "endpoint": ENDPOINT_IP,
        "masterAuth": {"clusterCaCertificate": ca_data},
        "network": "default",
        "subnetwork": "default",
        "masterAuthorizedNetworksConfig": {
            "enabled": True,
            "cidrBlocks": [{"displayName": "office", "cidrBlock": OFFICE}],
        },
        "nodePools": [
            {"name": "default-pool", "config": {"machineType": "e2-standard-4"}},
            _gpu_pool("a100-1", "nvidia-tesla-a100", 1),
            _gpu_pool("a100-4", "nvidia-tesla-a100", 4),
        ],
    }
    nat = {
        "NatGatewayId": "nat-0aa",
        "VpcId": VPC,
        "SubnetId": "subnet-0aa",
        "State": "available",
        "ConnectivityType": "public",
        "NatGatewayAddresses": [
            {"AllocationId": "eipalloc-1", "PublicIp": NAT_IP, "PrivateIp": "10.0.0.9"}
        ],
    }
    deleted = {
        **nat,
        "NatGatewayId": "nat-0bb",
        "State": "deleted",
        "NatGatewayAddresses": [{"AllocationId": "eipalloc-2", "PublicIp": "3.5.6.8"}],
    }
    elsewhere = {
        **nat,
        "NatGatewayId": "nat-0cc",
        "VpcId": "vpc-0ffffffffffffffff",
        "NatGatewayAddresses": [{"AllocationId": "eipalloc-3", "PublicIp": "3.9.9.9"}],
    }
    return {
        "gcp": {
            "project": PROJECT,
            "accessToken": "ya29.standin-" + secrets.token_urlsafe(24),
            "serviceAccounts": {},
            "iamBindings": {"roles/owner": ["user:operator@example.com"]},
            "networks": ["default"],
            "repositories": {},
            "images": {},
            "firewalls": {},
            "clusters": {f"{REGION}/{CLUSTER}": cluster},
        },
        "aws": {
            "accountId": "123456789012",
            "ecrPasswords": {AWS_REGION: "ecr-" + secrets.token_urlsafe(32)},
            "images": {WORKER_IMAGE: {"digest": "sha256:" + secrets.token_hex(32)}},
            "eksClusters": {
                f"{AWS_REGION}/{EKS_CLUSTER}": {
                    "name": EKS_CLUSTER,
                    "status": "ACTIVE",
                    "resourcesVpcConfig": {"vpcId": VPC, "subnetIds": ["subnet-0aa"]},
                }
            },
            "natGateways": {AWS_REGION: [nat, deleted, elsewhere]},
        },
        "kube": {
            "currentContext": "someone-else",
            "contexts": {
                EKS_CONTEXT: {
                    "nodes": [
                        _node("ip-10-0-1-5", "10.0.1.5", NODE_IPS[0]),
                        _node("ip-10-0-2-6", "10.0.2.6", NODE_IPS[1]),
                    ]
                },
                "someone-else": {"nodes": []},
            },
        },
        "skopeo": {"logins": {}},
    }


@attrs.frozen
class World:
    root: Path
    state_dir: Path
    home: Path
    tmp: Path
    bin_dir: Path
    ca: trustme.CA

    @property
    def private_values(self) -> Path:
        return self.home / ".levers9" / f"{CLUSTER}-private-values.yaml"

    def args(self, **changes: str | None) -> list[str]:
        flags: dict[str, str | None] = {
            "--project": PROJECT,
            "--region": REGION,
            "--cluster": CLUSTER,
            "--eks-context": EKS_CONTEXT,
            "--eks-cluster": EKS_CLUSTER,
            "--aws-region": AWS_REGION,
            "--worker-image": WORKER_IMAGE,
        }
        flags.update({"--" + key.replace("_", "-"): value for key, value in changes.items()})
        return [
            part for flag, value in flags.items() if value is not None for part in (flag, value)
        ]

    def run(
        self, *, path: str | None = None, **changes: str | None
    ) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": path or f"{STANDINS}:{self.bin_dir}:{os.environ['PATH']}",
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "CLOUD_STANDIN_STATE": str(self.state_dir),
            "CLOUD_STANDIN_PYTHON": sys.executable,
        }
        return subprocess.run(
            [BASH, str(SCRIPT), *self.args(**changes)],
            env=env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def ok(self, **changes: str | None) -> subprocess.CompletedProcess[str]:
        result = self.run(**changes)
        assert result.returncode == 0, result.stderr
        return result

    def state(self) -> dict[str, Any]:
        return read_state(self.state_dir)

    def change(self, **sections: Any) -> dict[str, Any]:
        state = self.state()
        state.update(sections)
        write_state(self.state_dir, state)
        return state

    def calls(self) -> list[dict[str, Any]]:
        return read_calls(self.state_dir)

    def credentials(self) -> dict[str, Any]:
        values = yaml.safe_load(self.private_values.read_text())
        creds: dict[str, Any] = values["secretConfig"]["worker"]["poolCredentials"]
        return creds


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    state_dir, home, tmp, bin_dir = (tmp_path / n for n in ("cloud", "home", "tmp", "bin"))
    for d in (state_dir, home, tmp, bin_dir):
        d.mkdir()
    # The script's python3, logging its argv so a test can show no secret is ever there.
    shim = bin_dir / "python3"
    shim.write_text(
        f"#!{BASH}\n"
        'printf "%s\\0" "$@" >> "$CLOUD_STANDIN_STATE/python3-argv"\n'
        f'exec {SCRIPT_PYTHON} "$@"\n'
    )
    shim.chmod(0o755)
    ca = trustme.CA()
    ca_data = base64.b64encode(ca.cert_pem.bytes()).decode()
    write_state(state_dir, _world_state(ca_data))
    yield World(tmp_path, state_dir, home, tmp, bin_dir, ca)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cluster(state: dict[str, Any]) -> dict[str, Any]:
    cluster: dict[str, Any] = state["gcp"]["clusters"][f"{REGION}/{CLUSTER}"]
    return cluster


def _authorized(state: dict[str, Any]) -> list[str]:
    blocks = _cluster(state)["masterAuthorizedNetworksConfig"]["cidrBlocks"]
    return [block["cidrBlock"] for block in blocks]


def _changing(calls: list[dict[str, Any]]) -> list[list[str]]:
    verbs = ("create", "update", "add-iam-policy-binding", "delete", "remove-iam-policy-binding")
    return [c["argv"] for c in calls if any(v in c["argv"] for v in verbs)]


def test_first_run_creates_everything_and_prints_a_block_the_controlplane_loads(
    world: World,
) -> None:
    result = world.ok()
    state = world.state()

    assert SA_EMAIL in state["gcp"]["serviceAccounts"]
    assert f"serviceAccount:{SA_EMAIL}" in state["gcp"]["iamBindings"]["roles/container.developer"]
    assert state["gcp"]["repositories"][f"{REGION}/levers9"]["format"] == "DOCKER"
    copied = state["gcp"]["images"][WORKER_COPY]
    assert copied["copies"] == 1
    assert copied["digest"] == state["aws"]["images"][WORKER_IMAGE]["digest"]
    # The EKS nodes' and the live NAT gateway's IPs, appended after what was there.
    assert _authorized(state) == [OFFICE, *EGRESS]
    rule = state["gcp"]["firewalls"][FIREWALL]
    assert rule["sourceRanges"] == EGRESS
    assert rule["targetTags"] == [NODE_TAG]
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["7443"]}]
    assert rule["network"].endswith("/global/networks/default")
    for said in ("created", "appended 54.210.1.5/32"):
        assert said in result.stderr

    # The key: in a 0600 file in a 0700 directory, and the one Google lists.
    assert _mode(world.private_values) == 0o600
    assert _mode(world.private_values.parent) == 0o700
    creds = world.credentials()
    key = creds[POOL]
    assert key["client_email"] == SA_EMAIL
    assert [k["id"] for k in state["gcp"]["serviceAccounts"][SA_EMAIL]["keys"]] == [
        key["private_key_id"]
    ]
    assert str(world.private_values) in result.stdout
    assert list(world.tmp.iterdir()) == []  # the work dir with the key file is gone

    # Pasted as it is under the chart's `pools:`, it is that list; deploy.sh's -f order is named.
    values = (REPO / "deploy/chart/values.yaml").read_text()
    assert values.count("\n    pools: []\n") == 1
    pasted = values.replace("\n    pools: []\n", "\n    pools:\n" + result.stdout)
    block = yaml.safe_load(pasted)["config"]["worker"]["pools"]
    assert isinstance(block, list)
    assert len(block) == 1
    assert f"deploy/deploy.sh -f values.yaml -f {world.private_values}" in result.stdout
    (pool,) = load_pools(block, creds).pools
    kube = pool.kubernetes
    assert pool.name == POOL
    assert kube.flavor is Flavor.GKE
    assert kube.endpoint == f"https://{ENDPOINT_IP}"
    assert kube.ca_pem == world.ca.cert_pem.bytes()
    assert kube.image == WORKER_COPY
    assert dict(kube.selector.match_labels) == {
        "cloud.google.com/gke-accelerator": "nvidia-tesla-a100"
    }
    assert (kube.namespace, kube.tunnel, kube.host_network) == ("levers9", False, True)
    assert isinstance(kube.credentials, GkeCredentials)
    assert kube.credentials.client_email == SA_EMAIL


def test_second_run_creates_nothing_keeps_the_key_and_copies_the_image_again(
    world: World,
) -> None:
    first = world.ok()
    values_before = world.private_values.read_text()
    before = len(world.calls())

    second = world.ok()
    calls = world.calls()[before:]

    assert _changing(calls) == []
    assert [c["argv"][:1] for c in calls if c["tool"] == "skopeo"] == [
        ["login"],
        ["login"],
        ["copy"],
    ]
    assert world.state()["gcp"]["images"][WORKER_COPY]["copies"] == 2
    assert world.private_values.read_text() == values_before
    assert second.stdout == first.stdout
    assert "exists, kept" in second.stderr
    assert "still listed, kept" in second.stderr


def test_replaced_eks_node_is_appended_and_no_address_is_removed(world: World) -> None:
    world.ok()
    state = world.state()
    authorized_before = _authorized(state)
    sources_before = state["gcp"]["firewalls"][FIREWALL]["sourceRanges"]
    nodes = state["kube"]["contexts"][EKS_CONTEXT]["nodes"]
    nodes[1] = _node("ip-10-0-3-7", "10.0.3.7", "54.210.3.7")
    world.change(kube=state["kube"])
    before = len(world.calls())

    third = world.ok()

    state = world.state()
    assert _authorized(state) == [*authorized_before, "54.210.3.7/32"]
    assert state["gcp"]["firewalls"][FIREWALL]["sourceRanges"] == [
        *sources_before,
        "54.210.3.7/32",
    ]
    changing = _changing(world.calls()[before:])
    assert [argv[:3] for argv in changing] == [
        ["container", "clusters", "update"],
        ["compute", "firewall-rules", "update"],
    ]
    assert third.stderr.count("appended 54.210.3.7/32") == 2


def test_the_key_is_only_in_the_private_values_file(world: World) -> None:
    started = time.time()
    runs = [world.ok(), world.ok()]  # the rerun reads the key's id from the file
    pem = world.credentials()[POOL]["private_key"]
    # A line from the middle of the PEM body: found whether the key was copied raw or
    # JSON-escaped (where its newlines become \n).
    secret = pem.splitlines()[5]
    assert len(secret) == 64

    # Where it was found, by name only: a failing test must not print the key either.
    places = {
        **{f"run {i} stdout": run.stdout for i, run in enumerate(runs)},
        **{f"run {i} stderr": run.stderr for i, run in enumerate(runs)},
        "the calls log (argv)": (world.state_dir / "calls.jsonl").read_text(),
        "python3's argv": (world.state_dir / "python3-argv").read_text(),
        "the fake cloud's state": (world.state_dir / "state.json").read_text(),
    }
    assert [where for where, text in places.items() if secret in text] == []
    assert [p for p in world.home.rglob("*") if p.is_file()] == [world.private_values]
    assert list(world.tmp.iterdir()) == []
    # Registry passwords travel on stdin too.
    state = world.state()
    logins = [c for c in world.calls() if c["argv"][:1] == ["login"]]
    assert [c["stdin"] for c in logins] == [True] * 4
    for call in logins:
        assert state["gcp"]["accessToken"] not in call["argv"]
        assert state["aws"]["ecrPasswords"][AWS_REGION] not in call["argv"]

    skip = {".venv", ".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
    leaked = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = Path(top, name)
            try:
                if path.stat().st_mtime < started - 1 or path.stat().st_size > 5_000_000:
                    continue
                if secret.encode() in path.read_bytes():
                    leaked.append(path)
            except OSError:
                continue
    assert leaked == []


def test_a_deleted_key_is_replaced_and_the_file_rewritten(world: World) -> None:
    world.ok()
    old = world.credentials()[POOL]["private_key_id"]
    state = world.state()
    state["gcp"]["serviceAccounts"][SA_EMAIL]["keys"] = []  # keys delete, by someone else
    world.change(gcp=state["gcp"])
    before = len(world.calls())

    result = world.ok()

    new = world.credentials()[POOL]["private_key_id"]
    assert new != old
    listed = [k["id"] for k in world.state()["gcp"]["serviceAccounts"][SA_EMAIL]["keys"]]
    assert listed == [new]
    assert [argv[:4] for argv in _changing(world.calls()[before:])] == [
        ["iam", "service-accounts", "keys", "create"]
    ]
    assert _mode(world.private_values) == 0o600
    assert f"key {old} in {world.private_values} is no longer listed" in result.stderr


def test_missing_project_exits_2_naming_it(world: World) -> None:
    result = world.run(project=None)

    assert result.returncode == 2
    assert "missing --project" in result.stderr
    assert world.calls() == []


def test_missing_gcloud_is_named(world: World) -> None:
    # Everything the script needs but gcloud (a real gcloud in /usr/bin must not be found).
    only = world.root / "only"
    only.mkdir()
    for tool in ("kubectl", "aws", "skopeo"):
        (only / tool).symlink_to(STANDINS / tool)
    (only / "python3").symlink_to(world.bin_dir / "python3")

    result = world.run(path=str(only))

    assert result.returncode == 1
    assert "gcloud is not on PATH" in result.stderr
    assert world.calls() == []


def test_private_values_inside_a_git_work_tree_is_refused(world: World) -> None:
    checkout = world.root / "checkout"
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    inside = checkout / "deploy" / "private.yaml"

    result = world.run(private_values=str(inside))

    assert result.returncode == 1
    assert f"inside the git work tree {checkout}" in result.stderr
    assert "out of any repository" in result.stderr
    assert not inside.exists()
    assert world.calls() == []


def test_several_gpu_types_need_accelerator_and_pool_tags_are_the_firewall_target(
    world: World,
) -> None:
    state = world.state()
    _cluster(state)["nodePools"].append(_gpu_pool("l4-2", "nvidia-l4", 2, ["levers9-gpu"]))
    world.change(gcp=state["gcp"])

    refused = world.run()

    assert refused.returncode == 1
    assert "nvidia-tesla-a100, nvidia-l4" in refused.stderr
    assert "--accelerator" in refused.stderr
    assert _changing(world.calls()) == []

    result = world.ok(accelerator="nvidia-l4")

    (pool,) = load_pools(yaml.safe_load(result.stdout), world.credentials()).pools
    assert dict(pool.kubernetes.selector.match_labels) == {
        "cloud.google.com/gke-accelerator": "nvidia-l4"
    }
    assert world.state()["gcp"]["firewalls"][FIREWALL]["targetTags"] == ["levers9-gpu"]


def test_an_autopilot_cluster_is_refused_before_any_change(world: World) -> None:
    set_autopilot(world.state_dir, REGION, CLUSTER)

    refused = world.run()

    assert refused.returncode == 1
    assert f"cluster {CLUSTER} is a GKE Autopilot cluster" in refused.stderr
    assert "does not admit privileged pods" in refused.stderr
    assert "Use a GKE Standard cluster" in refused.stderr
    assert _changing(world.calls()) == []
    assert refused.stdout == "" and not world.private_values.exists()

    set_autopilot(world.state_dir, REGION, CLUSTER, enabled=False)
    world.ok()


def test_authorized_networks_that_are_off_stay_off(world: World) -> None:
    state = world.state()
    _cluster(state)["masterAuthorizedNetworksConfig"] = {"enabled": False}
    world.change(gcp=state["gcp"])

    result = world.ok()

    assert _cluster(world.state())["masterAuthorizedNetworksConfig"] == {"enabled": False}
    assert not any(c["argv"][:3] == ["container", "clusters", "update"] for c in world.calls())
    assert "authorized networks of gpu-one: off" in result.stderr
    # The workers' firewall rule is still needed and made.
    assert world.state()["gcp"]["firewalls"][FIREWALL]["sourceRanges"] == EGRESS


def test_standins_answer_like_the_real_tools_and_refuse_the_unmodelled(world: World) -> None:
    env = {**os.environ, "CLOUD_STANDIN_STATE": str(world.state_dir)}
    env["CLOUD_STANDIN_PYTHON"] = sys.executable

    def standin(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(STANDINS / argv[0]), *argv[1:]],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    missing = standin("gcloud", "iam", "service-accounts", "describe", SA_EMAIL, "--format=json")
    assert missing.returncode == 1
    assert missing.stderr.startswith("ERROR: (gcloud.iam.service-accounts.describe) NOT_FOUND: ")
    unmodelled = standin("gcloud", "container", "clusters", "get-credentials", CLUSTER)
    assert unmodelled.returncode == 2
    assert "not modelled" in unmodelled.stderr
    bad_flag = standin("kubectl", "--context", EKS_CONTEXT, "get", "nodes", "--all-namespaces")
    assert bad_flag.returncode == 1
    assert "unrecognized arguments: --all-namespaces" in bad_flag.stderr
    no_stdin = standin("skopeo", "login", "--username", "AWS", "--password", "x", "host")
    assert no_stdin.returncode != 0
    assert "pass the password on stdin" in no_stdin.stderr
    assert [c["exit"] for c in world.calls()] == [1, 2, 1, 125]


def test_a_private_values_file_with_other_secrets_is_not_rewritten(world: World) -> None:
    mine = world.root / "private-values.yaml"
    text = "secretConfig:\n  apiTokens: [tok-123]\n  worker:\n    poolCredentials:\n"
    mine.write_text(text)
    mine.chmod(0o600)

    refused = world.run(private_values=str(mine))

    assert refused.returncode == 1
    assert "holds more than pool keys" in refused.stderr
    assert mine.read_text() == text
    assert _changing(world.calls()) == []


def test_other_pools_keys_in_the_file_are_kept(world: World) -> None:
    world.ok(pool_name="gke-first")
    first = world.credentials()["gke-first"]

    world.ok()

    creds = world.credentials()
    assert sorted(creds) == ["gke-first", POOL]
    assert creds["gke-first"] == first
    assert creds[POOL]["private_key_id"] != first["private_key_id"]
