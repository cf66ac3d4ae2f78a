"""Lina inference, popularity estimation (moe_plugins/lina/popularity.py): the table's counts and fallback, the
estimate and the paper's accuracy, the JSON file and its three refusals, and `moe-plugins lina-profile` end to
end on a checkpoint the DeepSpeed recipe trained for two steps."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_plugins.lina import popularity as pop
from tests.infer_checks import ROOT, TRAIN_CHARS


@st.composite
def profiles(draw):
    layers, experts = draw(st.integers(2, 5)), draw(st.integers(1, 5))
    rows = draw(st.lists(st.tuples(*[st.integers(0, experts - 1)] * layers), max_size=60))
    start = draw(st.integers(0, layers - 1))         # 0: layer 0's path is empty (its marginal)
    n = draw(st.integers(1, 4))
    return pop.ModelFacts(num_layers=layers, num_experts=experts, top_k=1), rows, start, n


@settings(max_examples=200, deadline=None)
@given(profiles())
def test_counts_sum_to_the_tokens_per_layer_and_per_path(profile):
    facts, rows, start, n = profile
    table = pop.build_table(rows, facts, start_layer=start, path_length=n)
    assert table.tokens == len(rows) and [c.layer for c in table.layers] == list(range(start, facts.num_layers))
    for c in table.layers:
        assert c.marginal == pop.actual_counts(rows, c.layer, facts.num_experts)
        assert tuple(map(sum, zip(*c.paths.values()))) == (c.marginal if c.paths else ())
        for path, counts in c.paths.items():
            span = pop.path_span(c.layer, n)
            assert len(path) == min(n, c.layer) == len(span)
            assert sum(counts) == sum(1 for r in rows if tuple(r[j] for j in span) == path)


@settings(max_examples=200, deadline=None)
@given(profiles(), st.data())
def test_unseen_paths_fall_back_to_the_marginal_and_loads_sum_to_the_batch(profile, data):
    facts, rows, start, n = profile
    table = pop.build_table(rows, facts, start_layer=start, path_length=n)
    batch = data.draw(st.lists(st.tuples(*[st.integers(0, facts.num_experts - 1)] * facts.num_layers),
                               max_size=30))
    for c in table.layers:
        marginal = table.distribution(c.layer, (-1,) * len(pop.path_span(c.layer, n)))
        assert marginal == pytest.approx([x / sum(c.marginal) for x in c.marginal] if rows
                                         else [1 / facts.num_experts] * facts.num_experts)
        for path, counts in c.paths.items():
            assert table.distribution(c.layer, path) == pytest.approx([x / sum(counts) for x in counts])
            assert table.distribution(c.layer, path, min_count=sum(counts) + 1) == marginal
        loads = pop.expected_loads(table, c.layer, batch)
        span = pop.path_span(c.layer, n)
        paths = collections.Counter(tuple(r[j] for j in span) for r in batch)     # the layer's form, per path
        assert pop.path_loads(table, c.layer, paths) == pytest.approx(loads)
        assert sum(loads) == pytest.approx(len(batch))
        assert sum(pop.expected_loads(table, c.layer, batch, keep=1)) <= len(batch) + 1e-9


def test_expected_loads_and_accuracy_on_a_hand_made_table():
    facts = pop.ModelFacts(num_layers=3, num_experts=3, top_k=1)
    rows = [(0, 0, 0)] * 3 + [(0, 1, 1)] + [(1, 1, 2)] * 4         # layer 2 follows path (e0, e1)
    table = pop.build_table(rows, facts, start_layer=1, path_length=3)
    assert dict(table.counts(2).paths) == {(0, 0): (3, 0, 0), (0, 1): (0, 1, 0), (1, 1): (0, 0, 4)}
    assert table.distribution(1, (0,)) == pytest.approx((0.75, 0.25, 0))
    assert table.distribution(2, (2, 2)) == pytest.approx((3 / 8, 1 / 8, 4 / 8))       # never seen: marginal
    assert pop.expected_loads(table, 2, [(0, 0), (1, 1), (2, 2)]) == pytest.approx((1 + 3 / 8, 1 / 8, 1.5))
    assert pop.expected_loads(table, 1, [(0,), (0,)], keep=1) == pytest.approx((1.5, 0, 0))
    assert pop.top_set([5, 7, 7, 1], 2) == {1, 2} and pop.top_set([3, 3, 3], 2) == {0, 1}   # ties: lower id
    # one expert got every token: the estimate is right when its top set holds that expert, whatever runner-up
    assert pop.top_matches([0.1, 0.3, 9, 0.2], [0, 0, 12, 0]) and pop.top_matches([0, 0, 9, 0], [0, 0, 12, 0])
    assert not pop.top_matches([5, 0.3, 0.1, 0.2], [0, 0, 12, 0])          # its top-2 {0, 1}
    assert not pop.top_matches([5, 7, 1, 0], [5, 1, 7, 0])                 # both busy: the sets must be equal
    right = [(0, 0, 0), (0, 0, 0), (1, 1, 2)]         # layer 1 actual {0: 2, 1: 1}; layer 2 actual {0: 2, 2: 1}
    wrong = [(1, 2, 1), (1, 2, 1), (1, 2, 1)]         # layer 1 actual {2}, layer 2 actual {1}
    acc = pop.estimation_accuracy(table, [right, wrong], top=2)
    assert acc.per_layer == ((1, 1, 2), (2, 1, 2)) and acc.value == 0.5
    assert pop.estimation_accuracy(table, [wrong], top=3).value == 1.0        # E <= top: always equal


@settings(max_examples=50, deadline=None)
@given(profiles())
def test_json_round_trip(tmp_path_factory, profile):
    facts, rows, start, n = profile
    table = pop.build_table(rows, facts, start_layer=start, path_length=n)
    path = pop.save_table(table, tmp_path_factory.mktemp("t") / "table.json", meta={"note": "x"})
    assert pop.load_table(path, expect=facts) == table
    assert json.loads(path.read_text())["meta"] == {"note": "x"}


def _saved(tmp_path):
    facts = pop.ModelFacts(num_layers=2, num_experts=4, top_k=1)
    return facts, pop.save_table(pop.build_table([(0, 1), (2, 3)], facts, start_layer=1), tmp_path / "t.json")


def test_a_missing_table_is_refused_naming_the_path(tmp_path):
    with pytest.raises(pop.TableError, match=re.escape(f"{str(tmp_path / 'nope.json')!r} does not exist")):
        pop.load_table(tmp_path / "nope.json")


def test_another_schema_version_is_refused_with_the_version_expected(tmp_path):
    _, path = _saved(tmp_path)
    obj = json.loads(path.read_text())
    for version in (0, 2, "1", None):
        path.write_text(json.dumps({**obj, "schema_version": version}))
        with pytest.raises(pop.TableError, match=f"schema_version {re.escape(repr(version))} is not supported; "
                                                 f"this moe_plugins reads schema_version 1 only"):
            pop.load_table(path)
    path.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(pop.TableError, match="not a lina popularity table"):
        pop.load_table(path)


def test_a_table_of_another_model_lists_every_mismatch(tmp_path):
    facts, path = _saved(tmp_path)
    assert pop.load_table(path, expect=facts).model == facts
    with pytest.raises(pop.TableError) as info:
        pop.load_table(path, expect=pop.ModelFacts(num_layers=6, num_experts=8, top_k=2))
    assert "profiled on another model: num_layers: table 2, model 6; num_experts: table 4, model 8; " \
           "top_k: table 1, model 2" in str(info.value)
    with pytest.raises(pop.TableError, match=r"profiled on another model: num_experts: table 4, model 8$"):
        pop.load_table(path, expect=pop.ModelFacts(num_layers=2, num_experts=8, top_k=1))


def test_a_malformed_table_lists_every_bad_field(tmp_path):
    _, path = _saved(tmp_path)
    obj = json.loads(path.read_text())
    obj["layers"][0]["marginal"] = [1, 2]
    obj["layers"][0]["paths"]["9"] = [0, 0, 0, 1]
    path.write_text(json.dumps(obj))
    with pytest.raises(pop.TableError) as info:
        pop.load_table(path)
    assert "layers[0].marginal must be 4 counts >= 0" in str(info.value)
    assert "layers[0].paths['9'] must be 1 comma-separated expert ids in [0, 4)" in str(info.value)


@pytest.mark.parametrize("call,message", [
    (lambda f: pop.build_table([(0, 0)], f, start_layer=2), "start_layer (2) must be in [0, 2)"),
    (lambda f: pop.build_table([(0, 0)], f, start_layer=-1), "start_layer (-1) must be in [0, 2)"),
    (lambda f: pop.build_table([(0, 0)], f, start_layer=1, path_length=0), "path_length (0) must be an integer"),
    (lambda f: pop.build_table([(0, 4)], f, start_layer=1), "records[0][1] (4) must be an expert id in [0, 4)"),
    (lambda f: pop.build_table([(0,)], f, start_layer=1), "records[0] has 1 entries; expected one per MoE layer"),
    (lambda f: pop.expected_loads(pop.build_table([], f, start_layer=1), 1, [(0,)], keep=0), "keep (0) must be"),
    (lambda f: pop.ModelFacts(num_layers=0, num_experts=4, top_k=True), "num_layers (0) must be an integer >= 1; "
                                                                         "top_k (True) must be"),
])
def test_bad_input_names_the_field_and_value(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(pop.ModelFacts(num_layers=2, num_experts=4, top_k=1))


# ---- the CLI on a recipe checkpoint ---------------------------------------------------------------------------

def test_lina_profile_on_a_recipe_checkpoint(tmp_path, recipe_checkpoint):
    ckpt = recipe_checkpoint            # the recipe's 2 steps on its first TRAIN_CHARS characters
    table = tmp_path / "table.json"
    cli = [sys.executable, "-m", "moe_plugins.tools.cli", "lina-profile", "--ckpt-dir", str(ckpt),
           "--skip-chars", str(TRAIN_CHARS), "--chars", "12000", "--batch-size", "2", "--out", str(table)]
    done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"estimation accuracy \(top-2 set equal, \d+ batch-layers .*\): \d+\.\d%", done.stdout)
    loaded = pop.load_table(table, expect=pop.ModelFacts(num_layers=2, num_experts=4, top_k=1))
    assert (loaded.start_layer, loaded.path_length) == (1, 3) and loaded.tokens > 0
    assert sum(loaded.counts(1).marginal) == loaded.tokens
    meta = json.loads(table.read_text())["meta"]
    assert meta["text"]["skip_chars"] == TRAIN_CHARS == 20000 and 0 <= meta["accuracy"]["value"] <= 1
    bad = subprocess.run(cli[:4] + ["--ckpt-dir", str(tmp_path / "none"), "--out", str(table)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and f"--ckpt-dir {str(tmp_path / 'none')!r} has no `latest` file" in bad.stderr
