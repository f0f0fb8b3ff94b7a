"""What every benchmark prints and writes: a table for people and one JSON report.

The report's shape, which every benchmark shares: ``figures`` (ours), ``anchors`` (the same
figures for the paths we compare against, measured in the same run), ``ratios`` (ours divided by
the anchor's) and ``machine``, because a figure means little without the machine it came from.
A benchmark whose figures depend on its size also writes ``inputs`` (node counts, file sizes):
what was measured on, never a measurement. Values must be finite numbers: a NaN in a report
would read as a result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
import psutil
import trio


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cgroup_cpu_max() -> str:
    """The cgroup v2 CPU quota (``max 100000`` means none); a container's cores may be fewer."""
    try:
        return Path("/sys/fs/cgroup/cpu.max").read_text(encoding="utf-8").strip()
    except OSError:
        return "unknown"


def _openssh_version() -> str:
    try:
        # `ssh -V` writes its version to stderr.
        done = subprocess.run(
            ["ssh", "-V"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"
    return (done.stderr or done.stdout).strip() or "unknown"


def machine_info() -> dict[str, str | int]:
    """The facts about this machine that move benchmark figures."""
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cgroup_cpu_max": _cgroup_cpu_max(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "openssh": _openssh_version(),
    }


def render_table(rows: list[tuple[str, ...]], headers: tuple[str, ...]) -> str:
    """A plain-text table: the first column left-aligned, the others (numbers) right-aligned."""
    for index, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(
                f"rows[{index}] has {len(row)} cells but there are {len(headers)} headers; "
                "give every row one cell per header"
            )
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: tuple[str, ...]) -> str:
        first, *rest = cells
        parts = [first.ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(rest, widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


@attrs.frozen
class Results:
    """The report's sections for a benchmark, or one part of it (`merged` joins the parts)."""

    figures: dict[str, float] = attrs.field(factory=dict)
    anchors: dict[str, float] = attrs.field(factory=dict)
    ratios: dict[str, float] = attrs.field(factory=dict)

    def merged(self, other: Results) -> Results:
        return Results(
            figures={**self.figures, **other.figures},
            anchors={**self.anchors, **other.anchors},
            ratios={**self.ratios, **other.ratios},
        )


def render_sections(
    figures: Mapping[str, float],
    anchors: Mapping[str, float],
    ratios: Mapping[str, float],
    inputs: Mapping[str, float] | None = None,
) -> str:
    """The report's sections as one table for people: section, name, value."""
    sections = {"inputs": inputs or {}, "figures": figures, "anchors": anchors, "ratios": ratios}
    rows: list[tuple[str, ...]] = [
        (section, name, f"{value:.4g}")
        for section, values in sections.items()
        for name, value in values.items()
    ]
    return render_table(rows, ("", "name", "value"))


def ratios_of(
    pairs: Mapping[str, tuple[str, str]],
    figures: Mapping[str, float],
    anchors: Mapping[str, float],
) -> dict[str, float]:
    """``figures[ours] / anchors[anchor]`` for each ``name: (ours, anchor)`` of `pairs` whose
    two values were measured (and the anchor's is not zero); the others are left out."""
    ratios: dict[str, float] = {}
    for name, (ours, anchor) in pairs.items():
        if ours in figures and anchors.get(anchor):
            ratios[name] = figures[ours] / anchors[anchor]
    return ratios


def _checked(section: str, values: Mapping[str, float]) -> dict[str, float]:
    for name, value in values.items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(
                f"{section}[{name!r}] is {value!r}, not a finite number; "
                "leave a figure out rather than report one that was not measured"
            )
    return dict(values)


def write_report(
    path: str | os.PathLike[str],
    *,
    figures: dict[str, float],
    ratios: dict[str, float],
    anchors: dict[str, float],
    inputs: Mapping[str, float] | None = None,
) -> None:
    """Write the JSON report to `path`, replacing it whole (never a half-written file);
    ``inputs`` only where given."""
    report: dict[str, object] = {
        "figures": _checked("figures", figures),
        "ratios": _checked("ratios", ratios),
        "anchors": _checked("anchors", anchors),
        "machine": machine_info(),
    }
    if inputs is not None:
        report["inputs"] = _checked("inputs", inputs)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(target)


def publish(
    results: Results,
    inputs: Mapping[str, float],
    json_path: str | os.PathLike[str] | None,
    *,
    target: str,
) -> None:
    """What a benchmark's `main` ends with: its sections as a table and its target line for
    people, then the JSON report where `--json` asked for one."""
    print(render_sections(results.figures, results.anchors, results.ratios, inputs))
    print(target)
    if json_path is not None:
        write_report(
            json_path,
            figures=results.figures,
            ratios=results.ratios,
            anchors=results.anchors,
            inputs=inputs,
        )


P = TypeVar("P")
"""A benchmark's plan: what it measures and how much."""


def run_planned(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    quick_help: str,
    plans: tuple[P, P],
    run: Callable[[Path, P], Awaitable[tuple[Results, dict[str, float]]]],
    target: str,
) -> None:
    """The command line of a benchmark with a full and a `--quick` plan (`plans`): runs
    `run(workdir, plan)` in a temporary directory, stopping cleanly on SIGTERM, then prints the
    report and writes it where `--json` says."""
    from bench.tunnel import run_until_sigterm  # the tunnel benchmark imports this module

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    full, quick = plans
    plan = quick if args.quick else full
    name = prog.rpartition(".")[2]
    with tempfile.TemporaryDirectory(prefix=f"levers9-bench-{name}-") as tmp:
        results, inputs = trio.run(run_until_sigterm, lambda: run(Path(tmp), plan))
    publish(results, inputs, args.json, target=target)
