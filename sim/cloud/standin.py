"""One fake cloud behind stand-in `gcloud`, `kubectl`, `aws` and `skopeo` executables.

deploy/attach-gke-pool.sh promises things about the commands it runs: each resource is created
once and updated after, nothing is removed, and the service-account key never appears in an
argv or a log. Those promises can only be checked by watching the commands, so the tests put
these stand-ins first on PATH. They model the real CLIs' subcommands, flags, JSON shapes
(camelCase for gcloud, PascalCase for AWS), exit codes and error text closely enough that a
script which passes here runs unchanged against the real tools, and they refuse, loudly and
with a "cloud stand-in:" line, every subcommand or flag they do not model instead of guessing.

They also model what docs/gke.md's recipe runs before the script: `aws ecr create-repository`
and `make images`' push (a `skopeo copy` from buildah's `containers-storage:` to ECR, refused
for a repository not created). A service-account key names the fake cloud's token endpoint
(`gcp.tokenUri`, served by sim.cloud.oauth) when there is one, and its public half stays in the
state, as Google keeps it, so that endpoint can check what the key signed.

All four share one JSON state file (`state.json`: a GCP project, an AWS account with ECR and
EKS, the EKS cluster's nodes, the images buildah left in local storage as `containersStorage`)
in the directory named by `$CLOUD_STANDIN_STATE`, and append each call's argv, whether stdin
was read (never what it held) and the exit status to `calls.jsonl` beside it. A lock file
serialises calls: `aws ecr get-login-password | skopeo login --password-stdin` runs both at
once, so stdin is read before the lock is taken.

The executables are bash wrappers that run this file with `$CLOUD_STANDIN_PYTHON` (a Python
with `cryptography`, which makes the service-account keys' real PEM private keys).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

STATE_ENV = "CLOUD_STANDIN_STATE"
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
STATE_FILE = "state.json"
CALLS_FILE = "calls.jsonl"
_LOCK_FILE = "lock"

VALUE = "value"  # --flag VALUE or --flag=VALUE
FLAG = "flag"  # --flag
MULTI = "multi"  # --flag V1 V2 ... (AWS list arguments)

State = dict[str, Any]


# --- helpers the tests use ---------------------------------------------------------------


def write_state(state_dir: Path, state: Mapping[str, Any]) -> None:
    """Write the fake cloud's state (the tests set up and change the world with this)."""
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_dir / STATE_FILE)


def read_state(state_dir: Path) -> State:
    """The fake cloud's state as the stand-ins left it."""
    loaded: State = json.loads((state_dir / STATE_FILE).read_text())
    return loaded


def set_autopilot(state_dir: Path, location: str, name: str, enabled: bool = True) -> None:
    """Make GKE cluster `location/name` an Autopilot one (`autopilot.enabled`, as `gcloud
    container clusters create-auto` makes it), or a Standard one again."""
    state = read_state(state_dir)
    cluster = state["gcp"]["clusters"][f"{location}/{name}"]
    cluster["autopilot"] = {"enabled": True} if enabled else {}
    write_state(state_dir, state)


def read_calls(state_dir: Path) -> list[dict[str, Any]]:
    """Every call so far: `{"tool", "argv", "stdin", "exit"}`, oldest first."""
    path = state_dir / CALLS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# --- argument parsing ----------------------------------------------------------------------


class CliError(Exception):
    """A failed call: the text the real tool prints on stderr, and its exit status."""

    def __init__(self, stderr: str, code: int) -> None:
        super().__init__(stderr)
        self.stderr = stderr if stderr.endswith("\n") else stderr + "\n"
        self.code = code


class Parsed(NamedTuple):
    positionals: list[str]
    flags: dict[str, list[str]]

    def value(self, name: str, default: str | None = None) -> str | None:
        values = self.flags.get(name)
        return values[-1] if values else default

    def has(self, name: str) -> bool:
        return name in self.flags


class Usage(Exception):
    """Arguments the real tool would reject before doing anything."""


def parse(argv: Sequence[str], spec: Mapping[str, str]) -> Parsed:
    positionals: list[str] = []
    flags: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("-") and token != "-":
            name, eq, inline = token.partition("=")
            kind = spec.get(name)
            if kind is None:
                raise Usage(f"unrecognized arguments: {token}")
            if kind == FLAG:
                if eq:
                    raise Usage(f"argument {name}: ignored explicit argument '{inline}'")
                flags[name] = []
            elif kind == VALUE:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise Usage(f"argument {name}: expected one argument")
                    inline = argv[i]
                flags[name] = [inline]
            else:
                values = [inline] if eq else []
                while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    i += 1
                    values.append(argv[i])
                if not values:
                    raise Usage(f"argument {name}: expected at least one argument")
                flags.setdefault(name, []).extend(values)
        else:
            positionals.append(token)
        i += 1
    return Parsed(positionals, flags)


