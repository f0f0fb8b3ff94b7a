"""Kubernetes worker pools as the operator writes them, typed and checked once at start-up.

`config.worker.pools` holds one block per pool (docs/kubernetes.md); `ControlConfig` keeps them
as raw mappings so that this module alone owns their shape. `load_pools` structures each
block with one cattrs converter (camelCase keys, unknown keys refused) and then checks the
rules that span fields. Every error names the pool and the dotted field
(`config.worker.pools[gke-a100].kubernetes.hostNetwork: ...`) and never the value of a
credential; credentials are hidden from every repr.

Credentials are typed by flavor: a GKE service-account key, EKS access keys, or for any other
cluster a bearer token, a client certificate, or a kubeconfig. A `credentialsFile` is checked
here (readable, well formed, not readable by group or others, which gives a warning) but read
again by `read_credentials` whenever a client is built, so a rotated key needs no restart.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import logging
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import cattrs
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from control.config import ConfigError, strict_bool
from wire.errors import make_converter

__all__ = [
    "ClientCertificateCredentials",
    "Credentials",
    "EksCredentials",
    "Flavor",
    "GkeCredentials",
    "KubeconfigCredentials",
    "KubernetesPool",
    "LoadedPools",
    "MatchExpression",
    "PoolConfig",
    "Selector",
    "TokenCredentials",
    "Toleration",
    "in_cluster_connection",
    "load_pools",
    "own_cluster_pool",
    "own_namespace",
    "read_credentials",
    "service_account_dir",
]

log = logging.getLogger("levers9.pools")

GKE_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class Flavor(enum.Enum):
    GKE = "gke"
    EKS = "eks"
    GENERIC = "generic"


# --- credentials -------------------------------------------------------------------------


@attrs.frozen
class GkeCredentials:
    """A GCP service-account key (the JSON `gcloud iam service-accounts keys create` writes)."""

    info: Mapping[str, Any] = attrs.field(repr=False)

    @property
    def client_email(self) -> str:
        return str(self.info["client_email"])

    def __repr__(self) -> str:
        return f"GkeCredentials(client_email={self.client_email!r}, key=<redacted>)"


@attrs.frozen
class EksCredentials:
    """AWS keys of an IAM identity mapped into the cluster, and where the cluster is."""

    access_key_id: str = attrs.field(repr=False)
    secret_access_key: str = attrs.field(repr=False)
    region: str
    cluster_name: str
    session_token: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class TokenCredentials:
    """A bearer token, e.g. a ServiceAccount token made by `levers9 cluster join`."""

    token: str = attrs.field(repr=False)


@attrs.frozen
class ClientCertificateCredentials:
    """A client certificate and key, each base64 PEM as in a kubeconfig."""

    client_certificate_data: str = attrs.field(repr=False)
    client_key_data: str = attrs.field(repr=False)


@attrs.frozen
class KubeconfigCredentials:
    """A whole kubeconfig (its user entry authenticates) and the context to use."""

    kubeconfig: Mapping[str, Any] = attrs.field(repr=False)
    context: str | None = None


Credentials = (
    GkeCredentials
    | EksCredentials
    | TokenCredentials
    | ClientCertificateCredentials
    | KubeconfigCredentials
)


# --- pool -------------------------------------------------------------------------------


@attrs.frozen
class MatchExpression:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def requirement(self) -> str:
        """This expression in label-selector syntax (`key in (a,b)`, `!key`)."""
        if self.operator == "In":
            return f"{self.key} in ({','.join(self.values)})"
        if self.operator == "NotIn":
            return f"{self.key} notin ({','.join(self.values)})"
        if self.operator == "Exists":
            return self.key
        return f"!{self.key}"


@attrs.frozen
class Selector:
    """Which nodes belong to the pool: labels that must match, plus match expressions."""

    match_labels: Mapping[str, str] = attrs.field(factory=dict)
    match_expressions: tuple[MatchExpression, ...] = ()

    def label_selector(self) -> str:
        """The `labelSelector` query value; empty selects every node."""
        parts = [f"{key}={value}" for key, value in sorted(self.match_labels.items())]
        parts += [expr.requirement() for expr in self.match_expressions]
        return ",".join(parts)


@attrs.frozen
class Toleration:
    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None

    def manifest(self) -> dict[str, Any]:
        """The toleration as a pod spec holds it (camelCase, unset fields left out)."""
        out: dict[str, Any] = {"operator": self.operator}
        if self.key is not None:
            out["key"] = self.key
        if self.value is not None:
            out["value"] = self.value
        if self.effect is not None:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


DEFAULT_QPS = 50.0
DEFAULT_BURST = 300
"""kubectl's request budget. client-go's own default (5 per second, 10 at once) would take
minutes to list 100,000 pods in pages of 500."""

DEFAULT_TOLERATIONS = (Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)


def _default_driver_path(pool: KubernetesPool) -> str:
    # GKE's driver installer puts the driver on the host under /home (the root is read-only).
    return "/home/kubernetes/bin/nvidia" if pool.flavor is Flavor.GKE else "/usr/local/nvidia"


@attrs.frozen
class KubernetesPool:
    flavor: Flavor
    endpoint: str
    ca_data: str = attrs.field(repr=False)
    image: str
    credentials: Credentials | None = None
    credentials_file: str | None = None
    namespace: str = "levers9"
    selector: Selector = Selector()
    tunnel: bool = False
    host_network: bool = True
    tolerations: tuple[Toleration, ...] = DEFAULT_TOLERATIONS
    objects_path: str = "/var/lib/levers9"
    driver_path: str = attrs.field(default=attrs.Factory(_default_driver_path, takes_self=True))
    idle_minutes: int = 5
    """An idle worker winds down after this ("a few idle minutes"), and the next one takes
    everything free then: cards a neighbour let go of join the machine that soon."""
    reconcile_seconds: float = 15.0
    qps: float = DEFAULT_QPS
    """Requests per second to this cluster's API server, on average (`burst` at once)."""
    burst: int = DEFAULT_BURST
    agent_metrics_port: int | None = None
    """The workers' own `/metrics` listener (plain HTTP, no token): off unless set. With
    hostNetwork it listens on the node, so `agentMetricsHost` stays loopback (a node-local
    scraper) unless the operator opens it."""
    agent_metrics_host: str = "127.0.0.1"
    in_cluster: bool = False
    """The controlplane's own cluster, reached with its pod's ServiceAccount: endpoint, CA and
    credentialsFile are filled in from the pod when the block is loaded."""
    allow_local_registries: bool = False
    """The workers pull from registries on their node's loopback or link-local addresses, or
    the node's own (LEVERS9_ALLOW_LOCAL_REGISTRIES=1): for a registry mirror on each node. Off,
    such images are refused, as a task could otherwise probe the node's ports."""

    @property
    def ca_pem(self) -> bytes:
        """The cluster CA as PEM bytes (checked to parse when the pool was loaded)."""
        return _decode_ca(self.ca_data)


