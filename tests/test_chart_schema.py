"""The chart's values.schema.json: Helm refuses a misspelt key or a value of the wrong kind at
`helm template`, `lint`, `install` and `upgrade`, naming its path, before anything is deployed.

The schema is generated from the controlplane's config types (control.values_schema). These
tests check that the committed file is that output; that Helm refuses the mistakes operators
make (a typo in a pool block or in `config:`, a flavor, an unquoted `true` as a label value, a
typo at the top); that everything the repository ships passes; and that what the schema says
agrees with the controlplane's own parsers, which are run on the same values: an unknown key
is refused at every level of the config, each pool block the pool parser takes passes, and
each one it refuses for its shape is refused by Helm too.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trustme
import yaml

from control.config import ConfigError, ControlConfig, merge, parse
from control.kube.pools import load_pools
from control.values_schema import SCHEMA_PATH, render, secret_paths
from sim.cloud.standin import write_state
from tests import test_attach_gke_pool as attach
from tests.test_chart import (
    CHART,
    HELM,
    NAMESPACE,
    gke_pool,
    helm_template,
    private_values,
    public_values,
    refused,
)
from tests.test_pools import EKS_CREDS, ca_pem, gke_block, rsa_pem, sa_key
from wire.errors import camel_path

REPO = Path(__file__).resolve().parents[1]
REGENERATE = ".venv/bin/python -m control.values_schema"

KeyPath = Sequence[str | int]


def schema() -> dict[str, Any]:
    data = json.loads(SCHEMA_PATH.read_text())
    assert isinstance(data, dict)
    return data


def helm_lint(tmp_path: Path, *values: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    argv = [str(HELM), "lint", "--strict", str(CHART)]
    for i, data in enumerate(values):
        path = tmp_path / f"lint-values-{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        argv += ["-f", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def helm_files(*files: Path, sets: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    argv = [str(HELM), "template", "test", str(CHART), "-n", NAMESPACE]
    for path in files:
        argv += ["-f", str(path)]
    for item in sets:
        argv += ["--set", item]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def named(output: str, path: KeyPath, word: str = "") -> bool:
    """Whether a schema error in Helm's output is at `path` and says `word`. Helm 3.17 writes
    `- config.worker: Additional property pols is not allowed`; later Helms name the path as a
    JSON pointer (`at '/config/worker'`), which is accepted too."""
    dotted = ".".join(map(str, path))
    pointer = "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)
    return any(
        word in line and (f"- {dotted}: " in line or f"'{pointer}'" in line)
        for line in output.splitlines()
    )


# --- the file ---------------------------------------------------------------------------------


def test_the_committed_schema_is_generated_from_the_config_types() -> None:
    assert SCHEMA_PATH.is_file(), f"{SCHEMA_PATH} is missing; run {REGENERATE}"
    assert SCHEMA_PATH.read_text() == render(), (
        f"{SCHEMA_PATH.relative_to(REPO)} differs from what the config types generate; "
        f"run {REGENERATE} and commit the result"
    )


def test_the_schema_describes_exactly_the_charts_values() -> None:
    """Every top-level value of values.yaml, and every key of the chart's own mappings, is in
    the schema, and the schema names nothing the chart lacks (`global` is what a parent chart
    passes down)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    properties = schema()["properties"]
    assert set(properties) - {"global"} == set(defaults)
    for key, value in defaults.items():
        described = properties[key]
        if described.get("additionalProperties") is False and key not in (
            "config",
            "secretConfig",
        ):
            assert set(described["properties"]) == set(value), key


def test_every_value_a_template_reads_is_described() -> None:
    """A closed mapping refuses a key the schema does not name: a template reading a new
    value must find it described, or no operator could set it."""
    used = set()
    for template in (CHART / "templates").iterdir():
        used |= set(re.findall(r"\.Values((?:\.[A-Za-z0-9_]+)+)", template.read_text()))
    assert used
    for dotted in sorted(used):
        node = schema()
        for part in dotted.strip(".").split("."):
            if "properties" not in node:
                break  # a free-form mapping (resources, affinity...)
            assert part in node["properties"], f".Values{dotted} is not in values.schema.json"
            node = node["properties"][part]


# --- what Helm refuses ------------------------------------------------------------------------


def _with_config(**config: Any) -> dict[str, Any]:
    values = public_values()
    values["config"].update(config)
    return values


