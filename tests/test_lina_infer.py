"""Lina's inference scheduling (#24, docs/lina.md "Inference"): the two-phase placement and the uneven exchange
give exactly the stock DeepSpeed layer's outputs (fp64, 4 gloo ranks) whatever the placement; the section and
the table are refused with every problem named; the pure helpers."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("deepspeed")

import moe_plugins  # noqa: E402
from moe_plugins.core.gating import Routing  # noqa: E402
from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.lina.config import InferenceConfig, LinaConfig  # noqa: E402
from moe_plugins.lina.exchange import kept_routes, receive_segments, send_order  # noqa: E402
from moe_plugins.lina.infer import ModelSchedule, PathRecorder  # noqa: E402
from moe_plugins.lina.placement import Placement, plan_placement, split_tokens  # noqa: E402
from moe_plugins.lina.popularity import ModelFacts, build_table, save_table, table_to_json  # noqa: E402
from moe_plugins.plugins import default_registry  # noqa: E402
from tests.workers import bad_configs as bad_jobs  # noqa: E402
from tests.workers import lina_infer as jobs  # noqa: E402
from tests.workers.bad_configs import HostState  # noqa: E402

WORLD, LAYERS, EXPERTS, DEAD = 4, 3, 8, 5
TOL = 1e-9
CASE = {"layers": LAYERS, "experts": EXPERTS, "k": 1, "eval_capacity": 8.0, "drop": True, "tokens": 24,
        "batches": 7, "seed": 3, "dead": DEAD, "rescale_at": 5}


def skewed_table(path: Path, *, layers: int = LAYERS, experts: int = EXPERTS, k: int = 1, start: int = 1) -> str:
    """A table whose paths mostly say "expert 0, then expert 0": phase one replicates expert 0 on most devices."""
    rng = random.Random(5)
    records = [[0] * layers if rng.random() < 0.9 else [rng.randrange(experts) for _ in range(layers)]
               for _ in range(400)]
    table = build_table(records, ModelFacts(num_layers=layers, num_experts=experts, top_k=k), start_layer=start)
    return str(save_table(table, path))


def section(table: Any = None, **inference: Any) -> Dict[str, Any]:
    return {"schedule": "baseline", "lina": {"inference": {"table": table, **inference}}}


# ---- exactness on 4 gloo ranks ------------------------------------------------------------------------------

def check_exact(results: List[Dict[str, Any]], case: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's outputs equal stock's; rank 0's statistics agree with the placements; its stats."""
    for rank, r in enumerate(results):
        assert r["max_err"] <= TOL, (rank, r["max_err"])
        assert r["same_zero"], rank
        assert len(r["placements"]) == case["batches"]
    stats = results[0]["stats"]
    assert [s["batches"] for s in stats] == [case["batches"]] * case["layers"]
    assert all(len(s["exchange_ms"]) == case["batches"] for s in stats)
    assert all(s["batches"] == 0 and s["exchange_ms"] == [] for s in results[0]["reset"])
    assert [s["layer"] for s in stats] == [s["layer"] for s in results[1]["stats"]]
    return stats


@pytest.mark.parametrize("weights", ["all", "home"])
def test_two_phase_schedule_equals_stock_for_every_placement(world, tmp_path, weights):
    """``all``: replicas swapped in from every rank's host copy of every expert, gathered at the first placement
    and again after the weights were rescaled in place (batch 5); ``home``: fetched from the home rank."""
    table = skewed_table(tmp_path / "table.json")
    results = world(WORLD).run(jobs.compare_stack, section(table, max_experts_per_device=8, expert_weights=weights),
                               CASE, timeout_s=600)
    stats = check_exact(results, CASE)
    r = results[0]
    assert any(min(c) == 0 for c in r["global_counts"])                   # the dead expert: no token at all
    assert all(p is None for batch in r["placements"] for p in batch[:1])  # layer 0: the plain exchange
    final = [p[0] for batch in r["placements"] for p in batch[1:]]
    first = [p[1] for batch in r["placements"] for p in batch[1:]]
    assert max(max(p) for p in final) >= 3 and max(max(p) for p in first) >= 3   # many replicas of one expert
    assert len({tuple(p) for p in final + first}) >= 3                    # many placements
    assert stats[0]["estimate_total"] == 0 and stats[0]["phase2_replans"] == 0
    for s in stats[1:]:
        assert s["estimate_total"] == CASE["batches"] and 0 < s["phase2_replans"] <= CASE["batches"]
        assert s["estimate_accurate"] + s["phase2_replans"] == s["estimate_total"]
        assert s["experts_moved"] > 0
        assert s["weight_gathers"] == (2 if weights == "all" else 0), s