@attrs.frozen
class PoolConfig:
    name: str
    kubernetes: KubernetesPool
    provider: str = "kubernetes"


@attrs.frozen
class LoadedPools:
    pools: tuple[PoolConfig, ...]
    warnings: tuple[str, ...] = ()


_CONVERTER = make_converter()
_CONVERTER.register_structure_hook(bool, strict_bool)


def load_pools(
    raw: Sequence[Mapping[str, Any]], pool_credentials: Mapping[str, Any] | None = None
) -> LoadedPools:
    """Type and check `config.worker.pools`; raise `ConfigError` naming pool and field.

    `pool_credentials` (`config.worker.poolCredentials`, from the private values file) gives
    a pool its inline credentials by name, so the block itself is pasted unchanged."""
    by_name = dict(pool_credentials or {})
    named = {b.get("name") for b in raw if isinstance(b, Mapping)}
    for name in by_name:
        if name not in named:
            raise ConfigError(
                f"config.worker.poolCredentials.{name}: no pool of that name in "
                "config.worker.pools; fix the name or remove the entry"
            )
    pools: list[PoolConfig] = []
    warnings: list[str] = []
    warnings_of: dict[str, list[str]] = {}
    seen: set[str] = set()
    for index, given in enumerate(raw):
        block = given
        if isinstance(given, Mapping) and given.get("name") in by_name:
            block = _with_credentials(given, by_name[str(given["name"])])
        pool, pool_warnings = _load_one(index, block)
        warnings_of[pool.name] = pool_warnings
        if pool.name in seen:
            raise ConfigError(
                f"config.worker.pools[{pool.name}].name: the pool name appears twice; "
                "give each pool its own name"
            )
        seen.add(pool.name)
        pools.append(pool)
        warnings += pool_warnings
    for pool in pools:
        for warning in warnings_of[pool.name]:
            log.warning("%s", warning, extra={"pool": pool.name})
    return LoadedPools(pools=tuple(pools), warnings=tuple(warnings))


