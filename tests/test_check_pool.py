"""deploy/check-pool.sh against a whole installation on loopback: what an operator runs to see
that a pool takes work ("Check it works" on the product page).

The script drives the real `levers9` CLI (LEVERS9_CLI points it at `python -m control.cli`)
against a controlplane whose worker runs busybox tasks in runc containers, so every step it
checks (a GPU job read back from its task record, an endpoint over HTTP/2, a box port, a
snapshot restore, a multi-card job) really happens; the failing runs check that the operator is
told why and that what the script started does not stay behind.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from control.models import TaskView
from sim.cluster import Cluster, PoolSpec, open_cluster, open_node_cluster
from sim.kubeapi.store import KubeStandin

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "check-pool.sh"


async def check_pool(
    cluster: Cluster, *args: str, token: str | None = None, logged_in: Path | None = None
) -> tuple[int, str]:
    """Run the script as an operator would; its exit code and its output (stdout, stderr).
    With `logged_in` (a contexts file), the operator ran `levers9 login` and exported
    nothing."""
    env = {**cluster.cli_env(), "LEVERS9_CLI": f"{sys.executable} -m control.cli"}
    if token is not None:
        env["LEVERS9_TOKEN"] = token
    secret = env["LEVERS9_TOKEN"]
    if logged_in is not None:
        env["LEVERS9_CONFIG"] = str(logged_in)
        login = [sys.executable, "-m", "control.cli", "login", cluster.url]
        await trio.run_process(
            [*login, "--ca", env["LEVERS9_CA"]], env=env, stdin=f"{secret}\n".encode()
        )
        for name in ("LEVERS9_CONTROLPLANE", "LEVERS9_TOKEN", "LEVERS9_CA"):
            del env[name]
    with trio.fail_after(240):  # a guard against a hang, not a timing goal
        result = await trio.run_process(
            ["bash", str(SCRIPT), *args],
            env=env,
            cwd=REPO,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    output = result.stdout.decode() + result.stderr.decode()
    # Nothing the script prints carries the token.
    assert secret not in output
    return result.returncode, output


def lines_starting(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


async def all_tasks(cluster: Cluster) -> tuple[TaskView, ...]:
    async with cluster.client() as client:
        return await client.tasks()


async def test_the_basic_check_passes_on_a_two_card_node(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_node_cluster(tmp_path / "cluster", kube, 2) as cluster:
        code, output = await check_pool(cluster, "--image", registry.busybox, "--gpus", "1")
        tasks = await all_tasks(cluster)
    assert code == 0, output
    assert lines_starting(output, "ok   machine list: 1 machine"), output
    assert lines_starting(output, "ok   GPU job (1 card(s)): 1 card(s) seen"), output
    assert not lines_starting(output, "FAIL"), output
    assert "summary: 2 passed, 0 failed" in output
    # The outcome came from the task record: its id, state and exit code.
    (task,) = tasks
    assert task.state == "succeeded"
    assert f"task {task.id} succeeded (exit 0)" in output
    assert f"cards={task.card_ids[0]}" in output


async def test_the_full_check_passes_on_a_tunnel_pool(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_node_cluster(tmp_path / "cluster", kube, 2, tunnel=True) as cluster:
        # Logged in with the CLI, nothing exported: the endpoint's GET takes the context's
        # controlplane, CA and token.
        code, output = await check_pool(
            cluster,
            "--full",
            "--multi",
            "2",
            "--image",
            registry.busybox,
            "--serve-image",
            registry.busybox,
            logged_in=tmp_path / "levers9-config",
        )
        tasks = await all_tasks(cluster)
    assert code == 0, output
    passed = [line.split(":")[0] for line in lines_starting(output, "ok   ")]
    assert passed == [
        "ok   machine list",
        "ok   GPU job (1 card(s))",
        "ok   endpoint",
        "ok   box port",
        "ok   snapshot restore",
        "ok   multi-card job (2 cards)",
    ], output
    assert "over HTTP/2" in output
    assert "summary: 6 passed, 0 failed" in output
    multi = [t for t in tasks if t.cards == 2]
    assert [t.state for t in multi] == ["succeeded"]
    assert len(set(multi[0].card_ids)) == 2
    # The serving and the snapshotted task were cancelled on the way out.
    left = [t for t in tasks if t.state not in ("succeeded", "cancelled")]
    assert left == [], left
    assert len([t for t in tasks if t.state == "cancelled"]) == 2


async def test_more_cards_than_any_worker_has_fails_with_the_waiting_reason(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_node_cluster(tmp_path / "cluster", kube, 2) as cluster:
        args = ("--image", registry.busybox, "--gpus", "4", "--timeout", "5")
        code, output = await check_pool(cluster, *args)
        (cancelled,) = await all_tasks(cluster)

        code_kept, output_kept = await check_pool(cluster, *args, "--keep")
        tasks = await all_tasks(cluster)
        kept = next(t for t in tasks if t.id != cancelled.id)
        async with cluster.client() as client:
            await client.cancel_task(kept.id)

    assert code == 1, output
    (failed,) = lines_starting(output, "FAIL GPU job (4 card(s)): ")
    assert f"task {cancelled.id} still pending after 5 s" in failed
    assert "4 cards asked; the largest machine has 2 cards (node gpu-node-1, pool " in failed
    assert "it waits for a node with 4 cards to join a pool" in failed
    assert "levers9 machine list" in failed
    assert "summary: 1 passed, 1 failed" in output
    assert cancelled.state == "cancelled"
    assert f"cancelled task {cancelled.id}" in output

    assert code_kept == 1, output_kept
    (failed_kept,) = lines_starting(output_kept, "FAIL GPU job (4 card(s)): ")
    assert kept.state == "pending"
    # The reason printed is the one in the task record.
    assert kept.waiting is not None
    assert f"still pending after 5 s: {kept.waiting}" in failed_kept
    assert f"kept (--keep): {kept.id}" in output_kept


async def test_a_wrong_token_or_no_machines_fail_at_the_machine_list(
    tmp_path: Path, kube: KubeStandin, registry: SharedRegistry
) -> None:
    async with open_cluster(
        tmp_path / "cluster", kube, nodes=[], pools=[PoolSpec("gpu")]
    ) as cluster:
        wrong = secrets.token_urlsafe(24)
        code, output = await check_pool(cluster, "--image", registry.busybox, token=wrong)
        code_empty, output_empty = await check_pool(cluster, "--image", registry.busybox)
        tasks = await all_tasks(cluster)

    assert code == 1, output
    (failed,) = lines_starting(output, "FAIL machine list: ")
    assert "levers9: UNAUTHENTICATED" in failed
    assert "LEVERS9_TOKEN" in failed
    assert "summary: 0 passed, 1 failed" in output

    assert code_empty == 1, output_empty
    (empty,) = lines_starting(output_empty, "FAIL machine list: ")
    assert "no machines: check the pool's selector, `levers9 cluster list`" in empty
    # Neither run got as far as starting a task.
    assert tasks == ()
