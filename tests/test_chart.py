"""The controlplane's Helm chart, rendered by Helm itself (`helm template`, `helm lint`).

An operator pastes a pool block into `config:` and keeps every key in `secretConfig:` of a
private values file; these tests check what the cluster would receive: the settings unchanged in
a ConfigMap, the secrets only in a Secret, a pod the controlplane's own loader can start from,
refusals that name the field, and RBAC no wider than the pools need.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from control.config import ControlConfig, load_files, merge
from control.kube.pools import GkeCredentials, load_pools
from tests.test_pools import ca_pem
from tests.test_pools import sa_key as pool_sa_key

HELM = Path(sys.executable).parent / "helm"
CHART = Path(__file__).resolve().parents[1] / "deploy" / "chart"
NAMESPACE = "levers9-control"

API_TOKEN = "api-token-0f9e8d7c6b5a"
WORKER_TOKEN = "worker-token-a1b2c3d4e5"
WORKSPACE_TOKEN = "workspace-token-99aa88bb"
ACCESS_KEY_ID = "AKIACHARTTESTKEYID01"
SECRET_ACCESS_KEY = "bucket-secret-access-key-5e6f7a8b"
PRIVATE_KEY_ID = "sa-private-key-id-3c4d5e"
REPLICA_SECRET = "replica-secret-7d6c5b4a3f2e1d0c"
POSTGRES_URL = "postgresql://levers9@pg.example:5432/levers9"


def ca_data() -> str:
    return base64.b64encode(ca_pem()).decode()


@cache
def sa_key() -> dict[str, str]:
    """A service-account key with a known key id, so tests can look for it in renders."""
    return {**pool_sa_key(), "private_key_id": PRIVATE_KEY_ID}


def gke_pool(**kube: Any) -> dict[str, Any]:
    """The block attach-gke-pool.sh prints (docs/kubernetes.md), as an operator pastes it."""
    block: dict[str, Any] = {
        "name": "gke-a100",
        "provider": "kubernetes",
        "kubernetes": {
            "flavor": "gke",
            "endpoint": "https://34.0.0.10",
            "caData": ca_data(),
            "namespace": "levers9",
            "selector": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
            "tunnel": False,
            "hostNetwork": True,
            "image": "europe-docker.pkg.dev/proj/levers9/worker:latest",
        },
    }
    block["kubernetes"].update(kube)
    return block


def in_cluster_pool(name: str = "local-gpus", **kube: Any) -> dict[str, Any]:
    block: dict[str, Any] = {
        "name": name,
        "provider": "kubernetes",
        "kubernetes": {
            "inCluster": True,
            "flavor": "generic",
            "selector": {"nvidia.com/gpu.present": "true"},
            "image": "registry.example.com/levers9/worker:1",
        },
    }
    block["kubernetes"].update(kube)
    return block


def public_values(*pools: dict[str, Any]) -> dict[str, Any]:
    """The values file kept in the repository."""
    return {
        "config": {
            "publicUrl": "https://levers9.example.com",
            "worker": {"pools": list(pools) if pools else [gke_pool()]},
        },
        "tls": {"secretName": "levers9-tls"},
    }


def private_values() -> dict[str, Any]:
    """The operator's private values file: every secret, under secretConfig."""
    return {
        "secretConfig": {
            "apiTokens": [{"name": "ci", "token": API_TOKEN}],
            "worker": {
                "tokens": [{"workerId": "w-static", "token": WORKER_TOKEN}],
                "poolCredentials": {"gke-a100": sa_key()},
            },
            "workspaces": [
                {
                    "name": "research",
                    "tokens": [{"name": "alice", "token": WORKSPACE_TOKEN}],
                    "buckets": [
                        {
                            "name": "data",
                            "url": "s3://research-data",
                            "s3": {
                                "accessKeyId": ACCESS_KEY_ID,
                                "secretAccessKey": SECRET_ACCESS_KEY,
                            },
                        }
                    ],
                }
            ],
            "replication": {"secret": REPLICA_SECRET},
        }
    }


SECRET_VALUES = (
    API_TOKEN,
    WORKER_TOKEN,
    WORKSPACE_TOKEN,
    ACCESS_KEY_ID,
    SECRET_ACCESS_KEY,
    PRIVATE_KEY_ID,
    REPLICA_SECRET,
)