def _with_credentials(block: Mapping[str, Any], credentials: Any) -> Mapping[str, Any]:
    kube = block.get("kubernetes")
    if not isinstance(kube, Mapping):
        return block
    if "credentials" in kube or "credentialsFile" in kube:
        raise ConfigError(
            f"config.worker.poolCredentials.{block['name']}: the pool's block already sets "
            "credentials or credentialsFile; keep one of the two"
        )
    return {**block, "kubernetes": {**kube, "credentials": credentials}}


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def service_account_dir() -> Path:
    """Where the pod's ServiceAccount token, CA and namespace are mounted
    (`LEVERS9_SERVICEACCOUNT_DIR` moves it, for a controlplane run outside a pod)."""
    return Path(os.environ.get("LEVERS9_SERVICEACCOUNT_DIR") or SERVICE_ACCOUNT_DIR)


def in_cluster_connection(where: str) -> dict[str, str]:
    """The pod's own API server: endpoint, caData and the token file, as pool fields."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError(
            f"{where}: the controlplane is not running in a pod (KUBERNETES_SERVICE_HOST is "
            "not set); give endpoint, caData and credentials instead"
        )
    directory = service_account_dir()
    try:
        ca = (directory / "ca.crt").read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read the pod's ServiceAccount CA {directory / 'ca.crt'}: "
            f"{exc.strerror}; is automountServiceAccountToken off?"
        ) from None
    token = directory / "token"
    if not token.is_file():
        raise ConfigError(
            f"{where}: the pod has no ServiceAccount token at {token}; "
            "is automountServiceAccountToken off?"
        )
    hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return {
        "endpoint": f"https://{hostport}",
        "caData": base64.b64encode(ca).decode(),
        "credentialsFile": str(token),
    }


def own_namespace(where: str) -> str:
    """The namespace the controlplane's pod runs in."""
    path = service_account_dir() / "namespace"
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read the pod's namespace from {path}: {exc.strerror}; "
            "give the namespace"
        ) from None


def own_cluster_pool(
    name: str, namespace: str | None, where: str, *, connection_field: str | None = None
) -> tuple[PoolConfig, str]:
    """The controlplane's own cluster as a pool named `name` (its pod's ServiceAccount), and
    `namespace` or else the pod's own. `where` is the config block errors name (and
    `connection_field` the field they name when the pod's ServiceAccount is missing)."""
    connection = in_cluster_connection(connection_field or where)
    namespace = namespace or own_namespace(f"{where}.namespace")
    kube = KubernetesPool(
        flavor=Flavor.GENERIC,
        endpoint=connection["endpoint"],
        ca_data=connection["caData"],
        credentials_file=connection["credentialsFile"],
        image="-",
        namespace=namespace,
        in_cluster=True,
    )
    return PoolConfig(name=name, kubernetes=kube), namespace


def read_credentials(pool: PoolConfig) -> Credentials:
    """The pool's credentials: inline, or read (again) from its credentials file now."""
    kube = pool.kubernetes
    if kube.credentials is not None:
        return kube.credentials
    assert kube.credentials_file is not None  # load_pools requires one of the two
    where = f"config.worker.pools[{pool.name}].kubernetes.credentialsFile"
    return _credentials_from_file(kube.flavor, Path(kube.credentials_file), where)


def _load_one(index: int, block: Mapping[str, Any]) -> tuple[PoolConfig, list[str]]:
    if not isinstance(block, Mapping):
        raise ConfigError(f"config.worker.pools[{index}]: must be a mapping with name: and kind")
    name = block.get("name")
    label = name if isinstance(name, str) and name else str(index)
    where = f"config.worker.pools[{label}]"
    data = dict(block)
    kube_raw = data.get("kubernetes")
    if not isinstance(kube_raw, Mapping):
        raise ConfigError(f"{where}.kubernetes: required mapping is missing (endpoint, caData...)")
    kube_data = dict(kube_raw)
    if kube_data.get("inCluster") is True:
        given = sorted(
            k for k in ("endpoint", "caData", "credentials", "credentialsFile") if k in kube_data
        )
        if given:
            raise ConfigError(
                f"{where}.kubernetes.inCluster: the pool is the controlplane's own cluster, "
                f"reached with its pod's ServiceAccount; remove {', '.join(given)}"
            )
        kube_data.update(in_cluster_connection(f"{where}.kubernetes.inCluster"))
    # Credentials and the selector have shapes cattrs cannot pick alone (they depend on the
    # flavor, or mix labels with keywords); they are parsed by hand below, with our messages.
    creds_raw = kube_data.pop("credentials", None)
    selector_raw = kube_data.pop("selector", None)
    data["kubernetes"] = kube_data
    try:
        pool = _CONVERTER.structure(data, PoolConfig)
    except Exception as exc:
        raise ConfigError(f"{where}{_structure_problem(exc)}") from None
    kube = pool.kubernetes
    if selector_raw is not None:
        kube = attrs.evolve(kube, selector=_parse_selector(selector_raw, f"{where}.kubernetes"))
    if creds_raw is not None:
        creds = _parse_credentials(kube.flavor, creds_raw, f"{where}.kubernetes.credentials")
        kube = attrs.evolve(kube, credentials=creds)
    pool = attrs.evolve(pool, kubernetes=kube)
    return pool, _validate(pool, f"config.worker.pools[{pool.name}]")


