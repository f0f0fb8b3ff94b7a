"""docs/gke.md's recipe, run as written: its numbered steps, in order, from nothing to a task on
a GPU of the GKE cluster, against stand-ins of both clouds and both clusters.

The page promises that a person who runs its steps in order ends with a task on a GPU. This
test takes the steps from the page itself (each `### N. Title` heading of "The recipe" and the
one ```sh block under it), gives step 1's variables this test's values, and runs each step with
bash, in one carried-over environment (what a step exports, and the directory it ends in, reach
the next), as one person's terminal:

- the clouds: `gcloud`, `aws` and `skopeo` are sim/cloud's stand-ins, sharing one fake GCP
  project (with its OAuth token endpoint, sim.cloud.oauth), AWS account (ECR, the EKS VPC) and
  the images buildah left in local storage;
- the EKS cluster, where the controlplane goes: a Kubernetes API stand-in driven by the real
  `kubectl` and Helm through a kubeconfig whose current context is another cluster, so a step
  that forgets `--context` fails;
- the GKE cluster: a second API stand-in, which the fake cloud describes as the GKE cluster (its
  endpoint and CA), with GPU nodes whose simulated kubelet runs the worker Jobs' agents as local
  processes on stand-in NVML cards; it accepts the tokens the pool's service-account key is
  exchanged for while the key is live and the account holds roles/container.developer;
- the controlplane's pod: the stand-in runs no pods, so after every deploy the test plays the
  kubelet for the Deployment Helm made (`ControlplanePod`): the image must be the one pushed to
  ECR, and the ConfigMap, Secret and TLS Secret it mounts must exist; they are written under a
  directory where the pod would see them, and `levers9-control serve` starts with the pod's
  arguments (re-rooted), its ServiceAccount's token, and the listen address the Service would
  forward `$PUBLIC_URL` to;
- the GPU image is busybox from the session's registry (Docker Hub is not reachable); the
  controlplane's certificate is from a CA this machine trusts (SSL_CERT_FILE).

Two commands are replaced by quicker ones that prove the same thing, after checking the page
says exactly them (`SUBSTITUTES`): `pip install .` (this checkout's installed `levers9` is linked
into the step's virtual environment) and `make images` (`make -n` shows it runs sim.images with
`--push $REGISTRY`, and sim.images' own push commands copy the images to the fake ECR, which
refuses a repository that was not created). Everything else runs as the page has it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import yaml

from control.config import merge
from sim.cloud.oauth import running_token_endpoint
from sim.cloud.standin import read_state, write_state
from sim.cluster import agent_environment, free_port, pod_environment
from sim.configs import Pki, make_pki
from sim.images import local_reference, push_argv
from sim.kubeapi.http import RunningKubeStandin, start_kube_standin
from sim.kubeapi.objects import make_node
from sim.kubeapi.store import KubeStandin
from sim.kubelet import SimNode, SimulatedKubelet

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.registry_fixtures"]

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gke.md"
STANDINS = REPO / "sim" / "cloud"
VENV_BIN = Path(sys.executable).parent
BASH = shutil.which("bash") or "/bin/bash"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STEP_S = 90.0
POD_READY_S = 30.0

VARIABLES = (
    "PROJECT",
    "REGION",
    "CLUSTER",
    "EKS_CLUSTER",
    "AWS_REGION",
    "EKS_CONTEXT",
    "REGISTRY",
    "PUBLIC_URL",
    "TLS_CERT",
    "TLS_KEY",
    "GPU_IMAGE",
)
"""Step 1 sets exactly these; every later step uses no other variable of its own."""

STEPS_IN_ORDER = (
    "export PROJECT=",
    "~/.levers9/cli/bin/pip install .",
    'make images PUSH="$REGISTRY"',
    'kubectl --context "$EKS_CONTEXT" create namespace levers9-control',
    'kubectl --context "$EKS_CONTEXT" -n levers9-control create secret tls levers9-tls',
    "cat > values.yaml <<EOF",
    "cat > ~/.levers9/private-values.yaml <<EOF",
    "deploy/deploy.sh -f values.yaml -f ~/.levers9/private-values.yaml",
    "deploy/attach-gke-pool.sh",
    "cat gke-pool.yaml >> values.new",
    'levers9 login "$PUBLIC_URL"',
    'levers9 run --gpus 1 "$GPU_IMAGE" -- nvidia-smi',
)
"""What each step does, in the page's order: a line (or its start) of that step's block."""

PROJECT = "levers9-recipe"
REGION = "us-central1"
CLUSTER = "gpu-one"
CLUSTER_ID = "9c1d2e3f4a5b6c7d8e9f00112233445566778899aabbccddeeff001122334455"
EKS_CLUSTER = "levers9-control"
AWS_REGION = "us-east-1"
ACCOUNT = "123456789012"
EKS_CONTEXT = f"arn:aws:eks:{AWS_REGION}:{ACCOUNT}:cluster/{EKS_CLUSTER}"
ECR = f"{ACCOUNT}.dkr.ecr.{AWS_REGION}.amazonaws.com"
VPC = "vpc-0123456789abcdef0"
EKS_NODE_IPS = ("54.210.1.5", "54.210.2.6")
NAT_IP = "3.5.6.7"
ACCELERATOR = "nvidia-tesla-a100"
NODE = "gke-gpu-one-a100-2-3b1f9c2e-7xkq"
"""A GPU node named as GKE names them (`gke-<cluster>-<node pool>-<hash>-<suffix>`): the worker
Job's name, and so the worker's id, is then as long as a name may be."""
POOL = f"gke-{CLUSTER}"
NAMESPACE = "levers9-control"
RELEASE = "levers9"
SA_EMAIL = f"levers9-controlplane@{PROJECT}.iam.gserviceaccount.com"
WORKER_COPY = f"{REGION}-docker.pkg.dev/{PROJECT}/levers9/worker:latest"
IMAGES = ("worker", "control")


# --- the page ------------------------------------------------------------------------------


@attrs.frozen
class Step:
    number: int
    title: str
    script: str

    def lines(self) -> list[str]:
        return self.script.splitlines()


_HEADING = re.compile(r"^### (\d+)\. (.+)$", re.M)


def recipe_steps(text: str) -> list[Step]:
    """The numbered steps of the page's "The recipe" section, each heading with the one
    ```sh block under it."""
    assert "\n## The recipe\n" in text, "the page has no '## The recipe' section"
    section = text.split("\n## The recipe\n", 1)[1].split("\n## ", 1)[0]
    heads = list(_HEADING.finditer(section))
    steps = []
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(section)
        blocks = re.findall(r"```sh\n(.*?)```", section[head.end() : end], re.S)
        assert len(blocks) == 1, (
            f"step {head.group(1)} ({head.group(2)}) has {len(blocks)} sh blocks; each step has one"
        )
        steps.append(Step(int(head.group(1)), head.group(2), blocks[0]))
    assert [s.number for s in steps] == list(range(1, len(steps) + 1)), (
        "steps are numbered 1, 2, ..."
    )
    return steps


def page_steps() -> list[Step]:
    return recipe_steps(DOC.read_text())


def used_variables(script: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", script))


# --- the world the steps run in ------------------------------------------------------------


def _cloud_state(gke: KubeStandin) -> dict[str, Any]:
    """A GCP project whose GKE cluster is the `gke` stand-in, an AWS account with the EKS
    cluster's VPC and NAT gateway, and the two images `make images` builds, in local storage."""
    endpoint = gke.url.removeprefix("https://")
    cluster = {
        "name": CLUSTER,
        "id": CLUSTER_ID,
        "location": REGION,
        "status": "RUNNING",
        "endpoint": endpoint,
        "masterAuth": {"clusterCaCertificate": base64.b64encode(gke.ca_pem).decode()},
        "network": "default",
        "masterAuthorizedNetworksConfig": {
            "enabled": True,
            "cidrBlocks": [{"displayName": "office", "cidrBlock": "203.0.113.0/24"}],
        },
        "nodePools": [
            {"name": "default-pool", "config": {"machineType": "e2-standard-4"}},
            {
                "name": "a100-2",
                "config": {
                    "machineType": "a2-highgpu-2g",
                    "accelerators": [{"acceleratorCount": "2", "acceleratorType": ACCELERATOR}],
                },
            },
        ],
    }
    nat = {
        "NatGatewayId": "nat-0aa",
        "VpcId": VPC,
        "SubnetId": "subnet-0aa",
        "State": "available",
        "NatGatewayAddresses": [{"AllocationId": "eipalloc-1", "PublicIp": NAT_IP}],
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
            "accountId": ACCOUNT,
            "ecrPasswords": {AWS_REGION: "ecr-" + secrets.token_urlsafe(32)},
            "repositories": {},
            "images": {},
            "eksClusters": {
                f"{AWS_REGION}/{EKS_CLUSTER}": {
                    "name": EKS_CLUSTER,
                    "status": "ACTIVE",
                    "resourcesVpcConfig": {"vpcId": VPC, "subnetIds": ["subnet-0aa"]},
                }
            },
            "natGateways": {AWS_REGION: [nat]},
        },
        "kube": {"currentContext": "", "contexts": {}},
        "skopeo": {"logins": {}},
        # What `make images` leaves in buildah's storage before it pushes.
        "containersStorage": {
            local_reference(name): {"digest": "sha256:" + secrets.token_hex(32)} for name in IMAGES
        },
    }


def _eks_node(name: str, external_ip: str) -> dict[str, Any]:
    node = make_node(name, gpus=0, labels={"eks.amazonaws.com/nodegroup": "control"})
    node["status"]["addresses"] = [
        {"type": "InternalIP", "address": "10.0.1." + external_ip.rsplit(".", 1)[1]},
        {"type": "ExternalIP", "address": external_ip},
        {"type": "Hostname", "address": f"{name}.ec2.internal"},
    ]
    return node


def _kubeconfig(eks: KubeStandin, path: Path) -> Path:
    """The operator's kubeconfig: the EKS cluster as `EKS_CONTEXT`, and a current context on
    another cluster (nothing listens there), so a step that names no context fails."""
    config = yaml.safe_load(eks.write_kubeconfig(path).read_text())
    config["contexts"] = [
        {"name": EKS_CONTEXT, "context": {"cluster": "standin", "user": "standin"}},
        {"name": "elsewhere", "context": {"cluster": "elsewhere", "user": "standin"}},
    ]
    config["clusters"].append({"name": "elsewhere", "cluster": {"server": "https://127.0.0.1:1"}})
    config["current-context"] = "elsewhere"
    path.write_text(yaml.safe_dump(config))
    return path


@attrs.frozen
class Substitute:
    """A line of the page, exactly, and what the test runs in its place."""

    line: str
    instead: str


def substitutes(registry: str) -> list[Substitute]:
    pushes = [
        shlex.join(
            push_argv(local_reference(name), f"{registry}/levers9/{name}:latest", tls_verify=True)
        )
        for name in IMAGES
    ]
    return [
        Substitute("python3 -m venv ~/.levers9/cli", "mkdir -p ~/.levers9/cli/bin"),
        Substitute(
            "~/.levers9/cli/bin/pip install .",
            f"ln -s {shlex.quote(str(VENV_BIN / 'levers9'))} ~/.levers9/cli/bin/levers9",
        ),
        Substitute(
            'make images PUSH="$REGISTRY"',
            "\n".join(
                [
                    'make -n images PUSH="$REGISTRY" > "$TMPDIR/make-images"',
                    "grep -E -- '-m sim\\.images +--push '\"$REGISTRY\"'$' \"$TMPDIR/make-images\"",
                    *pushes,
                ]
            ),
        ),
    ]


class StepFailed(Exception):
    def __init__(self, step: Step, why: str) -> None:
        super().__init__(f"step {step.number} ({step.title}) failed: {why}")
        self.step = step
        self.why = why


class PodNotStarting(Exception):
    """What `kubectl describe pod` would show for a pod that does not start."""


@attrs.define
class ControlplanePod:
    """The controlplane's pod as the EKS cluster's kubelet would run it, from what the Helm
    release put into the stand-in, started again after every deploy (the chart's checksum
    annotations roll the pod whenever the config changes; Recreate stops the old one first)."""

    eks: KubeStandin
    root: Path
    port: int
    cloud_state: Path
    process: trio.Process | None = None
    starts: int = 0
    _pod_env: dict[str, str] | None = None

    def deployment(self) -> dict[str, Any]:
        """The release's Deployment (Helm's annotations name the release)."""
        found = [
            d
            for d in self.eks.objects("deployments", NAMESPACE)
            if d["metadata"].get("annotations", {}).get("meta.helm.sh/release-name") == RELEASE
        ]
        if len(found) != 1:
            raise PodNotStarting(f"{len(found)} Deployments of release {RELEASE} in {NAMESPACE}")
        return found[0]

    def configmap(self) -> dict[str, Any]:
        """The ConfigMap the pod mounts its settings from."""
        volumes = self.deployment()["spec"]["template"]["spec"]["volumes"]
        (name,) = [v["configMap"]["name"] for v in volumes if "configMap" in v]
        found = self.eks.get("configmaps", name, NAMESPACE)
        assert found is not None
        return found

    def _mount(self, volume: Mapping[str, Any], target: Path) -> None:
        """Lays out one of the pod's volumes at `target`, or says why the kubelet cannot."""
        if "configMap" in volume:
            name = volume["configMap"]["name"]
            found = self.eks.get("configmaps", name, NAMESPACE)
            if found is None:
                raise PodNotStarting(f'FailedMount: configmap "{name}" not found')
            files = {k: v.encode() for k, v in found.get("data", {}).items()}
        elif "secret" in volume:
            name = volume["secret"]["secretName"]
            found = self.eks.get("secrets", name, NAMESPACE)
            if found is None:
                raise PodNotStarting(f'FailedMount: secret "{name}" not found')
            files = {k: base64.b64decode(v) for k, v in found.get("data", {}).items()}
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if self.eks.get("persistentvolumeclaims", claim, NAMESPACE) is None:
                raise PodNotStarting(f'FailedScheduling: persistentvolumeclaim "{claim}" not found')
            disk = self.root / "volumes" / claim
            disk.mkdir(parents=True, exist_ok=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(disk)
            return
        else:
            files = {}
        target.mkdir(parents=True, exist_ok=True)
        for key, data in files.items():
            (target / key).write_bytes(data)

    def _environment(self, service_account: str) -> dict[str, str]:
        if self._pod_env is None:
            self._pod_env = pod_environment(
                self.eks, NAMESPACE, service_account, self.root / "serviceaccount"
            )
        return self._pod_env

    async def restart(self) -> None:
        await self.stop()
        deployment = self.deployment()
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        pushed = read_state(self.cloud_state)["aws"]["images"]
        if container["image"] not in pushed:
            raise PodNotStarting(
                f"ErrImagePull: {container['image']}: not found in the registry (pushed: "
                f"{sorted(pushed)})"
            )
        self.starts += 1
        rootfs = self.root / f"pod-{self.starts}"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            target = rootfs / mount["mountPath"].lstrip("/")
            self._mount(volumes[mount["name"]], target)
            mounts[mount["mountPath"]] = target

        args = [reroot(arg, mounts) for arg in container.get("args", [])]
        merged: dict[str, Any] = {}
        for file in (Path(a) for a in args if a.endswith(".yaml")):
            merged = merge(merged, yaml.safe_load(file.read_text()) or {})
        outside = outside_a_pod(merged, mounts, self.port)
        override = rootfs / "outside-a-pod.yaml"
        override.write_text(yaml.safe_dump(outside))
        env = {
            "PATH": f"{VENV_BIN}:{SYSTEM_PATH}",
            "HOME": str(rootfs / "tmp"),
            "TMPDIR": str(rootfs / "tmp"),
            "POD_IP": "127.0.0.1",
            "LEVERS9_LOG_LEVEL": "INFO",
            **self._environment(spec["serviceAccountName"]),
        }
        with (self.root / f"pod-{self.starts}.log").open("wb") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "control.main", "serve", *args, "--config", str(override)],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        with trio.move_on_after(POD_READY_S):
            while self.process.poll() is None:
                if _accepts(self.port):
                    return
                await trio.sleep(0.1)
        raise PodNotStarting(
            f"the controlplane did not start listening (exit {self.process.poll()}): "
            + self.log()[-3000:]
        )

    def log(self) -> str:
        path = self.root / f"pod-{self.starts}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(5):
            await process.wait()
        if process.poll() is None:
            process.kill()
            await process.wait()


def reroot(value: str, mounts: Mapping[str, Path]) -> str:
    """`value`, a path in the pod, where this test laid that file out."""
    for path, target in mounts.items():
        if value.startswith(path + "/"):
            return str(target / value.removeprefix(path + "/"))
    return value


def outside_a_pod(
    config: Mapping[str, Any], mounts: Mapping[str, Path], port: int
) -> dict[str, Any]:
    """The settings that differ outside a pod, as one more `--config` merged last: every path in
    `config` under a mount, where the mount is laid out, the listen address on loopback at
    the port `$PUBLIC_URL` names (where the Service would send its port 443), and images from
    a registry on loopback (the test's registry; the nodes' agents are told so by the kubelet,
    `agent_environment`), which a real recipe's registry is not."""

    def paths(node: Any) -> Any:
        if isinstance(node, Mapping):
            found = {k: paths(v) for k, v in node.items()}
            return {k: v for k, v in found.items() if v not in (None, {})}
        if isinstance(node, str) and reroot(node, mounts) != node:
            return reroot(node, mounts)
        return None

    outside: dict[str, Any] = paths(config) or {}
    outside.setdefault("config", {})["listen"] = f"127.0.0.1:{port}"
    outside["config"].setdefault("worker", {})["allowLocalRegistries"] = True
    return outside


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@attrs.define
class StepResult:
    step: Step
    returncode: int
    stdout: str
    stderr: str


@attrs.define
class Recipe:
    """The world, and a terminal in it that runs steps one after another."""

    root: Path
    home: Path
    state_dir: Path
    eks: KubeStandin
    gke: KubeStandin
    pod: ControlplanePod
    variables: dict[str, str]
    env: dict[str, str]
    cwd: Path
    substitutes: list[Substitute]
    results: list[StepResult] = attrs.Factory(list)
    used: list[str] = attrs.Factory(list)

    def script(self, step: Step) -> str:
        lines = step.lines()
        for sub in self.substitutes:
            if sub.line in lines:
                lines = [sub.instead if line == sub.line else line for line in lines]
                self.used.append(sub.line)
        return "\n".join(lines) + "\n"

    async def run(self, steps: Sequence[Step]) -> None:
        for step in steps:
            await self.run_step(step)

    async def run_step(self, step: Step) -> StepResult:
        n = len(self.results)
        saved_env, saved_pwd = self.root / f"env-{n}", self.root / f"pwd-{n}"
        wrapped = (
            "set -euo pipefail\n"
            + self.script(step)
            + f"env -0 > {shlex.quote(str(saved_env))}\npwd > {shlex.quote(str(saved_pwd))}\n"
        )
        out, err = self.root / f"out-{n}", self.root / f"err-{n}"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            returncode = -1
            with trio.move_on_after(STEP_S) as timer:
                done = await trio.run_process(
                    [BASH, "-c", wrapped],
                    env=self.env,
                    cwd=self.cwd,
                    stdin=b"",
                    stdout=stdout,
                    stderr=stderr,
                    check=False,
                )
                returncode = done.returncode
        result = StepResult(
            step,
            returncode,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )
        self.results.append(result)
        if timer.cancelled_caught:
            raise StepFailed(
                step, f"not done in {STEP_S:g} s\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
        if returncode != 0:
            raise StepFailed(
                step, f"exit {returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
        self.env = dict(
            item.split("=", 1) for item in saved_env.read_text().split("\0") if "=" in item
        )
        self.cwd = Path(saved_pwd.read_text().strip())
        if step.number == 1:
            # Step 1 sets the variables to the page's examples; this world has its own.
            self.env.update(self.variables)
        if "deploy/deploy.sh" in step.script:
            try:
                await self.pod.restart()
            except PodNotStarting as exc:
                raise StepFailed(step, f"the controlplane's pod does not start: {exc}") from None
        return result

    def transcript(self) -> str:
        return "\n".join(
            f"--- step {r.step.number} ({r.step.title}): exit {r.returncode}\n{r.stdout}{r.stderr}"
            for r in self.results
        )


def _world_variables(registry_busybox: str, pki: Pki, port: int) -> dict[str, str]:
    return {
        "PROJECT": PROJECT,
        "REGION": REGION,
        "CLUSTER": CLUSTER,
        "EKS_CLUSTER": EKS_CLUSTER,
        "AWS_REGION": AWS_REGION,
        "EKS_CONTEXT": EKS_CONTEXT,
        "REGISTRY": ECR,
        "PUBLIC_URL": f"https://127.0.0.1:{port}",
        "TLS_CERT": str(pki.cert_file),
        "TLS_KEY": str(pki.key_file),
        "GPU_IMAGE": registry_busybox,
    }


NVIDIA_SMI = """#!/bin/sh
# nvidia-smi of the simulated node's driver: the cards the container was given.
echo "NVIDIA-SMI 550.90.07 (stand-in)   Driver Version: 550.90.07"
for uuid in $(echo "$NVIDIA_VISIBLE_DEVICES" | tr , ' '); do
    echo "GPU: NVIDIA A100-SXM4-80GB (UUID: $uuid)"
done
"""


def _install_nvidia_smi(driver: Path) -> None:
    """GKE's driver installer puts an executable nvidia-smi in the driver's bin/, which the
    worker mounts into every GPU container; the simulated node's is an empty file."""
    path = driver / "bin" / "nvidia-smi"
    assert path.exists(), f"the simulated node has no {path}"
    path.write_text(NVIDIA_SMI)
    path.chmod(0o755)


def _checkout(root: Path) -> Path:
    """A clone of this repository as the recipe sees it: its top directory, without this
    checkout's virtual environment or anything the tests left."""
    checkout = root / "levers9"
    checkout.mkdir()
    for name in ("Makefile", "pyproject.toml", "README.md", "deploy", "docs", "images"):
        (checkout / name).symlink_to(REPO / name)
    for name in ("agent", "control", "nvml", "sim", "bench", "tests"):
        (checkout / name).symlink_to(REPO / name)
    return checkout


@asynccontextmanager
async def open_recipe(root: Path, registry_busybox: str) -> AsyncIterator[Recipe]:
    home, state_dir, bin_dir, tmp = (root / n for n in ("home", "cloud", "bin", "tmp"))
    for d in (home, state_dir, bin_dir, tmp):
        d.mkdir(parents=True)
    for tool in ("gcloud", "aws", "skopeo"):
        # The stand-ins find standin.py beside themselves: a wrapper, not a link. Their kubectl
        # is left out: the real one talks to the EKS stand-in.
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!{BASH}\nexec {shlex.quote(str(STANDINS / tool))} "$@"\n')
        wrapper.chmod(0o755)
    (bin_dir / "helm").symlink_to(VENV_BIN / "helm")
    pki = make_pki(root)
    port = free_port()
    running: list[RunningKubeStandin] = []
    try:
        eks_running = start_kube_standin(root / "eks")
        running.append(eks_running)
        gke_running = start_kube_standin(root / "gke")
        running.append(gke_running)
        eks, gke = eks_running.kube, gke_running.kube
        for i, ip in enumerate(EKS_NODE_IPS):
            eks.add_node(_eks_node(f"ip-10-0-{i + 1}-5.ec2.internal", ip))
        write_state(state_dir, _cloud_state(gke))

        def grant(email: str, token: str) -> None:
            # GKE: IAM's roles/container.developer lets the account's tokens in; without it
            # they authenticate and are forbidden everything.
            members = read_state(state_dir)["gcp"]["iamBindings"].get(
                "roles/container.developer", []
            )
            allowed = f"serviceAccount:{email}" in members
            verbs = ("get", "list", "watch", "create", "update", "patch", "delete")
            denied = () if allowed else verbs
            gke.add_token(token, denied_verbs=denied)

        with running_token_endpoint(state_dir, grant):
            kubelet = SimulatedKubelet(
                gke,
                root / "kubelet",
                [
                    SimNode(
                        NODE,
                        2,
                        labels={
                            "cloud.google.com/gke-accelerator": ACCELERATOR,
                            "cloud.google.com/gke-nodepool": "a100-2",
                        },
                    )
                ],
                # The nodes trust the controlplane's CA (a public CA's would need nothing).
                extra_env=agent_environment(
                    {"LEVERS9_CONTROLPLANE_CA": str(pki.ca_file), "LEVERS9_LOG_LEVEL": "INFO"}
                ),
                service_ports=[port],
            )
            variables = _world_variables(registry_busybox, pki, port)
            env = {
                "PATH": f"{bin_dir}:{SYSTEM_PATH}",
                "HOME": str(home),
                "TMPDIR": str(tmp),
                "LANG": "C.UTF-8",
                "KUBECONFIG": str(_kubeconfig(eks, root / "kubeconfig")),
                "SSL_CERT_FILE": str(pki.ca_file),
                "CLOUD_STANDIN_STATE": str(state_dir),
                "CLOUD_STANDIN_PYTHON": sys.executable,
            }
            pod = ControlplanePod(eks, root / "controlplane", port, state_dir)
            recipe = Recipe(
                root=root,
                home=home,
                state_dir=state_dir,
                eks=eks,
                gke=gke,
                pod=pod,
                variables=variables,
                env=env,
                cwd=_checkout(root),
                substitutes=substitutes(ECR),
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(kubelet.run)
                _install_nvidia_smi(root / "kubelet" / "nodes" / NODE / "driver")
                try:
                    yield recipe
                finally:
                    with trio.CancelScope(shield=True):
                        await pod.stop()
                    nursery.cancel_scope.cancel()
    finally:
        for server in running:
            server.stop()


# --- the tests -----------------------------------------------------------------------------


def test_the_page_has_its_steps_in_order() -> None:
    steps = page_steps()
    assert len(steps) == len(STEPS_IN_ORDER)
    for step, marker in zip(steps, STEPS_IN_ORDER, strict=True):
        assert any(line.startswith(marker) for line in step.lines()), (
            f"step {step.number} ({step.title}) should hold a line starting {marker!r}"
        )
    first, *rest = steps
    exported = set(re.findall(r"^export ([A-Z_]+)=", first.script, re.M))
    assert exported == set(VARIABLES)
    used = set().union(*(used_variables(step.script) for step in rest))
    assert used - {"HOME", "PATH"} == set(VARIABLES)
    # Every line the test replaces is on the page, once.
    lines = [line for step in steps for line in step.lines()]
    for sub in substitutes(ECR):
        assert lines.count(sub.line) == 1, sub.line


def test_the_values_it_writes_pass_the_chart(tmp_path: Path) -> None:
    """Steps 6 and 7 write values the chart (and its schema) takes as they are, with the pool
    block of step 10 pasted in: the image pushed in step 3, the Secret of step 5."""
    steps = {s.number: s for s in page_steps()}
    variables = {
        "REGISTRY": ECR,
        "PUBLIC_URL": "https://levers9.example.com",
        **{name: "unused" for name in VARIABLES if name not in ("REGISTRY", "PUBLIC_URL")},
    }
    env = {"PATH": SYSTEM_PATH, "HOME": str(tmp_path), **variables}
    for number in (6, 7):
        subprocess.run(
            [BASH, "-euo", "pipefail", "-c", steps[number].script],
            env=env,
            cwd=tmp_path,
            check=True,
        )
    values, private = tmp_path / "values.yaml", tmp_path / ".levers9" / "private-values.yaml"
    assert private.stat().st_mode & 0o077 == 0
    rendered = _template(values, private)
    deployment = _one(rendered, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{ECR}/levers9/control:latest"
    tls = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert tls[0]["secret"]["secretName"] == "levers9-tls"
    config = yaml.safe_load(_one(rendered, "ConfigMap")["data"]["config.yaml"])["config"]
    assert config["publicUrl"] == "https://levers9.example.com"
    secret = _one(rendered, "Secret")
    tokens = yaml.safe_load(base64.b64decode(secret["data"]["config.yaml"]))["config"]
    assert [t["name"] for t in tokens["apiTokens"]] == ["operator"]

    # The block step 10 pastes, as the page shows values.yaml ending with it.
    section = DOC.read_text().split("### 10. ", 1)[1].split("\n### ", 1)[0]
    (shown,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    pasted = yaml.safe_load(values.read_text())
    pasted["config"]["worker"] = yaml.safe_load(shown)["config"]["worker"]
    values.write_text(yaml.safe_dump(pasted))
    config = yaml.safe_load(_one(_template(values, private), "ConfigMap")["data"]["config.yaml"])
    assert config["config"]["worker"]["pools"][0]["kubernetes"]["flavor"] == "gke"


def _template(*files: Path) -> list[dict[str, Any]]:
    args = [a for f in files for a in ("-f", str(f))]
    done = subprocess.run(
        [str(VENV_BIN / "helm"), "template", RELEASE, str(REPO / "deploy" / "chart"),
         "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _one(rendered: Sequence[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in rendered if d["kind"] == kind]
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker runs containers; needs root (CI is)")
async def test_the_recipe_takes_a_person_from_nothing_to_a_task_on_a_gpu(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    steps = page_steps()
    async with open_recipe(tmp_path, registry.busybox) as recipe:
        try:
            await recipe.run(steps)
        except StepFailed as exc:
            pytest.fail(
                f"{exc}\n\n{recipe.transcript()[-6000:]}\n\ncontrolplane:\n"
                f"{recipe.pod.log()[-3000:]}"
            )
        results = {r.step.number: r for r in recipe.results}
        state = read_state(recipe.state_dir)

        # What $PUBLIC_URL's host leads to: the release's load balancer on 443.
        services = [
            svc
            for svc in recipe.eks.objects("services", NAMESPACE)
            if svc["spec"].get("type") == "LoadBalancer"
        ]
        assert [p["port"] for svc in services for p in svc["spec"]["ports"]] == [443]
        # Step 9 gave the account the role GKE let its tokens in with.
        assert (
            f"serviceAccount:{SA_EMAIL}" in state["gcp"]["iamBindings"]["roles/container.developer"]
        )
        # Step 3 pushed both images; the controlplane's pod runs the control image of it.
        assert sorted(state["aws"]["images"]) == [
            f"{ECR}/levers9/{n}:latest" for n in ("control", "worker")
        ]
        # Step 9 copied the worker image where GKE pulls from; the Jobs run that copy.
        assert state["gcp"]["images"][WORKER_COPY]["source"] == f"{ECR}/levers9/worker:latest"
        jobs = recipe.gke.jobs("levers9")
        assert jobs, "no worker Job on the GKE cluster"
        images = {c["image"] for j in jobs for c in j["spec"]["template"]["spec"]["containers"]}
        assert images == {WORKER_COPY}
        # The key: in the script's private file only, not in the values or the release's config.
        key = yaml.safe_load(
            (recipe.home / ".levers9" / f"{CLUSTER}-private-values.yaml").read_text()
        )["secretConfig"]["worker"]["poolCredentials"][POOL]
        line = key["private_key"].splitlines()[5]
        assert line not in (recipe.cwd / "values.yaml").read_text()
        configmap = recipe.pod.configmap()
        assert line not in json.dumps(configmap)
        assert POOL in configmap["data"]["config.yaml"]

        # Step 11: the pool and its machine; step 12: the check passed and the task ran.
        assert POOL in results[11].stdout
        assert "the pool takes work" in results[12].stdout, recipe.transcript()
        assert NODE in results[12].stdout
        # `levers9 run ... -- nvidia-smi` printed the one card the task was given.
        assert re.findall(r"^GPU: .* \(UUID: (GPU-[-0-9a-f]+)\)$", results[12].stdout, re.M)
        assert recipe.used == [s.line for s in recipe.substitutes]


async def _failing_step(tmp_path: Path, busybox: str, steps: Sequence[Step]) -> StepFailed:
    async with open_recipe(tmp_path, busybox) as recipe:
        with pytest.raises(StepFailed) as failed:
            await recipe.run(steps)
    return failed.value


def _without(steps: Sequence[Step], marker: str) -> list[Step]:
    return [s for s in steps if not any(line.startswith(marker) for line in s.lines())]


def _numbered(steps: Sequence[Step], marker: str) -> int:
    """The number of the first step with a line starting `marker`."""
    return next(s.number for s in steps if any(line.startswith(marker) for line in s.lines()))


async def test_the_tls_secret_before_its_namespace_fails(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    steps = page_steps()
    namespace, secret = (_numbered(steps, STEPS_IN_ORDER[i]) for i in (3, 4))
    swapped = list(steps)
    swapped[namespace - 1], swapped[secret - 1] = steps[secret - 1], steps[namespace - 1]

    failed = await _failing_step(tmp_path, registry.busybox, swapped[:secret])

    assert failed.step.number == secret
    assert 'namespaces "levers9-control" not found' in failed.why


async def test_without_the_tls_secret_the_controlplane_does_not_start(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    steps = page_steps()
    deploy = _numbered(steps, STEPS_IN_ORDER[7])
    shortened = _without(steps[:deploy], STEPS_IN_ORDER[4])

    failed = await _failing_step(tmp_path, registry.busybox, shortened)

    assert failed.step.number == deploy
    assert 'secret "levers9-tls" not found' in failed.why


async def test_without_the_images_the_controlplane_does_not_start(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    steps = page_steps()
    deploy = _numbered(steps, STEPS_IN_ORDER[7])
    shortened = _without(steps[:deploy], STEPS_IN_ORDER[2])

    failed = await _failing_step(tmp_path, registry.busybox, shortened)

    assert failed.step.number == deploy
    assert "ErrImagePull" in failed.why


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker runs containers; needs root (CI is)")
async def test_without_the_pool_block_deployed_the_check_finds_no_machine(
    tmp_path: Path, registry: SharedRegistry
) -> None:
    steps = page_steps()
    paste = _numbered(steps, STEPS_IN_ORDER[9])
    shortened = [s for s in steps if s.number != paste]

    failed = await _failing_step(tmp_path, registry.busybox, shortened)

    assert failed.step.number == _numbered(steps, STEPS_IN_ORDER[11])
    assert "FAIL machine list: no machines" in failed.why
