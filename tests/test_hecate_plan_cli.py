"""``moe-plugins plan hecate`` (moe_plugins/hecate/plan_cli.py) and the pure explanation behind it
(moe_plugins/hecate/explain.py): a case worked by hand, the load flags, the text and JSON, and bad flags refused in
one line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moe_plugins.hecate.explain import LayerShape, explain, source_routes
from moe_plugins.hecate.plan import rank_nodes
from moe_plugins.plugins import default_registry
from moe_plugins.tools.cli import main


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_source_routes_split_the_load_evenly():
    assert source_routes([10, 3, 0], 4) == ((3, 1, 0), (3, 1, 0), (2, 1, 0), (2, 0, 0))


def test_a_two_rank_case_by_hand():
    """2 nodes x 1 rank, E 2 of M 2, H 2 (12 values, 48 bytes each; a row 8 bytes), load [10, 2]: m = 1 slot per
    rank, so each expert gets one copy; every route then stays local. Expert parallelism: rank 1 sends its 5
    routes of expert 0 and rank 0 its 1 route of expert 1, 4 times a step; Hecate: no token bytes, spAG and spRS of
    one expert each way (4 x 48 bytes), each node receiving 2 x 48; Eq. 2: 2 x (1/2) x 48 per expert."""
    out = explain([10, 2], rank_nodes(2, 1), LayerShape(experts=2, hidden=2, ffn=2))
    assert out["expert_bytes"] == 48 and out["row_bytes"] == 8
    assert out["budget"] == {"t": 2, "m": 1, "everywhere": False}
    assert [r["copies"] for r in out["per_expert"]] == [[0, 1], [0, 1]] and out["extra_copies"] == 2
    assert [r["pays"] for r in out["per_expert"]] == [True, False] and out["paying_experts"] == 1
    assert "cost more than they save" in out["per_expert"][1]["why"]
    ep, hc = out["expert_parallelism"], out["hecate"]
    assert ep["token_bytes_per_step"] == (5 + 1) * 4 * 8 == ep["inter_node_bytes_per_step"]
    assert ep["node_inbound_bytes"] == {"0": 5 * 32, "1": 1 * 32} and ep["busiest_node_inbound_bytes"] == 160
    assert hc["token_bytes_per_step"] == 0 and hc["copy_bytes_per_step"] == 4 * 48
    assert hc["copy_inter_node_bytes_per_step"] == 4 * 48 and hc["copy_bytes_R"] == [96, 96]
    assert hc["node_inbound_bytes"] == {"0": 96, "1": 96} and hc["busiest_node_inbound_bytes"] == 96
    assert hc["eq2_bytes"] == 2 * 48


def test_budget_knobs_change_the_copies():
    shape = LayerShape(experts=4, hidden=4, ffn=8)
    nodes = rank_nodes(4, 2)
    none = explain([100, 10, 10, 10], nodes, shape, overlap=0)
    assert none["extra_copies"] == 0 and none["hecate"]["copy_bytes_per_step"] == 0
    assert none["hecate"]["token_bytes_per_step"] == none["expert_parallelism"]["token_bytes_per_step"]
    assert all("not among the top t = 0" in r["why"] for r in none["per_expert"])
    one = explain([100, 10, 10, 10], nodes, shape, overlap=1, extra_experts=1)
    assert one["budget"] == {"t": 1, "m": 1, "everywhere": True}
    assert one["per_expert"][0]["copies"] == [0, 1, 2, 3] and one["extra_copies"] == 3
    moved = explain([100, 10, 10, 10], nodes, shape, overlap=0, homes_E=(3, 0, 1, 2))
    assert [r["home"] for r in moved["per_expert"]] == [3, 0, 1, 2]
    assert moved["expert_parallelism"]["node_inbound_bytes"]["1"] > none["expert_parallelism"]["node_inbound_bytes"]["1"]


LAYER = ["--nodes", "2", "--ranks-per-node", "2", "--E", "8", "--M", "256", "--H", "512"]


def test_plan_hecate_is_registered_and_prints_text_and_json():
    assert "hecate" in default_registry().planners()
    code, out, err = run_cli("plan", "hecate", *LAYER, "--routes", "8192", "--hot-share", "0.45", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["per_expert"][0]["routes"] == 3686 and sum(r["routes"] for r in plan["per_expert"]) == 8192
    assert plan["per_expert"][0]["copies"] == [0, 1, 2, 3] and plan["budget"]["m"] == 2
    assert plan == explain([3686] + [644] * 5 + [643] * 2, rank_nodes(4, 2), LayerShape(8, 256, 512))
    code, text, err = run_cli("plan", "hecate", *LAYER, "--load", *map(str, [800] * 8), "--extra-experts", "0")
    assert code == 0, err
    assert "busiest node's inbound bytes" in text and "m = 0 copies per rank" in text
    assert text.count("home only") == 0 and text.count("but m = 0: no rank has a slot for a copy") == 8


@pytest.mark.parametrize("args, message", [
    (["--load", "1", "2"], "--load ([1, 2]) must be 8 integers >= 0 (one per expert)"),
    ([], "give the load as --load (E integers) or as --routes with --hot-share, not both or neither"),
    (["--routes", "10"], "--routes and --hot-share go together"),
    (["--routes", "10", "--hot-share", "1.5"], "--hot-share (1.5) in [0, 1]"),
    (["--load", *["1"] * 8, "--extra-experts", "many", "--overlap", "-1"],
     "--extra-experts ('many') must be an integer >= 0 or \"auto\"; --overlap (-1) must be an integer >= 0"),
    (["--load", *["1"] * 8, "--homes", "0", "9"], "--homes ([0, 9]) must be 8 ranks in [0, 4)"),
])
def test_plan_hecate_bad_input_is_one_line(args, message):
    code, out, err = run_cli("plan", "hecate", *LAYER, *args)
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("moe-plugins plan: error: invalid Hecate plan:")
    assert message in lines[0], lines[0]


def test_plan_hecate_checks_the_layout():
    code, _, err = run_cli("plan", "hecate", "--nodes", "2", "--ranks-per-node", "3", "--E", "8", "--M", "4",
                           "--H", "4", "--load", *["1"] * 8)
    assert code == 2 and "--E (8) must be a multiple of the 6 ranks" in err
