"""The `Table` form `kubectl get` asks for (`application/json;as=Table`), with its columns."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sim.kubeapi.model import Obj, Resource


def _age(obj: Obj) -> str:
    return _since(obj["metadata"].get("creationTimestamp"))


def _since(stamp: str | None) -> str:
    """How long ago a timestamp (seconds, or an Event's microseconds) was, as kubectl prints it."""
    if not stamp:
        return "<unknown>"
    then = datetime.strptime(stamp.split(".")[0].rstrip("Z"), "%Y-%m-%dT%H:%M:%S")
    seconds = int((datetime.now(UTC) - then.replace(tzinfo=UTC)).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _row(res: Resource, obj: Obj) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    name = obj["metadata"]["name"]
    if res.plural == "nodes":
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions", ())
        )
        state = "Ready" if ready else "NotReady"
        if spec.get("unschedulable"):
            state += ",SchedulingDisabled"
        version = status.get("nodeInfo", {}).get("kubeletVersion", "")
        return [name, state, "<none>", _age(obj), version]
    if res.plural == "pods":
        containers = status.get("containerStatuses") or []
        ready_count = sum(1 for c in containers if c.get("ready"))
        restarts = sum(int(c.get("restartCount", 0)) for c in containers)
        total = len(spec.get("containers", ()))
        return [name, f"{ready_count}/{total}", status.get("phase", ""), restarts, _age(obj)]
    if res.plural == "jobs":
        done = f"{status.get('succeeded', 0)}/{spec.get('completions', 1)}"
        state = "Running" if status.get("active") else "Complete" if status.get("succeeded") else ""
        return [name, state, done, "", _age(obj)]
    if res.plural == "secrets":
        return [name, obj.get("type", ""), len(obj.get("data") or {}), _age(obj)]
    if res.plural == "serviceaccounts":
        return [name, len(obj.get("secrets") or ()), _age(obj)]
    if res.plural in ("roles", "clusterroles"):
        return [name, obj["metadata"].get("creationTimestamp", "")]
    if res.plural in ("rolebindings", "clusterrolebindings"):
        ref = obj.get("roleRef") or {}
        return [name, f"{ref.get('kind', '')}/{ref.get('name', '')}", _age(obj)]
    if res.plural == "leases":
        return [name, spec.get("holderIdentity") or "", _age(obj)]
    if res.plural == "configmaps":
        return [name, len(obj.get("data") or {}) + len(obj.get("binaryData") or {}), _age(obj)]
    if res.plural == "services":
        return [
            name,
            spec.get("type", "ClusterIP"),
            spec.get("clusterIP") or "<none>",
            _external_ip(spec, status),
            _ports(spec),
            _age(obj),
        ]
    if res.plural == "persistentvolumeclaims":
        modes = {"ReadWriteOnce": "RWO", "ReadOnlyMany": "ROX", "ReadWriteMany": "RWX"}
        return [
            name,
            status.get("phase", ""),
            spec.get("volumeName", ""),
            (status.get("capacity") or {}).get("storage", ""),
            ",".join(modes.get(m, m) for m in status.get("accessModes") or ()),
            spec.get("storageClassName") or "<unset>",
            _age(obj),
        ]
    if res.plural == "poddisruptionbudgets":
        return [
            name,
            str(spec["minAvailable"]) if "minAvailable" in spec else "N/A",
            str(spec["maxUnavailable"]) if "maxUnavailable" in spec else "N/A",
            status.get("disruptionsAllowed", 0),
            _age(obj),
        ]
    if res.plural == "deployments":
        return [
            name,
            f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
            status.get("updatedReplicas", 0),
            status.get("availableReplicas", 0),
            _age(obj),
        ]
    if res.plural == "events":
        involved = obj.get("involvedObject") or {}
        last = (
            obj.get("lastTimestamp")
            or obj.get("eventTime")
            or obj["metadata"].get("creationTimestamp")
        )
        what = f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"
        return [_since(last), obj.get("type", ""), obj.get("reason", ""), what, obj.get("message")]
    return [name, status.get("phase", ""), _age(obj)]


def _external_ip(spec: Obj, status: Obj) -> str:
    if spec.get("externalIPs"):
        return ",".join(spec["externalIPs"])
    if spec.get("type") != "LoadBalancer":
        return "<none>"
    ingress = (status.get("loadBalancer") or {}).get("ingress") or []
    return ",".join(i.get("ip") or i.get("hostname", "") for i in ingress) or "<pending>"


def _ports(spec: Obj) -> str:
    return (
        ",".join(
            f"{p.get('port')}:{p['nodePort']}/{p.get('protocol', 'TCP')}"
            if p.get("nodePort")
            else f"{p.get('port')}/{p.get('protocol', 'TCP')}"
            for p in spec.get("ports") or ()
        )
        or "<none>"
    )


_COLUMNS = {
    "nodes": ["Name", "Status", "Roles", "Age", "Version"],
    "pods": ["Name", "Ready", "Status", "Restarts", "Age"],
    "jobs": ["Name", "Status", "Completions", "Duration", "Age"],
    "secrets": ["Name", "Type", "Data", "Age"],
    "events": ["Last Seen", "Type", "Reason", "Object", "Message"],
    "namespaces": ["Name", "Status", "Age"],
    "serviceaccounts": ["Name", "Secrets", "Age"],
    "roles": ["Name", "Created At"],
    "clusterroles": ["Name", "Created At"],
    "rolebindings": ["Name", "Role", "Age"],
    "clusterrolebindings": ["Name", "Role", "Age"],
    "leases": ["Name", "Holder", "Age"],
    "configmaps": ["Name", "Data", "Age"],
    "services": ["Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age"],
    "persistentvolumeclaims": [
        "Name",
        "Status",
        "Volume",
        "Capacity",
        "Access Modes",
        "StorageClass",
        "Age",
    ],
    "poddisruptionbudgets": [
        "Name",
        "Min Available",
        "Max Unavailable",
        "Allowed Disruptions",
        "Age",
    ],
    "deployments": ["Name", "Ready", "Up-to-date", "Available", "Age"],
}
_INTEGER_COLUMNS = frozenset(
    {"Restarts", "Data", "Secrets", "Allowed Disruptions", "Up-to-date", "Available"}
)


def table_of(res: Resource, objs: Sequence[Obj], list_meta: Obj) -> Obj:
    """A meta.k8s.io/v1 Table, the shape kubectl prints from."""
    columns = [
        {
            "name": col,
            "type": "integer" if col in _INTEGER_COLUMNS else "string",
            "format": "name" if col == "Name" else "",
            "description": col,
            "priority": 0,
        }
        for col in _COLUMNS[res.plural]
    ]
    rows = [
        {
            "cells": _row(res, obj),
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            },
        }
        for obj in objs
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": columns,
        "rows": rows,
    }
