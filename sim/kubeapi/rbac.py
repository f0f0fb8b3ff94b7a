"""RBAC as the apiserver enforces it for ServiceAccount tokens: Roles, ClusterRoles and their
bindings, the 403 wording, SelfSubjectAccessReview and SelfSubjectRulesReview.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from sim.kubeapi.model import RBAC, SA_NAME_ANNOTATION, SA_TOKEN_TYPE, KubeError, Obj, Resource


def token_owner(secret: Obj) -> str | None:
    """The ServiceAccount a token Secret belongs to, or None for any other Secret."""
    if secret.get("type") != SA_TOKEN_TYPE:
        return None
    name = (secret["metadata"].get("annotations") or {}).get(SA_NAME_ANNOTATION)
    return str(name) if name else None


def check_role_ref(res: Resource, binding: Obj, old: Obj | None) -> None:
    """The apiserver's validation of a binding's roleRef (required, and immutable)."""
    ref = binding.get("roleRef")
    kinds = ("ClusterRole",) if res.plural == "clusterrolebindings" else ("Role", "ClusterRole")
    prefix = f'{res.kind}.{res.group} "{binding["metadata"]["name"]}" is invalid: roleRef'
    problem = None
    if not isinstance(ref, dict) or not ref.get("name"):
        problem = ".name: Required value"
    elif ref.get("apiGroup") != RBAC:
        problem = (
            f'.apiGroup: Unsupported value: "{ref.get("apiGroup", "")}": supported values: "{RBAC}"'
        )
    elif ref.get("kind") not in kinds:
        supported = ", ".join(f'"{k}"' for k in kinds)
        problem = (
            f'.kind: Unsupported value: "{ref.get("kind", "")}": supported values: {supported}'
        )
    elif old is not None and old.get("roleRef") != ref:
        problem = ": Invalid value: cannot change roleRef; delete the binding and create it anew"
    if problem is not None:
        raise KubeError(422, "Invalid", prefix + problem, {"name": binding["metadata"]["name"]})


def binds(binding: Obj, namespace: str, user: str) -> bool:
    """Whether a (Cluster)RoleBinding's subjects include ServiceAccount user `user`; a
    RoleBinding's ServiceAccount subjects default to the binding's `namespace`."""
    _, _, sa_ns, sa_name = user.split(":", 3)
    groups = {"system:authenticated", "system:serviceaccounts", f"system:serviceaccounts:{sa_ns}"}
    for subject in binding.get("subjects") or ():
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "ServiceAccount":
            if name == sa_name and (subject.get("namespace") or namespace) == sa_ns:
                return True
        elif (kind == "User" and name == user) or (kind == "Group" and name in groups):
            return True
    return False


@attrs.frozen
class Want:
    """One request as RBAC rules see it; `resource` carries the subresource (`pods/log`)."""

    verb: str
    group: str
    resource: str
    name: str

    def allowed_by(self, rule: Mapping[str, Any]) -> bool:
        verbs = rule.get("verbs") or ()
        groups = rule.get("apiGroups") or ()
        names = rule.get("resourceNames") or ()
        if not ("*" in verbs or self.verb in verbs) or not ("*" in groups or self.group in groups):
            return False
        if names and self.name not in names:
            return False
        sub = self.resource.partition("/")[2]
        # As the real authorizer: "*" is every resource and subresource, "*/log" one
        # subresource of every resource; "pods/*" is no wildcard.
        return any(
            r in ("*", self.resource) or (bool(sub) and r == f"*/{sub}")
            for r in rule.get("resources") or ()
        )


def forbidden(user: str, verb: str, res: Resource, ns: str, name: str, sub: str) -> KubeError:
    resource = f"{res.plural}/{sub}" if sub else res.plural
    what = f'{res.qualified} "{name}"' if name else res.qualified
    where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
    details = {"name": name, "group": res.group, "kind": res.plural}
    return KubeError(
        403,
        "Forbidden",
        f'{what} is forbidden: User "{user}" cannot {verb} resource "{resource}" in API group '
        f'"{res.group}"{where}',
        {k: v for k, v in details.items() if v},
    )


def subject_review(user: str) -> Obj:
    """Answers a SelfSubjectReview (what `kubectl auth whoami` sends)."""
    groups = ["system:authenticated"]
    if user.startswith("system:serviceaccount:"):
        namespace = user.split(":")[2]
        groups[:0] = ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]
    return {
        "kind": "SelfSubjectReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": None},
        "status": {"userInfo": {"username": user, "groups": groups}},
    }
