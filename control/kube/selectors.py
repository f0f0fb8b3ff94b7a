"""Label selectors and taint tolerations, as Kubernetes matches them against a node.

A pool names its nodes with a selector (matchLabels and matchExpressions) and lets its workers
onto tainted nodes with tolerations; the planner asks `selector_matches` and `tolerated`, and
`label_selector_text` writes the same selector as the API's `labelSelector` query parameter.
Pure functions of the dicts the API has; an unknown operator is the pool's mistake and is named
as such. The simulated API server keeps its own reading (`sim.kubeapi.selectors`) and never
imports this one (an import-linter contract), so a test through it is not this code checking
itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from wire.errors import ApiError, ErrorCode

__all__ = ["Selector", "label_selector_text", "selector_matches", "tolerated"]


@attrs.frozen
class Selector:
    """A label selector: matchLabels and matchExpressions (dicts, as the API has them)."""

    labels: Mapping[str, str] = attrs.field(factory=dict)
    expressions: tuple[Mapping[str, Any], ...] = ()


def _expression_matches(labels: Mapping[str, str], expression: Mapping[str, Any]) -> bool:
    key = expression.get("key", "")
    operator = expression.get("operator")
    values = expression.get("values") or ()
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ApiError(
        ErrorCode.INVALID_ARGUMENT,
        f"selector operator {operator!r} for key {key!r} is not one of In, NotIn, Exists, "
        "DoesNotExist; fix the pool's selector",
        field="selector.matchExpressions",
    )


def selector_matches(labels: Mapping[str, str], selector: Selector) -> bool:
    """Whether a node with `labels` is selected (every label and every expression must hold)."""
    for key, value in selector.labels.items():
        if labels.get(key) != value:
            return False
    return all(_expression_matches(labels, e) for e in selector.expressions)


def label_selector_text(selector: Selector) -> str:
    """The `labelSelector` query parameter that asks the API server for the same nodes."""
    parts = [f"{key}={value}" for key, value in sorted(selector.labels.items())]
    for expression in selector.expressions:
        key = expression.get("key", "")
        operator = expression.get("operator")
        values = ",".join(sorted(expression.get("values") or ()))
        if operator == "In":
            parts.append(f"{key} in ({values})")
        elif operator == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif operator == "Exists":
            parts.append(key)
        elif operator == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            _expression_matches({}, expression)  # raises the error naming the operator
    return ",".join(parts)


def tolerated(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """Whether one of `tolerations` lets a pod onto a node with `taint` (key, value, effect)."""
    for toleration in tolerations:
        effect = toleration.get("effect") or ""
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key") or ""
        if toleration.get("operator", "Equal") == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False