def test_profiled_table_phase_one_placement_carries_the_exchange(world, tmp_path):
    """A table profiled on the same model's stock routing (other batches of the same kind): the estimate is often
    right, so phase one's placement, replicas included, is the one the tokens are exchanged on."""
    case = {**CASE, "hot_scale": 1.5, "batches": 14, "rescale_at": 9, "profile": str(tmp_path / "profiled.json")}
    results = world(WORLD).run(jobs.compare_stack, section("placeholder", max_experts_per_device=4), case,
                               timeout_s=600)
    stats = check_exact(results, case)
    kept = [p for batch in results[0]["placements"] for p in batch[1:] if p[0] == p[1]]
    assert kept and max(max(p[0]) for p in kept) >= 2                     # phase one's replicas, exchanged on
    for s in stats[1:]:
        assert s["estimate_accurate"] > 0 and s["estimate_accurate"] + s["phase2_replans"] == case["batches"]
    # layer 1 gathers its own estimate (layer 0 is not scheduled); layer 1's phase two carries layer 2's
    assert [s["phase1_gathers"] for s in stats] == [0, case["batches"], 0]
    assert [s["estimate_accurate"] for s in stats[1:]] == [13, 8]        # as when layer 2 gathered its own


def test_estimation_off_tight_packing_top2_drops_equals_stock(world):
    case = {**CASE, "k": 2, "eval_capacity": 2.0, "batches": 5, "rescale_at": 3}
    results = world(WORLD).run(jobs.compare_stack,
                               section(None, estimation=False, start_layer=0, max_experts_per_device=2), case,
                               timeout_s=600)
    stats = check_exact(results, case)
    assert all(s["estimate_total"] == 0 and s["phase2_replans"] == case["batches"] for s in stats)
    for batch in results[0]["placements"]:
        assert all(p is not None and p[1] is None and sum(p[0]) <= WORLD * 2 for p in batch)


def test_top1_drops_with_phase_one_from_the_tables_start_equals_stock(world, tmp_path):
    """Layers 0 and 1 run the section's own schedule (here with the ragged exchange) and record the path."""
    table = skewed_table(tmp_path / "t2.json", start=2)
    case = {**CASE, "eval_capacity": 1.0, "batches": 4, "rescale_at": None}
    plugin = {**section(table), "exchange": "ragged"}                    # start_layer: the table's 2
    results = world(WORLD).run(jobs.compare_stack, plugin, case, timeout_s=600)
    stats = check_exact(results, case)
    assert sum(r["zero_rows"] for r in results) > 0                       # capacity drops, the same tokens
    assert [s["estimate_total"] for s in stats] == [0, 0, case["batches"]]


def test_a_table_from_layer_0_schedules_layer_0_from_its_marginal_and_equals_stock(world, tmp_path):
    """``start_layer`` 0: layer 0's path is empty, so phase one places it from the profiled marginal (expert 0
    hot in this table: replicated), the same placement every batch; outputs equal stock's."""
    table = skewed_table(tmp_path / "t0.json", start=0)
    case = {**CASE, "batches": 4, "rescale_at": None}
    results = world(WORLD).run(jobs.compare_stack, section(table, max_experts_per_device=8), case, timeout_s=600)
    stats = check_exact(results, case)
    assert [s["estimate_total"] for s in stats] == [case["batches"]] * LAYERS
    assert [s["phase1_gathers"] for s in stats] == [0] * LAYERS          # layer 0: the marginal; then delivered
    first_0 = [batch[0][1] for batch in results[0]["placements"]]         # layer 0's phase-one placements
    assert all(p is not None and p == first_0[0] for p in first_0) and first_0[0][0] >= 2, first_0