MISTAKES: list[tuple[str, dict[str, Any], KeyPath, str]] = [
    (
        "pool-key-typo",
        public_values(gke_pool(hostNetwrok=False)),
        ("config", "worker", "pools", 0, "kubernetes"),
        "hostNetwrok",
    ),
    (
        "flavor",
        public_values(gke_pool(flavor="gek")),
        ("config", "worker", "pools", 0, "kubernetes", "flavor"),
        "gke",
    ),
    (
        "boolean-label-value",
        public_values(gke_pool(selector={"nvidia.com/gpu.present": True})),
        ("config", "worker", "pools", 0, "kubernetes", "selector", "nvidia.com/gpu.present"),
        "boolean",
    ),
    ("config-key-typo", _with_config(worker={"pols": []}), ("config", "worker"), "pols"),
    ("top-level-typo", {**public_values(), "replicaCont": 3}, (), "replicaCont"),
]


@pytest.mark.parametrize("command", ["template", "lint"])
@pytest.mark.parametrize(
    ("values", "path", "word"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES]
)
def test_helm_refuses_the_mistake_naming_its_path(
    tmp_path: Path, command: str, values: dict[str, Any], path: KeyPath, word: str
) -> None:
    run = helm_template if command == "template" else helm_lint
    done = run(tmp_path, values)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "values don't meet the specifications of the schema" in output
    if path:
        assert named(output, path, word), output
    else:  # a top-level key: Helm 3.17 gives no path for the root
        assert f"Additional property {word} is not allowed" in output or f"'{word}'" in output


def test_a_failed_check_names_its_own_line_not_the_first_template_rendered(
    tmp_path: Path,
) -> None:
    values = public_values()
    del values["config"]["publicUrl"]
    stderr = refused(tmp_path, values)
    assert "config.publicUrl is empty" in stderr
    assert re.search(r"execution error at \([^)]*templates/_helpers\.tpl:\d+:\d+\)", stderr), stderr
    assert "servicemonitor.yaml" not in stderr


# --- what the repository ships ------------------------------------------------------------------


