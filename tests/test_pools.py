"""Pool blocks from the values files: typed, defaulted, refused with pool and field named."""

from __future__ import annotations

import base64
import copy
import datetime
import json
import logging
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from control.config import ConfigError
from control.kube.pools import (
    EksCredentials,
    Flavor,
    GkeCredentials,
    KubeconfigCredentials,
    TokenCredentials,
    load_pools,
    read_credentials,
)


@cache
def ca_pem() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test cluster CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def ca_data() -> str:
    return base64.b64encode(ca_pem()).decode()


@cache
def rsa_pem() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def sa_key(token_uri: str = "https://oauth2.googleapis.com/token") -> dict[str, str]:
    return {
        "type": "service_account",
        "project_id": "proj",
        "private_key_id": "kid-1",
        "private_key": rsa_pem(),
        "client_email": "levers9@proj.iam.gserviceaccount.com",
        "client_id": "1234",
        "token_uri": token_uri,
    }


def gke_block(**kube: Any) -> dict[str, Any]:
    block: dict[str, Any] = {
        "name": "gke-a100",
        "provider": "kubernetes",
        "kubernetes": {
            "flavor": "gke",
            "endpoint": "https://34.0.0.10",
            "caData": ca_data(),
            "credentials": sa_key(),
            "selector": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
            "image": "europe-docker.pkg.dev/p/levers9/worker:1",
        },
    }
    block["kubernetes"].update(kube)
    return block


EKS_CREDS = {
    "accessKeyId": "AKIAFAKEFAKEFAKE",
    "secretAccessKey": "eks-secret-access-key-value",
    "sessionToken": "eks-session-token-value",
    "region": "eu-west-1",
    "clusterName": "gpu-cluster",
}


def test_gke_pool_gets_the_documented_defaults() -> None:
    loaded = load_pools([gke_block()])
    assert loaded.warnings == ()
    (pool,) = loaded.pools
    kube = pool.kubernetes
    assert pool.name == "gke-a100"
    assert kube.flavor is Flavor.GKE
    assert kube.namespace == "levers9"
    assert kube.tunnel is False
    assert kube.host_network is True
    assert kube.objects_path == "/var/lib/levers9"
    assert kube.driver_path == "/home/kubernetes/bin/nvidia"
    assert kube.idle_minutes == 5
    assert kube.reconcile_seconds == 15
    assert [t.manifest() for t in kube.tolerations] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert kube.selector.label_selector() == "cloud.google.com/gke-accelerator=nvidia-tesla-a100"
    assert kube.ca_pem == ca_pem()
    assert isinstance(kube.credentials, GkeCredentials)


def test_eks_pool_with_expressions_and_overrides() -> None:
    block = gke_block(
        flavor="eks",
        credentials=EKS_CREDS,
        selector={
            "pool": "gpu",
            "matchExpressions": [
                {"key": "gpu-type", "operator": "In", "values": ["a100", "h100"]},
                {"key": "spot", "operator": "DoesNotExist"},
            ],
        },
        tunnel=True,
        hostNetwork=False,
        namespace="gpus",
        idleMinutes=5,
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml"}],
    )
    (pool,) = load_pools([block]).pools
    kube = pool.kubernetes
    assert kube.driver_path == "/usr/local/nvidia"
    assert kube.selector.label_selector() == "pool=gpu,gpu-type in (a100,h100),!spot"
    assert (kube.tunnel, kube.host_network, kube.namespace, kube.idle_minutes) == (
        True,
        False,
        "gpus",
        5,
    )
    assert [t.manifest() for t in kube.tolerations] == [
        {"key": "dedicated", "operator": "Equal", "value": "ml"}
    ]
    assert kube.credentials == EksCredentials(
        access_key_id="AKIAFAKEFAKEFAKE",
        secret_access_key="eks-secret-access-key-value",
        session_token="eks-session-token-value",
        region="eu-west-1",
        cluster_name="gpu-cluster",
    )


