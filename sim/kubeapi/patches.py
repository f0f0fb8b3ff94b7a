"""Strategic merge patches, as the apiserver applies them to the built-in kinds it serves.

`kubectl apply` and `helm upgrade` compute a three-way strategic merge patch: a list of
containers, volumes, env or ports is patched element by element, keyed by its merge key (a
container by `name`, a volume mount by `mountPath`), with directives for what a plain merge
cannot say: `$patch: delete` (drop an element or a map), `$patch: replace`, `$retainKeys`
(a Deployment's `strategy`, a volume's source: keys not listed go), `$setElementOrder/<list>`
and `$deleteFromPrimitiveList/<list>`. A JSON merge patch would replace such a list by the
few changed fields and keep the directives as data.

The merge keys are the Kubernetes API's, by field name, as a table rather than from a schema;
a list not in it is replaced whole (as an atomic list is), and `finalizers` is merged as a set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "env": "name",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "conditions": "type",
    "ownerReferences": "uid",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
    "schedulingGates": "name",
}
"""List field -> the key its elements are merged by. `ports` is told apart by content: a
container's are keyed by `containerPort`, a Service's by `port`."""
_SET_LISTS = frozenset({"finalizers"})
_ORDER = "$setElementOrder/"
_DELETE_FROM = "$deleteFromPrimitiveList/"


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """`target` with the strategic merge patch `patch` applied (neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    return _merge_map(target if isinstance(target, dict) else {}, patch)


def _strip(value: Any) -> Any:
    """A patch value stored as it is, without directives."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not k.startswith("$") and v is not None}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _merge_map(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    if patch.get("$patch") == "replace":
        return dict(_strip(patch))
    result = dict(target)
    orders: dict[str, list[Any]] = {}
    removals: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith(_ORDER):
            orders[key.removeprefix(_ORDER)] = list(value or ())
        elif key.startswith(_DELETE_FROM):
            removals[key.removeprefix(_DELETE_FROM)] = list(value or ())
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            if value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                current = result.get(key)
                result[key] = _merge_map(current if isinstance(current, dict) else {}, value)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            result[key] = value
    for key, gone in removals.items():
        if isinstance(result.get(key), list):
            result[key] = [v for v in result[key] if v not in gone]
    for key, order in orders.items():
        if isinstance(result.get(key), list):
            result[key] = _ordered(key, result[key], order)
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_key(field: str, items: Sequence[Any]) -> str | None:
    if field == "ports":
        return "containerPort" if any("containerPort" in i for i in items) else "port"
    return _MERGE_KEYS.get(field)


def _merge_list(field: str, target: Any, patch: list[Any]) -> list[Any]:
    current = list(target) if isinstance(target, list) else []
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [_strip(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    if field in _SET_LISTS:
        return current + [v for v in patch if v not in current]
    objects = all(isinstance(i, dict) for i in [*current, *patch])
    key = _merge_key(field, [*current, *patch]) if objects else None
    if key is None:
        return [_strip(i) for i in patch]
    for item in patch:
        found = next((n for n, c in enumerate(current) if c.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if found is not None:
                del current[found]
        elif found is None:
            current.append(_strip(item))
        else:
            current[found] = _merge_map(current[found], item)
    return current


def _ordered(field: str, items: list[Any], order: Sequence[Any]) -> list[Any]:
    """`items` in the order a `$setElementOrder` directive gives; others keep theirs, after."""
    key = _merge_key(field, items) if all(isinstance(i, dict) for i in items) else None

    def ident(value: Any) -> Any:
        return value.get(key) if key is not None and isinstance(value, dict) else value

    wanted = [ident(o) for o in order]
    return sorted(
        items,
        key=lambda i: wanted.index(ident(i)) if ident(i) in wanted else len(wanted),
    )