def test_the_chart_defaults_pass_and_a_typo_beside_them_does_not(tmp_path: Path) -> None:
    done = helm_lint(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    done = helm_lint(tmp_path, {"image": {"tagg": "1"}})
    assert done.returncode != 0
    assert named(done.stdout, ("image",), "tagg"), done.stdout


def values_blocks() -> list[tuple[str, dict[str, Any]]]:
    """The docs' YAML blocks written for a values file (their keys are chart values)."""
    top = set(yaml.safe_load((CHART / "values.yaml").read_text()))
    blocks = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        text = doc.read_text()
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data and set(data) <= top:
                blocks.append((f"{doc.name}-{i}", data))
    return blocks


def test_the_docs_values_blocks_pass_and_a_typo_in_each_does_not(tmp_path: Path) -> None:
    """Each block over the tests' own values (a public URL, a TLS Secret), as an operator adds
    it; then the same block with an unknown key in its first mapping."""
    blocks = values_blocks()
    documents = {name.rsplit("-", 1)[0] for name, _ in blocks}
    assert {"gke.md", "kubernetes.md", "eks.md", "day-two.md"} <= documents
    for name, block in blocks:
        done = helm_template(tmp_path, public_values(), private_values(), block)
        assert done.returncode == 0, (name, done.stderr)
        key = next(k for k, v in block.items() if isinstance(v, dict))
        typo = copy.deepcopy(block)
        typo[key]["typoKey"] = 1
        done = helm_template(tmp_path, public_values(), private_values(), typo)
        assert done.returncode != 0, name
        assert named(done.stderr, (key,), "typoKey"), (name, done.stderr)


@pytest.fixture
def attach_world(tmp_path: Path) -> Iterator[attach.World]:
    """deploy/attach-gke-pool.sh's world of stand-in cloud CLIs (tests/test_attach_gke_pool)."""
    state_dir, home, tmp, bin_dir = (tmp_path / n for n in ("cloud", "home", "tmp", "bin"))
    for d in (state_dir, home, tmp, bin_dir):
        d.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(f'#!{attach.BASH}\nexec {attach.SCRIPT_PYTHON} "$@"\n')
    shim.chmod(0o755)
    ca = trustme.CA()
    write_state(state_dir, attach._world_state(base64.b64encode(ca.cert_pem.bytes()).decode()))
    yield attach.World(tmp_path, state_dir, home, tmp, bin_dir, ca)


def test_the_block_attach_gke_pool_prints_passes_with_its_private_values(
    tmp_path: Path, attach_world: attach.World
) -> None:
    printed = attach_world.ok().stdout
    values = (CHART / "values.yaml").read_text()
    pasted = tmp_path / "values.yaml"
    pasted.write_text(values.replace("\n    pools: []\n", "\n    pools:\n" + printed))
    sets = ("config.publicUrl=https://levers9.example.com", "tls.secretName=levers9-tls")
    done = helm_files(pasted, attach_world.private_values, sets=sets)
    assert done.returncode == 0, done.stderr

    pasted.write_text(pasted.read_text().replace("hostNetwork: true", "hostNetwrok: true"))
    done = helm_files(pasted, attach_world.private_values, sets=sets)
    assert done.returncode != 0
    assert named(done.stderr, ("config", "worker", "pools", 0, "kubernetes"), "hostNetwrok")


# --- the schema agrees with the controlplane's parsers ------------------------------------------


BASE_CONFIG = {
    "publicUrl": "https://levers9.example.com",
    "tls": {"certFile": "/tls/tls.crt", "keyFile": "/tls/tls.key"},
}


def mapping_positions(cls: type = ControlConfig, path: tuple[str, ...] = ()) -> list[KeyPath]:
    """The path of every mapping of the config that the controlplane merges key by key: the
    config itself, and each field typed by a settings class (not inside a list)."""
    out: list[KeyPath] = [path]
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        tp = hints[field.name]
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
        for member in typing.get_args(tp) if optional else (tp,):
            if isinstance(member, type) and attrs.has(member):
                out += mapping_positions(member, (*path, camel_path(field.name)))
    return out


def _at(path: KeyPath, leaf: Any) -> Any:
    """`leaf` at `path` in nested mappings."""
    out = leaf
    for part in reversed(path):
        out = {str(part): out}
    return out


def test_an_unknown_key_is_refused_at_every_level_of_the_config(tmp_path: Path) -> None:
    positions = mapping_positions()
    assert ("worker",) in positions and ("http2",) in positions
    everywhere: dict[str, Any] = {}
    for path in positions:
        with pytest.raises(ConfigError, match="typoKey"):
            parse({"config": merge(BASE_CONFIG, _at(path, {"typoKey": 1}))})
        everywhere = merge(everywhere, _at(path, {"typoKey": 1}))
    for tree in ("config", "secretConfig"):
        done = helm_template(tmp_path, public_values(), {tree: everywhere})
        assert done.returncode != 0
        for path in positions:
            assert named(done.stderr, (tree, *path), "typoKey"), (tree, path, done.stderr)


SECRETS: dict[str, Any] = {
    "apiTokens": [{"name": "ci", "token": "t" * 20}],
    "workspaces": [{"name": "w", "tokens": [{"name": "alice", "token": "u" * 20}]}],
    "worker.tokens": [{"workerId": "w", "token": "v" * 20}],
    "worker.poolCredentials": {"gke-a100": {"token": "w" * 20}},
    "database.password": "pg-password",
    "replication.secret": "r" * 20,
}


def test_secrets_are_checked_under_secret_config_and_left_to_the_chart_under_config(
    tmp_path: Path,
) -> None:
    """Under `secretConfig:` the schema checks each secret as the controlplane reads it. Under
    `config:` it lets each one pass, so that the chart's own message (it belongs under
    secretConfig, in the private values file) is the one an operator reads."""
    assert set(secret_paths()) == set(SECRETS), (
        "a new secret in the config types: make the chart refuse it under config "
        "(deploy/chart/templates/_helpers.tpl) and add it here"
    )
    secret: dict[str, Any] = {}
    for path, value in SECRETS.items():
        secret = merge(secret, _at(path.split("."), value))
    parse({"config": merge(BASE_CONFIG, secret)})
    done = helm_template(tmp_path, public_values(), {"secretConfig": secret})
    assert done.returncode == 0, done.stderr

    typos = copy.deepcopy(secret)
    misspelt: list[KeyPath] = [
        ("apiTokens", 0),
        ("workspaces", 0, "tokens", 0),
        ("worker", "tokens", 0),
        ("worker", "poolCredentials", "gke-a100"),
    ]
    for where in misspelt:
        one = copy.deepcopy(secret)
        for tree in (one, typos):
            node: Any = tree
            for part in where:
                node = node[part]
            node["typoKey"] = 1
        with pytest.raises(ConfigError, match="typoKey"):
            if where[:2] == ("worker", "poolCredentials"):
                pool = _pool("gke-a100", {"credentials": None})
                load_pools([pool], one["worker"]["poolCredentials"])
            else:
                parse({"config": merge(BASE_CONFIG, one)})
    done = helm_template(tmp_path, public_values(), {"secretConfig": typos})
    assert done.returncode != 0
    for where in misspelt:
        assert named(done.stderr, ("secretConfig", *where)), (where, done.stderr)

    for path, value in SECRETS.items():
        values = public_values()
        values["config"] = merge(values["config"], _at(path.split("."), value))
        stderr = refused(tmp_path, values)
        assert "values don't meet the specifications" not in stderr
        assert f"config.{path}: " in stderr and "secretConfig" in stderr, stderr


def _pool(name: str, change: dict[str, Any], **top: Any) -> dict[str, Any]:
    block = gke_block()
    block.update(name=name, **top)
    for key, value in change.items():
        if value is None:
            block["kubernetes"].pop(key)
        else:
            block["kubernetes"][key] = value
    return block


CLIENT_CERTIFICATE = {
    "clientCertificateData": base64.b64encode(ca_pem()).decode(),
    "clientKeyData": base64.b64encode(rsa_pem().encode()).decode(),
}
KUBECONFIG = {
    "kubeconfig": {
        "users": [{"name": "u", "user": {"token": "kube-token"}}],
        "contexts": [{"name": "lab", "context": {"user": "u"}}],
        "current-context": "lab",
    },
    "context": "lab",
}
TAKEN: list[tuple[str, dict[str, Any]]] = [
    ("gke-key", {}),
    ("gke-key-text", {"credentials": json.dumps(sa_key())}),
    ("gke-token", {"credentials": {"token": "sa-token"}}),
    (
        "eks-everything",
        {
            "flavor": "eks",
            "credentials": EKS_CREDS,
            "selector": {
                "gpu-count": 8,
                "matchLabels": {"pool": "gpu", "zone-index": 1.5},
                "matchExpressions": [
                    {"key": "gpu-type", "operator": "In", "values": ["a100", "h100"]},
                    {"key": "spot", "operator": "DoesNotExist"},
                ],
            },
            "tolerations": [
                {
                    "key": "dedicated",
                    "operator": "Equal",
                    "value": "ml",
                    "effect": "NoSchedule",
                    "tolerationSeconds": 30,
                },
                {"operator": "Exists"},
            ],
            "tunnel": True,
            "hostNetwork": False,
            "namespace": "gpus",
            "objectsPath": "/data/levers9",
            "driverPath": "/opt/nvidia",
            "idleMinutes": 10,
            "reconcileSeconds": 7.5,
            "qps": 20,
            "burst": 40,
            "agentMetricsPort": 9400,
            "agentMetricsHost": "0.0.0.0",
        },
    ),
    ("generic-token", {"flavor": "generic", "credentials": {"token": "bearer"}}),
    ("generic-certificate", {"flavor": "generic", "credentials": CLIENT_CERTIFICATE}),
    ("generic-kubeconfig", {"flavor": "generic", "credentials": KUBECONFIG}),
    (
        "in-cluster",
        {
            "inCluster": True,
            "flavor": "generic",
            "endpoint": None,
            "caData": None,
            "credentials": None,
        },
    ),
]


@pytest.fixture
def in_a_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an inCluster pool reads in a pod: the API server's address and a ServiceAccount."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(ca_pem())
    (account / "token").write_text("pod-token")
    (account / "namespace").write_text(NAMESPACE)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("LEVERS9_SERVICEACCOUNT_DIR", str(account))


K = ("kubernetes",)
SELECTOR = (*K, "selector")
REFUSED: list[tuple[str, dict[str, Any], dict[str, Any], KeyPath, str]] = [
    # name, change to the kubernetes block, change to the pool block, path under the pool, word
    (
        "label-true",
        {"selector": {"nvidia.com/gpu.present": True}},
        {},
        (*SELECTOR, "nvidia.com/gpu.present"),
        "boolean",
    ),
    (
        "match-label-false",
        {"selector": {"matchLabels": {"a": False}}},
        {},
        (*SELECTOR, "matchLabels", "a"),
        "boolean",
    ),
    ("label-list", {"selector": {"a": ["b"]}}, {}, (*SELECTOR, "a"), "array"),
    ("flavor", {"flavor": "aks"}, {}, (*K, "flavor"), "gke"),
    ("pool-key", {}, {"zone": "x"}, (), "zone"),
    ("kubernetes-key", {"hostNetwrok": False}, {}, K, "hostNetwrok"),
    ("host-network-text", {"hostNetwork": "false"}, {}, (*K, "hostNetwork"), "boolean"),
    ("provider", {}, {"provider": "docker"}, ("provider",), "kubernetes"),
    ("no-image", {"image": None}, {}, K, "image"),
    ("no-endpoint", {"endpoint": None}, {}, K, "endpoint"),
    (
        "in-cluster-with-endpoint",
        {"inCluster": True, "credentials": None},
        {},
        (*K, "endpoint"),
        "",
    ),
    (
        "expression-operator",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}},
        {},
        (*SELECTOR, "matchExpressions", 0, "operator"),
        "In",
    ),
    (
        "expression-key",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "Exists", "value": ["b"]}]}},
        {},
        (*SELECTOR, "matchExpressions", 0),
        "value",
    ),
    (
        "toleration-operator",
        {"tolerations": [{"operator": "Maybe"}]},
        {},
        (*K, "tolerations", 0, "operator"),
        "Equal",
    ),
    (
        "toleration-key",
        {"tolerations": [{"operator": "Exists", "efect": "NoSchedule"}]},
        {},
        (*K, "tolerations", 0),
        "efect",
    ),
    ("idle-minutes-text", {"idleMinutes": "five"}, {}, (*K, "idleMinutes"), "integer"),
    (
        "eks-unknown",
        {"flavor": "eks", "credentials": {**EKS_CREDS, "profile": "x"}},
        {},
        (*K, "credentials"),
        "",
    ),
    (
        "eks-no-region",
        {"flavor": "eks", "credentials": {k: v for k, v in EKS_CREDS.items() if k != "region"}},
        {},
        (*K, "credentials"),
        "",
    ),
    (
        "eks-empty",
        {"flavor": "eks", "credentials": {**EKS_CREDS, "accessKeyId": ""}},
        {},
        (*K, "credentials"),
        "",
    ),
    ("eks-key-on-gke", {"credentials": EKS_CREDS}, {}, (*K, "credentials"), ""),
    ("gke-not-a-key", {"credentials": {"type": "user"}}, {}, (*K, "credentials"), ""),
    (
        "generic-nothing-usable",
        {"flavor": "generic", "credentials": {"password": "x"}},
        {},
        (*K, "credentials"),
        "",
    ),
    (
        "generic-text",
        {"flavor": "generic", "credentials": "token text"},
        {},
        (*K, "credentials"),
        "",
    ),
    (
        "token-and-more",
        {"flavor": "generic", "credentials": {"token": "t", "user": "u"}},
        {},
        (*K, "credentials"),
        "",
    ),
    (
        "kubeconfig-without-users",
        {"flavor": "generic", "credentials": {"kubeconfig": {"contexts": []}}},
        {},
        (*K, "credentials"),
        "",
    ),
]


