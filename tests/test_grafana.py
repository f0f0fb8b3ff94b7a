"""The Grafana dashboard in deploy/grafana queries only metrics that the controlplane and the
agent serve, with labels they carry, counters through rate() over $__rate_interval, and units
that fit; a misspelt metric or label fails here instead of as an empty panel in front of an
operator. METRICS is the list the two programs' GET /metrics serve; keep the two in step."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "levers9-dashboard.json"

GPU = frozenset({"uuid", "index", "model"})

# name: (kind, labels). Histograms are queried through their _bucket, _sum and _count series.
METRICS: dict[str, tuple[str, frozenset[str]]] = {
    # The controlplane.
    "levers9_tasks": ("gauge", frozenset({"workspace", "state"})),
    "levers9_task_placement_seconds": ("histogram", frozenset()),
    "levers9_reconcile_pass_seconds": ("histogram", frozenset({"pool"})),
    "levers9_reconcile_errors_total": ("counter", frozenset({"pool"})),
    "levers9_cache_relists_total": ("counter", frozenset({"cache", "reason"})),
    "levers9_cache_unusable_total": ("counter", frozenset({"cache"})),
    "levers9_pool_machines": ("gauge", frozenset({"pool"})),
    "levers9_pool_cards": ("gauge", frozenset({"pool", "use"})),
    "levers9_pool_refused_workers": ("gauge", frozenset({"pool"})),
    "levers9_workers": ("gauge", frozenset({"mode", "connected"})),
    "levers9_tunnels_open": ("gauge", frozenset()),
    "levers9_worker_connection_bytes_total": ("counter", frozenset({"mode", "direction"})),
    "levers9_worker_rtt_seconds": ("histogram", frozenset({"mode"})),
    "levers9_api_requests_total": ("counter", frozenset({"route", "method", "code"})),
    "levers9_api_request_seconds": ("histogram", frozenset({"route", "method"})),
    "levers9_control_info": ("gauge", frozenset({"replica", "version"})),
    # The agent, one scrape target (instance) per worker.
    "levers9_gpu_utilization_percent": ("gauge", GPU),
    "levers9_gpu_memory_utilization_percent": ("gauge", GPU),
    "levers9_gpu_memory_used_bytes": ("gauge", GPU),
    "levers9_gpu_memory_total_bytes": ("gauge", GPU),
    "levers9_gpu_temperature_celsius": ("gauge", GPU),
    "levers9_gpu_power_watts": ("gauge", GPU),
    "levers9_gpu_ecc_errors_total": ("counter", GPU | {"type"}),
    "levers9_gpu_xid_errors_total": ("counter", GPU),
    "levers9_gpu_claimed": ("gauge", GPU),
    "levers9_containers": ("gauge", frozenset({"state"})),
    "levers9_store_bytes": ("gauge", frozenset()),
    "levers9_store_objects": ("gauge", frozenset()),
    "levers9_store_evictions_total": ("counter", frozenset()),
    "levers9_bucket_mounts": ("gauge", frozenset()),
    "levers9_agent_info": ("gauge", frozenset({"worker", "mode", "version"})),
}

# Labels Prometheus (and a Prometheus operator's ServiceMonitor) adds to every series.
TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod", "service", "container"})
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
RATE_INTERVAL = "[$__rate_interval]"

SERIES = re.compile(r"\b(levers9_[a-z0-9_]+)\b(\{[^}]*\})?(\[[^\]]*\])?")
MATCHER = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"[^\"]*\"\s*")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def graph_panels(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel but rows, those nested in collapsed rows included."""
    found: list[dict[str, Any]] = []
    for panel in data["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def exprs(data: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in graph_panels(data) for target in panel["targets"]]


def series_of(name: str) -> tuple[str, str, frozenset[str]]:
    """(the metric's name in METRICS, its kind, the labels a series of it may carry) for a
    series name; AssertionError for a name no program serves."""
    if name in METRICS:
        kind, labels = METRICS[name]
        assert kind != "histogram", f"{name} is a histogram: query {name}_bucket, _sum or _count"
        return name, kind, labels
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and METRICS.get(base, ("", frozenset()))[0] == "histogram":
            labels = METRICS[base][1] | ({"le"} if suffix == "_bucket" else set())
            return base, "counter", frozenset(labels)
    raise AssertionError(f"{name} is not a metric levers9 serves (see METRICS)")


def check_expr(expr: str) -> set[str]:
    """Checks one query and returns the metrics (METRICS' names) it reads."""
    used: set[str] = set()
    known_labels: set[str] = set(TARGET_LABELS)
    found = list(SERIES.finditer(expr))
    assert found, f"{expr!r} queries no levers9 metric"
    for match in found:
        name, selector, window = match.groups()
        base, kind, labels = series_of(name)
        used.add(base)
        known_labels |= labels
        for matcher in (selector or "{}")[1:-1].split(","):
            if not matcher.strip():
                continue
            parsed = MATCHER.fullmatch(matcher)
            assert parsed, f"{expr!r}: cannot read the matcher {matcher!r}"
            assert parsed[1] in labels | TARGET_LABELS, f"{expr!r}: {name} has no label {parsed[1]}"
        if kind == "counter":
            assert window == RATE_INTERVAL, f"{expr!r}: {name} needs rate(...{RATE_INTERVAL})"
            before = expr[: match.start()].rstrip()
            assert before.endswith(("rate(", "increase(")), f"{expr!r}: {name} outside rate()"
        else:
            assert window is None, f"{expr!r}: {name} is a gauge, not a range"
    for group in GROUPING.findall(expr):
        for label in (word.strip() for word in group.split(",")):
            assert label in known_labels | {"le"}, f"{expr!r}: no metric here has label {label}"
    return used


def test_the_dashboard_has_a_dashboards_shape() -> None:
    data = dashboard()
    assert data["title"] == "levers9"
    assert isinstance(data["uid"], str) and 0 < len(data["uid"]) <= 40
    assert data["schemaVersion"] == 39
    assert "id" not in data or data["id"] is None  # an import makes its own
    panels = graph_panels(data)
    assert len(panels) >= len(METRICS) // 2
    ids = [panel["id"] for panel in data["panels"]] + [
        panel["id"] for row in data["panels"] if row["type"] == "row" for panel in row["panels"]
    ]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["title"] and panel["type"] in {"timeseries", "stat", "table"}, panel
        assert panel["targets"], f"{panel['title']}: no query"
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        position = panel["gridPos"]
        assert position["w"] > 0 and position["h"] > 0
        assert position["x"] + position["w"] <= 24, panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        position = panel["gridPos"]
        for x in range(position["x"], position["x"] + position["w"]):
            for y in range(position["y"], position["y"] + position["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_the_variables_pick_data_source_pool_and_workspace() -> None:
    variables = {var["name"]: var for var in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, metric in (("pool", "levers9_pool_machines"), ("workspace", "levers9_tasks")):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert var["query"]["query"] == f"label_values({metric}, {name})"
        assert var["definition"] == var["query"]["query"]
    for var in variables.values():
        if var["type"] != "query":
            continue
        query = re.fullmatch(r"label_values\((levers9_[a-z0-9_]+), ([a-z_]+)\)", var["definition"])
        assert query, var["definition"]
        _, _, labels = series_of(query[1])
        assert query[2] in labels | TARGET_LABELS


def test_every_query_reads_metrics_levers9_serves() -> None:
    shown: set[str] = set()
    for expr in exprs(dashboard()):
        shown |= check_expr(expr)
    # And every metric has a panel.
    assert shown == set(METRICS)


def test_the_pool_and_workspace_variables_are_applied() -> None:
    for expr in exprs(dashboard()):
        if re.search(r"\blevers9_(pool_machines|pool_cards|reconcile_[a-z_]+)\b", expr):
            assert 'pool=~"$pool"' in expr, expr
        if re.search(r"\blevers9_tasks\b", expr):
            assert 'workspace=~"$workspace"' in expr, expr


UNITS = {
    "_bytes": "bytes",
    "_percent": "percent",
    "_celsius": "celsius",
    "_watts": "watt",
}


def test_units_fit_the_metrics() -> None:
    for panel in graph_panels(dashboard()):
        unit = panel["fieldConfig"]["defaults"].get("unit")
        for target in panel["targets"]:
            expr = target["expr"]
            if " / " in expr:  # a ratio
                assert unit in {"percentunit", "percent"}, panel["title"]
                continue
            if "histogram_quantile" in expr:
                assert unit == "s", panel["title"]
                continue
            if "_bytes_total" in expr:
                assert unit == "Bps", panel["title"]
                continue
            for name in SERIES.findall(expr):
                for suffix, expected in UNITS.items():
                    if name[0].endswith(suffix):
                        assert unit == expected, f"{panel['title']}: {name[0]} in {unit}"


@pytest.mark.parametrize(
    "expr",
    [
        "levers9_gpu_utilisation_percent",  # misspelt
        "levers9_task_placement_seconds",  # a histogram's bare name has no series
        'levers9_pool_cards{usage="free"}',  # no such label
        "sum by (workspace) (levers9_pool_machines)",  # not a label of this metric
        "sum(levers9_api_requests_total)",  # a counter outside rate()
        "rate(levers9_reconcile_errors_total[5m])",  # not $__rate_interval
        "rate(levers9_tasks[$__rate_interval])",  # a gauge as a range
        "histogram_quantile(0.5, rate(levers9_worker_rtt_seconds_buckets[$__rate_interval]))",
    ],
)
def test_a_wrong_query_is_caught(expr: str) -> None:
    with pytest.raises(AssertionError):
        check_expr(expr)