def helm_template(
    tmp_path: Path, *values: dict[str, Any], sets: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    argv = [str(HELM), "template", "test", str(CHART), "-n", NAMESPACE]
    for i, data in enumerate(values):
        path = tmp_path / f"values-{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        argv += ["-f", str(path)]
    for item in sets:
        argv += ["--set", item]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def render(tmp_path: Path, *values: dict[str, Any], sets: tuple[str, ...] = ()) -> list[Any]:
    done = helm_template(tmp_path, *values, sets=sets)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def refused(tmp_path: Path, *values: dict[str, Any], sets: tuple[str, ...] = ()) -> str:
    done = helm_template(tmp_path, *values, sets=sets)
    assert done.returncode != 0, done.stdout
    assert done.stdout == ""
    return done.stderr


def one(docs: list[Any], kind: str) -> Any:
    (found,) = [doc for doc in docs if doc["kind"] == kind]
    return found


def of_kind(docs: list[Any], kind: str) -> list[Any]:
    return [doc for doc in docs if doc["kind"] == kind]


def configmap_text(docs: list[Any]) -> str:
    return str(one(docs, "ConfigMap")["data"]["config.yaml"])


def secret_text(docs: list[Any]) -> str:
    return base64.b64decode(one(docs, "Secret")["data"]["config.yaml"]).decode()


def container(docs: list[Any]) -> Any:
    (found,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return found


def chart_defaults() -> dict[str, Any]:
    data = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(data, dict)
    return data


# --- what gets rendered ------------------------------------------------------------------------


def test_renders_the_controlplane_kinds(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "PersistentVolumeClaim",
            "Role",
            "RoleBinding",
            "Secret",
            "Service",
            "ServiceAccount",
        ]
    )
    assert all(
        doc["metadata"]["namespace"] == NAMESPACE for doc in docs if doc["kind"] != "ClusterRole"
    )


def test_configmap_holds_the_values_config_unchanged(tmp_path: Path) -> None:
    values = public_values()
    docs = render(tmp_path, values, private_values())
    rendered = yaml.safe_load(configmap_text(docs))
    assert list(rendered) == ["config"]
    assert rendered["config"]["worker"]["pools"] == [gke_pool()]
    assert rendered["config"] == merge(chart_defaults()["config"], values["config"])
    assert rendered["config"]["listen"] == "0.0.0.0:8443"
    assert rendered["config"]["tls"] == {
        "certFile": "/etc/levers9/tls/tls.crt",
        "keyFile": "/etc/levers9/tls/tls.key",
    }
    assert rendered["config"]["database"] == {"path": "/var/lib/levers9-control/tasks.db"}
    assert rendered["config"]["joinedPools"] == {"inCluster": True}


def test_secret_holds_secret_config(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    assert yaml.safe_load(secret_text(docs)) == {"config": private_values()["secretConfig"]}


def test_no_secret_value_leaves_the_secret(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    private_key_line = sa_key()["private_key"].splitlines()[1]
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = yaml.safe_dump(doc) + (configmap_text(docs) if doc["kind"] == "ConfigMap" else "")
        for value in (*SECRET_VALUES, private_key_line):
            assert value not in text, f"a secret value is in the {doc['kind']}"


def load_rendered(tmp_path: Path, docs: list[Any]) -> ControlConfig:
    """The pod's view: the ConfigMap's file, then the Secret's, through the real loader."""
    public = tmp_path / "config" / "config.yaml"
    secret = tmp_path / "secret" / "config.yaml"
    public.parent.mkdir()
    secret.parent.mkdir()
    public.write_text(configmap_text(docs))
    secret.write_text(secret_text(docs))
    secret.chmod(0o600)
    return load_files([public, secret])


def test_rendered_files_load_with_the_controlplanes_loader(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    config = load_rendered(tmp_path, docs)
    assert config.public_url == "https://levers9.example.com"
    assert config.listen_port == 8443
    assert [api.name for api in config.api_tokens] == ["ci"]
    assert [ws.name for ws in config.workspaces] == ["research"]
    assert config.database.path == "/var/lib/levers9-control/tasks.db"

    assert config.joined_pools is not None
    assert config.joined_pools.in_cluster is True
    loaded = load_pools(config.worker.pools, config.worker.pool_credentials)
    (pool,) = loaded.pools
    assert pool.name == "gke-a100"
    assert pool.kubernetes.namespace == "levers9"
    assert pool.kubernetes.host_network is True
    assert pool.kubernetes.tunnel is False
    assert isinstance(pool.kubernetes.credentials, GkeCredentials)
    assert pool.kubernetes.credentials.client_email == sa_key()["client_email"]


def test_in_cluster_pool_loads_with_the_pods_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(tmp_path, public_values(gke_pool(), in_cluster_pool()), private_values())
    config = load_rendered(tmp_path, docs)
    # What a pod sees: the API server's address and the mounted ServiceAccount.
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(base64.b64decode(ca_data()))
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text(NAMESPACE)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("LEVERS9_SERVICEACCOUNT_DIR", str(account))

    loaded = load_pools(config.worker.pools, config.worker.pool_credentials)
    pools = {pool.name: pool for pool in loaded.pools}
    assert sorted(pools) == ["gke-a100", "local-gpus"]
    local = pools["local-gpus"].kubernetes
    assert local.in_cluster is True
    assert local.namespace == "levers9"
    assert local.selector.label_selector() == "nvidia.com/gpu.present=true"


def test_checksums_roll_the_pod_when_settings_or_secrets_change(tmp_path: Path) -> None:
    def annotations(*values: dict[str, Any]) -> dict[str, str]:
        docs = render(tmp_path, *values)
        return dict(one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"])

    before = annotations(public_values(), private_values())
    rotated = private_values()
    rotated["secretConfig"]["apiTokens"][0]["token"] = "a-rotated-api-token"
    after_secret = annotations(public_values(), rotated)
    assert after_secret["checksum/secret"] != before["checksum/secret"]
    assert after_secret["checksum/config"] == before["checksum/config"]

    tunnelled = public_values(gke_pool(tunnel=True))
    after_config = annotations(tunnelled, private_values())
    assert after_config["checksum/config"] != before["checksum/config"]
    assert after_config["checksum/secret"] == before["checksum/secret"]


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("host_network", "tunnel"), [(True, True), (False, True), (True, False)])
def test_host_network_and_tunnel_combinations_that_work(
    tmp_path: Path, host_network: bool, tunnel: bool
) -> None:
    docs = render(tmp_path, public_values(gke_pool(hostNetwork=host_network, tunnel=tunnel)))
    (pool,) = yaml.safe_load(configmap_text(docs))["config"]["worker"]["pools"]
    assert pool["kubernetes"]["hostNetwork"] is host_network
    assert pool["kubernetes"]["tunnel"] is tunnel


@pytest.mark.parametrize("tunnel", [False, None])
def test_pod_network_without_tunnel_is_refused(tmp_path: Path, tunnel: bool | None) -> None:
    pool = gke_pool(hostNetwork=False, tunnel=tunnel)
    if tunnel is None:
        del pool["kubernetes"]["tunnel"]  # the default is no tunnel
    stderr = refused(tmp_path, public_values(pool))
    assert (
        "config.worker.pools[gke-a100].kubernetes.hostNetwork: false needs tunnel: true "
        "(nothing outside the cluster can dial a pod address); "
        "set tunnel: true or hostNetwork: true"
    ) in stderr


SECRETS_IN_CONFIG = [
    ("config.apiTokens", {"apiTokens": [{"name": "ci", "token": API_TOKEN}]}),
    ("config.workspaces", {"workspaces": [{"name": "w", "tokens": [{"token": WORKSPACE_TOKEN}]}]}),
    ("config.worker.tokens", {"worker": {"tokens": [{"workerId": "w", "token": WORKER_TOKEN}]}}),
    (
        "config.worker.poolCredentials",
        {"worker": {"poolCredentials": {"gke-a100": {"private_key_id": PRIVATE_KEY_ID}}}},
    ),
    ("config.replication.secret", {"replication": {"secret": REPLICA_SECRET}}),
]


@pytest.mark.parametrize(
    ("field", "extra"), SECRETS_IN_CONFIG, ids=[f for f, _ in SECRETS_IN_CONFIG]
)
def test_secret_under_config_is_refused(tmp_path: Path, field: str, extra: dict[str, Any]) -> None:
    values = public_values()
    values["config"] = merge(values["config"], extra)
    stderr = refused(tmp_path, values)
    assert f"{field}: " in stderr
    assert "secretConfig" in stderr
    assert "private values file" in stderr
    for value in SECRET_VALUES:
        assert value not in stderr


def test_pool_credentials_in_the_pool_block_are_refused(tmp_path: Path) -> None:
    stderr = refused(tmp_path, public_values(gke_pool(credentials=sa_key())))
    assert "config.worker.pools[gke-a100].kubernetes.credentials: " in stderr
    assert "secretConfig.worker.poolCredentials.gke-a100" in stderr
    assert PRIVATE_KEY_ID not in stderr


def test_missing_public_url_is_refused(tmp_path: Path) -> None:
    values = public_values()
    del values["config"]["publicUrl"]
    stderr = refused(tmp_path, values)
    assert "config.publicUrl is empty; set it to the https:// URL" in stderr


def test_missing_tls_secret_is_refused(tmp_path: Path) -> None:
    values = public_values()
    del values["tls"]
    stderr = refused(tmp_path, values)
    assert "tls.secretName is empty" in stderr
    assert "kubernetes.io/tls" in stderr


def test_duplicate_pool_names_are_refused(tmp_path: Path) -> None:
    stderr = refused(tmp_path, public_values(gke_pool(), gke_pool(tunnel=True)))
    assert "config.worker.pools[gke-a100].name: the pool name appears twice" in stderr


# --- leader election ---------------------------------------------------------------------------


def with_leader_election(**timings: Any) -> dict[str, Any]:
    values = public_values()
    values["leaderElection"] = {"enabled": True, **timings}
    return values


def test_leader_election_is_rendered_into_the_config_the_controlplane_loads(
    tmp_path: Path,
) -> None:
    docs = render(tmp_path, with_leader_election(renewDeadlineS=7.5), private_values())
    rendered = yaml.safe_load(configmap_text(docs))["config"]
    assert rendered["leaderElection"] == {
        "enabled": True,
        "namespace": NAMESPACE,
        "leaseDurationS": 15,
        "renewDeadlineS": 7.5,
        "retryPeriodS": 2,
    }
    election = load_rendered(tmp_path, docs).leader_election
    assert election.enabled and election.namespace == NAMESPACE
    assert (election.lease_duration_s, election.renew_deadline_s, election.retry_period_s) == (
        15,
        7.5,
        2,
    )


def test_leader_election_is_off_by_default(tmp_path: Path) -> None:
    assert chart_defaults()["leaderElection"]["enabled"] is False
    docs = render(tmp_path, public_values(), private_values())
    assert "leaderElection" not in yaml.safe_load(configmap_text(docs))["config"]
    assert not [d for d in docs if d["metadata"]["name"].endswith("-leader-election")]
    assert load_rendered(tmp_path, docs).leader_election.enabled is False


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            with_leader_election(renewDeadlineS=15),
            "leaderElection.renewDeadlineS must be less than leaseDurationS (15), not 15",
        ),
        (
            with_leader_election(retryPeriodS=10),
            "leaderElection.retryPeriodS must be less than renewDeadlineS (10), not 10",
        ),
        (
            with_leader_election(leaseDurationS=12.5),
            "leaderElection.leaseDurationS: 12.5 must be a whole number of seconds",
        ),
        (
            with_leader_election(retryPeriodS="soon"),
            "leaderElection.retryPeriodS: soon must be a number of seconds above 0",
        ),
        (
            {**public_values(), "config": {**public_values()["config"], "leaderElection": {}}},
            "config.leaderElection: set the chart's leaderElection: values instead",
        ),
    ],
    ids=["renew-deadline", "retry-period", "whole-seconds", "not-a-number", "under-config"],
)
def test_leader_election_timings_are_checked(
    tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    assert message in refused(tmp_path, values)


# --- metrics -----------------------------------------------------------------------------------


def with_metrics(port: int = 9090, **monitor: Any) -> dict[str, Any]:
    values = public_values()
    values["metrics"] = {"enabled": True, "port": port}
    if monitor:
        values["metrics"]["serviceMonitor"] = {"enabled": True, **monitor}
    return values


def services(docs: list[Any]) -> dict[str, Any]:
    """The Services by the names of their ports: the public one is `https`."""
    return {
        ",".join(port["name"] for port in doc["spec"]["ports"]): doc
        for doc in of_kind(docs, "Service")
    }


def test_metrics_are_off_by_default(tmp_path: Path) -> None:
    assert chart_defaults()["metrics"] == {
        "enabled": False,
        "port": 9090,
        "serviceMonitor": {"enabled": False, "interval": "30s", "labels": {}},
    }
    docs = render(tmp_path, public_values(), private_values())
    assert "metrics" not in yaml.safe_load(configmap_text(docs))["config"]
    assert [port["name"] for port in container(docs)["ports"]] == ["https"]
    assert list(services(docs)) == ["https"]
    assert of_kind(docs, "ServiceMonitor") == []


def test_metrics_enabled_renders_the_listener_its_port_and_a_cluster_service(
    tmp_path: Path,
) -> None:
    docs = render(tmp_path, with_metrics(9191), private_values())
    rendered = yaml.safe_load(configmap_text(docs))["config"]
    assert rendered["metrics"] == {"listen": "0.0.0.0:9191"}
    assert rendered["listen"] == "0.0.0.0:8443"
    assert {"name": "metrics", "containerPort": 9191, "protocol": "TCP"} in container(docs)["ports"]
    # The probes stay on the HTTPS port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container(docs)[probe]["tcpSocket"]["port"] == "https"

    by_ports = services(docs)
    assert sorted(by_ports) == ["https", "metrics"]
    # The tokenless listener is not put on the public (LoadBalancer) Service.
    assert by_ports["https"]["spec"]["type"] == "LoadBalancer"
    metrics = by_ports["metrics"]
    assert metrics["metadata"]["namespace"] == NAMESPACE
    assert metrics["spec"]["type"] == "ClusterIP"
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "protocol": "TCP", "port": 9191, "targetPort": "metrics"}
    ]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert metrics["spec"]["selector"].items() <= pod_labels.items()
    assert of_kind(docs, "ServiceMonitor") == []


