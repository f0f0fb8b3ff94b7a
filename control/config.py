"""The controlplane's configuration: YAML shaped like the Helm values, merged, then typed.

`levers9-control serve --config FILE [--config FILE ...]` reads each file, merges later
files over earlier ones (mappings merge key by key, anything else is replaced; the private
values file holding keys is a second file), takes the `config:` block and structures it into
frozen attrs with this module's own cattrs converter (camelCase keys as in the values; the
worker API's wire converter is another boundary and changes for its own reasons). Unknown keys
and bad values are refused with the dotted path of the field; secrets (worker tokens, API
tokens) are hidden from every repr.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import cattrs
import yaml

from wire.admission import ConnectionLimits
from wire.errors import camel_path, make_converter
from wire.http2 import Http2Settings
from workerapi.models import GcsCredentials, S3Credentials

WORKSPACE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class ConfigError(ValueError):
    """The configuration is missing, unreadable or invalid; the message names the field."""


@attrs.frozen
class TlsFiles:
    cert_file: str
    key_file: str


@attrs.frozen
class WorkerToken:
    """A worker's bearer secret (minted per worker Job by the Kubernetes provider later)."""

    worker_id: str
    token: str = attrs.field(repr=False)


@attrs.frozen
class ApiToken:
    """A token for the CLI and scripts."""

    name: str
    token: str = attrs.field(repr=False)


@attrs.frozen
class BucketConfig:
    """A bucket a workspace's tasks may mount, with the workspace's own credentials (only in
    the private values file; held in memory, passed to the worker per container)."""

    name: str
    url: str
    s3: S3Credentials | None = None
    gcs: GcsCredentials | None = None


@attrs.frozen
class RegistryLogin:
    """Credentials for a private image registry (`host[:port]` as image references name it),
    used for each pull of the workspace's tasks from there and never stored by a worker."""

    host: str
    username: str
    password: str = attrs.field(repr=False)


