"""Lina's core: its config section, tensor partitioning and the "auto" micro-op size (pure), and the
scheduler on gloo ranks: dense gradients reduced as micro-ops during backward equal a synchronous all-reduce
(bitwise at DP = 2, 1e-12 in fp64 at DP = 4); from the engine's timeline, no micro-op starts while an MoE
exchange is pending or in flight and at most one overlaps any all-to-all; 50 steps with random delays finish."""

import pytest
from hypothesis import given, strategies as st

from moe_plugins.core.costmodel import LinearModel
from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.lina.config import LinaConfig, lina_problems
from moe_plugins.lina.microops import MAX_BYTES, MIN_BYTES, auto_micro_op_bytes, micro_op_bytes, micro_op_slices
from moe_plugins.plugins import default_registry
from tests.lina_checks import micro_op_order as _order
from tests.workers.lina import lina_steps


def test_config_lists_every_problem_with_its_path():
    problems = lina_problems({"priority": "yes", "micro_op_mb": 0, "packing": 3.5, "chunks": 2})
    text = "; ".join(problems)
    for needle in ("moe_plugins.lina.chunks is unknown; allowed: priority, micro_op_mb, packing",
                   "moe_plugins.lina.priority ('yes') must be true or false",
                   "moe_plugins.lina.micro_op_mb (0) must be a number of MB > 0",
                   "moe_plugins.lina.packing (3.5) must be an integer >= 1"):
        assert needle in text, needle
    assert LinaConfig.from_dict({"micro_op_mb": 0.25}) == LinaConfig(micro_op_mb=0.25)


def test_the_plugin_section_validates_lina_through_the_registry():
    choices = default_registry().config_choices()
    with pytest.raises(ValueError) as err:
        PluginConfig.from_dict({"schedule": "nope", "lina": {"micro_op_mb": -1}}, **choices)
    assert "moe_plugins.schedule ('nope')" in str(err.value) and "moe_plugins.lina.micro_op_mb (-1)" in str(err.value)
    assert PluginConfig.from_dict({"lina": {"priority": True}}, **choices).lina == {"priority": True}
    with pytest.raises(ValueError, match=r"moe_plugins.lina \(1\) must be a JSON object"):
        PluginConfig.from_dict({"lina": 1}, **choices)


@given(numel=st.integers(0, 10_000), chunk=st.integers(-1, 3_000))
def test_micro_op_slices_cover_the_buffer_once(numel, chunk):
    slices = micro_op_slices(numel, chunk)
    assert [i for a, b in slices for i in range(a, b)] == list(range(numel))
    if chunk > 0:
        assert all(b - a <= chunk for a, b in slices) and len(slices) == -(-numel // chunk)


def test_auto_size_takes_about_the_target_on_the_fitted_link():
    # 1 Gbit/s (8 ns per byte): 2.5 ms on the link is 312.5 kB, whatever the per-op software cost
    assert auto_micro_op_bytes(1e-3, 8e-9) == 312_500 == auto_micro_op_bytes(5e-3, 8e-9)
    assert auto_micro_op_bytes(0.0, 1e-6) == MIN_BYTES and auto_micro_op_bytes(0.0, 1e-15) == MAX_BYTES

    class Profile:
        def model(self, op, group):
            assert (op, group) == ("all_reduce", "dp")
            return LinearModel(alpha=1e-3, beta=8e-9, unit="bytes")
    assert micro_op_bytes("auto", Profile()) == 312_500 and micro_op_bytes(0.5) == 500_000
    with pytest.raises(ValueError, match=r'micro_op_mb \("auto"\) needs a cost profile'):
        micro_op_bytes("auto", None)


# ---- gloo ranks --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,tolerance", [(2, 0.0), (4, 1e-12)])
def test_micro_op_reduction_equals_the_synchronous_one_and_yields_to_exchanges(world, size, tolerance):
    results = world(size).run(lina_steps, size, 4, priority=True, micro_op_bytes=512, timeout_s=300)
    waited = 0
    for res in results:
        assert max(res["diffs"]) <= tolerance, res["diffs"]
        waited += _order(res["timeline"])
        assert sum(r["priority"] == "background" for r in res["timeline"]) > 4 * 6    # cut into micro-ops
    assert waited > 0, "no micro-op ever waited for an exchange: the test exercised nothing"


def test_fifty_steps_with_random_delays_finish(world):
    results = world(4).run(lina_steps, 4, 50, priority=True, micro_op_bytes=1024, max_sleep_s=0.02, seed=3,
                           timeout_s=600)
    for res in results:
        assert max(res["diffs"]) <= 1e-12
        _order(res["timeline"])


def test_fifo_reference_runs_beside_the_exchanges(world):
    results = world(2).run(lina_steps, 2, 3, priority=False, micro_op_bytes=512, timeout_s=300)
    for res in results:
        assert max(res["diffs"]) == 0.0
        # one op per gradient: no partitioning
        assert sum(r["priority"] == "background" for r in res["timeline"]) == 3 * 6
