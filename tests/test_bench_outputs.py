"""The bench scripts' shared ends (``moe_plugins.tools.bench.outputs``): a checked report written as
JSON/Markdown/PNG, and a rank running its JSON config."""

from __future__ import annotations

import json

import pytest

from moe_plugins.tools.bench.outputs import run_rank_config, write_report


def _plot(report, path):
    path.write_bytes(b"png of " + report["name"].encode())


def test_a_report_is_written_as_json_md_and_png(tmp_path):
    report = {"name": "r", "rows": [1, 2]}
    out = tmp_path / "results"
    assert write_report(report, out, "stem", problems=lambda r: [], markdown=lambda r: f"# {r['name']}\n",
                        plot=_plot) is report
    assert json.loads((out / "stem.json").read_text()) == report
    assert (out / "stem.md").read_text() == "# r\n" and (out / "stem.png").read_bytes() == b"png of r"


def test_a_malformed_report_names_its_problems_and_writes_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="the report is malformed: rows missing; meta missing"):
        write_report({"name": "r"}, tmp_path / "results", "stem", problems=lambda r: ["rows missing", "meta missing"],
                     markdown=lambda r: "", plot=_plot)
    assert not (tmp_path / "results").exists()


def test_a_rank_runs_its_json_config(tmp_path):
    path = tmp_path / "rank.json"
    path.write_text(json.dumps({"rank": 1, "case": "link"}))
    seen = []
    assert run_rank_config(str(path), seen.append) == 0
    assert seen == [{"rank": 1, "case": "link"}]