def test_metrics_enabled_rolls_the_pod(tmp_path: Path) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(render(tmp_path, values), "Deployment")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum(with_metrics()) != checksum(public_values())


def test_service_monitor_scrapes_every_replica_through_the_metrics_service(
    tmp_path: Path,
) -> None:
    values = replicated(3)
    values["metrics"] = with_metrics(interval="15s", labels={"release": "kube-prometheus-stack"})[
        "metrics"
    ]
    docs = render(tmp_path, values, private_values())
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "scheme": "http", "interval": "15s"}
    ]

    # The selector picks the metrics Service, and only it, by its labels.
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    by_ports = services(docs)
    assert selector <= by_ports["metrics"]["metadata"]["labels"].items()
    assert not selector <= by_ports["https"]["metadata"]["labels"].items()
    # That Service has the endpoint's port and selects the pods of every replica.
    assert [port["name"] for port in by_ports["metrics"]["spec"]["ports"]] == ["metrics"]
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert by_ports["metrics"]["spec"]["selector"].items() <= pod_labels.items()


def test_service_monitor_labels_are_strings(tmp_path: Path) -> None:
    values = with_metrics(labels={"team": "ml", "tier": 1})
    labels = one(render(tmp_path, values), "ServiceMonitor")["metadata"]["labels"]
    assert (labels["team"], labels["tier"]) == ("ml", "1")
    assert labels["app.kubernetes.io/instance"] == "test"