@pytest.mark.usefixtures("in_a_pod")
def test_the_schema_and_the_pool_parser_agree_on_pool_blocks(tmp_path: Path) -> None:
    """Under secretConfig, where a block may carry its credentials inline: what `load_pools`
    takes passes, and what it refuses for its shape Helm refuses, naming the field."""
    taken = [_pool(name, change) for name, change in TAKEN]
    assert [pool.name for pool in load_pools(taken).pools] == [name for name, _ in TAKEN]
    done = helm_template(tmp_path, public_values(), {"secretConfig": {"worker": {"pools": taken}}})
    assert done.returncode == 0, done.stderr
    # Each credentials form by pool name too, as the private values file gives them.
    by_name = {
        block["name"]: block["kubernetes"]["credentials"]
        for block in taken
        if "credentials" in block["kubernetes"]
    }
    done = helm_template(
        tmp_path, public_values(), {"secretConfig": {"worker": {"poolCredentials": by_name}}}
    )
    assert done.returncode == 0, done.stderr

    refused_blocks = []
    for name, kube, top, _, _ in REFUSED:
        block = _pool(name, kube, **top)
        with pytest.raises(ConfigError):
            load_pools([block])
        refused_blocks.append(block)
    done = helm_template(
        tmp_path, public_values(), {"secretConfig": {"worker": {"pools": refused_blocks}}}
    )
    assert done.returncode != 0
    for i, (name, _, _, path, word) in enumerate(REFUSED):
        where = ("secretConfig", "worker", "pools", i, *path)
        assert named(done.stderr, where, word), (name, done.stderr)
