"""The Helm chart's values schema (deploy/chart/values.schema.json), built from the
controlplane's own config types.

Helm checks the values against that file on install, upgrade, template and lint, so a misspelt
key or a value of the wrong kind fails before anything is deployed, with its path named,
instead of as a crash-looping pod. `config:` and `secretConfig:` become the controlplane's
config files, so their part is generated from the attrs classes that `control.config` and
`control.kube.pools` structure them into, with their converters' rules: camelCase keys, unknown
keys refused, a field without a default required only where its block is given whole. A new
config field therefore appears in the schema without a second edit. What the parsers check by
hand (node selectors, credentials by flavor, operators, `inCluster`) and the chart's own keys are
described here; tests/test_chart_schema.py holds each of them against the parser and the chart.

Three choices follow from how the files are used:
- Helm merges nothing between `config:` and `secretConfig:`; the controlplane merges the second
  over the first, key by key. A mapping's field may so come from either tree and is never
  required; a list is replaced whole, so a list item's fields without a default are.
- A secret under `config:` (a field kept out of repr, or a list of items holding one) is left to
  the chart's templates, which refuse it there with a message naming where it belongs.
- A chart value its templates already check with a message of their own (replicaCount, the
  leader-election timings, the budget, the metrics port's range, the ServiceMonitor's interval
  and labels) is only named here, so that message is the one an operator reads.

Regenerate after changing a config type or a chart value, and commit the result:

    .venv/bin/python -m control.values_schema            # writes deploy/chart/values.schema.json
    .venv/bin/python -m control.values_schema --check    # exits 1 when the file is stale
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from agent.wire.errors import camel_path
from control.config import ControlConfig, WorkerSettings
from control.kube.pools import (
    ClientCertificateCredentials,
    EksCredentials,
    Flavor,
    KubernetesPool,
    MatchExpression,
    PoolConfig,
    Selector,
    TokenCredentials,
    Toleration,
)

__all__ = ["SCHEMA_PATH", "main", "render", "secret_paths", "values_schema"]

JsonSchema = dict[str, Any]

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "deploy" / "chart" / "values.schema.json"

_SCALARS: dict[Any, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}
_STRING: JsonSchema = {"type": "string"}
_NON_EMPTY: JsonSchema = {"type": "string", "minLength": 1}
_BOOLEAN: JsonSchema = {"type": "boolean"}
_OBJECT: JsonSchema = {"type": "object"}
# Kubernetes' string maps (annotations, nodeSelector), which its API refuses other values in.
_STRING_MAP: JsonSchema = {"type": "object", "additionalProperties": _STRING}
_STRING_LIST: JsonSchema = {"type": "array", "items": _STRING}

# `_parse_labels`: a label value is a string, or a number it turns into one; a boolean is
# refused (an unquoted `true` is YAML's boolean, not the label value "true").
_LABEL_VALUE: JsonSchema = {"type": ["string", "number"]}
_LABELS: JsonSchema = {"type": "object", "additionalProperties": _LABEL_VALUE}

# Operators the pool parser accepts (`_OPERATORS` and `_validate` in control.kube.pools).
_EXPRESSION_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
_TOLERATION_OPERATORS = ("Equal", "Exists")

# `inCluster: true` fills these in from the pod's ServiceAccount (`in_cluster_connection`)...
_FILLED_IN_CLUSTER = ("endpoint", "caData")
# ...and refuses them given (`_load_one`).
_REFUSED_IN_CLUSTER = ("endpoint", "caData", "credentials", "credentialsFile")

_SECRET_UNDER_CONFIG: JsonSchema = {
    "description": "A secret: the chart refuses it under config and names where it goes "
    "(secretConfig, in the private values file)."
}
_TEMPLATE_CHECKED: JsonSchema = {
    "description": "Checked by the chart's templates, which say what they expect."
}


def values_schema() -> JsonSchema:
    """The whole values.schema.json: the chart's own keys, `config:` and `secretConfig:`."""
    config = _describe(ControlConfig, whole=False, public=True)
    config["description"] = (
        "The controlplane's settings without secrets (a ConfigMap), as control.config reads them."
    )
    secret_config = _describe(ControlConfig, whole=False, public=False)
    secret_config["description"] = (
        "The controlplane's secret settings (a Secret, merged over config), as control.config "
        "reads them."
    )
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": "Generated by `python -m control.values_schema` from the controlplane's "
        "config types; edit control/values_schema.py or the types, not this file.",
        "type": "object",
        "properties": {**_chart_values(), "config": config, "secretConfig": secret_config},
        "additionalProperties": False,
    }


def render() -> str:
    """values.schema.json's text, as committed."""
    return json.dumps(values_schema(), indent=2) + "\n"


def secret_paths() -> tuple[str, ...]:
    """The dotted camelCase paths under `config:` that hold secrets, which the chart must
    refuse there (`apiTokens`, `worker.tokens`, `database.password`...)."""
    return tuple(_secret_paths(ControlConfig, ""))


# --- the chart's own keys ------------------------------------------------------------------