def test_own_metrics_listener_without_the_chart_is_kept(tmp_path: Path) -> None:
    """config.metrics.listen set by hand (say on loopback for a sidecar) passes unchanged; the
    chart adds no port or Service for it."""
    docs = render(tmp_path, own_metrics_listener())
    assert yaml.safe_load(configmap_text(docs))["config"]["metrics"] == {"listen": "127.0.0.1:9100"}
    assert list(services(docs)) == ["https"]


def own_metrics_listener() -> dict[str, Any]:
    values = public_values()
    values["config"]["metrics"] = {"listen": "127.0.0.1:9100"}
    return values


@pytest.mark.parametrize(
    ("values", "listen"),
    [(with_metrics(9191), "0.0.0.0:9191"), (own_metrics_listener(), "127.0.0.1:9100")],
    ids=["chart", "own"],
)
def test_the_controlplane_loads_the_metrics_listener(
    tmp_path: Path, values: dict[str, Any], listen: str
) -> None:
    loaded = attrs.asdict(load_rendered(tmp_path, render(tmp_path, values, private_values())))
    assert loaded["metrics"]["listen"] == listen


def test_service_monitor_without_metrics_is_refused(tmp_path: Path) -> None:
    values = public_values()
    values["metrics"] = {"serviceMonitor": {"enabled": True}}
    stderr = refused(tmp_path, values)
    assert "metrics.serviceMonitor.enabled is true but metrics.enabled is not" in stderr
    assert "set metrics.enabled: true as well, or metrics.serviceMonitor.enabled: false" in stderr


