"""Label and field selectors parsed and matched as the apiserver does (=, ==, !=, in, notin,
exists), with its error wording for a bad one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from sim.kubeapi.model import FIELDS, FIELDS_OF, Obj, bad_request


@attrs.frozen
class Requirement:
    """One label-selector term: `op` is one of =, !=, in, notin, exists, !exists."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        if self.op in ("=", "in"):
            return self.key in labels and labels[self.key] in self.values
        # `!=` and `notin` match objects that lack the label, as the apiserver's do.
        return labels.get(self.key) not in self.values


def _split_terms(selector: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t.strip() for t in terms if t.strip()]


def parse_label_selector(selector: str) -> list[Requirement]:
    """Parses the apiserver's label-selector syntax; raises `KubeError` 400 when malformed."""
    reqs = []
    for term in _split_terms(selector):
        words = term.split(None, 1)
        if len(words) == 2 and words[1].split(None, 1)[0] in ("in", "notin"):
            op, rest = words[1].split(None, 1) if " " in words[1] else (words[1], "")
            rest = rest.strip()
            if not (rest.startswith("(") and rest.endswith(")")):
                raise bad_request(f"unable to parse requirement: {term!r}: expected (values)")
            values = frozenset(v.strip() for v in rest[1:-1].split(",") if v.strip())
            reqs.append(Requirement(words[0], op, values))
        elif "!=" in term:
            key, value = term.split("!=", 1)
            reqs.append(Requirement(key.strip(), "!=", frozenset({value.strip()})))
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            reqs.append(Requirement(key.strip(), "=", frozenset({value.strip()})))
        elif term.startswith("!"):
            reqs.append(Requirement(term[1:].strip(), "!exists"))
        elif " " in term or "(" in term:
            raise bad_request(f"unable to parse requirement: {term!r}")
        else:
            reqs.append(Requirement(term, "exists"))
    return reqs


@attrs.frozen
class FieldTerm:
    field: str
    value: str
    negate: bool


def parse_field_selector(selector: str, plural: str = "") -> list[FieldTerm]:
    """Parses `field=value`, `field==value`, `field!=value` terms over the fields resource
    `plural` supports (`FIELDS_OF`, else `FIELDS`)."""
    supported = FIELDS_OF.get(plural, FIELDS)
    terms = []
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            field, value = term.split("!=", 1)
            negate = True
        elif "=" in term:
            field, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            negate = False
        else:
            raise bad_request(f"invalid selector: {selector!r}; can't understand {term!r}")
        field = field.strip()
        if field not in supported:
            raise bad_request(f'field label not supported: "{field}"')
        terms.append(FieldTerm(field, value.strip(), negate))
    return terms


def field_value(obj: Obj, field: str) -> str:
    if field == "source":
        # An Event's reporter: the legacy `source.component`, else `reportingComponent`.
        source = (obj.get("source") or {}).get("component") or obj.get("reportingComponent")
        return str(source or "")
    value: Any = obj
    for part in field.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def selected(obj: Obj, labels: Sequence[Requirement], fields: Sequence[FieldTerm]) -> bool:
    """Whether `obj` matches every label and field term (as lists and watches filter)."""
    if labels:
        obj_labels = obj["metadata"].get("labels") or {}
        if not all(r.matches(obj_labels) for r in labels):
            return False
    return all((field_value(obj, f.field) == f.value) != f.negate for f in fields)
