"""Lancet's ``"lancet"`` section of the ``moe_plugins`` config (moe_plugins/lancet/config.py): defaults, every
refusal naming the field, the value and what is allowed, refusals across the section, and the pure overlap
arithmetic of moe_plugins/lancet/overlap.py. One process, no ranks."""

from __future__ import annotations

import pytest

from moe_plugins.core.plugin_config import PluginConfig, plugin_config_problems
from moe_plugins.lancet.config import LancetConfig, lancet_across, lancet_problems
from moe_plugins.lancet.overlap import covered, hidden_fraction, merged, overlap_fraction
from moe_plugins.patches.deepspeed_hecate import config_choices
from moe_plugins.plugins import default_registry

CHOICES = config_choices()       # the DeepSpeed adapter's rules: it runs the section


def _parse(section):
    return PluginConfig.from_dict(section, "moe_plugins", **CHOICES)


def test_section_parses_and_defaults():
    assert LancetConfig.from_dict(None) == LancetConfig(defer_wgrad=True, partitions=1, dense_wgrad=False)
    cfg = _parse({"lancet": {}, "pipeline_degree": 2})
    assert cfg.lancet == {} and LancetConfig.from_dict(cfg.lancet).defer_wgrad
    full = {"defer_wgrad": True, "partitions": 1, "dense_wgrad": False}
    assert _parse({"lancet": full}).to_dict()["lancet"] == full
    assert lancet_problems(full) == []
    # defer_wgrad false keeps the section and constrains nothing
    assert _parse({"lancet": {"defer_wgrad": False}, "schedule": "parm-s2", "exchange": "padded"}).lancet


def test_partitions_and_auto_accepted():
    assert lancet_problems({"partitions": 4}) == [] and _parse({"lancet": {"partitions": 2}}).lancet["partitions"] == 2
    assert lancet_problems({"partitions": "auto"}) == [] and lancet_problems({"partitions": "tune"}) == []
    with pytest.raises(ValueError, match=r"moe_plugins\.pipeline_degree \(2\) cannot run with moe_plugins\.lancet\."
                                         r"partitions \(auto\)"):
        _parse({"lancet": {"partitions": "auto"}, "pipeline_degree": 2})
    # partitions make the section active even without defer_wgrad: its combinations are checked
    with pytest.raises(ValueError, match=r"moe_plugins\.pipeline_degree \(2\) cannot run with moe_plugins\.lancet\."
                                         r"partitions \(2\): the partitions replace PipeMoE's capacity chunks"):
        _parse({"lancet": {"defer_wgrad": False, "partitions": 2}, "pipeline_degree": 2})
    assert _parse({"lancet": {"defer_wgrad": False, "partitions": 1}, "pipeline_degree": 2}).lancet


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "1", "Auto", None, [1]])
def test_partitions_bad_values_name_what_is_allowed(value):
    with pytest.raises(ValueError, match=r"moe_plugins\.lancet\.partitions \(.*\) must be an integer >= 1 that "
                                         r"divides the micro-batch, \"auto\" or \"tune\""):
        _parse({"lancet": {"partitions": value}})


@pytest.mark.parametrize("section,message", [
    ({"defer_wgrad": "yes"}, r"moe_plugins\.lancet\.defer_wgrad \('yes'\) must be true or false"),
    ({"dense_wgrad": 1}, r"moe_plugins\.lancet\.dense_wgrad \(1\) must be true or false"),
    ({"dense_wgrad": True, "defer_wgrad": False}, r"moe_plugins\.lancet\.dense_wgrad \(True\) needs "
                                                  r"moe_plugins\.lancet\.defer_wgrad true"),
    ({"defer_wgrads": True}, r"moe_plugins\.lancet\.defer_wgrads is unknown; allowed: defer_wgrad, partitions, "
                             r"dense_wgrad \(did you mean 'defer_wgrad'\?\)"),
])
def test_field_refusals(section, message):
    with pytest.raises(ValueError, match=message):
        _parse({"lancet": section})


def test_every_problem_at_once_and_not_an_object():
    problems = plugin_config_problems({"lancet": {"partitions": 0, "dense_wgrad": "no", "x": 1}}, "ds", **CHOICES)
    assert [p.split(" ")[0] for p in problems] == ["ds.lancet.x", "ds.lancet.partitions", "ds.lancet.dense_wgrad"]
    with pytest.raises(ValueError, match=r"moe_plugins\.lancet \(\[1\]\) must be a JSON object"):
        _parse({"lancet": [1]})