def metrics_refusals() -> list[tuple[str, dict[str, Any], str]]:
    both = with_metrics()
    both["config"]["metrics"] = {"listen": "0.0.0.0:9100"}
    return [
        (
            "listen-twice",
            both,
            'metrics.enabled and config.metrics.listen ("0.0.0.0:9100") are both set; keep one',
        ),
        (
            "https-port",
            with_metrics(8443),
            "metrics.port: 8443 is config.listen's port too (0.0.0.0:8443)",
        ),
        ("port-zero", with_metrics(0), "metrics.port: 0 must be a port number, 1 to 65535"),
        ("port-high", with_metrics(70000), "metrics.port: 70000 must be a port number"),
        (
            "interval",
            with_metrics(interval="half a minute"),
            'metrics.serviceMonitor.interval: "half a minute" must be a Prometheus duration',
        ),
        (
            "labels",
            with_metrics(labels=["release=prometheus"]),
            "metrics.serviceMonitor.labels: must be a mapping",
        ),
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [(values, message) for _, values, message in metrics_refusals()],
    ids=[name for name, _, _ in metrics_refusals()],
)
def test_metrics_values_are_checked(tmp_path: Path, values: dict[str, Any], message: str) -> None:
    assert message in refused(tmp_path, values)


# --- RBAC --------------------------------------------------------------------------------------


