"""Pod Security Admission as the apiserver enforces it: a pod that breaks its namespace's level
is refused with 403 Forbidden and the plugin's own words; and GKE Autopilot's admission (GKE
Warden), which refuses privileged workloads in every namespace.

Why: levers9's worker pods are privileged (hostNetwork, hostPath volumes, a privileged
container), and many clusters refuse such pods in namespaces labelled
`pod-security.kubernetes.io/enforce: baseline` or `restricted`, or cluster-wide through the
AdmissionConfiguration's `defaults.enforce`. The controlplane must notice and say so; it can be
tested only against a stand-in that refuses as a real one does.

Design choices:
- Pure functions over plain dicts: `namespace_policy` reads the enforce labels (falling back to
  the cluster's default), `violations` runs the checks, `forbidden_message` words the refusal
  as `k8s.io/pod-security-admission` does: `violates PodSecurity "baseline:latest": host
  namespaces (hostNetwork=true), hostPath volumes (volumes "a", "b"), privileged (container "x"
  must not set securityContext.privileged=true)`. The store calls them on a pod's create.
- Only the checks a levers9 worker or an obvious offender hits are modelled: for baseline,
  non-default capabilities, host namespaces, hostPath volumes, host ports and privileged; for
  restricted besides, allowPrivilegeEscalation, unrestricted capabilities, restricted volume
  types, runAsNonRoot and seccompProfile. As there, baseline checks come first, each level's
  in the order of their check IDs, and a restricted check replaces the baseline one it
  overrides (restricted volume types replace hostPath volumes, unrestricted capabilities the
  non-default ones).
- `enforce-version` only names the policy in the message: every version is evaluated as
  `latest`. An enforce level the plugin does not know is evaluated as restricted, the safe side.
  No exemptions, no audit or warn modes.
- Autopilot (`autopilot_refusal`) refuses a pod, or a Job whose pod template, runs privileged,
  in a host namespace or with hostPath volumes, as the validating webhook
  `warden-validating.common-webhooks.networking.gke.io` words it (`[denied by
  autogke-disallow-privilege]` and its siblings); it reads the spec only, never the namespace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from sim.kubeapi.model import KubeError, Obj

__all__ = [
    "ENFORCE_LABEL",
    "ENFORCE_VERSION_LABEL",
    "LEVELS",
    "Policy",
    "autopilot_refusal",
    "forbidden_message",
    "namespace_policy",
    "refusal",
    "violations",
]

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION_LABEL = "pod-security.kubernetes.io/enforce-version"
LEVELS = ("privileged", "baseline", "restricted")
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
"""What baseline lets a container add (the Pod Security Standards' list)."""
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)


@attrs.frozen
class Policy:
    """An enforce level and the version it is pinned to (`latest` or `v1.N`)."""

    level: str = "privileged"
    version: str = "latest"

    def __attrs_post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(
                f"a Pod Security level is one of {', '.join(LEVELS)}, not {self.level!r}"
            )

    def __str__(self) -> str:
        return f"{self.level}:{self.version}"