def _closed(properties: Mapping[str, JsonSchema]) -> JsonSchema:
    """A mapping of the chart's own, whose templates read exactly these keys."""
    return {"type": "object", "properties": dict(properties), "additionalProperties": False}


def _chart_values() -> dict[str, JsonSchema]:
    # Kubernetes objects (resources, affinity, tolerations, security contexts) go into the
    # manifests as written, so the API server checks them, not this schema.
    return {
        "replicaCount": _TEMPLATE_CHECKED,
        "podDisruptionBudget": _closed({"enabled": _BOOLEAN, "maxUnavailable": _TEMPLATE_CHECKED}),
        "leaderElection": _closed(
            {
                "enabled": _BOOLEAN,
                "leaseDurationS": _TEMPLATE_CHECKED,
                "renewDeadlineS": _TEMPLATE_CHECKED,
                "retryPeriodS": _TEMPLATE_CHECKED,
            }
        ),
        "image": _closed(
            {
                "repository": _STRING,
                "tag": _STRING,
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }
        ),
        "imagePullSecrets": {"type": "array", "items": _OBJECT},
        "nameOverride": _STRING,
        "fullnameOverride": _STRING,
        "service": _closed(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "annotations": _STRING_MAP,
                "loadBalancerSourceRanges": _STRING_LIST,
            }
        ),
        "resources": _OBJECT,
        "metrics": _closed(
            {
                "enabled": _BOOLEAN,
                "port": {"type": "integer"},
                "serviceMonitor": _closed(
                    {
                        "enabled": _BOOLEAN,
                        "interval": _STRING,
                        "labels": _TEMPLATE_CHECKED,
                    }
                ),
            }
        ),
        "nodeSelector": _STRING_MAP,
        "tolerations": {"type": "array", "items": _OBJECT},
        "affinity": _OBJECT,
        "podAnnotations": _STRING_MAP,
        # Quoted into the claim as written: a Kubernetes quantity such as 5Gi.
        "persistence": _closed({"size": _STRING, "storageClass": _STRING}),
        "tls": _closed({"secretName": _STRING}),
        "serviceAccount": _closed(
            {"create": _BOOLEAN, "name": _STRING, "annotations": _STRING_MAP}
        ),
        "rbac": _closed(
            {
                "create": _BOOLEAN,
                "workerNamespaces": _STRING_LIST,
                "createWorkerNamespaces": _BOOLEAN,
            }
        ),
        "podSecurityContext": _OBJECT,
        "securityContext": _OBJECT,
        # What a parent chart passes down to this one as a subchart.
        "global": _OBJECT,
    }


# --- the config types ------------------------------------------------------------------------


def _describe(tp: Any, *, whole: bool, public: bool) -> JsonSchema:
    """The schema of a value of type `tp`. `whole`: the value sits in a list, which the
    controlplane's merge replaces whole, so its required fields must all be there. `public`:
    under `config:`, where secrets are left to the chart's templates."""
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is Any:
        return {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in args if m is not type(None)]
        if len(members) == 1 and len(args) == 2:
            return _nullable(_describe(members[0], whole=whole, public=public))
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return {"type": "array", "items": _describe(args[0], whole=True, public=public)}
    elif origin is Mapping and len(args) == 2 and args[0] is str:
        values = _describe(args[1], whole=whole, public=public)
        return {"type": "object", **({"additionalProperties": values} if values else {})}
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [member.value for member in tp]}
    elif isinstance(tp, type) and attrs.has(tp):
        return _object(tp, whole=whole, public=public)
    raise TypeError(f"no JSON Schema for {tp!r}: describe it in control/values_schema.py")


def _nullable(schema: JsonSchema) -> JsonSchema:
    out = dict(schema)
    if isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
        return out
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


def _object(cls: type, *, whole: bool, public: bool) -> JsonSchema:
    hints = typing.get_type_hints(cls)
    properties: dict[str, JsonSchema] = {}
    required: list[str] = []
    for field in attrs.fields(cls):
        name = camel_path(field.name)
        by_hand = _BY_HAND.get((cls, field.name))
        if public and _holds_secret(field, hints[field.name]):
            properties[name] = _SECRET_UNDER_CONFIG
        elif by_hand is not None:
            properties[name] = by_hand()
        else:
            properties[name] = _describe(hints[field.name], whole=whole, public=public)
        if whole and field.default is attrs.NOTHING:
            required.append(name)
    schema: JsonSchema = {
        "type": "object",
        "properties": properties,
        "additionalProperties": _OTHER_KEYS.get(cls, False),
    }
    if cls is KubernetesPool:
        required = [name for name in required if name not in _FILLED_IN_CLUSTER]
        schema["allOf"] = _pool_rules()
    if required:
        schema["required"] = required
    return schema


def _holds_secret(field: attrs.Attribute[Any], tp: Any) -> bool:
    """Kept out of repr, or a list (replaced whole, refused whole) of items holding such."""
    if not field.repr:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and args and isinstance(args[0], type) and attrs.has(args[0]):
        return _class_holds_secret(args[0])
    return False


