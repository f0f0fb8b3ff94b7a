"""Log lines carry the fields a person filters on (pool, node, worker, task, ...) as fields:
JSON keys for log pipelines, key=value after the message on a terminal."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

from proc.logs import JsonFormatter, RecentLogs, TextFormatter


def _record(**fields: object) -> logging.LogRecord:
    logger = logging.getLogger("levers9.test")
    return logger.makeRecord(
        logger.name, logging.INFO, __file__, 1, "pass took %.1f s", (0.25,), None, extra=fields
    )


def test_json_lines_carry_extra_fields_as_keys() -> None:
    line = JsonFormatter().format(_record(pool="gpus", node="n1", jobs_created=2, duration_s=0.25))
    entry = json.loads(line)
    assert entry["msg"] == "pass took 0.2 s"
    assert entry["level"] == "info"
    assert (entry["pool"], entry["node"], entry["jobs_created"], entry["duration_s"]) == (
        "gpus",
        "n1",
        2,
        0.25,
    )


def test_values_that_are_not_json_scalars_are_shown_as_text() -> None:
    entry = json.loads(JsonFormatter().format(_record(cards=("GPU-1", "GPU-2"))))
    assert entry["cards"] == "('GPU-1', 'GPU-2')"


def test_a_terminal_line_shows_the_fields_after_the_message() -> None:
    line = TextFormatter().format(_record(task="t-1", worker="w-a"))
    assert line.endswith("levers9.test: pass took 0.2 s  task=t-1 worker=w-a")
    assert "task=" not in TextFormatter().format(_record())


def test_the_agents_recent_lines_keep_the_fields() -> None:
    recent = RecentLogs(capacity=2)
    for number in range(3):
        recent.emit(_record(container=f"c-{number}"))
    lines, next_sequence = recent.since(0)
    assert next_sequence == 3
    assert [json.loads(line)["container"] for line in lines] == ["c-1", "c-2"]


def test_no_log_call_passes_a_field_that_logging_reserves() -> None:
    """`extra={"created": ...}` (or name, msg, ...) makes logging raise KeyError at the call,
    which would turn a log line into a crash; every literal `extra=` key in the programs is
    checked here."""
    reserved = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
    root = Path(__file__).resolve().parent.parent
    clashes = []
    for package in ("agent", "control", "nvml", "sim"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                for keyword in node.keywords:
                    if keyword.arg == "extra" and isinstance(keyword.value, ast.Dict):
                        for key in keyword.value.keys:
                            if isinstance(key, ast.Constant) and key.value in reserved:
                                clashes.append(
                                    f"{path.relative_to(root)}:{node.lineno} {key.value}"
                                )
    assert not clashes
