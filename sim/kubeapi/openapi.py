"""The OpenAPI v3 documents the stand-in serves: only what a client asks of them before writing.

`helm install` and `kubectl apply` validate a manifest before sending it: they ask OpenAPI v3
whether the server validates fields itself (the `fieldValidation` parameter of the kind's PATCH
operation) and, if it does, leave validation to it; without OpenAPI they fall back to OpenAPI
v2 as protobuf, and fail with "failed to download openapi" when that is missing too. So each
group version's document lists, for every served kind, its object path with a PATCH operation
tagged with the kind (`x-kubernetes-group-version-kind`) and taking `fieldValidation`, and no
schemas: a client that wants one (`kubectl explain`) finds none, and `kubectl apply` computes
its patches from the types built into it, as it does against an apiserver without OpenAPI.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from sim.kubeapi.model import KUBE_VERSION, RESOURCES, Obj, Resource

ROOT = "/openapi/v3"


def _group_version_path(group: str) -> str:
    """How the OpenAPI v3 root names a group version: `api/v1`, `apis/apps/v1`."""
    return f"apis/{group}/v1" if group else "api/v1"


def _document(group: str) -> Obj:
    prefix = "/" + _group_version_path(group)
    paths: Obj = {}
    for res in RESOURCES:
        if res.group != group:
            continue
        scope = f"{prefix}/namespaces/{{namespace}}" if res.namespaced else prefix
        paths[f"{scope}/{res.plural}/{{name}}"] = {"patch": _patch_operation(res)}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": KUBE_VERSION["gitVersion"]},
        "paths": paths,
        "components": {"schemas": {}},
    }


def _patch_operation(res: Resource) -> Obj:
    query = [
        {"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
        for name in ("dryRun", "fieldManager", "fieldValidation")
    ]
    return {
        "operationId": f"patch{res.kind}",
        "parameters": query,
        "responses": {"200": {"description": "OK"}},
        "x-kubernetes-action": "patch",
        "x-kubernetes-group-version-kind": {
            "group": res.group,
            "version": res.version,
            "kind": res.kind,
        },
    }


def openapi_v3(path: str, groups: Sequence[str]) -> Obj | None:
    """The document at `path` (the root or a group version's), or None for any other path.
    `groups` are the API groups served besides core."""
    served = {_group_version_path(g): g for g in ("", *groups)}
    if path == ROOT:
        listed = {}
        for gv, group in served.items():
            digest = hashlib.sha256(json.dumps(_document(group)).encode()).hexdigest()
            listed[gv] = {"serverRelativeURL": f"{ROOT}/{gv}?hash={digest[:32].upper()}"}
        return {"paths": listed}
    gv = path.removeprefix(ROOT + "/")
    if path.startswith(ROOT + "/") and gv in served:
        return _document(served[gv])
    return None