def test_engine_path_dropless_top2_equals_stock_engine(world, tmp_path):
    table = skewed_table(tmp_path / "t3.json", layers=2, k=2)
    case = {**CASE, "layers": 2, "k": 2, "drop": False, "batches": 3}
    plugin = {"schedule": "baseline", "lina": {"inference": {"table": table, "start_layer": 1}}}
    results = world(WORLD).run(jobs.compare_engines, plugin, case, timeout_s=600)
    for r in results:
        assert r["max_err"] <= 1e-5 * max(1.0, r["scale"]), r
        assert [s["batches"] for s in r["stats"]] == [case["batches"]] * 2
        assert r["stats"][1]["estimate_total"] == case["batches"]


# ---- bad input ----------------------------------------------------------------------------------------------

def enable_message(plugin: Dict[str, Any]) -> str:
    before = HostState.capture(megatron=False)
    with pytest.raises(ValueError) as info:
        moe_plugins.enable({"train_batch_size": 8, "moe_plugins": plugin})
    assert before.differences(HostState.capture(megatron=False)) == []
    return str(info.value)


def test_missing_table_is_refused_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "table.json"
    message = enable_message(section(str(missing)))
    assert str(missing) in message and "does not exist" in message


def test_older_schema_is_refused_naming_the_version(tmp_path):
    path = tmp_path / "old.json"
    table = build_table([[0, 1, 2]] * 4, ModelFacts(num_layers=3, num_experts=8, top_k=1), start_layer=1)
    path.write_text(json.dumps({**table_to_json(table), "schema_version": 0}))
    message = enable_message(section(str(path)))
    assert "schema_version 0 is not supported" in message and "schema_version 1" in message


def test_table_of_another_model_is_refused_by_the_engine(world, tmp_path):
    table = skewed_table(tmp_path / "other.json", layers=3, experts=8)
    results = world(2).run(bad_jobs.refused_engine, section(table, start_layer=1), None, {}, str(tmp_path), 2,
                           timeout_s=600)
    for r in results:
        assert r["changed"] == [], r
        assert "profiled on another model" in r["message"], r
        assert "num_layers: table 3, model 1" in r["message"] and "num_experts: table 8, model 4" in r["message"]


def test_table_of_another_model_is_refused_outside_an_engine(world, tmp_path):
    experts = skewed_table(tmp_path / "e4.json", experts=4)
    layers = skewed_table(tmp_path / "l2.json", layers=2)
    results = world(WORLD).run(jobs.refused_stack, section(experts), {**CASE, "batches": 1}, timeout_s=600)
    for r in results:
        assert r["changed"] == [] and "num_experts: table 4, model 8" in r["message"], r
    results = world(WORLD).run(jobs.refused_stack, section(layers), {**CASE, "batches": 1}, timeout_s=600)
    for r in results:
        assert r["changed"] == [] and "num_layers: table 2, model 3" in r["message"], r


@pytest.mark.parametrize("inference, fragments", [
    ({"tabel": "x"}, ["inference.tabel is unknown", "(did you mean 'table'?)", "inference.table is missing"]),
    ({"table": "", "estimation": "yes"}, ["inference.table ('')", "inference.estimation ('yes') must be true"]),
    ({"table": "t.json", "start_layer": -2, "max_experts_per_device": 0},
     ["inference.start_layer (-2) must be an integer >= 0", "inference.max_experts_per_device (0) must be an integer"]),
    ({"estimation": False, "start_layer": -1}, ["inference.start_layer (-1) must be an integer >= 0"]),
    ({"estimation": False, "expert_weights": "host"}, ["inference.expert_weights ('host') must be \"all\""]),
    ([1], ["moe_plugins.lina.inference ([1]) must be a JSON object"]),
])
def test_bad_sections_name_every_field(inference: Any, fragments: List[str]):
    plugin = {"lina": {"inference": inference}}
    for message in (str(pytest.raises(ValueError, PluginConfig.from_dict, plugin,
                                      **default_registry().config_choices()).value), enable_message(plugin)):
        for fragment in fragments:
            assert fragment in message, (fragment, message)


def test_section_parts():
    only = LinaConfig.from_dict({"inference": {"estimation": False}})
    assert only.inference == InferenceConfig(estimation=False) and not only.training
    both = LinaConfig.from_dict({"priority": False, "inference": {"table": "t.json", "start_layer": 4}})
    assert both.training and both.inference.start_layer == 4
    assert LinaConfig.from_dict({}).training and LinaConfig.from_dict({}).inference is None
    with pytest.raises(ValueError, match="allowed: priority, micro_op_mb, packing, inference"):
        LinaConfig.from_dict({"infer": {}})