RBAC_KINDS = ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


def rules_as_sets(role: Any) -> list[tuple[frozenset[str], frozenset[str], frozenset[str]]]:
    return [
        (
            frozenset(rule["apiGroups"]),
            frozenset(rule["resources"]),
            frozenset(rule["verbs"]),
        )
        for rule in role["rules"]
    ]


def assert_least_privilege(docs: list[Any]) -> None:
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        for rule in doc["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}
            for word in (*rule["apiGroups"], *rule["resources"], *rule["verbs"]):
                assert "*" not in word
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
            if doc["kind"] == "ClusterRole":
                assert "secrets" not in rule["resources"]


def test_without_in_cluster_pools_no_cluster_role(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    assert of_kind(docs, "ClusterRole") == []
    assert of_kind(docs, "ClusterRoleBinding") == []
    (role,) = of_kind(docs, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert rules_as_sets(role) == [
        (
            frozenset({""}),
            frozenset({"secrets"}),
            frozenset({"get", "list", "watch", "create", "update", "delete"}),
        )
    ]
    (binding,) = of_kind(docs, "RoleBinding")
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    assert_least_privilege(docs)


def test_without_joined_pools_no_role(tmp_path: Path) -> None:
    values = public_values()
    values["config"]["joinedPools"] = None  # removes the chart's default block
    docs = render(tmp_path, values)
    assert [doc for doc in docs if doc["kind"] in RBAC_KINDS] == []
    assert "joinedPools" not in yaml.safe_load(configmap_text(docs))["config"]


def test_in_cluster_pool_gets_node_reading_and_a_worker_role(tmp_path: Path) -> None:
    values = public_values(gke_pool(), in_cluster_pool())
    docs = render(tmp_path, values, private_values())
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    subject = [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]

    cluster_role = one(docs, "ClusterRole")
    assert rules_as_sets(cluster_role) == [
        (frozenset({""}), frozenset({"nodes", "pods"}), frozenset({"get", "list", "watch"}))
    ]
    cluster_binding = one(docs, "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["kind"] == "ClusterRole"
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert cluster_binding["subjects"] == subject

    roles = {doc["metadata"]["namespace"]: doc for doc in of_kind(docs, "Role")}
    assert sorted(roles) == ["levers9", NAMESPACE]  # the pool's default namespace
    worker_verbs = frozenset({"create", "delete", "get", "list", "watch"})
    assert sorted(rules_as_sets(roles["levers9"]), key=sorted_key) == sorted(
        [
            (frozenset({"batch"}), frozenset({"jobs"}), worker_verbs),
            (frozenset({""}), frozenset({"secrets"}), worker_verbs),
            (frozenset({""}), frozenset({"pods/log"}), frozenset({"get"})),
            (frozenset({""}), frozenset({"events"}), frozenset({"create", "list", "patch"})),
        ],
        key=sorted_key,
    )
    bindings = {doc["metadata"]["namespace"]: doc for doc in of_kind(docs, "RoleBinding")}
    assert bindings["levers9"]["roleRef"]["name"] == roles["levers9"]["metadata"]["name"]
    assert bindings["levers9"]["subjects"] == subject
    assert_least_privilege(docs)


def sorted_key(rule: tuple[frozenset[str], ...]) -> list[list[str]]:
    return [sorted(part) for part in rule]


def test_in_cluster_pools_share_a_namespace_role_once(tmp_path: Path) -> None:
    values = public_values(
        in_cluster_pool("a", namespace="gpu"),
        in_cluster_pool("b", namespace="gpu"),
        in_cluster_pool("c", namespace="batch-gpu"),
    )
    docs = render(tmp_path, values)
    worker_roles = [
        doc for doc in of_kind(docs, "Role") if doc["metadata"]["namespace"] != NAMESPACE
    ]
    assert sorted(doc["metadata"]["namespace"] for doc in worker_roles) == ["batch-gpu", "gpu"]
    assert len(of_kind(docs, "ClusterRole")) == 1
    assert_least_privilege(docs)


def test_rbac_off_renders_none(tmp_path: Path) -> None:
    values = public_values(in_cluster_pool())
    docs = render(tmp_path, values, sets=("rbac.create=false", "leaderElection.enabled=true"))
    assert [doc for doc in docs if doc["kind"] in RBAC_KINDS] == []


def test_leader_election_gets_a_role_on_exactly_leases(tmp_path: Path) -> None:
    docs = render(tmp_path, with_leader_election(), private_values())
    roles = {doc["metadata"]["name"]: doc for doc in of_kind(docs, "Role")}
    (name,) = [n for n in roles if n.endswith("-leader-election")]
    role = roles[name]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert rules_as_sets(role) == [
        (
            frozenset({"coordination.k8s.io"}),
            frozenset({"leases"}),
            frozenset({"get", "create", "update"}),
        )
    ]
    (binding,) = [b for b in of_kind(docs, "RoleBinding") if b["metadata"]["name"] == name]
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": name,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    assert_least_privilege(docs)


# --- the pod -----------------------------------------------------------------------------------


def test_pod_runs_locked_down_as_the_images_user(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["runAsGroup"] == 10001
    assert pod["securityContext"]["fsGroup"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = container(docs)["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert ctx["runAsUser"] == 10001
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is True
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_container_args_mounts_and_single_replica(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    main = container(docs)
    assert main["args"] == [
        "--config",
        "/etc/levers9/config/config.yaml",
        "--config",
        "/etc/levers9/secret/config.yaml",
    ]
    assert "command" not in main  # the image's entrypoint is `levers9-control serve`
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    config_volume = volumes[mounts["/etc/levers9/config"]]
    assert config_volume["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    secret_volume = volumes[mounts["/etc/levers9/secret"]]
    assert secret_volume["secret"]["secretName"] == one(docs, "Secret")["metadata"]["name"]
    assert secret_volume["secret"]["defaultMode"] == 0o440
    assert volumes[mounts["/etc/levers9/tls"]]["secret"]["secretName"] == "levers9-tls"
    data = volumes[mounts["/var/lib/levers9-control"]]
    pvc = one(docs, "PersistentVolumeClaim")
    assert data["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_probes_and_service_use_the_listen_port(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), sets=("config.listen=0.0.0.0:9443",))
    main = container(docs)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = main[probe]["tcpSocket"]["port"]
        assert ports.get(port, port) == 9443, probe
    service = one(docs, "Service")
    assert service["spec"]["type"] == "LoadBalancer"
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == 443
    assert ports.get(service_port["targetPort"], service_port["targetPort"]) == 9443
    assert service["spec"]["selector"].items() <= (
        one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )


def test_service_source_ranges_and_annotations(tmp_path: Path) -> None:
    values = public_values()
    values["service"] = {
        "annotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"},
        "loadBalancerSourceRanges": ["203.0.113.0/24"],
    }
    service = one(render(tmp_path, values), "Service")
    assert service["spec"]["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
    assert service["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-type": "nlb"
    }


@pytest.mark.parametrize(
    "with_values",
    ["operator", "metrics", None],
    ids=["operator-values", "metrics", "chart-defaults"],
)
def test_helm_lint_passes(tmp_path: Path, with_values: str | None) -> None:
    argv = [str(HELM), "lint", "--strict", str(CHART)]
    if with_values:
        data = public_values(gke_pool(), in_cluster_pool())
        if with_values == "metrics":
            data["metrics"] = with_metrics(labels={"release": "prometheus"})["metrics"]
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(data))
        argv += ["-f", str(values)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_records_in_postgresql_need_no_claim_and_keep_the_password_secret(tmp_path: Path) -> None:
    values = public_values()
    values["config"]["database"] = {"url": "postgresql://levers9@pg.example:5432/levers9"}
    private = private_values()
    private.setdefault("secretConfig", {})["database"] = {"password": "pg-secret-2468"}
    docs = render(tmp_path, values, private)
    assert of_kind(docs, "PersistentVolumeClaim") == []
    volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert "data" not in {v["name"] for v in volumes}
    assert "pg-secret-2468" not in configmap_text(docs)
    config = load_rendered(tmp_path, docs)
    assert config.database.url == "postgresql://levers9@pg.example:5432/levers9"
    assert config.database.password == "pg-secret-2468"

    values["config"]["database"]["password"] = "pg-secret-2468"
    stderr = refused(tmp_path, values, private_values())
    assert "config.database.password" in stderr and "secretConfig" in stderr
    assert "pg-secret-2468" not in stderr


def test_the_pods_grace_period_covers_the_drain(tmp_path: Path) -> None:
    docs = render(tmp_path, public_values(), private_values())
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 35  # drainS 20, and the watchers' 5 s
    values = public_values()
    values["config"]["drainS"] = 60
    pod = one(render(tmp_path, values, private_values()), "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 75
    assert load_rendered(tmp_path, render(tmp_path, values, private_values())).drain_s == 60


# --- several replicas --------------------------------------------------------------------------


def replicated(count: int = 3) -> dict[str, Any]:
    """The repository's values for several replicas: the records in PostgreSQL."""
    values = public_values()
    values["replicaCount"] = count
    values["config"]["database"] = {"url": POSTGRES_URL}
    return values


def pod_spec(docs: list[Any]) -> Any:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def test_several_replicas_render_what_they_need(tmp_path: Path) -> None:
    docs = render(tmp_path, replicated(3), private_values())
    config = load_rendered(tmp_path, docs)
    assert config.database.url == POSTGRES_URL
    assert config.leader_election.enabled and config.leader_election.namespace == NAMESPACE
    assert config.replication.secret == REPLICA_SECRET
    assert REPLICA_SECRET not in configmap_text(docs)

    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert pod_spec(docs)["affinity"] == {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": selector},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    }
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
        container(docs)["env"]
    )
    assert "tcpSocket" in container(docs)["readinessProbe"]

    budget = one(docs, "PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1"
    assert budget["metadata"]["namespace"] == NAMESPACE
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    assert of_kind(docs, "PersistentVolumeClaim") == []

    roles = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    (role,) = roles
    assert rules_as_sets(role) == [
        (
            frozenset({"coordination.k8s.io"}),
            frozenset({"leases"}),
            frozenset({"get", "create", "update"}),
        )
    ]
    assert_least_privilege(docs)


def test_several_replicas_without_postgresql_are_refused(tmp_path: Path) -> None:
    values = replicated(2)
    del values["config"]["database"]  # the chart's default: SQLite on the volume
    stderr = refused(tmp_path, values, private_values())
    assert "replicaCount: 2 needs the task records in PostgreSQL" in stderr
    assert "config.database.url" in stderr
    assert "replicaCount: 1" in stderr


def test_several_replicas_without_the_replica_secret_are_refused(tmp_path: Path) -> None:
    private = private_values()
    del private["secretConfig"]["replication"]
    stderr = refused(tmp_path, replicated(2), private)
    assert "secretConfig.replication.secret is empty; replicaCount: 2 needs it" in stderr
    assert "private values file" in stderr


def test_a_short_replica_secret_is_refused_without_showing_it(tmp_path: Path) -> None:
    private = private_values()
    private["secretConfig"]["replication"] = {"secret": "short-secret"}
    stderr = refused(tmp_path, replicated(2), private)
    assert "secretConfig.replication.secret must be a string of 16 characters or more" in stderr
    assert "short-secret" not in stderr


@pytest.mark.parametrize("count", [0, -1, 1.5, "two"])
def test_replica_count_below_one_or_not_whole_is_refused(tmp_path: Path, count: object) -> None:
    values = replicated()
    values["replicaCount"] = count
    stderr = refused(tmp_path, values, private_values())
    assert f"replicaCount: {count} must be a whole number, 1 or more" in stderr


def test_one_replica_is_recreated_on_either_database(tmp_path: Path) -> None:
    """One replica is replaced, never doubled: two pods side by side would both reconcile the
    pools, since only several replicas turn leader election on."""
    sqlite = render(tmp_path, public_values(), private_values())
    postgres = render(tmp_path, replicated(1), private_values())
    assert one(sqlite, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert one(postgres, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    for docs in (sqlite, postgres):
        assert one(docs, "Deployment")["spec"]["replicas"] == 1
        assert of_kind(docs, "PodDisruptionBudget") == []
        assert "affinity" not in pod_spec(docs)
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
            container(docs)["env"]
        )


def test_own_pod_anti_affinity_and_budget_settings_are_kept(tmp_path: Path) -> None:
    values = replicated(4)
    own = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"team": "ml"}}, "topologyKey": "zone"}
            ]
        },
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cp"]}]}
                ]
            }
        },
    }
    values["affinity"] = own
    values["podDisruptionBudget"] = {"enabled": True, "maxUnavailable": "50%"}
    docs = render(tmp_path, values, private_values())
    assert pod_spec(docs)["affinity"] == own
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "50%"

    values["podDisruptionBudget"] = {"enabled": False}
    assert of_kind(render(tmp_path, values, private_values()), "PodDisruptionBudget") == []

    values["podDisruptionBudget"] = {"enabled": True, "maxUnavailable": 0}
    stderr = refused(tmp_path, values, private_values())
    assert "podDisruptionBudget.maxUnavailable: 0 must be a whole number of pods" in stderr


def test_replica_secret_and_secret_file_together_are_refused(tmp_path: Path) -> None:
    values = replicated(2)
    values["config"]["replication"] = {"secretFile": "/etc/levers9/replica/secret"}
    stderr = refused(tmp_path, values, private_values())
    assert "secretConfig.replication.secret and config.replication.secretFile are both set" in (
        stderr
    )
    assert REPLICA_SECRET not in stderr