def _structure_problem(exc: Exception) -> str:
    """`.field.path: what` from a cattrs failure; cattrs' own text never carries the value."""
    problems = cattrs.transform_error(exc, path="$")
    first = problems[0] if problems else "invalid"
    what, _, at = first.partition(" @ ")
    path = at.removeprefix("$")
    dotted = ".".join(_camel(part) for part in path.split(".")) if path else ""
    return f"{dotted}: {what}"


def _camel(part: str) -> str:
    head, *rest = part.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _validate(pool: PoolConfig, where: str) -> list[str]:
    """Every rule of one pool's block that spans fields; returns warnings to log."""
    kube = pool.kubernetes
    kw = f"{where}.kubernetes"
    if not _DNS_LABEL.match(pool.name):
        raise ConfigError(
            f"{where}.name: must be a DNS label (lowercase letters, digits, '-', at most 63); "
            "it names the pool's Jobs"
        )
    if pool.provider != "kubernetes":
        raise ConfigError(
            f"{where}.provider: only 'kubernetes' is supported, not {pool.provider!r}"
        )
    _validate_cluster(kube, kw)
    _validate_workers(kube, kw)
    _validate_rates(kube, kw)
    _validate_pod(kube, kw)
    return _credentials_file_warnings(kube, kw)


def _validate_cluster(kube: KubernetesPool, kw: str) -> None:
    """How the controlplane reaches the cluster: endpoint, CA, credentials, namespace."""
    url = urlsplit(kube.endpoint)
    if url.scheme != "https" or not url.hostname:
        raise ConfigError(
            f"{kw}.endpoint: must be an https:// URL of the cluster's API server, "
            f"not {kube.endpoint!r}"
        )
    try:
        _decode_ca(kube.ca_data)
    except ValueError as exc:
        raise ConfigError(f"{kw}.caData: {exc}") from None
    if (kube.credentials is None) == (kube.credentials_file is None):
        raise ConfigError(
            f"{kw}.credentials: set exactly one of credentials and credentialsFile "
            "(the key belongs in the private values file or a mounted Secret)"
        )
    if not _DNS_LABEL.match(kube.namespace):
        raise ConfigError(f"{kw}.namespace: must be a DNS label, not {kube.namespace!r}")


def _validate_workers(kube: KubernetesPool, kw: str) -> None:
    """What the worker Jobs are made of: network, image, host paths."""
    if not kube.host_network and not kube.tunnel:
        raise ConfigError(
            f"{kw}.hostNetwork: false needs tunnel: true (without the tunnel the controlplane "
            "dials the node's address, which only hostNetwork gives)"
        )
    if not kube.image:
        raise ConfigError(f"{kw}.image: set the worker image (REGISTRY/levers9/worker:TAG)")
    for field, host_path in (("objectsPath", kube.objects_path), ("driverPath", kube.driver_path)):
        if not host_path.startswith("/"):
            raise ConfigError(f"{kw}.{field}: must be an absolute host path, not {host_path!r}")


def _validate_rates(kube: KubernetesPool, kw: str) -> None:
    """How often the pool is reconciled, and how hard its API server may be asked."""
    if kube.idle_minutes < 1:
        raise ConfigError(f"{kw}.idleMinutes: must be 1 or more, not {kube.idle_minutes}")
    if not kube.reconcile_seconds > 0:
        raise ConfigError(
            f"{kw}.reconcileSeconds: must be more than 0, not {kube.reconcile_seconds}"
        )
    if not (kube.qps > 0 and kube.qps != float("inf")):
        raise ConfigError(f"{kw}.qps: must be a number more than 0, not {kube.qps}")
    if kube.burst < 1:
        raise ConfigError(f"{kw}.burst: must be 1 or more, not {kube.burst}")