def test_start_layer_and_layer_count_are_checked_at_the_first_batch():
    table = build_table([[0, 1, 2]] * 4, ModelFacts(num_layers=3, num_experts=8, top_k=1), start_layer=2)
    model = ModelSchedule(config=InferenceConfig(table="t.json"), table=table, start_layer=2, source="'t.json'")
    for _ in range(2):
        model.join()
    with pytest.raises(ValueError, match="num_layers: table 3, model 2.*start_layer \\(2\\) must be below"):
        model.seal()
    model.join()
    model.seal()
    with pytest.raises(RuntimeError, match="no MoE layer can join"):
        model.join()


# ---- pure helpers -------------------------------------------------------------------------------------------

def routing(expert_SK: List[List[int]], slot_SK: List[List[int]], capacity: int) -> Routing:
    e = torch.tensor(expert_SK)
    return Routing(expert_SK=e, slot_SK=torch.tensor(slot_SK), weight_SK=torch.ones(e.shape, dtype=torch.float64),
                   capacity=capacity, aux_loss=torch.tensor(0.0), exp_counts_E=torch.bincount(e.reshape(-1), minlength=3))


def test_kept_routes_are_in_slot_order_without_drops():
    r = routing([[1, 0], [1, 2], [0, 1], [1, 0]], [[0, 1], [1, -1], [0, 2], [-1, -1]], capacity=3)
    kept = kept_routes(r, 3)
    assert kept.counts_E == (2, 3, 0)
    assert kept.flat_R.tolist() == [0, 1, 3, 4, 5]                       # expert * C + slot
    assert kept.token_R.tolist() == [2, 0, 0, 1, 2]


def test_send_order_and_receive_segments_follow_the_splits():
    placement = plan_placement([10, 1, 1, 0], 3, max_experts_per_device=4)
    counts = [[3, 1, 0, 0], [4, 0, 1, 0], [2, 0, 0, 0]]
    splits = split_tokens(placement, counts)
    for source in range(3):
        order = send_order(splits, source, counts[source])
        assert sorted(order) == list(range(sum(counts[source])))
        # each expert's routes leave in slot order
        starts = [sum(counts[source][:e]) for e in range(4)]
        for e in range(4):
            mine = [i for i in order if starts[e] <= i < starts[e] + counts[source][e]]
            assert mine == sorted(mine)
    for device in range(3):
        segments = receive_segments(splits, device)
        assert sum(n for _, _, n in segments) == sum(splits.recv_DE[device])
        assert {e for e, _, n in segments if n} <= set(placement.experts_on(device))
    bad = Placement(num_devices=1, max_experts_per_device=4, loads=(1.0,), shares=(1.0,), assignments=((0, 0),),
                    trimmed=0)
    with pytest.raises(ValueError, match="covers"):
        send_order(split_tokens(bad, [[2]]), 0, [3])


def test_path_recorder_resets_at_layer_zero_and_checks_tokens():
    rec = PathRecorder()
    rec.record(0, torch.tensor([1, 2]))
    rec.record(1, torch.tensor([3, 0]))
    rec.record(2, torch.tensor([3, 3]))
    assert rec.path_counts(3, 3, 2, 4) == {(1, 3, 3): 1, (2, 0, 3): 1}
    assert rec.path_counts(3, 1, 2, 4) == {(3,): 2}                       # only the path's layers are read
    assert rec.path_counts(0, 3, 5, 4) == {(): 5}                         # layer 0: the empty path
    rec.record(0, torch.tensor([5, 5]))                                   # a new forward
    with pytest.raises(RuntimeError, match="layers \\[1\\] did not run"):
        rec.path_counts(2, 3, 2, 8)
    with pytest.raises(RuntimeError, match="has 3 tokens and layer 0 had 2"):
        rec.path_counts(1, 3, 3, 8)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(1, 3), st.data())
def test_path_counts_count_every_distinct_path(experts, layers, data):
    rows = data.draw(st.lists(st.tuples(*[st.integers(0, experts - 1)] * layers), min_size=1, max_size=40))
    rec = PathRecorder()
    for j in range(layers):
        rec.record(j, torch.tensor([r[j] for r in rows]))
    assert rec.path_counts(layers, layers, len(rows), experts) == dict(collections.Counter(rows))