def namespace_policy(namespace: Mapping[str, Any] | None, default: Policy) -> Policy:
    """The enforce policy for pods in `namespace` (the Namespace object; None when it is not
    known): its labels, else the cluster's `default`. An unknown level is restricted."""
    labels = ((namespace or {}).get("metadata") or {}).get("labels") or {}
    level = labels.get(ENFORCE_LABEL)
    version = labels.get(ENFORCE_VERSION_LABEL)
    if level is None:
        return default if version is None else attrs.evolve(default, version=str(version))
    level = str(level)
    return Policy(level if level in LEVELS else "restricted", str(version or "latest"))


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every container of a pod spec, in the order the plugin visits them."""
    for field in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(field) or ()


def _context(container: Mapping[str, Any]) -> Mapping[str, Any]:
    return container.get("securityContext") or {}


def _plural(one: str, many: str, count: int) -> str:
    return one if count == 1 else many


def _quoted(items: Sequence[str]) -> str:
    return ", ".join(f'"{item}"' for item in items)


def _names(containers: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(c.get("name", "")) for c in containers]


# Each check: (pod spec) -> (forbidden reason, detail) or None.


def _capabilities_baseline(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    bad: list[str] = []
    caps: set[str] = set()
    for container in _containers(spec):
        added = (_context(container).get("capabilities") or {}).get("add") or ()
        extra = {str(c) for c in added if str(c) not in BASELINE_CAPABILITIES}
        if extra:
            bad.append(str(container.get("name", "")))
            caps |= extra
    if not bad:
        return None
    return (
        "non-default capabilities",
        f"{_plural('container', 'containers', len(bad))} {_quoted(bad)} must not include "
        f"{_quoted(sorted(caps))} in securityContext.capabilities.add",
    )


def _host_namespaces(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    used = [f"{field}=true" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    return ("host namespaces", ", ".join(used)) if used else None


def _host_path_volumes(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    bad = [str(v.get("name", "")) for v in spec.get("volumes") or () if v.get("hostPath")]
    if not bad:
        return None
    return "hostPath volumes", f"{_plural('volume', 'volumes', len(bad))} {_quoted(bad)}"


def _host_ports(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    bad: list[str] = []
    ports: list[str] = []
    for container in _containers(spec):
        used = [str(p["hostPort"]) for p in container.get("ports") or () if p.get("hostPort")]
        if used:
            bad.append(str(container.get("name", "")))
            ports += used
    if not bad:
        return None
    return (
        "hostPort",
        f"{_plural('container', 'containers', len(bad))} {_quoted(bad)} "
        f"{_plural('uses', 'use', len(bad))} {_plural('hostPort', 'hostPorts', len(ports))} "
        f"{', '.join(ports)}",
    )


def _privileged(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    bad = _names([c for c in _containers(spec) if _context(c).get("privileged") is True])
    if not bad:
        return None
    return (
        "privileged",
        f"{_plural('container', 'containers', len(bad))} {_quoted(bad)} must not set "
        "securityContext.privileged=true",
    )


def _allow_privilege_escalation(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    bad = _names(
        [c for c in _containers(spec) if _context(c).get("allowPrivilegeEscalation") is not False]
    )
    if not bad:
        return None
    return (
        "allowPrivilegeEscalation != false",
        f"{_plural('container', 'containers', len(bad))} {_quoted(bad)} must set "
        "securityContext.allowPrivilegeEscalation=false",
    )


def _capabilities_restricted(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    no_drop: list[str] = []
    adding: list[str] = []
    caps: set[str] = set()
    for container in _containers(spec):
        name = str(container.get("name", ""))
        capabilities = _context(container).get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or ()):
            no_drop.append(name)
        extra = {str(c) for c in capabilities.get("add") or () if c != "NET_BIND_SERVICE"}
        if extra:
            adding.append(name)
            caps |= extra
    details = []
    if no_drop:
        details.append(
            f"{_plural('container', 'containers', len(no_drop))} {_quoted(no_drop)} must set "
            'securityContext.capabilities.drop=["ALL"]'
        )
    if adding:
        details.append(
            f"{_plural('container', 'containers', len(adding))} {_quoted(adding)} must not "
            f"include {_quoted(sorted(caps))} in securityContext.capabilities.add"
        )
    return ("unrestricted capabilities", "; ".join(details)) if details else None


def _restricted_volumes(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    bad: list[str] = []
    kinds: set[str] = set()
    for volume in spec.get("volumes") or ():
        used = {k for k in volume if k != "name" and k not in RESTRICTED_VOLUME_TYPES}
        if used:
            bad.append(str(volume.get("name", "")))
            kinds |= used
    if not bad:
        return None
    return (
        "restricted volume types",
        f"{_plural('volume', 'volumes', len(bad))} {_quoted(bad)} "
        f"{_plural('uses', 'use', len(bad))} "
        f"{_plural('restricted volume type', 'restricted volume types', len(kinds))} "
        f"{_quoted(sorted(kinds))}",
    )


def _run_as_non_root(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    pod = (spec.get("securityContext") or {}).get("runAsNonRoot")
    details = []
    if pod is False:
        details.append("pod must not set securityContext.runAsNonRoot=false")
    containers = list(_containers(spec))
    explicit = _names([c for c in containers if _context(c).get("runAsNonRoot") is False])
    if explicit:
        details.append(
            f"{_plural('container', 'containers', len(explicit))} {_quoted(explicit)} must not "
            "set securityContext.runAsNonRoot=false"
        )
    if pod is not True:
        implicit = _names([c for c in containers if _context(c).get("runAsNonRoot") is None])
        if implicit:
            details.append(
                f"pod or {_plural('container', 'containers', len(implicit))} "
                f"{_quoted(implicit)} must set securityContext.runAsNonRoot=true"
            )
    return ("runAsNonRoot != true", "; ".join(details)) if details else None


def _seccomp_restricted(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    allowed = ("RuntimeDefault", "Localhost")
    pod = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    details = []
    if pod is not None and pod not in allowed:
        details.append(f'pod must not set securityContext.seccompProfile.type to "{pod}"')
    containers = list(_containers(spec))
    types = {
        str(c.get("name", "")): (_context(c).get("seccompProfile") or {}).get("type")
        for c in containers
    }
    explicit = [name for name, t in types.items() if t is not None and t not in allowed]
    if explicit:
        bad_types = sorted({str(types[name]) for name in explicit})
        details.append(
            f"{_plural('container', 'containers', len(explicit))} {_quoted(explicit)} must not "
            f"set securityContext.seccompProfile.type to {_quoted(bad_types)}"
        )
    if pod is None:
        implicit = [name for name, t in types.items() if t is None]
        if implicit:
            details.append(
                f"pod or {_plural('container', 'containers', len(implicit))} "
                f"{_quoted(implicit)} must set securityContext.seccompProfile.type to "
                '"RuntimeDefault" or "Localhost"'
            )
    return ("seccompProfile", "; ".join(details)) if details else None


_BASELINE = (
    ("capabilities_baseline", _capabilities_baseline),
    ("hostNamespaces", _host_namespaces),
    ("hostPathVolumes", _host_path_volumes),
    ("hostPorts", _host_ports),
    ("privileged", _privileged),
)
_RESTRICTED = (
    ("allowPrivilegeEscalation", _allow_privilege_escalation),
    ("capabilities_restricted", _capabilities_restricted),
    ("restrictedVolumes", _restricted_volumes),
    ("runAsNonRoot", _run_as_non_root),
    ("seccompProfile_restricted", _seccomp_restricted),
)
_OVERRIDES = {
    "hostPathVolumes": "restrictedVolumes",
    "capabilities_baseline": "capabilities_restricted",
}
"""Baseline checks a restricted one replaces at the restricted level."""


def violations(level: str, pod_spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What `pod_spec` breaks at `level`: (forbidden reason, detail) in the plugin's order;
    [] when it is allowed (always at privileged)."""
    if level == "privileged":
        return []
    checks = [c for c in _BASELINE if level == "baseline" or c[0] not in _OVERRIDES]
    if level != "baseline":
        checks += _RESTRICTED
    found = []
    for _, check in checks:
        result = check(pod_spec)
        if result is not None:
            found.append(result)
    return found