def _without(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    out = dict(mapping)
    out.pop(key)
    return out


P = "config.worker.pools[gke-a100]"
K = f"{P}.kubernetes"
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("host network without tunnel", {"hostNetwork": False}, f"{K}.hostNetwork"),
    ("host network not a bool", {"hostNetwork": "false"}, f"{K}.hostNetwork"),
    ("no credentials", {"credentials": None}, f"{K}.credentials"),
    (
        "both credentials and file",
        {"credentialsFile": "/etc/levers9/key.json"},
        f"{K}.credentials",
    ),
    ("plain http endpoint", {"endpoint": "http://34.0.0.10"}, f"{K}.endpoint"),
    ("endpoint without host", {"endpoint": "https://"}, f"{K}.endpoint"),
    ("ca not base64", {"caData": "not base64 !!"}, f"{K}.caData"),
    ("ca not a certificate", {"caData": base64.b64encode(b"hello").decode()}, f"{K}.caData"),
    ("unknown flavor", {"flavor": "aks"}, f"{K}.flavor"),
    ("unknown key", {"nodeSelector": {"a": "b"}}, f"{K}: extra fields found (nodeSelector)"),
    ("bad namespace", {"namespace": "Not_A_Label"}, f"{K}.namespace"),
    ("relative objects path", {"objectsPath": "var/lib"}, f"{K}.objectsPath"),
    ("idle minutes zero", {"idleMinutes": 0}, f"{K}.idleMinutes"),
    ("reconcile seconds zero", {"reconcileSeconds": 0}, f"{K}.reconcileSeconds"),
    ("qps zero", {"qps": 0}, f"{K}.qps"),
    ("burst zero", {"burst": 0}, f"{K}.burst"),
    ("agent metrics port too big", {"agentMetricsPort": 70000}, f"{K}.agentMetricsPort"),
    ("bad toleration", {"tolerations": [{"operator": "Maybe"}]}, f"{K}.tolerations[0].operator"),
    (
        "bad selector operator",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}},
        f"{K}.selector.matchExpressions[0].operator",
    ),
    (
        "In without values",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
        f"{K}.selector.matchExpressions[0].values",
    ),
    ("selector not a mapping", {"selector": ["a"]}, f"{K}.selector"),
    ("gke key not a key", {"credentials": {"type": "user"}}, f"{K}.credentials.type"),
    (
        "gke key unparsable private key",
        {"credentials": {**sa_key(), "private_key": "-----BEGIN nonsense"}},
        f"{K}.credentials.private_key",
    ),
    (
        "eks without region",
        {"flavor": "eks", "credentials": _without(EKS_CREDS, "region")},
        f"{K}.credentials.region",
    ),
    (
        "eks unknown field",
        {"flavor": "eks", "credentials": {**EKS_CREDS, "profile": "x"}},
        f"{K}.credentials: unknown field(s) profile",
    ),
    (
        "generic with nothing usable",
        {"flavor": "generic", "credentials": {"password": "x"}},
        f"{K}.credentials",
    ),
    (
        "generic token and extra",
        {"flavor": "generic", "credentials": {"token": "t", "user": "u"}},
        f"{K}.credentials: unknown field(s) user",
    ),
    (
        "generic client key broken",
        {
            "flavor": "generic",
            "credentials": {
                "clientCertificateData": base64.b64encode(ca_pem()).decode(),
                "clientKeyData": base64.b64encode(b"nope").decode(),
            },
        },
        f"{K}.credentials.clientKeyData",
    ),
    (
        "kubeconfig without the context",
        {
            "flavor": "generic",
            "credentials": {
                "kubeconfig": {"users": [], "contexts": [{"name": "a"}]},
                "context": "b",
            },
        },
        f"{K}.credentials.context",
    ),
]