def _class_holds_secret(cls: type) -> bool:
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        if not field.repr:
            return True
        for tp in (hints[field.name], *typing.get_args(hints[field.name])):
            if isinstance(tp, type) and attrs.has(tp) and _class_holds_secret(tp):
                return True
    return False


def _secret_paths(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    paths: list[str] = []
    for field in attrs.fields(cls):
        path = prefix + camel_path(field.name)
        tp = hints[field.name]
        if _holds_secret(field, tp):
            paths.append(path)
            continue
        for member in (tp, *typing.get_args(tp)):
            if isinstance(member, type) and attrs.has(member):
                paths += _secret_paths(member, path + ".")
    return paths


# --- what the pool parser reads by hand ---------------------------------------------------------


def _pools() -> JsonSchema:
    """config.worker.pools: raw mappings to ControlConfig, typed by `load_pools`."""
    return {"type": "array", "items": _describe(PoolConfig, whole=True, public=False)}


def _fields_shape(cls: type) -> JsonSchema:
    """Credentials read by `_fields`: exactly the class's fields, each a non-empty string."""
    names = [camel_path(field.name) for field in attrs.fields(cls)]
    required = [camel_path(f.name) for f in attrs.fields(cls) if f.default is attrs.NOTHING]
    return {
        "type": "object",
        "properties": dict.fromkeys(names, _NON_EMPTY),
        "required": required,
        "additionalProperties": False,
    }


_GKE_KEY: JsonSchema = {
    # A service-account key as gcloud writes it: `_parse_gke` reads four of its fields and
    # keeps the rest. Or the same key as JSON text.
    "type": ["object", "string"],
    "properties": {
        "type": {"const": "service_account"},
        "client_email": _NON_EMPTY,
        "private_key": _NON_EMPTY,
        "token_uri": _NON_EMPTY,
    },
    "required": ["type", "client_email", "private_key", "token_uri"],
}
_KUBECONFIG: JsonSchema = {
    "type": "object",
    "properties": {
        # A kubeconfig as a mapping or as YAML text; its users authenticate.
        "kubeconfig": {
            "type": ["object", "string"],
            "properties": {"users": {"type": "array"}},
            "required": ["users"],
        },
        "context": {"type": ["string", "null"]},
    },
    "required": ["kubeconfig"],
    "additionalProperties": False,
}


def _credentials(flavor: Flavor | None) -> JsonSchema:
    """`_parse_credentials`: a token on any flavor, else the flavor's own kind (None: any)."""
    by_flavor = {
        Flavor.GKE: [_GKE_KEY],
        Flavor.EKS: [_fields_shape(EksCredentials)],
        Flavor.GENERIC: [_fields_shape(ClientCertificateCredentials), _KUBECONFIG],
    }
    shapes = [_fields_shape(TokenCredentials)]
    for kind in Flavor:
        if flavor in (kind, None):
            shapes += by_flavor[kind]
    return {"anyOf": shapes}


def _pool_rules() -> list[JsonSchema]:
    """The kubernetes block's rules across fields: what `inCluster` fills in and refuses,
    and the credentials each flavor takes."""
    in_cluster: JsonSchema = {
        "if": {"properties": {"inCluster": {"const": True}}, "required": ["inCluster"]},
        "then": {"properties": dict.fromkeys(_REFUSED_IN_CLUSTER, False)},
        "else": {"required": list(_FILLED_IN_CLUSTER)},
    }
    by_flavor = [
        {
            "if": {"properties": {"flavor": {"const": flavor.value}}, "required": ["flavor"]},
            "then": {"properties": {"credentials": _credentials(flavor)}},
        }
        for flavor in Flavor
    ]
    return [in_cluster, *by_flavor]


_BY_HAND: dict[tuple[type, str], Callable[[], JsonSchema]] = {
    (WorkerSettings, "pools"): _pools,
    (WorkerSettings, "pool_credentials"): lambda: {
        "type": "object",
        "additionalProperties": _credentials(None),
    },
    (PoolConfig, "provider"): lambda: {"enum": ["kubernetes"]},
    # By flavor, in _pool_rules.
    (KubernetesPool, "credentials"): lambda: {},
    (Selector, "match_labels"): lambda: _LABELS,
    (MatchExpression, "operator"): lambda: {"enum": list(_EXPRESSION_OPERATORS)},
    (Toleration, "operator"): lambda: {"enum": list(_TOLERATION_OPERATORS)},
}

# Classes whose parser takes keys beyond their fields: `_parse_selector` reads a selector's
# other keys as node labels.
_OTHER_KEYS: dict[type, JsonSchema] = {Selector: _LABEL_VALUE}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m control.values_schema",
        description="Write the Helm chart's values.schema.json from the controlplane's config "
        "types.",
    )
    parser.add_argument("path", nargs="?", type=Path, default=SCHEMA_PATH)
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the file is stale"
    )
    args = parser.parse_args(argv)
    text = render()
    path: Path = args.path
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale; run: python -m control.values_schema", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