@pytest.mark.parametrize("section,message", [
    ({"schedule": "parm-s2"}, r"moe_plugins\.schedule \('parm-s2'\) cannot run with moe_plugins\.lancet\.defer_wgrad"),
    ({"schedule": "baseline-tp"}, r"moe_plugins\.schedule \('baseline-tp'\) cannot run with"),
    ({"exchange": "ragged"}, r"moe_plugins\.exchange \('ragged'\) cannot run with moe_plugins\.lancet\.defer_wgrad"),
    ({"hecate": {}}, r"moe_plugins\.hecate \(enabled\) cannot run with moe_plugins\.lancet\.defer_wgrad"),
])
def test_refused_combinations(section, message):
    with pytest.raises(ValueError, match=message):
        _parse({"lancet": {}, **section})


def test_lina_beside_lancet_on_both_hosts_only():
    """Lina's micro-ops and Lancet share the adapter's engine (tests/test_lancet_blocks_deepspeed.py; on Megatron
    tests/test_lancet_megatron.py and tests/test_lancet_parts_megatron.py): both hosts take the pair, partitions
    or deferred dW, and a reader that runs neither host refuses it."""
    from moe_plugins.patches.megatron_config import config_choices as megatron_choices
    both = {"lancet": {"partitions": 2}, "lina": {"micro_op_mb": 1}}
    assert _parse(both).lina == {"micro_op_mb": 1}
    assert PluginConfig.from_dict(both, "moe_plugins", **megatron_choices()).lina == {"micro_op_mb": 1}
    deferred = {"lancet": {"defer_wgrad": True}, "lina": {"micro_op_mb": 1}}
    assert PluginConfig.from_dict(deferred, "moe_plugins", **megatron_choices()).lina == {"micro_op_mb": 1}
    assert any("through the DeepSpeed and Megatron-core adapters only" in p
               for p in lancet_across(deferred, host=None))


# ---- the overlap arithmetic (pure) -----------------------------------------------------------------------------

def test_overlap_fractions():
    assert merged([(5, 9), (0, 2), (1, 3), (9, 10)]) == [(0, 3), (5, 10)]
    assert covered([(0, 10)], [(2, 4), (3, 6), (12, 20)]) == 4
    comm, compute = [(0, 10), (20, 30)], [(2, 6), (8, 22), (40, 50)]
    assert overlap_fraction(comm, compute) == pytest.approx((4 + 2 + 2) / 20)
    assert hidden_fraction(comm, compute) == pytest.approx(8 / 28)
    assert overlap_fraction(comm, []) == 0.0 and hidden_fraction([], compute) == 0.0
    assert overlap_fraction([], compute) == 0.0
    with pytest.raises(ValueError, match=r"interval \(5, 4\) ends before it starts"):
        overlap_fraction([(5, 4)], compute)


def test_readers_other_than_the_host_adapters_refuse_the_section():
    """The registry's own rules (a reader that is not a host adapter) refuse an enabled section, so that no reader
    runs the layer without Lancet silently; a section that defers nothing passes. The Megatron-core adapter reads
    it with its own rules: defer_wgrad and batch partitions run there."""
    with pytest.raises(ValueError, match=r"moe_plugins.lancet: Lancet runs through the DeepSpeed and Megatron-core "
                                         r"adapters \(enable\(\)\) or the core LancetMoELayer; this reader does not"):
        PluginConfig.from_dict({"lancet": {}}, "moe_plugins", **default_registry().config_choices())
    from moe_plugins.patches.megatron_config import config_choices as megatron_choices
    assert PluginConfig.from_dict({"lancet": {}}, "moe_plugins", **megatron_choices()).lancet == {}
    assert PluginConfig.from_dict({"lancet": {"partitions": "auto"}}, "moe_plugins",
                                  **megatron_choices()).lancet == {"partitions": "auto"}
    with pytest.raises(ValueError, match=r"moe_plugins\.pipeline_degree \(2\) cannot run with moe_plugins\.lancet\."
                                         r"partitions \(2\)"):
        PluginConfig.from_dict({"pipeline_degree": 2, "lancet": {"partitions": 2}}, "moe_plugins", **megatron_choices())
    assert PluginConfig.from_dict({"lancet": {"dense_wgrad": True}}, "moe_plugins",            # both hosts wrap them
                                  **megatron_choices()).lancet == {"dense_wgrad": True}
    from moe_plugins.patches.deepspeed_hecate import config_choices as deepspeed_choices
    assert PluginConfig.from_dict({"lancet": {"dense_wgrad": True}}, "moe_plugins",
                                  **deepspeed_choices()).lancet == {"dense_wgrad": True}
    off = PluginConfig.from_dict({"lancet": {"defer_wgrad": False}}, "moe_plugins",
                                 **default_registry().config_choices())
    assert off.lancet == {"defer_wgrad": False}