def _validate_pod(kube: KubernetesPool, kw: str) -> None:
    """The agent's metrics port and the tolerations its pod carries."""
    if kube.agent_metrics_port is not None and not 0 < kube.agent_metrics_port < 65536:
        raise ConfigError(
            f"{kw}.agentMetricsPort: must be a port 1-65535, not {kube.agent_metrics_port}"
        )
    for i, tol in enumerate(kube.tolerations):
        if tol.operator not in ("Equal", "Exists"):
            raise ConfigError(
                f"{kw}.tolerations[{i}].operator: must be Equal or Exists, not {tol.operator!r}"
            )


def _credentials_file_warnings(kube: KubernetesPool, kw: str) -> list[str]:
    """A `credentialsFile` checked (readable, well formed); a warning when others can read it."""
    warnings: list[str] = []
    if kube.credentials_file is not None:
        path = Path(kube.credentials_file)
        if kube.in_cluster:
            # The kubelet mounts the ServiceAccount token world-readable; that is its design.
            return []
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise ConfigError(
                f"{kw}.credentialsFile: cannot read {path}: {exc.strerror}; mount the key there"
            ) from None
        _credentials_from_file(kube.flavor, path, f"{kw}.credentialsFile")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.append(
                f"{kw}.credentialsFile: {path} can be read by group or others; run chmod 600 {path}"
            )
    return warnings


def _decode_ca(ca_data: str) -> bytes:
    text = ca_data.strip()
    if text.startswith("-----BEGIN"):
        pem = text.encode()
    else:
        try:
            pem = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                "is not base64; put the base64 of the cluster CA's PEM here "
                "(certificate-authority-data in a kubeconfig)"
            ) from None
    try:
        x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise ValueError(
            "does not hold a PEM certificate; put the base64 of the cluster CA's PEM here"
        ) from None
    return pem


def _parse_selector(raw: Any, kw: str) -> Selector:
    where = f"{kw}.selector"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a mapping of node labels")
    labels: dict[str, str] = {}
    expressions: list[MatchExpression] = []
    for key, value in raw.items():
        if key == "matchExpressions":
            if not isinstance(value, list):
                raise ConfigError(f"{where}.matchExpressions: must be a list")
            for i, item in enumerate(value):
                expressions.append(_parse_expression(item, f"{where}.matchExpressions[{i}]"))
        elif key == "matchLabels":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}.matchLabels: must be a mapping of node labels")
            labels.update(_parse_labels(value, f"{where}.matchLabels"))
        else:
            labels.update(_parse_labels({key: value}, where))
    return Selector(match_labels=labels, match_expressions=tuple(expressions))


def _parse_labels(raw: Mapping[Any, Any], where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}: label keys must be non-empty strings")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{where}.{key}: the label value must be a string")
        out[key] = str(value)
    return out


def _parse_expression(raw: Any, where: str) -> MatchExpression:
    try:
        expr = _CONVERTER.structure(raw, MatchExpression)
    except Exception as exc:
        raise ConfigError(f"{where}{_structure_problem(exc)}") from None
    if expr.operator not in _OPERATORS:
        raise ConfigError(
            f"{where}.operator: must be one of {', '.join(_OPERATORS)}, not {expr.operator!r}"
        )
    if expr.operator in ("In", "NotIn") and not expr.values:
        raise ConfigError(f"{where}.values: {expr.operator} needs at least one value")
    if expr.operator in ("Exists", "DoesNotExist") and expr.values:
        raise ConfigError(f"{where}.values: {expr.operator} takes no values")
    return expr


# Credential parsing never puts a value into a message: only field names and kinds.


def _credentials_from_file(flavor: Flavor, path: Path, where: str) -> Credentials:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not text (JSON or YAML expected)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"{where}: {path} is not valid JSON or YAML") from None
    if (
        flavor is Flavor.GENERIC
        and isinstance(data, Mapping)
        and ("clusters" in data or data.get("kind") == "Config")
    ):
        data = {"kubeconfig": data}
    elif isinstance(data, str):
        data = {"token": data.strip()}
    return _parse_credentials(flavor, data, f"{where} ({path})")