class Out(NamedTuple):
    stdout: str = ""
    stderr: str = ""


Handler = Callable[[State, Sequence[str], str], Out]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _digits(n: int) -> str:
    return "".join(str(secrets.randbelow(10)) for _ in range(n))


# --- gcloud --------------------------------------------------------------------------------

_GCLOUD_GLOBAL = {"--project": VALUE, "--format": VALUE, "--quiet": FLAG, "-q": FLAG}


class _Gcloud:
    """gcloud's commands as the script uses them; `path` is e.g. `iam.service-accounts.create`."""

    def __init__(self, path: tuple[str, ...], state: State, args: Parsed) -> None:
        self.path = path
        self.state = state
        self.args = args
        self.gcp: State = state["gcp"]

    def error(self, message: str, code: int = 1) -> CliError:
        return CliError(f"ERROR: (gcloud.{'.'.join(self.path)}) {message}", code)

    @property
    def project(self) -> str:
        project = self.args.value("--project", self.gcp["project"])
        assert project is not None
        if project != self.gcp["project"]:
            raise self.error(
                f"PERMISSION_DENIED: Permission denied on resource project {project}. "
                "This command is authenticated as operator@example.com"
            )
        return project

    def check_project(self) -> None:
        _ = self.project

    def one_positional(self, what: str) -> str:
        if len(self.args.positionals) != 1:
            raise self.error(f"argument {what}: Must be specified.", 2)
        return self.args.positionals[0]

    def render(self, resource: Any) -> str:
        fmt = self.args.value("--format")
        if fmt == "json":
            return json.dumps(resource, indent=2) + "\n"
        if fmt == "none":
            return ""
        if fmt is None:
            # Real gcloud prints YAML here; a script that parses this is asking for trouble.
            if isinstance(resource, Mapping):
                return "".join(f"{key}: {json.dumps(v)}\n" for key, v in resource.items())
            return "".join(f"- {json.dumps(item)}\n" for item in resource)
        raise CliError(f"cloud stand-in: gcloud --format={fmt} is not modelled", 2)

    # iam service-accounts

    def sa_resource(self, email: str) -> dict[str, Any]:
        sa = self.gcp["serviceAccounts"][email]
        return {
            "email": email,
            "name": f"projects/{self.project}/serviceAccounts/{email}",
            "projectId": self.project,
            "uniqueId": sa["uniqueId"],
            "oauth2ClientId": sa["uniqueId"],
            "displayName": sa["displayName"],
            "etag": "MDEwMjE5MjA=",
        }

    def require_sa(self, email: str) -> dict[str, Any]:
        sa = self.gcp["serviceAccounts"].get(email)
        if sa is None:
            raise self.error(f"NOT_FOUND: Unknown service account [{email}].")
        found: dict[str, Any] = sa
        return found

    def sa_describe(self) -> Out:
        email = self.one_positional("SERVICE_ACCOUNT")
        self.check_project()
        self.require_sa(email)
        return Out(self.render(self.sa_resource(email)))

    def sa_create(self) -> Out:
        name = self.one_positional("NAME")
        if not re.fullmatch(r"[a-z][a-z0-9-]{4,28}[a-z0-9]", name):
            raise self.error(
                "INVALID_ARGUMENT: Account ID must be between 6 and 30 characters, start with "
                "a lower case letter and contain only lower case letters, digits and dashes."
            )
        email = f"{name}@{self.project}.iam.gserviceaccount.com"
        if email in self.gcp["serviceAccounts"]:
            raise self.error(
                f"Resource in projects [{self.project}] is the subject of a conflict: Service "
                f"account {name} already exists within project projects/{self.project}."
            )
        self.gcp["serviceAccounts"][email] = {
            "displayName": self.args.value("--display-name", ""),
            "uniqueId": _digits(21),
            "keys": [],
        }
        return Out(self.render(self.sa_resource(email)), f"Created service account [{name}].")

    def key_resource(self, email: str, key: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "keyAlgorithm": "KEY_ALG_RSA_2048",
            "keyOrigin": "GOOGLE_PROVIDED",
            "keyType": key.get("keyType", "USER_MANAGED"),
            "name": f"projects/{self.project}/serviceAccounts/{email}/keys/{key['id']}",
            "validAfterTime": key["validAfterTime"],
            "validBeforeTime": "9999-12-31T23:59:59Z",
        }

    def keys_list(self) -> Out:
        email = self.args.value("--iam-account")
        if email is None:
            raise self.error("argument --iam-account: Must be specified.", 2)
        keys = list(self.require_sa(email)["keys"])
        managed_by = self.args.value("--managed-by", "any")
        if managed_by not in ("user", "system", "any"):
            raise self.error(f"argument --managed-by: Invalid choice: '{managed_by}'.", 2)
        system = {"id": "0" * 40, "validAfterTime": "2024-01-01T00:00:00Z"}
        system["keyType"] = "SYSTEM_MANAGED"
        if managed_by == "system":
            keys = [system]
        elif managed_by == "any":
            keys.append(system)
        return Out(self.render([self.key_resource(email, key) for key in keys]))

    def keys_create(self) -> Out:
        target = self.one_positional("OUTPUT-FILE")
        email = self.args.value("--iam-account")
        if email is None:
            raise self.error("argument --iam-account: Must be specified.", 2)
        if self.args.value("--key-file-type", "json") != "json":
            raise CliError("cloud stand-in: only --key-file-type=json is modelled", 2)
        if target == "-":
            raise CliError("cloud stand-in: writing the key to stdout is not modelled", 2)
        sa = self.require_sa(email)
        if len(sa["keys"]) >= 10:
            raise self.error(
                "FAILED_PRECONDITION: Precondition check failed. (a service account holds at "
                "most 10 user-managed keys)"
            )
        key_id = secrets.token_hex(20)
        private_pem, public_pem = _new_key_pair_pem()
        info = {
            "type": "service_account",
            "project_id": self.project,
            "private_key_id": key_id,
            "private_key": private_pem,
            "client_email": email,
            "client_id": sa["uniqueId"],
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            # Google's, unless the fake cloud runs its own token endpoint (sim.cloud.oauth).
            "token_uri": self.gcp.get("tokenUri", GOOGLE_TOKEN_URI),
            "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
            "client_x509_cert_url": "https://www.googleapis.com/robot/v1/metadata/x509/"
            + email.replace("@", "%40"),
            "universe_domain": "googleapis.com",
        }
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise self.error(f"Unable to write file [{target}]: {exc}") from None
        with os.fdopen(fd, "w") as out:
            json.dump(info, out, indent=2)
        # Google keeps the public half only (it checks the key's signatures with it); the
        # private key lives in that file alone.
        sa["keys"].append({"id": key_id, "validAfterTime": _now(), "publicKey": public_pem})
        return Out(stderr=f"created key [{key_id}] of type [json] as [{target}] for [{email}]")

    # projects

    def policy(self) -> dict[str, Any]:
        bindings = [
            {"members": sorted(members), "role": role}
            for role, members in sorted(self.gcp["iamBindings"].items())
        ]
        return {"bindings": bindings, "etag": "BwYmZr7JdE4=", "version": 1}

    def get_iam_policy(self) -> Out:
        if self.one_positional("PROJECT_ID") != self.project:
            raise self.error("PERMISSION_DENIED: The caller does not have permission")
        return Out(self.render(self.policy()))

    def add_iam_policy_binding(self) -> Out:
        if self.one_positional("PROJECT_ID") != self.project:
            raise self.error("PERMISSION_DENIED: The caller does not have permission")
        member = self.args.value("--member")
        role = self.args.value("--role")
        if member is None or role is None:
            raise self.error("argument --member --role: Must be specified.", 2)
        condition = self.args.value("--condition")
        if condition not in (None, "None"):
            raise CliError("cloud stand-in: IAM conditions are not modelled", 2)
        kind, _, who = member.partition(":")
        if kind == "serviceAccount" and who not in self.gcp["serviceAccounts"]:
            raise self.error(f"INVALID_ARGUMENT: Service account {who} does not exist.")
        members = self.gcp["iamBindings"].setdefault(role, [])
        if member not in members:
            members.append(member)
        return Out(self.render(self.policy()), f"Updated IAM policy for project [{self.project}].")

    # artifacts

    def location(self, flag: str = "--location") -> str:
        location = self.args.value(flag)
        if location is None:
            raise self.error(f"argument {flag}: Must be specified.", 2)
        return location

    def repo_describe(self) -> Out:
        name = self.one_positional("REPOSITORY")
        location = self.location()
        repo = self.gcp["repositories"].get(f"{location}/{name}")
        if repo is None or not repo["name"].startswith(f"projects/{self.project}/"):
            raise self.error("NOT_FOUND: Requested entity was not found.")
        return Out(self.render(repo))

    def repo_create(self) -> Out:
        name = self.one_positional("REPOSITORY")
        location = self.location()
        if self.args.value("--repository-format") != "docker":
            raise CliError("cloud stand-in: only --repository-format=docker is modelled", 2)
        key = f"{location}/{name}"
        if key in self.gcp["repositories"]:
            raise self.error(f"ALREADY_EXISTS: the repository already exists: {name}")
        now = _now()
        self.gcp["repositories"][key] = {
            "createTime": now,
            "description": self.args.value("--description", ""),
            "format": "DOCKER",
            "mode": "STANDARD_REPOSITORY",
            "name": f"projects/{self.project}/locations/{location}/repositories/{name}",
            "updateTime": now,
        }
        return Out(stderr=f"Create request issued for: [{name}]\nCreated repository [{name}].")

    # auth

    def print_access_token(self) -> Out:
        if self.args.positionals:
            raise CliError("cloud stand-in: print-access-token for another account", 2)
        return Out(self.gcp["accessToken"] + "\n")

    # container

    def cluster_key(self) -> tuple[str, str]:
        name = self.one_positional("NAME")
        given = [f for f in ("--region", "--zone", "--location") if self.args.has(f)]
        if len(given) != 1:
            raise self.error("One of [--location, --region, --zone] must be supplied.", 2)
        location = self.location(given[0])
        key = f"{location}/{name}"
        self.check_project()
        if key not in self.gcp["clusters"]:
            raise self.error(
                f"ResponseError: code=404, message=Not found: projects/{self.project}/"
                f"locations/{location}/clusters/{name}.\nNo cluster named '{name}' in "
                f"{self.project}."
            )
        return key, name

    def cluster_describe(self) -> Out:
        key, _ = self.cluster_key()
        # The API says `autopilot: {}` of a Standard cluster, `{"enabled": true}` of the other.
        return Out(self.render({"autopilot": {}, **self.gcp["clusters"][key]}))

    def cluster_update(self) -> Out:
        key, name = self.cluster_key()
        cluster = self.gcp["clusters"][key]
        networks = self.args.value("--master-authorized-networks")
        if not self.args.has("--enable-master-authorized-networks"):
            raise CliError("cloud stand-in: only authorized-network updates are modelled", 2)
        if networks is None:
            raise CliError("cloud stand-in: enabling without a list is not modelled", 2)
        blocks = [cidr for cidr in networks.split(",") if cidr]
        for cidr in blocks:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError:
                raise self.error(
                    "argument --master-authorized-networks: Must be specified in CIDR notation.",
                    2,
                ) from None
        if len(blocks) > 50:
            raise self.error(
                f"ResponseError: code=400, message=Too many authorized networks: {len(blocks)} "
                "(at most 50)."
            )
        # Real gcloud sends only the CIDRs: display names are lost on update.
        cluster["masterAuthorizedNetworksConfig"] = {
            "enabled": True,
            "cidrBlocks": [{"cidrBlock": cidr} for cidr in blocks],
        }
        location = key.split("/")[0]
        return Out(
            stderr=f"Updating {name}...done.\nUpdated [https://container.googleapis.com/v1/"
            f"projects/{self.project}/zones/{location}/clusters/{name}]."
        )

    # compute

    def fetch_error(self, what: str, problem: str) -> CliError:
        return self.error(
            f"Could not fetch resource:\n - The resource 'projects/{self.project}/global/"
            f"{what}' {problem}"
        )

    def firewall_name(self) -> str:
        name = self.one_positional("NAME")
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
            raise self.error(
                f"Could not fetch resource:\n - Invalid value for field 'resource.name': "
                f"'{name}'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{{0,61}}[a-z0-9])?)'"
            )
        return name

    def firewall_describe(self) -> Out:
        name = self.firewall_name()
        rule = self.gcp["firewalls"].get(name)
        if rule is None:
            raise self.fetch_error(f"firewalls/{name}", "was not found")
        return Out(self.render(rule))

    def ranges(self, flag: str) -> list[str]:
        raw = self.args.value(flag, "")
        assert raw is not None
        out = [cidr for cidr in raw.split(",") if cidr]
        for cidr in out:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise self.error(f"argument {flag}: Bad value [{cidr}].", 2) from None
        return out

    def firewall_create(self) -> Out:
        name = self.firewall_name()
        if name in self.gcp["firewalls"]:
            raise self.fetch_error(f"firewalls/{name}", "already exists")
        network = self.args.value("--network", "default")
        assert network is not None
        if network not in self.gcp["networks"]:
            raise self.fetch_error(f"networks/{network}", "was not found")
        direction = self.args.value("--direction", "INGRESS")
        if direction not in ("INGRESS", "IN"):
            raise CliError("cloud stand-in: only ingress rules are modelled", 2)
        allow = self.args.value("--allow")
        if allow is None:
            raise self.error("Exactly one of (--action | --allow) must be specified.", 2)
        allowed: list[dict[str, Any]] = []
        for entry in allow.split(","):
            protocol, _, port = entry.partition(":")
            item: dict[str, Any] = {"IPProtocol": protocol}
            if port:
                item["ports"] = [port]
            allowed.append(item)
        sources = self.ranges("--source-ranges")
        if not sources:
            sources = ["0.0.0.0/0"]  # what real gcloud does without --source-ranges
        compute = f"https://www.googleapis.com/compute/v1/projects/{self.project}/global"
        rule: dict[str, Any] = {
            "allowed": allowed,
            "creationTimestamp": _now(),
            "description": self.args.value("--description", ""),
            "direction": "INGRESS",
            "disabled": False,
            "id": _digits(19),
            "kind": "compute#firewall",
            "logConfig": {"enable": False},
            "name": name,
            "network": f"{compute}/networks/{network}",
            "priority": int(self.args.value("--priority", "1000") or "1000"),
            "selfLink": f"{compute}/firewalls/{name}",
            "sourceRanges": sources,
        }
        tags = [tag for tag in (self.args.value("--target-tags") or "").split(",") if tag]
        if tags:
            rule["targetTags"] = tags
        self.gcp["firewalls"][name] = rule
        table = (
            "NAME  NETWORK  DIRECTION  PRIORITY  ALLOW  DENY  DISABLED\n"
            f"{name}  {network}  INGRESS  {rule['priority']}  {allow}    False\n"
        )
        return Out(table, f"Creating firewall...\nCreated [{rule['selfLink']}].\ndone.")

    def firewall_update(self) -> Out:
        name = self.firewall_name()
        rule = self.gcp["firewalls"].get(name)
        if rule is None:
            raise self.fetch_error(f"firewalls/{name}", "was not found")
        if not self.args.has("--source-ranges"):
            raise CliError("cloud stand-in: only --source-ranges updates are modelled", 2)
        rule["sourceRanges"] = self.ranges("--source-ranges")
        return Out(stderr=f"Updating firewall...\nUpdated [{rule['selfLink']}].\ndone.")