def forbidden_message(policy: Policy, found: Sequence[tuple[str, str]]) -> str:
    """The plugin's error: `violates PodSecurity "baseline:latest": reason (detail), ...`."""
    parts = ", ".join(f"{reason} ({detail})" if detail else reason for reason, detail in found)
    return f'violates PodSecurity "{policy}": {parts}'


def refusal(policy: Policy, pod: Obj) -> KubeError | None:
    """The 403 the apiserver answers a create of `pod` (named already) under `policy`, or
    None when it is admitted."""
    found = violations(policy.level, pod.get("spec") or {})
    if not found:
        return None
    name = str((pod.get("metadata") or {}).get("name", ""))
    return KubeError(
        403,
        "Forbidden",
        f'pods "{name}" is forbidden: {forbidden_message(policy, found)}',
        {"name": name, "kind": "pods"},
    )


WARDEN = "warden-validating.common-webhooks.networking.gke.io"
"""The validating webhook through which GKE Autopilot refuses privileged workloads."""


def autopilot_violations(pod_spec: Mapping[str, Any]) -> dict[str, list[str]]:
    """What GKE Warden holds against a pod spec in an Autopilot cluster: constraint -> the
    reasons, in its words; {} when it is admitted."""
    found: dict[str, list[str]] = {}
    used = [field for field in ("hostNetwork", "hostPID", "hostIPC") if pod_spec.get(field)]
    if used:
        found["autogke-disallow-hostnamespaces"] = [
            f"enabling {field} is not allowed in Autopilot." for field in used
        ]
    privileged = [
        f"container {c.get('name', '')} is privileged; not allowed in Autopilot"
        for c in _containers(pod_spec)
        if _context(c).get("privileged") is True
    ]
    if privileged:
        found["autogke-disallow-privilege"] = privileged
    host_paths = {
        str(v.get("name", "")) for v in pod_spec.get("volumes") or () if v.get("hostPath")
    }
    written = [
        f"hostPath volume {m.get('name', '')} in container {c.get('name', '')} is accessed in "
        "write mode; disallowed in Autopilot."
        for c in _containers(pod_spec)
        for m in c.get("volumeMounts") or ()
        if m.get("name") in host_paths and not m.get("readOnly")
    ]
    if written:
        found["autogke-no-write-mode-hostpath"] = written
    return found


def autopilot_refusal(plural: str, obj: Obj) -> KubeError | None:
    """What an Autopilot cluster answers a create of a pod or Job (`plural` "pods" or "jobs")
    it refuses, or None (any other resource, or an admitted one)."""
    if plural == "pods":
        spec = obj.get("spec") or {}
    elif plural == "jobs":
        spec = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    else:
        return None
    found = autopilot_violations(spec)
    if not found:
        return None
    details = json.dumps(
        {f"[denied by {name}]": reasons for name, reasons in found.items()},
        separators=(",", ":"),
    )
    return KubeError(
        403,
        "|".join(f"[denied by {name}]" for name in found),
        f'admission webhook "{WARDEN}" denied the request: GKE Warden rejected the request '
        f"because it violates one or more constraints.\nViolations details: {details}",
    )