def _parse_credentials(flavor: Flavor, raw: Any, where: str) -> Credentials:
    # A ServiceAccount token (what `levers9 cluster join` makes) works on any flavor.
    if isinstance(raw, Mapping) and "token" in raw:
        _fields(raw, where, allowed=("token",), required=("token",))
        return TokenCredentials(token=raw["token"])
    if flavor is Flavor.GKE:
        return _parse_gke(raw, where)
    if flavor is Flavor.EKS:
        return _parse_eks(raw, where)
    return _parse_generic(raw, where)


def _fields(raw: Any, where: str, allowed: Sequence[str], required: Sequence[str]) -> None:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a mapping with {', '.join(required)}")
    extra = sorted(str(key) for key in raw if key not in allowed)
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(extra)}")
    for key in required:
        if key not in raw:
            raise ConfigError(f"{where}.{key}: required field is missing")
    for key in raw:
        value = raw[key]
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}.{key}: must be a non-empty string")


def _parse_gke(raw: Any, where: str) -> GkeCredentials:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ConfigError(
                f"{where}: is not a service-account key (JSON text or mapping expected)"
            ) from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be the service-account key JSON")
    if raw.get("type") != "service_account":
        raise ConfigError(
            f"{where}.type: must be service_account; use a key from "
            "`gcloud iam service-accounts keys create`"
        )
    for key in ("client_email", "private_key", "token_uri"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ConfigError(f"{where}.{key}: required field of the key is missing")
    try:
        load_pem_private_key(str(raw["private_key"]).encode(), password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{where}.private_key: is not an unencrypted PEM private key") from None
    return GkeCredentials(info=dict(raw))


def _parse_eks(raw: Any, where: str) -> EksCredentials:
    _fields(
        raw,
        where,
        allowed=("accessKeyId", "secretAccessKey", "sessionToken", "region", "clusterName"),
        required=("accessKeyId", "secretAccessKey", "region", "clusterName"),
    )
    return EksCredentials(
        access_key_id=raw["accessKeyId"],
        secret_access_key=raw["secretAccessKey"],
        session_token=raw.get("sessionToken"),
        region=raw["region"],
        cluster_name=raw["clusterName"],
    )


def _parse_generic(raw: Any, where: str) -> Credentials:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where}: must be a mapping with token, or clientCertificateData and "
            "clientKeyData, or kubeconfig (and context)"
        )
    if "token" in raw:
        _fields(raw, where, allowed=("token",), required=("token",))
        return TokenCredentials(token=raw["token"])
    if "clientCertificateData" in raw or "clientKeyData" in raw:
        keys = ("clientCertificateData", "clientKeyData")
        _fields(raw, where, allowed=keys, required=keys)
        try:
            x509.load_pem_x509_certificates(base64.b64decode(raw["clientCertificateData"]))
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"{where}.clientCertificateData: is not base64 of a PEM certificate"
            ) from None
        try:
            load_pem_private_key(base64.b64decode(raw["clientKeyData"]), password=None)
        except (ValueError, TypeError, binascii.Error):
            raise ConfigError(
                f"{where}.clientKeyData: is not base64 of an unencrypted PEM private key"
            ) from None
        return ClientCertificateCredentials(
            client_certificate_data=raw["clientCertificateData"],
            client_key_data=raw["clientKeyData"],
        )
    if "kubeconfig" in raw:
        extra = sorted(str(key) for key in raw if key not in ("kubeconfig", "context"))
        if extra:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(extra)}")
        kubeconfig = raw["kubeconfig"]
        if isinstance(kubeconfig, str):
            try:
                kubeconfig = yaml.safe_load(kubeconfig)
            except yaml.YAMLError:
                raise ConfigError(f"{where}.kubeconfig: is not valid YAML") from None
        if not isinstance(kubeconfig, Mapping) or not isinstance(kubeconfig.get("users"), list):
            raise ConfigError(f"{where}.kubeconfig: must be a kubeconfig with users:")
        context = raw.get("context")
        if context is not None and not isinstance(context, str):
            raise ConfigError(f"{where}.context: must be a context name")
        names = [c.get("name") for c in kubeconfig.get("contexts") or [] if isinstance(c, Mapping)]
        wanted = context if context is not None else kubeconfig.get("current-context")
        if wanted not in names:
            raise ConfigError(
                f"{where}.context: the kubeconfig has no context {wanted!r} "
                f"(it has {', '.join(map(str, names)) or 'none'})"
            )
        return KubeconfigCredentials(kubeconfig=dict(kubeconfig), context=context)
    raise ConfigError(
        f"{where}: set token, or clientCertificateData and clientKeyData, or kubeconfig"
    )