@attrs.frozen
class WorkspaceLimits:
    """What one workspace may hold of the shared controlplane (`control.limits` decides).

    The defaults leave a person or a CI job ample room and keep the worst a workspace can do
    small beside the rest: 100 tasks pending or running is more than a pool's cards for most
    operators, and with 64 KiB of command, args and env each a full list page stays under
    7 MiB (the CLI reads at most 64 MiB); 128 variables of at most 32 KiB each fit any real
    program; a dashboard holds 2 watch streams and the CLI none, so 16 per token leaves room
    for several tabs; 100 requests a second, in bursts of 500, is far above a person or a
    `levers9 run` and lets a script collect a few hundred ended tasks one after another, yet
    stays well below what costs the controlplane a core."""

    max_active_tasks: int = 100
    """Tasks pending, starting or running at once, counted in the task database."""
    max_spec_bytes: int = 64 * 1024
    """Bytes of a task's command, args and env together (UTF-8)."""
    max_env: int = 128
    """Environment variables of one task."""
    max_env_entry_bytes: int = 32 * 1024
    """Bytes of one environment entry, NAME=VALUE."""
    max_watch_streams: int = 16
    """`?watch=true` streams one token holds open at once, on each replica."""
    requests_per_s: float = 100.0
    """Task API requests one token makes a second, on average (each replica counts its own)."""
    request_burst: int = 500
    """Requests one token may make at once above that rate."""

    def __attrs_post_init__(self) -> None:
        for name in (
            "max_active_tasks",
            "max_spec_bytes",
            "max_env",
            "max_env_entry_bytes",
            "max_watch_streams",
            "request_burst",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be 1 or more, not {getattr(self, name)}")
        if not self.requests_per_s > 0:
            raise ValueError(f"requests_per_s must be above 0, not {self.requests_per_s}")


@attrs.frozen
class LimitOverrides:
    """A workspace's own `limits:`: each one set replaces `config.workspaceLimits`' value."""

    max_active_tasks: int | None = None
    max_spec_bytes: int | None = None
    max_env: int | None = None
    max_env_entry_bytes: int | None = None
    max_watch_streams: int | None = None
    requests_per_s: float | None = None
    request_burst: int | None = None

    def over(self, defaults: WorkspaceLimits) -> WorkspaceLimits:
        """The limits in force: `defaults` with what this block sets. Pure."""
        given = {k: v for k, v in attrs.asdict(self).items() if v is not None}
        return attrs.evolve(defaults, **given)


@attrs.frozen
class WorkspaceConfig:
    """A workspace: its API tokens (every task call is scoped to the token's workspace), its
    buckets, its registry logins and its own limits over `config.workspaceLimits`."""

    name: str
    tokens: tuple[ApiToken, ...] = ()
    buckets: tuple[BucketConfig, ...] = ()
    registries: tuple[RegistryLogin, ...] = ()
    limits: LimitOverrides = LimitOverrides()


@attrs.frozen
class DatabaseSettings:
    """Where task records live: one SQLite file (mode 0600, kept across restarts; a single
    controlplane), or with `url` a PostgreSQL database (`postgresql://USER@HOST:PORT/DB`, any
    number of replicas). Its password is `password` (the private values file) or the first
    line of `passwordFile`, never part of the URL."""

    path: str = "/var/lib/levers9-control/tasks.db"
    url: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    password_file: str | None = None
    pool_size: int = 8
    """Connections to PostgreSQL this replica holds at most."""


@attrs.frozen
class TunnelSettings:
    ping_interval_s: float = 15.0
    ping_timeout_s: float = 15.0
    handshake_timeout_s: float = 10.0
    """The TLS handshake of every connection to the public endpoint, tunnel or API."""


@attrs.frozen
class ConnectionSettings:
    """Limits on the public endpoint's connections (wire.admission has why the defaults
    are what they are): per source address and in total, then the time from the TLS handshake
    to the first request, and how long one with no request open and no PING may stay (null:
    as long as its peer keeps it)."""

    max_per_source: int = ConnectionLimits().max_per_source
    max_total: int = ConnectionLimits().max_total
    first_request_timeout_s: float = ConnectionLimits().first_request_timeout_s
    idle_timeout_s: float | None = ConnectionLimits().idle_timeout_s


@attrs.frozen
class WorkerSettings:
    tokens: tuple[WorkerToken, ...] = ()
    pools: tuple[Mapping[str, Any], ...] = ()
    connect_timeout_s: float = 10.0
    lost_after_s: float = 120.0
    """A worker that cannot be reached for this long has lost the tasks it was running."""
    pool_credentials: Mapping[str, Any] = attrs.field(factory=dict, repr=False)
    """Inline credentials by pool name (the private values file), so that a pool's block is
    pasted as printed."""
    allow_local_registries: bool = False
    """Workers registered by token (not by a pool) pull from registries on their own node's
    loopback: tasks may name such images (`127.0.0.1:5000/x`). A pool says so for its own
    workers with `kubernetes.allowLocalRegistries`."""

    def allows_local_registries(self) -> bool:
        """Whether any worker may pull from a registry on its node: images on loopback and
        link-local addresses are refused at the controlplane otherwise."""
        return self.allow_local_registries or any(
            isinstance(pool.get("kubernetes"), Mapping)
            and pool["kubernetes"].get("allowLocalRegistries") is True
            for pool in self.pools
        )


@attrs.frozen
class JoinedPoolsSettings:
    """Where pools registered by `levers9 cluster join` are kept: one Kubernetes Secret each,
    in the controlplane's own namespace, reached with its pod's ServiceAccount (so a pool's
    token never touches the controlplane's disk)."""

    in_cluster: bool = True
    namespace: str | None = None


@attrs.frozen
class LeaderElectionSettings:
    """Several controlplane replicas: each pool is reconciled by one replica at a time, the
    holder of the pool's Lease in `namespace` (default: the pod's own), reached with the pod's
    ServiceAccount and decided as client-go's leader election decides. `identity` names this
    replica in the Leases (default: the pod's name, HOSTNAME, and a short random suffix)."""

    enabled: bool = False
    namespace: str | None = None
    identity: str | None = None
    lease_duration_s: float = 15.0
    """How long a Lease holds once renewed (whole seconds: the Lease keeps seconds)."""
    renew_deadline_s: float = 10.0
    """How long a leader keeps reconciling without a renewal going through."""
    retry_period_s: float = 2.0
    """Between tries to take a Lease, and between renewals."""


@attrs.frozen
class ReplicationSettings:
    """Several replicas behind one Service (`control.workers`): each worker is owned by one
    replica at a time (the one holding its tunnel, or for a direct worker the one that took
    it), and a request for it that arrives elsewhere is forwarded ONE hop to the owner over
    HTTP/2 and TLS, authenticated with `secret` (the private values file, or the first line
    of `secretFile`). `advertise` is the HOST:PORT the other replicas dial this one at
    (default: the pod's address from POD_IP, else the listen host, and the listen port).
    `leaseS`: how long a replica's claim on a worker holds without being renewed; a replica
    that stopped renewing is taken over after it."""

    secret: str | None = attrs.field(default=None, repr=False)
    secret_file: str | None = None
    advertise: str | None = None
    lease_s: float = 15.0


@attrs.frozen
class MetricsSettings:
    """`listen`: HOST:PORT of a plain-HTTP listener that serves only `GET /metrics`, without a
    token, for Prometheus inside the cluster (the figures carry no secrets). Unset: none; the
    main HTTPS port serves `/metrics` to an operator token either way."""

    listen: str | None = None

    @property
    def host(self) -> str:
        assert self.listen is not None
        return self.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"

    @property
    def port(self) -> int:
        assert self.listen is not None
        return int(self.listen.rpartition(":")[2])


@attrs.frozen
class DashboardSettings:
    """The dashboard's sessions (`control.ui.sessions`): one ends `sessionMaxS` after sign-in
    however much it is used, and `sessionIdleS` after its last request; signing out ends it
    at once. Twelve hours is a working day with margin; an hour unused is a lunch break."""

    session_max_s: float = 12 * 3600.0
    session_idle_s: float = 3600.0

    def __attrs_post_init__(self) -> None:
        for name in ("session_max_s", "session_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, not {getattr(self, name)}")


@attrs.frozen
class ControlConfig:
    public_url: str
    tls: TlsFiles
    listen: str = "0.0.0.0:8443"
    api_tokens: tuple[ApiToken, ...] = ()
    worker: WorkerSettings = WorkerSettings()
    tunnel: TunnelSettings = TunnelSettings()
    database: DatabaseSettings = DatabaseSettings()
    connections: ConnectionSettings = ConnectionSettings()
    http2: Http2Settings = Http2Settings()
    """Windows, frame sizes and flood limits of every HTTP/2 connection: the listener's, the
    tunnels' and the dials of direct workers."""
    workspaces: tuple[WorkspaceConfig, ...] = ()
    workspace_limits: WorkspaceLimits = WorkspaceLimits()
    """Every workspace's limits, unless its own `limits:` says otherwise."""
    joined_pools: JoinedPoolsSettings | None = None
    drain_s: float = 20.0
    """On SIGTERM: how long connections (tunnels included) get to finish what is in flight
    after their GOAWAY; within the pod's termination grace period (30 s by default)."""
    leader_election: LeaderElectionSettings = LeaderElectionSettings()
    replication: ReplicationSettings = ReplicationSettings()
    metrics: MetricsSettings = MetricsSettings()
    dashboard: DashboardSettings = DashboardSettings()

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; any other value in `override` replaces the base's."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_files(paths: Sequence[str | Path]) -> ControlConfig:
    if not paths:
        raise ConfigError("no --config file given; pass the values file (YAML)")
    merged: dict[str, Any] = {}
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must hold a mapping with a 'config:' key")
        merged = merge(merged, data)
    return parse(merged)


def parse(values: Mapping[str, Any]) -> ControlConfig:
    """Type the `config:` block of merged values; errors name the dotted field path."""
    block = values.get("config")
    if not isinstance(block, Mapping):
        raise ConfigError("the values have no 'config:' mapping; put the settings under config:")
    config = _structure(block)
    _validate(config)
    return config


# The config's own converter, not the worker API's (`wire.errors.CONVERTER`): the same
# rules (camelCase keys as the Helm values spell them, unknown keys refused, so a misspelt
# setting is an error rather than a default silently kept), a separate instance, so hooks one
# boundary registers never change how the other reads.
_CONVERTER = make_converter()


def strict_bool(value: Any, _: type[bool]) -> bool:
    """A config boolean is true or false: cattrs would call bool(), which reads the string
    "false" as True."""
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


_CONVERTER.register_structure_hook(bool, strict_bool)


_SHOWN_PROBLEMS = 5


def _describe_problem(exc: BaseException, type_: type | None) -> str:
    """cattrs' words for a problem, except that a settings class's own check says what it
    wants (`max_pings_per_window must be 0 or more, not -5`), not just "invalid value". Only
    those: another ValueError's text may quote the value, which may be a secret."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if isinstance(exc, ValueError) and tb and tb.tb_frame.f_code.co_name == "__attrs_post_init__":
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def _structure(block: Mapping[str, Any]) -> ControlConfig:
    """The typed config, or a `ConfigError` naming each bad field by its dotted path
    (`config.worker.tokens[0].token: required field missing`)."""
    try:
        return _CONVERTER.structure(dict(block), ControlConfig)
    except Exception as exc:
        problems = cattrs.transform_error(
            exc, path="config", format_exception=_describe_problem
        ) or [f"invalid ({exc})"]
        # Every problem is named (a misspelt key beside a missing one is the usual pair:
        # showing only the first would hide the typo), up to a handful.
        named = []
        for problem in problems[:_SHOWN_PROBLEMS]:
            what, _, at = problem.partition(" @ ")
            named.append(f"{camel_path(at) if at else 'config'}: {what}")
        if len(problems) > _SHOWN_PROBLEMS:
            named.append(f"and {len(problems) - _SHOWN_PROBLEMS} more problem(s)")
        raise ConfigError("; ".join(named)) from None


def _validate(config: ControlConfig) -> None:
    """Every rule that spans fields, section by section, in the order a reader meets them."""
    _validate_listener(config)
    _validate_worker_tokens(config.worker)
    tokens = _validate_api_tokens(config.api_tokens)
    _validate_workspaces(config.workspaces, config.workspace_limits, tokens)
    _validate_joined_pools(config.joined_pools)
    _validate_leader_election(config.leader_election)
    _validate_connections(config.connections, config.tunnel)
    _validate_database(config.database)
    _validate_replication(config.replication)
    _validate_metrics(config.metrics)
    if not config.drain_s >= 0:
        raise ConfigError(f"config.drainS must be 0 or more seconds, not {config.drain_s:g}")


def _validate_listener(config: ControlConfig) -> None:
    if not config.public_url.startswith("https://"):
        raise ConfigError(f"config.publicUrl must start with https://, not {config.public_url!r}")
    host, _, port = config.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"config.listen must be HOST:PORT, not {config.listen!r}")


def _validate_worker_tokens(worker: WorkerSettings) -> None:
    seen: set[str] = set()
    for i, entry in enumerate(worker.tokens):
        if not entry.token:
            raise ConfigError(f"config.worker.tokens[{i}].token is empty; set a secret token")
        if entry.worker_id in seen:
            raise ConfigError(
                f"config.worker.tokens[{i}].workerId {entry.worker_id!r} appears twice"
            )
        seen.add(entry.worker_id)


def _validate_api_tokens(api_tokens: Sequence[ApiToken]) -> set[str]:
    """The operator tokens, checked; returns them, since no workspace may reuse one."""
    tokens: set[str] = set()
    for i, api in enumerate(api_tokens):
        if not api.token:
            raise ConfigError(f"config.apiTokens[{i}].token is empty; set a secret token")
        tokens.add(api.token)
    return tokens


def _validate_workspaces(
    workspaces: Sequence[WorkspaceConfig], defaults: WorkspaceLimits, tokens: set[str]
) -> None:
    """Each workspace; `tokens` (the tokens seen so far) grows with each workspace's."""
    names: set[str] = set()
    for i, workspace in enumerate(workspaces):
        where = f"config.workspaces[{i}]"
        if not WORKSPACE_NAME.fullmatch(workspace.name):
            raise ConfigError(
                f"{where}.name {workspace.name!r} must be 1-63 lowercase letters, digits or '-'"
            )
        if workspace.name in names:
            raise ConfigError(f"{where}.name {workspace.name!r} appears twice")
        names.add(workspace.name)
        _validate_workspace_tokens(where, workspace, tokens)
        _validate_buckets(where, workspace.buckets)
        try:
            workspace.limits.over(defaults)
        except ValueError as exc:
            raise ConfigError(f"{where}.limits: {exc}") from None
        _validate_registries(where, workspace.registries)


def _validate_workspace_tokens(where: str, workspace: WorkspaceConfig, tokens: set[str]) -> None:
    for j, token in enumerate(workspace.tokens):
        if not token.token:
            raise ConfigError(f"{where}.tokens[{j}].token is empty; set a secret token")
        if token.token in tokens:
            raise ConfigError(
                f"{where}.tokens[{j}] ({token.name}) reuses a token given elsewhere in the "
                "config; every token must be unique"
            )
        tokens.add(token.token)


def _validate_buckets(where: str, buckets: Sequence[BucketConfig]) -> None:
    names: set[str] = set()
    for j, bucket in enumerate(buckets):
        if bucket.name in names:
            raise ConfigError(f"{where}.buckets[{j}].name {bucket.name!r} appears twice")
        names.add(bucket.name)
        if not bucket.url.startswith(("s3://", "gs://")):
            raise ConfigError(
                f"{where}.buckets[{j}].url must be s3://BUCKET[/PREFIX] or "
                f"gs://BUCKET[/PREFIX], not {bucket.url!r}"
            )
        if bucket.url.startswith("s3://") and bucket.s3 is None:
            raise ConfigError(
                f"{where}.buckets[{j}].s3 is missing; give the credentials for {bucket.url}"
            )
        if bucket.url.startswith("gs://") and bucket.gcs is None:
            raise ConfigError(
                f"{where}.buckets[{j}].gcs is missing; give the credentials for {bucket.url}"
            )


def _validate_registries(where: str, registries: Sequence[RegistryLogin]) -> None:
    hosts: set[str] = set()
    for j, login in enumerate(registries):
        if not login.host or "/" in login.host:
            raise ConfigError(
                f"{where}.registries[{j}].host must be a registry host[:port] such as "
                f"registry.example.com, not {login.host!r}"
            )
        if login.host in hosts:
            raise ConfigError(f"{where}.registries[{j}].host {login.host!r} appears twice")
        hosts.add(login.host)


def _validate_joined_pools(joined: JoinedPoolsSettings | None) -> None:
    if joined is not None and not joined.in_cluster:
        raise ConfigError(
            "config.joinedPools.inCluster: joined pools are kept as Secrets in the "
            "controlplane's own cluster; set inCluster: true or remove joinedPools"
        )


def _validate_leader_election(election: LeaderElectionSettings) -> None:
    # client-go's own checks: a leader stops before its Lease can expire for the others, and
    # tries to renew more than once before it stops.
    where = "config.leaderElection"
    lease_s, renew_s, retry_s = (
        election.lease_duration_s,
        election.renew_deadline_s,
        election.retry_period_s,
    )
    if not (lease_s >= 1 and lease_s == int(lease_s)):
        raise ConfigError(
            f"{where}.leaseDurationS must be a whole number of seconds, 1 or more (a Lease keeps "
            f"whole seconds), not {lease_s:g}"
        )
    if not retry_s > 0:
        raise ConfigError(
            f"{where}.retryPeriodS must be a number of seconds above 0, not {retry_s:g}"
        )
    if not renew_s < lease_s:
        raise ConfigError(
            f"{where}.renewDeadlineS must be less than leaseDurationS ({lease_s:g} s), not "
            f"{renew_s:g}: a leader must stop reconciling before its Lease can expire"
        )
    if not retry_s < renew_s:
        raise ConfigError(
            f"{where}.retryPeriodS must be less than renewDeadlineS ({renew_s:g} s), not "
            f"{retry_s:g}: a leader must be able to try renewing more than once"
        )
    for key, text in (("identity", election.identity), ("namespace", election.namespace)):
        if text is not None and not text.strip():
            raise ConfigError(f"{where}.{key} is empty; remove it for the default, or give one")


def _validate_connections(connections: ConnectionSettings, tunnel: TunnelSettings) -> None:
    for key, number in (
        ("maxPerSource", connections.max_per_source),
        ("maxTotal", connections.max_total),
    ):
        if number < 1:
            raise ConfigError(f"config.connections.{key} must be 1 or more, not {number}")
    for key, seconds in (
        ("connections.firstRequestTimeoutS", connections.first_request_timeout_s),
        ("connections.idleTimeoutS", connections.idle_timeout_s),
        ("tunnel.handshakeTimeoutS", tunnel.handshake_timeout_s),
    ):
        if seconds is not None and not seconds > 0:
            raise ConfigError(f"config.{key} must be a number of seconds above 0, not {seconds}")


def _validate_database(database: DatabaseSettings) -> None:
    if database.url is None:
        if not database.path:
            raise ConfigError("config.database.path is empty; give the task database's file path")
        return
    url = urlsplit(database.url)
    if url.scheme not in ("postgresql", "postgres") or not url.hostname:
        raise ConfigError(
            "config.database.url must be postgresql://USER@HOST[:PORT]/DATABASE "
            f"(the scheme was {url.scheme or 'missing'!r})"
        )
    if url.password is not None or "password=" in url.query:
        # The values file holding the URL is a ConfigMap: the password must not be in it.
        raise ConfigError(
            "config.database.url must not carry a password; put it in "
            "config.database.password in the private values file, or in a file named by "
            "config.database.passwordFile"
        )
    if not url.path.strip("/"):
        raise ConfigError("config.database.url names no database; end it with /DATABASE")
    if database.password is not None and database.password_file is not None:
        raise ConfigError(
            "config.database.password and config.database.passwordFile are both set; keep one"
        )
    if database.pool_size < 1:
        raise ConfigError(f"config.database.poolSize must be 1 or more, not {database.pool_size}")


def _validate_metrics(metrics: MetricsSettings) -> None:
    if metrics.listen is None:
        return
    host, _, port = metrics.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            "config.metrics.listen must be HOST:PORT (for example 0.0.0.0:9090), "
            f"not {metrics.listen!r}"
        )


def _validate_replication(replication: ReplicationSettings) -> None:
    where = "config.replication"
    if replication.secret is not None and replication.secret_file is not None:
        raise ConfigError(f"{where}.secret and {where}.secretFile are both set; keep one")
    if replication.secret is not None and len(replication.secret) < 16:
        raise ConfigError(
            f"{where}.secret is shorter than 16 characters; use a long random secret "
            "(openssl rand -hex 32)"
        )
    if replication.advertise is not None:
        host, _, port = replication.advertise.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"{where}.advertise must be HOST:PORT (the address other replicas reach this "
                f"one at), not {replication.advertise!r}"
            )
    if not replication.lease_s >= 3:
        raise ConfigError(f"{where}.leaseS must be 3 seconds or more, not {replication.lease_s:g}")
