"""Configuration at the edges: the controlplane's values files and the agent's environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.daemon.config import ConfigError as AgentConfigError
from agent.daemon.config import load_config
from control.config import ConfigError, load_files, merge, parse

BASE = """
config:
  publicUrl: https://cp.example.com
  listen: 127.0.0.1:8443
  tls: {certFile: /etc/tls.crt, keyFile: /etc/tls.key}
  worker:
    tokens:
      - {workerId: w-1, token: public-placeholder}
"""

PRIVATE = """
config:
  worker:
    tokens:
      - {workerId: w-1, token: the-real-secret-1234}
  apiTokens:
    - {name: ops, token: ops-secret-5678}
"""


def test_later_files_merge_over_earlier(tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text(BASE)
    (tmp_path / "private.yaml").write_text(PRIVATE)
    config = load_files([tmp_path / "values.yaml", tmp_path / "private.yaml"])
    assert config.public_url == "https://cp.example.com"
    assert config.worker.tokens[0].token == "the-real-secret-1234"
    assert config.api_tokens[0].name == "ops"
    assert config.listen_port == 8443


def test_secrets_are_not_in_repr(tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text(BASE + PRIVATE.replace("config:\n", "", 1))
    (tmp_path / "private.yaml").write_text(PRIVATE)
    config = load_files([tmp_path / "values.yaml", tmp_path / "private.yaml"])
    assert "the-real-secret-1234" not in repr(config)
    assert "ops-secret-5678" not in repr(config)


def test_merge_replaces_lists_and_merges_mappings() -> None:
    merged = merge({"a": {"b": 1, "c": [1, 2]}}, {"a": {"c": [3], "d": 4}})
    assert merged == {"a": {"b": 1, "c": [3], "d": 4}}


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({}, "no 'config:' mapping"),
        ({"config": {"publicUrl": "https://x"}}, "config.tls"),
        (
            {
                "config": {
                    "publicUrl": "https://x",
                    "tls": {"certFile": "a", "keyFile": "b"},
                    "tunel": {},
                }
            },
            "tunel",
        ),
        (
            {"config": {"publicUrl": "http://x", "tls": {"certFile": "a", "keyFile": "b"}}},
            "config.publicUrl must start with https://",
        ),
        (
            {
                "config": {
                    "publicUrl": "https://x",
                    "tls": {"certFile": "a", "keyFile": "b"},
                    "worker": {"tokens": [{"workerId": "w"}]},
                }
            },
            "config.worker.tokens[0].token",
        ),
        (
            {
                "config": {
                    "publicUrl": "https://x",
                    "tls": {"certFile": "a", "keyFile": "b"},
                    "listen": "nowhere",
                }
            },
            "config.listen must be HOST:PORT",
        ),
        (
            {
                "config": {
                    "publicUrl": "https://x",
                    "tls": {"certFile": "a", "keyFile": "b"},
                    "http2": {"maxPingsPerWindow": -5},
                }
            },
            "config.http2: max_pings_per_window must be 0 or more, not -5",
        ),
        # A quoted "false" is not false (cattrs' bool() would read it as True).
        (
            {
                "config": {
                    "publicUrl": "https://x",
                    "tls": {"certFile": "a", "keyFile": "b"},
                    "joinedPools": {"inCluster": "false"},
                }
            },
            "config.joinedPools.inCluster",
        ),
    ],
)
def test_bad_values_name_the_field(values: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(values)
    assert needle in str(err.value)


def _with_workspaces(*workspaces: dict[str, object]) -> dict[str, object]:
    return {
        "config": {
            "publicUrl": "https://x",
            "tls": {"certFile": "a", "keyFile": "b"},
            "workspaces": list(workspaces),
        }
    }


S3_KEYS = {"accessKeyId": "AKIDEXAMPLE", "secretAccessKey": "bucket-secret-9999"}


@pytest.mark.parametrize(
    ("workspaces", "needle"),
    [
        (({"name": "Team A"},), "config.workspaces[0].name 'Team A' must be"),
        (({"name": "a"}, {"name": "a"}), "config.workspaces[1].name 'a' appears twice"),
        (
            (
                {"name": "a", "tokens": [{"name": "x", "token": "same-token"}]},
                {"name": "b", "tokens": [{"name": "y", "token": "same-token"}]},
            ),
            "config.workspaces[1].tokens[0] (y) reuses a token",
        ),
        (({"name": "a", "tokens": [{"name": "x", "token": ""}]},), "tokens[0].token is empty"),
        (
            ({"name": "a", "buckets": [{"name": "d", "url": "s3://b/"}]},),
            "config.workspaces[0].buckets[0].s3 is missing",
        ),
        (
            ({"name": "a", "buckets": [{"name": "d", "url": "ftp://b/", "s3": S3_KEYS}]},),
            "config.workspaces[0].buckets[0].url must be s3://",
        ),
        (
            ({"name": "a", "buckets": [{"name": "d", "url": "s3://b/", "s3": {"key": "x"}}]},),
            "config.workspaces[0].buckets[0].s3",
        ),
        (
            ({"name": "a", "registries": [{"host": "r.io/x", "username": "u", "password": "p"}]},),
            "config.workspaces[0].registries[0].host must be a registry host",
        ),
    ],
)
def test_bad_workspaces_name_the_field(
    workspaces: tuple[dict[str, object], ...], needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse(_with_workspaces(*workspaces))
    assert needle in str(err.value)
    assert "same-token" not in str(err.value)


def test_workspace_tokens_and_bucket_keys_stay_out_of_repr() -> None:
    config = parse(
        _with_workspaces(
            {
                "name": "team-a",
                "tokens": [{"name": "alice", "token": "alice-secret-1234"}],
                "buckets": [{"name": "data", "url": "s3://bucket/", "s3": S3_KEYS}],
            }
        )
    )
    assert config.workspaces[0].buckets[0].s3 is not None
    assert "alice-secret-1234" not in repr(config)
    assert "bucket-secret-9999" not in repr(config)


def test_unreadable_or_bad_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_files([tmp_path / "missing.yaml"])
    (tmp_path / "bad.yaml").write_text("config: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_files([tmp_path / "bad.yaml"])


def _env(**extra: str) -> dict[str, str]:
    env = {
        "LEVERS9_WORKER_ID": "w-1",
        "LEVERS9_WORKER_TOKEN": "agent-secret-token",
        "LEVERS9_CONTROLPLANE_URL": "https://cp.example.com:8443",
    }
    env.update(extra)
    return env


def test_agent_config_pops_the_token_and_hides_it() -> None:
    env = _env(LEVERS9_MODE="tunnel")
    config = load_config(env)
    assert config.token == "agent-secret-token"
    assert "LEVERS9_WORKER_TOKEN" not in env  # no child process inherits it
    assert "agent-secret-token" not in repr(config)
    assert config.controlplane_port == 8443
    assert config.mode == "tunnel"


def test_agent_runs_containers_unless_told_not_to() -> None:
    config = load_config(
        _env(
            LEVERS9_STATE_DIR="/srv/levers9",
            LEVERS9_OBJECT_BUDGET_BYTES="1048576",
            LEVERS9_INSECURE_REGISTRIES="registry.lan:5000, 10.0.0.5:5000",
        )
    )
    assert config.containers is not None
    assert str(config.containers.state_dir) == "/srv/levers9"
    assert config.containers.object_budget_bytes == 1 << 20
    assert config.containers.insecure_registries == ("registry.lan:5000", "10.0.0.5:5000")
    assert load_config(_env(LEVERS9_CONTAINERS="off")).containers is None
    assert load_config(_env()).idle_s is None
    assert load_config(_env(LEVERS9_IDLE_S="1800")).idle_s == 1800.0


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"LEVERS9_WORKER_ID": ""}, "LEVERS9_WORKER_ID is not set"),
        ({"LEVERS9_MODE": "sideways"}, "LEVERS9_MODE must be 'direct' or 'tunnel'"),
        ({"LEVERS9_CONTROLPLANE_URL": "http://cp"}, "LEVERS9_CONTROLPLANE_URL must be an https"),
        ({"LEVERS9_LISTEN": "7443"}, "LEVERS9_LISTEN must be HOST:PORT"),
        ({"LEVERS9_PING_INTERVAL_S": "soon"}, "LEVERS9_PING_INTERVAL_S must be a number"),
        ({"LEVERS9_CONTROLPLANE_CA": "/nonexistent/ca.pem"}, "which is not a file"),
        ({"LEVERS9_CONTAINERS": "maybe"}, "LEVERS9_CONTAINERS must be 'on' or 'off'"),
        ({"LEVERS9_STATE_DIR": "relative/dir"}, "LEVERS9_STATE_DIR must be an absolute path"),
        ({"LEVERS9_OBJECT_BUDGET_BYTES": "10G"}, "LEVERS9_OBJECT_BUDGET_BYTES must be a whole"),
    ],
)
def test_agent_config_errors_name_the_variable(changes: dict[str, str], needle: str) -> None:
    with pytest.raises(AgentConfigError) as err:
        load_config(_env(**changes))
    assert needle in str(err.value)
    assert "agent-secret-token" not in str(err.value)


def test_a_misspelt_key_is_named_beside_a_missing_one() -> None:
    """The usual pair after a typo: the key that was meant is missing and the misspelt one is
    extra. Both are named, so the typo is not hidden behind the first problem."""
    with pytest.raises(ConfigError) as err:
        parse({"config": {"listen": "127.0.0.1:0", "publicUrl": "https://x", "tsl": {}}})
    message = str(err.value)
    assert "config.tls: required field missing" in message
    assert "extra fields found (tsl)" in message


def test_the_http2_flood_limits_come_from_the_values() -> None:
    config = parse(
        {
            "config": {
                "publicUrl": "https://x",
                "tls": {"certFile": "a", "keyFile": "b"},
                "http2": {"maxPingsPerWindow": 5, "floodWindowS": 2, "maxEmptyFramesPerWindow": 1},
            }
        }
    )
    assert config.http2.max_pings_per_window == 5
    assert config.http2.flood_window_s == 2.0
    assert config.http2.max_empty_frames_per_window == 1
    assert config.http2.max_resets_per_window == 2000  # the rest keep their defaults


def _with_database(**database: object) -> dict[str, object]:
    return {
        "config": {
            "publicUrl": "https://x",
            "tls": {"certFile": "a", "keyFile": "b"},
            "database": database,
        }
    }


@pytest.mark.parametrize(
    ("database", "needle"),
    [
        ({"url": "mysql://db/x"}, "config.database.url must be postgresql://"),
        ({"url": "postgresql://u:hunter2@db/x"}, "config.database.url must not carry a password"),
        ({"url": "postgresql://u@db/x?password=hunter2"}, "must not carry a password"),
        ({"url": "postgresql://u@db"}, "config.database.url names no database"),
        (
            {"url": "postgresql://u@db/x", "password": "a", "passwordFile": "/p"},
            "config.database.password and config.database.passwordFile are both set",
        ),
        ({"url": "postgresql://u@db/x", "poolSize": 0}, "config.database.poolSize"),
        ({"path": ""}, "config.database.path is empty"),
    ],
)
def test_bad_database_settings_name_the_field(database: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(_with_database(**database))
    assert needle in str(err.value)
    assert "hunter2" not in str(err.value)


def test_the_database_password_comes_from_the_private_values_and_stays_out_of_repr(
    tmp_path: Path,
) -> None:
    (tmp_path / "values.yaml").write_text(
        BASE + "  database: {url: 'postgresql://levers9@db.example:5432/levers9'}\n"
    )
    (tmp_path / "private.yaml").write_text("config:\n  database: {password: pg-secret-4321}\n")
    config = load_files([tmp_path / "values.yaml", tmp_path / "private.yaml"])
    assert config.database.url == "postgresql://levers9@db.example:5432/levers9"
    assert config.database.password == "pg-secret-4321"
    assert "pg-secret-4321" not in repr(config)