@pytest.mark.parametrize(
    ("change", "needle"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_pool_is_refused_naming_pool_and_field(change: dict[str, Any], needle: str) -> None:
    block = gke_block()
    for key, value in change.items():
        if value is None:
            block["kubernetes"].pop(key)
        else:
            block["kubernetes"][key] = value
    with pytest.raises(ConfigError) as info:
        load_pools([block])
    assert needle in str(info.value)


def test_missing_image_and_bad_top_level_fields_are_named() -> None:
    block = gke_block()
    del block["kubernetes"]["image"]
    with pytest.raises(ConfigError, match=r"pools\[gke-a100\]\.kubernetes\.image"):
        load_pools([block])
    with pytest.raises(ConfigError, match=r"pools\[gke-a100\]\.provider"):
        load_pools([{**gke_block(), "provider": "docker"}])
    with pytest.raises(ConfigError, match=r"pools\[gke-a100\]: extra fields found \(zone\)"):
        load_pools([{**gke_block(), "zone": "x"}])
    with pytest.raises(ConfigError, match=r"pools\[Bad_Name\]\.name"):
        load_pools([{**gke_block(), "name": "Bad_Name"}])


def test_host_network_false_is_fine_with_the_tunnel() -> None:
    (pool,) = load_pools([gke_block(hostNetwork=False, tunnel=True)]).pools
    assert pool.kubernetes.host_network is False


def test_duplicate_pool_names_are_refused() -> None:
    second = copy.deepcopy(gke_block())
    with pytest.raises(ConfigError, match=r"pools\[gke-a100\]\.name: .*twice"):
        load_pools([gke_block(), second])


def test_secrets_are_absent_from_repr_and_errors() -> None:
    generic = gke_block(flavor="generic", credentials={"token": "bearer-secret-value"})
    eks = {**gke_block(flavor="eks", credentials=EKS_CREDS), "name": "eks"}
    loaded = load_pools([generic, eks, {**gke_block(), "name": "gke"}])
    text = repr(loaded)
    for secret in (
        "bearer-secret-value",
        EKS_CREDS["secretAccessKey"],
        EKS_CREDS["sessionToken"],
        EKS_CREDS["accessKeyId"],
        "PRIVATE KEY",
    ):
        assert secret not in text
    assert "levers9@proj.iam.gserviceaccount.com" in text  # who, not the key

    # A credential of the wrong kind or with a stray field: the message names fields only.
    bad = [
        gke_block(flavor="generic", credentials={"token": 12345678}),
        gke_block(flavor="generic", credentials={"token": "bearer-secret-value", "x": "other-s"}),
        gke_block(flavor="eks", credentials={**EKS_CREDS, "secretAccessKey": ["eks-list-secret"]}),
        gke_block(credentials=json.dumps(sa_key())[:-3]),
    ]
    for block in bad:
        with pytest.raises(ConfigError) as info:
            load_pools([block])
        message = str(info.value)
        assert f"{K}.credentials" in message
        for secret in ("12345678", "bearer-secret-value", "other-s", "eks-list-secret", "PRIVATE"):
            assert secret not in message


def test_gke_key_may_be_json_text() -> None:
    (pool,) = load_pools([gke_block(credentials=json.dumps(sa_key()))]).pools
    creds = pool.kubernetes.credentials
    assert isinstance(creds, GkeCredentials)
    assert creds.client_email == "levers9@proj.iam.gserviceaccount.com"


def test_credentials_file_open_to_others_gives_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "gke-key.json"
    key_file.write_text(json.dumps(sa_key()))
    key_file.chmod(0o644)
    block = gke_block(credentials=None, credentialsFile=str(key_file))
    del block["kubernetes"]["credentials"]
    with caplog.at_level(logging.WARNING, logger="levers9.pools"):
        loaded = load_pools([block])
    (warning,) = loaded.warnings
    assert str(key_file) in warning
    assert "chmod 600" in warning
    assert f"{K}.credentialsFile" in warning
    assert any("chmod 600" in r.getMessage() for r in caplog.records)
    assert rsa_pem()[40:80] not in caplog.text

    key_file.chmod(0o600)
    assert load_pools([block]).warnings == ()


def test_credentials_file_is_read_again_when_asked(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first-token\n")
    token_file.chmod(0o600)
    block = gke_block(flavor="generic", credentialsFile=str(token_file))
    del block["kubernetes"]["credentials"]
    (pool,) = load_pools([block]).pools
    assert pool.kubernetes.credentials is None
    assert read_credentials(pool) == TokenCredentials("first-token")
    token_file.write_text("rotated-token\n")
    assert read_credentials(pool) == TokenCredentials("rotated-token")

    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1"}}],
        "users": [{"name": "u", "user": {"token": "kc-token"}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    token_file.write_text(json.dumps(kubeconfig))
    creds = read_credentials(pool)
    assert isinstance(creds, KubeconfigCredentials)
    assert "kc-token" not in repr(creds)


def test_missing_or_malformed_credentials_file_is_an_error(tmp_path: Path) -> None:
    block = gke_block(credentialsFile=str(tmp_path / "absent.json"))
    del block["kubernetes"]["credentials"]
    with pytest.raises(ConfigError, match=r"kubernetes\.credentialsFile: cannot read"):
        load_pools([block])
    broken = tmp_path / "broken.json"
    broken.write_text('{"type": "service_account", "private_key": "s3cr3t"}')
    broken.chmod(0o600)
    block["kubernetes"]["credentialsFile"] = str(broken)
    with pytest.raises(ConfigError) as info:
        load_pools([block])
    assert "credentialsFile" in str(info.value)
    assert "s3cr3t" not in str(info.value)


def test_pool_credentials_by_name_complete_a_pasted_block() -> None:
    block = gke_block()
    key = block["kubernetes"].pop("credentials")
    (pool,) = load_pools([block], {"gke-a100": key}).pools
    creds = read_credentials(pool)
    assert isinstance(creds, GkeCredentials)
    assert creds.client_email == key["client_email"]
    assert block["kubernetes"].get("credentials") is None  # the pasted block is untouched


def test_pool_credentials_for_no_pool_or_twice_are_refused() -> None:
    block = gke_block()
    with pytest.raises(ConfigError, match=r"poolCredentials\.gke-a100: the pool's block already"):
        load_pools([block], {"gke-a100": sa_key()})
    with pytest.raises(ConfigError, match=r"poolCredentials\.other: no pool of that name"):
        load_pools([block], {"other": sa_key()})


def test_an_in_cluster_pool_uses_the_pods_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = gke_block(flavor="generic", inCluster=True)
    for key in ("endpoint", "caData", "credentials"):
        del block["kubernetes"][key]
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(
        ConfigError, match=r"kubernetes\.inCluster: the controlplane is not running"
    ):
        load_pools([block])
    (tmp_path / "token").write_text("pod-token\n")
    (tmp_path / "ca.crt").write_bytes(ca_pem())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("LEVERS9_SERVICEACCOUNT_DIR", str(tmp_path))
    loaded = load_pools([block])
    (pool,) = loaded.pools
    assert loaded.warnings == ()
    assert pool.kubernetes.endpoint == "https://10.96.0.1:443"
    assert pool.kubernetes.ca_pem == ca_pem()
    assert read_credentials(pool) == TokenCredentials("pod-token")
    with pytest.raises(ConfigError, match=r"inCluster: .* remove caData, credentials, endpoint"):
        load_pools([gke_block(flavor="generic", inCluster=True)])