_GCLOUD_COMMANDS: dict[tuple[str, ...], tuple[dict[str, str], Callable[[_Gcloud], Out]]] = {
    ("iam", "service-accounts", "describe"): ({}, _Gcloud.sa_describe),
    ("iam", "service-accounts", "create"): (
        {"--display-name": VALUE, "--description": VALUE},
        _Gcloud.sa_create,
    ),
    ("iam", "service-accounts", "keys", "list"): (
        {"--iam-account": VALUE, "--managed-by": VALUE},
        _Gcloud.keys_list,
    ),
    ("iam", "service-accounts", "keys", "create"): (
        {"--iam-account": VALUE, "--key-file-type": VALUE},
        _Gcloud.keys_create,
    ),
    ("projects", "get-iam-policy"): ({}, _Gcloud.get_iam_policy),
    ("projects", "add-iam-policy-binding"): (
        {"--member": VALUE, "--role": VALUE, "--condition": VALUE},
        _Gcloud.add_iam_policy_binding,
    ),
    ("artifacts", "repositories", "describe"): ({"--location": VALUE}, _Gcloud.repo_describe),
    ("artifacts", "repositories", "create"): (
        {
            "--location": VALUE,
            "--repository-format": VALUE,
            "--description": VALUE,
            "--async": FLAG,
        },
        _Gcloud.repo_create,
    ),
    ("auth", "print-access-token"): ({}, _Gcloud.print_access_token),
    ("container", "clusters", "describe"): (
        {"--region": VALUE, "--zone": VALUE, "--location": VALUE},
        _Gcloud.cluster_describe,
    ),
    ("container", "clusters", "update"): (
        {
            "--region": VALUE,
            "--zone": VALUE,
            "--location": VALUE,
            "--enable-master-authorized-networks": FLAG,
            "--master-authorized-networks": VALUE,
        },
        _Gcloud.cluster_update,
    ),
    ("compute", "firewall-rules", "describe"): ({}, _Gcloud.firewall_describe),
    ("compute", "firewall-rules", "create"): (
        {
            "--network": VALUE,
            "--direction": VALUE,
            "--allow": VALUE,
            "--source-ranges": VALUE,
            "--target-tags": VALUE,
            "--description": VALUE,
            "--priority": VALUE,
        },
        _Gcloud.firewall_create,
    ),
    ("compute", "firewall-rules", "update"): (
        {"--source-ranges": VALUE},
        _Gcloud.firewall_update,
    ),
}


