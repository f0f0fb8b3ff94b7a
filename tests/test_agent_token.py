"""The worker token does not stay in the agent's environment as the kernel shows it
(`/proc/PID/environ`): `levers9-agent run` starts itself again without it and reads it from a
pipe. First the parts without a process, then the agent as a worker Job runs it, registering
with a controlplane on loopback (which proves the token arrived)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from agent.daemon.config import (
    TOKEN_FD_VARIABLE,
    TOKEN_VARIABLE,
    ConfigError,
    environ_for_reexec,
    load_config,
)
from control.api.server import Controlplane
from sim.configs import WORKER_TOKENS, control_config, make_pki
from sim.controlplane import run_controlplane

REPO = Path(__file__).resolve().parents[1]
TOKEN = WORKER_TOKENS["w-tunnel"]


def worker_environ(port: int = 7443, ca: str = "") -> dict[str, str]:
    return {
        "LEVERS9_WORKER_ID": "w-tunnel",
        TOKEN_VARIABLE: TOKEN,
        "LEVERS9_MODE": "tunnel",
        "LEVERS9_CONTROLPLANE_URL": f"https://127.0.0.1:{port}",
        "LEVERS9_CONTROLPLANE_CA": ca,
        "LEVERS9_CONTAINERS": "off",
    }


def test_the_environment_started_again_has_a_descriptor_not_the_token() -> None:
    env = environ_for_reexec({**worker_environ(), "PATH": "/bin"}, 7)
    assert TOKEN_VARIABLE not in env
    assert TOKEN not in "".join(env.values())
    assert env[TOKEN_FD_VARIABLE] == "7"
    assert env["PATH"] == "/bin" and env["LEVERS9_WORKER_ID"] == "w-tunnel"


def test_the_token_is_read_from_the_pipe_to_its_end_and_the_pipe_closed() -> None:
    read, write = os.pipe()
    os.write(write, TOKEN.encode())
    os.close(write)
    env = environ_for_reexec(worker_environ(), read)
    config = load_config(env)
    assert config.token == TOKEN
    assert TOKEN_FD_VARIABLE not in env and TOKEN_VARIABLE not in env
    with pytest.raises(OSError):
        os.fstat(read)  # closed


def test_a_descriptor_that_is_not_a_pipe_of_ours_is_refused_by_name() -> None:
    env = {**worker_environ(), TOKEN_FD_VARIABLE: "not-a-number"}
    with pytest.raises(ConfigError) as caught:
        load_config(env)
    assert caught.value.variable == TOKEN_FD_VARIABLE


def environ_of(pid: int) -> dict[str, str]:
    """What the kernel shows as `pid`'s environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(os.fsdecode(item).partition("=")[::2] for item in raw.split(b"\0") if item)


async def test_the_running_agent_shows_no_token_in_proc_environ(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    pki = make_pki(tmp_path)
    control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
    env = {**os.environ, **worker_environ(control.port, str(pki.ca_file))}
    env["LEVERS9_LOG_LEVEL"] = "WARNING"
    agent = await trio.lowlevel.open_process(
        [sys.executable, "-m", "agent.daemon.cli", "run"], env=env, cwd=REPO
    )
    try:
        with trio.fail_after(30):
            client = await control.registry.client_for("w-tunnel")  # its token was accepted
            assert (await client.health()).worker_id == "w-tunnel"
        shown = environ_of(agent.pid)
        assert shown["LEVERS9_WORKER_ID"] == "w-tunnel"  # it is the agent's environment
        assert TOKEN_VARIABLE not in shown
        assert not any(TOKEN in value for value in shown.values())
        assert TOKEN.encode() not in Path(f"/proc/{agent.pid}/environ").read_bytes()
        # Nothing it holds open is the pipe the token came through.
        for fd in Path(f"/proc/{agent.pid}/fd").iterdir():
            target = os.readlink(fd)
            assert not target.startswith("pipe:") or fd.name in ("0", "1", "2"), target
    finally:
        agent.terminate()
        with trio.move_on_after(5):
            await agent.wait()
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
