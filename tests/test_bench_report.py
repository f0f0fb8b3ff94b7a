"""The benchmarks' shared report: ratios only from measured pairs, inputs apart from figures,
and never a number that was not measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.ingest import RATIOS as INGEST_RATIOS
from bench.ingest import measure_ingest_vs_cp
from bench.report import Results, ratios_of, render_sections, write_report


def test_ratios_of_leaves_out_pairs_not_measured() -> None:
    pairs = {"a_vs": ("a", "x"), "b_vs": ("b", "x"), "c_vs": ("c", "zero")}
    ratios = ratios_of(pairs, {"a": 3.0, "c": 1.0}, {"x": 2.0, "zero": 0.0})
    assert ratios == {"a_vs": 1.5}


def test_write_report_keeps_inputs_apart_and_only_when_given(tmp_path: Path) -> None:
    path = tmp_path / "out" / "report.json"
    write_report(path, figures={"f_s": 1.0}, ratios={"r": 0.5}, anchors={"a_s": 2.0})
    assert set(json.loads(path.read_text())) == {"figures", "ratios", "anchors", "machine"}

    write_report(
        path, figures={"f_s": 1.0}, ratios={"r": 0.5}, anchors={"a_s": 2.0}, inputs={"n": 5}
    )
    report = json.loads(path.read_text())
    assert report["inputs"] == {"n": 5}
    assert report["figures"] == {"f_s": 1.0}
    assert list(tmp_path.joinpath("out").iterdir()) == [path]  # no partial file left


def test_write_report_refuses_a_number_that_was_not_measured(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"inputs\['n'\]"):
        write_report(tmp_path / "r.json", figures={}, ratios={}, anchors={}, inputs={"n": math.nan})
    assert not (tmp_path / "r.json").exists()


def test_render_sections_shows_every_section() -> None:
    table = render_sections({"f_s": 1.0}, {"a_s": 2.0}, {"r": 0.5}, {"n": 5.0})
    lines = table.splitlines()
    assert [line.split()[:2] for line in lines[2:]] == [
        ["inputs", "n"],
        ["figures", "f_s"],
        ["anchors", "a_s"],
        ["ratios", "r"],
    ]


def test_results_merged_joins_every_section() -> None:
    left = Results(figures={"f": 1.0}, anchors={"a": 2.0}, ratios={"r": 0.5})
    right = Results(figures={"g": 3.0}, anchors={"b": 4.0})
    assert left.merged(right) == Results(
        figures={"f": 1.0, "g": 3.0}, anchors={"a": 2.0, "b": 4.0}, ratios={"r": 0.5}
    )


def test_ingest_reports_cp_as_its_anchor(tmp_path: Path) -> None:
    results = measure_ingest_vs_cp(tmp_path, size_bytes=1 << 20, repeats=1)
    assert set(results.figures) == {"ingest_mb_s", "ingest_stream_mb_s"}
    assert set(results.anchors) == {"cp_mb_s"}
    assert set(results.ratios) == set(INGEST_RATIOS)
    for section in (results.figures, results.anchors, results.ratios):
        assert all(math.isfinite(v) and v > 0 for v in section.values())
    assert list(tmp_path.iterdir()) == []  # it removes what it wrote