def gcloud(state: State, argv: Sequence[str], stdin: str) -> Out:
    words = []
    for token in argv:
        if token.startswith("-"):
            break
        words.append(token)
    for length in range(len(words), 0, -1):
        path = tuple(words[:length])
        if path in _GCLOUD_COMMANDS:
            break
    else:
        raise CliError(
            f"ERROR: (gcloud) Invalid choice: '{' '.join(words)}'.\n"
            "cloud stand-in: this gcloud command is not modelled",
            2,
        )
    spec, method = _GCLOUD_COMMANDS[path]
    rest = list(argv)
    for word in path:
        rest.remove(word)
    try:
        args = parse(rest, {**_GCLOUD_GLOBAL, **spec})
    except Usage as exc:
        raise CliError(f"ERROR: (gcloud.{'.'.join(path)}) {exc}", 2) from None
    return method(_Gcloud(path, state, args))


def _new_key_pair_pem() -> tuple[str, str]:
    """A service-account key: its private half (PKCS#8 PEM) and its public half (SPKI PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private, public


# --- kubectl -------------------------------------------------------------------------------


def kubectl(state: State, argv: Sequence[str], stdin: str) -> Out:
    kube = state["kube"]
    try:
        args = parse(
            argv,
            {"--context": VALUE, "-o": VALUE, "--output": VALUE, "--request-timeout": VALUE},
        )
    except Usage as exc:
        raise CliError(f"error: {exc}", 1) from None
    if args.positionals != ["get", "nodes"]:
        raise CliError(f"cloud stand-in: kubectl {' '.join(args.positionals)} is not modelled", 2)
    context = args.value("--context", kube.get("currentContext"))
    if context not in kube["contexts"]:
        raise CliError(f'error: context "{context}" does not exist', 1)
    nodes = kube["contexts"][context]["nodes"]
    output = args.value("-o", args.value("--output"))
    if output == "json":
        listing = {"apiVersion": "v1", "items": nodes, "kind": "List", "metadata": {}}
        return Out(json.dumps(listing, indent=4) + "\n")
    if output is not None:
        raise CliError(f"cloud stand-in: kubectl -o {output} is not modelled", 2)
    rows = "".join(f"{n['metadata']['name']}   Ready    <none>   3d   v1.30.4\n" for n in nodes)
    return Out("NAME   STATUS   ROLES    AGE   VERSION\n" + rows)


# --- aws -----------------------------------------------------------------------------------

_AWS_GLOBAL = {"--region": VALUE, "--output": VALUE, "--no-cli-pager": FLAG}


def _aws_error(code: str, operation: str, message: str) -> CliError:
    return CliError(
        f"\nAn error occurred ({code}) when calling the {operation} operation: {message}", 254
    )


def aws(state: State, argv: Sequence[str], stdin: str) -> Out:
    account = state["aws"]
    commands: dict[tuple[str, str], dict[str, str]] = {
        ("ecr", "get-login-password"): {},
        ("ecr", "create-repository"): {"--repository-name": VALUE},
        ("eks", "describe-cluster"): {"--name": VALUE},
        ("ec2", "describe-nat-gateways"): {"--filter": MULTI, "--nat-gateway-ids": MULTI},
    }
    try:
        args = parse(
            argv, {**_AWS_GLOBAL, **{k: v for s in commands.values() for k, v in s.items()}}
        )
    except Usage as exc:
        raise CliError(f"\naws: error: {exc}\n", 252) from None
    command = tuple(args.positionals)
    if len(command) != 2 or command not in commands:
        raise CliError(
            f"\naws: error: argument operation: Invalid choice: {' '.join(command)}\n"
            "cloud stand-in: this aws command is not modelled",
            252,
        )
    allowed = set(_AWS_GLOBAL) | set(commands[(command[0], command[1])])
    stray = sorted(set(args.flags) - allowed)
    if stray:
        raise CliError(f"\naws: error: Unknown options: {', '.join(stray)}\n", 252)
    region = args.value("--region")
    if region is None:
        raise CliError(
            'You must specify a region. You can also configure your region by running "aws '
            'configure".',
            253,
        )
    if args.value("--output", "json") != "json":
        raise CliError("cloud stand-in: only --output json is modelled", 2)
    if command == ("ecr", "get-login-password"):
        password = account["ecrPasswords"].get(region)
        if password is None:
            raise _aws_error("UnrecognizedClientException", "GetAuthorizationToken", "no ECR")
        return Out(password + "\n")
    if command == ("ecr", "create-repository"):
        return _ecr_create_repository(account, region, args.value("--repository-name"))
    if command == ("eks", "describe-cluster"):
        name = args.value("--name")
        if name is None:
            raise CliError("\naws: error: the following arguments are required: --name\n", 252)
        cluster = account["eksClusters"].get(f"{region}/{name}")
        if cluster is None:
            raise _aws_error(
                "ResourceNotFoundException",
                "DescribeCluster",
                f"No cluster found for name: {name}.",
            )
        return Out(json.dumps({"cluster": cluster}, indent=4) + "\n")
    gateways = list(account["natGateways"].get(region, []))
    names = {"vpc-id": "VpcId", "state": "State", "subnet-id": "SubnetId"}
    for raw in args.flags.get("--filter", []):
        match = re.fullmatch(r"Name=([^,]+),Values=(.+)", raw)
        if match is None:
            raise CliError(
                f"\nError parsing parameter '--filter': Expected: '=', received: '{raw}'\n", 252
            )
        name, values = match.group(1), match.group(2).split(",")
        if name not in names:
            raise _aws_error(
                "InvalidParameterValue",
                "DescribeNatGateways",
                f"The filter '{name}' is invalid",
            )
        gateways = [g for g in gateways if g.get(names[name]) in values]
    return Out(json.dumps({"NatGateways": gateways}, indent=4) + "\n")


_ECR_REPOSITORY = re.compile(r"(?:[a-z0-9]+(?:[._-][a-z0-9]+)*/)*[a-z0-9]+(?:[._-][a-z0-9]+)*")


def _ecr_create_repository(account: State, region: str, name: str | None) -> Out:
    if name is None:
        raise CliError(
            "\naws: error: the following arguments are required: --repository-name\n", 252
        )
    if not _ECR_REPOSITORY.fullmatch(name) or len(name) > 256:
        raise _aws_error(
            "InvalidParameterException",
            "CreateRepository",
            f"Invalid parameter at 'repositoryName' failed to satisfy constraint: '{name}'",
        )
    repositories = account.setdefault("repositories", {})
    if f"{region}/{name}" in repositories:
        raise _aws_error(
            "RepositoryAlreadyExistsException",
            "CreateRepository",
            f"The repository with name '{name}' already exists in the registry with id "
            f"'{account['accountId']}'",
        )
    host = f"{account['accountId']}.dkr.ecr.{region}.amazonaws.com"
    repository = {
        "repositoryArn": f"arn:aws:ecr:{region}:{account['accountId']}:repository/{name}",
        "registryId": account["accountId"],
        "repositoryName": name,
        "repositoryUri": f"{host}/{name}",
        "createdAt": _now(),
        "imageTagMutability": "MUTABLE",
        "imageScanningConfiguration": {"scanOnPush": False},
        "encryptionConfiguration": {"encryptionType": "AES256"},
    }
    repositories[f"{region}/{name}"] = repository
    return Out(json.dumps({"repository": repository}, indent=4) + "\n")


# --- skopeo --------------------------------------------------------------------------------

_ECR_HOST = re.compile(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com")
_AR_HOST = re.compile(r"([a-z0-9-]+)-docker\.pkg\.dev")


def skopeo(state: State, argv: Sequence[str], stdin: str) -> Out:
    if not argv or argv[0] not in ("login", "copy"):
        raise CliError(
            f'Error: unknown command "{argv[0] if argv else ""}" for "skopeo"\n'
            "cloud stand-in: this skopeo command is not modelled",
            125,
        )
    if argv[0] == "login":
        return _skopeo_login(state, argv[1:], stdin)
    return _skopeo_copy(state, argv[1:])


def _authfile_key(args: Parsed) -> str:
    return args.value("--authfile") or "<default auth file>"


def _skopeo_login(state: State, argv: Sequence[str], stdin: str) -> Out:
    try:
        args = parse(
            argv,
            {"--username": VALUE, "-u": VALUE, "--password-stdin": FLAG, "--authfile": VALUE},
        )
    except Usage as exc:
        raise CliError(f"Error: {exc}\ncloud stand-in: pass the password on stdin", 125) from None
    if len(args.positionals) != 1:
        raise CliError("Error: login accepts only one registry to login to", 125)
    host = args.positionals[0]
    username = args.value("--username", args.value("-u"))
    if not args.has("--password-stdin") or username is None:
        raise CliError("cloud stand-in: an interactive login prompt is not modelled", 2)
    password = stdin[:-1] if stdin.endswith("\n") else stdin
    if not password:
        raise CliError("Error: password is required", 125)
    expected: str | None = None
    if match := _ECR_HOST.fullmatch(host):
        if match.group(1) == state["aws"]["accountId"] and username == "AWS":
            expected = state["aws"]["ecrPasswords"].get(match.group(2))
    elif _AR_HOST.fullmatch(host) and username == "oauth2accesstoken":
        expected = state["gcp"]["accessToken"]
    if expected is None or not secrets.compare_digest(password, expected):
        raise CliError(
            f'Error: authenticating creds for "{host}": unauthorized: authentication failed', 1
        )
    key = _authfile_key(args)
    state["skopeo"]["logins"].setdefault(key, {})[host] = username
    authfile = args.value("--authfile")
    if authfile is not None:
        path = Path(authfile)
        auths = json.loads(path.read_text()) if path.exists() else {"auths": {}}
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        auths["auths"][host] = {"auth": token}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(auths, out)
    return Out("Login Succeeded!\n")


def _docker_ref(ref: str) -> tuple[str, str]:
    if not ref.startswith("docker://"):
        raise CliError(f'Invalid image name "{ref}": only the docker:// transport is modelled', 1)
    name = ref.removeprefix("docker://")
    if ":" not in name.rsplit("/", 1)[-1] and "@" not in name:
        name += ":latest"
    return name.split("/", 1)[0], name


_LOCAL_STORAGE = "containers-storage:"


def _fatal(message: str) -> CliError:
    return CliError(f'time="{_now()}" level=fatal msg="{message}"', 1)


def _copy_source(state: State, ref: str, logins: Mapping[str, str]) -> tuple[str, State]:
    """The image a copy reads: one buildah built (`containers-storage:`, what `make images`
    pushes; the state's `containersStorage`) or one in ECR. Its name and record."""
    if ref.startswith(_LOCAL_STORAGE):
        name = ref.removeprefix(_LOCAL_STORAGE)
        local = state.get("containersStorage", {}).get(name)
        if local is None:
            raise _fatal(
                f"initializing source {ref}: reference "
                f'\\"[overlay@/var/lib/containers/storage]{name}\\" does not resolve to an '
                "image ID: identifier is not an image"
            )
        return name, local
    host, src = _docker_ref(ref)
    if host not in logins:
        raise _fatal(
            f"initializing source docker://{src}: reading manifest: no basic auth credentials"
        )
    image = state["aws"]["images"].get(src)
    if image is None:
        raise _fatal(
            f"initializing source docker://{src}: reading manifest: name unknown: The "
            "repository does not exist in the registry"
        )
    found: State = image
    return src, found


def _skopeo_copy(state: State, argv: Sequence[str]) -> Out:
    """ECR to Artifact Registry (attach-gke-pool.sh), or a local build to ECR (`make images`)."""
    try:
        args = parse(
            argv,
            {
                "--all": FLAG,
                "-a": FLAG,
                "--authfile": VALUE,
                "--quiet": FLAG,
                "--dest-tls-verify": VALUE,
            },
        )
    except Usage as exc:
        raise CliError(f"Error: {exc}", 125) from None
    if len(args.positionals) != 2:
        raise CliError("Error: Exactly two arguments expected", 125)
    logins = state["skopeo"]["logins"].get(_authfile_key(args), {})
    src, image = _copy_source(state, args.positionals[0], logins)
    dst_host, dst = _docker_ref(args.positionals[1])
    parts = dst.split("/")
    ecr = _ECR_HOST.fullmatch(dst_host)
    repo = None
    if ecr is not None and ecr.group(1) == state["aws"]["accountId"]:
        name = dst.split("/", 1)[1].rsplit(":", 1)[0]
        repo = state["aws"].get("repositories", {}).get(f"{ecr.group(2)}/{name}")
    elif (match := _AR_HOST.fullmatch(dst_host)) is not None:
        if len(parts) >= 4 and parts[1] == state["gcp"]["project"]:
            repo = state["gcp"]["repositories"].get(f"{match.group(1)}/{parts[2]}")
    else:
        raise CliError(f"cloud stand-in: copying to {dst_host} is not modelled", 2)
    if dst_host not in logins:
        raise _fatal("trying to reuse blob at destination: unauthorized: authentication required")
    if repo is None:
        if ecr is not None:
            raise _fatal(
                f"writing blob: initiating layer upload to {dst}: name unknown: The repository "
                f"with name '{name}' does not exist in the registry with id "
                f"'{state['aws']['accountId']}'"
            )
        raise _fatal(
            f"writing blob: initiating layer upload to {dst}: name unknown: Repository not found"
        )
    if ecr is not None:
        state["aws"]["images"][dst] = {"digest": image["digest"], "source": src}
    else:
        copied = state["gcp"]["images"].setdefault(dst, {"copies": 0})
        copied.update(digest=image["digest"], source=src, copies=copied["copies"] + 1)
        copied["all"] = args.has("--all") or args.has("-a")
    if args.has("--quiet"):
        return Out()
    return Out(
        "Getting image source signatures\n"
        f"Copying blob {image['digest'][:19]}\n"
        "Writing manifest to image destination\n"
    )


# --- entry point ---------------------------------------------------------------------------

TOOLS: dict[str, Handler] = {"gcloud": gcloud, "kubectl": kubectl, "aws": aws, "skopeo": skopeo}


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    with open(state_dir / _LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run(tool: str, argv: Sequence[str], state_dir: Path, stdin: str | None) -> tuple[Out, int]:
    """One call: the tool's answer and exit status, the state saved and the call logged."""
    with _locked(state_dir):
        state = read_state(state_dir)
        try:
            out, code = TOOLS[tool](state, argv, stdin or ""), 0
        except CliError as exc:
            out, code = Out(stderr=exc.stderr), exc.code
        else:
            write_state(state_dir, state)
        entry = {"tool": tool, "argv": list(argv), "stdin": stdin is not None, "exit": code}
        with open(state_dir / CALLS_FILE, "a") as log:
            log.write(json.dumps(entry) + "\n")
    return out, code


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in TOOLS:
        print(f"cloud stand-in: first argument must be one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    state_dir = os.environ.get(STATE_ENV)
    if not state_dir:
        print(f"cloud stand-in: set {STATE_ENV} to the state directory", file=sys.stderr)
        return 2
    tool, rest = argv[0], argv[1:]
    # Only a login reads stdin, and it must do so before taking the lock: the command that
    # feeds it (aws ecr get-login-password | skopeo login ...) needs the lock too.
    stdin = sys.stdin.read() if tool == "skopeo" and "--password-stdin" in rest else None
    out, code = run(tool, rest, Path(state_dir), stdin)
    sys.stdout.write(out.stdout)
    sys.stderr.write(
        out.stderr if not out.stderr or out.stderr.endswith("\n") else out.stderr + "\n"
    )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
