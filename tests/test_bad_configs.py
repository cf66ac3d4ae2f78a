"""Bad configs (issue #28, item 3): one table of invalid ``moe_plugins`` sections, host settings and command lines.

Every row is refused through each entry point that accepts it, and each refusal must name every problem of the
row in one message (each expected fragment is asserted; ``$`` stands for the section path the entry point
reports, e.g. ``moe_plugins`` or ``--moe-plugins``). Command lines exit with code 2. After every row the host is
as it was: the functions both adapters replace are the identical objects, DeepSpeed's expert-group registry is
unchanged, and neither adapter is active (:class:`tests.workers.bad_configs.HostState`).

Row kinds (the first part of each id):

- ``section``: a section bad on its own (wrong types, unknown keys with a "did you mean", out-of-range degrees,
  reserved keys, a bad ``lina`` sub-section). Fed to ``PluginConfig.from_dict``, ``moe_plugins.enable(ds_config)``,
  ``patches.megatron.enable``, Megatron-LM's ``--moe-plugins`` flag (argparse, exit 2), ``moe-plugins launch
  --config`` and ``moe-plugins launch --megatron`` (exit 2).
- ``ds-layer``: a section valid alone that one DeepSpeed MoE layer and world cannot run (layouts that do not
  divide, ranks_per_node against the world, expert-TP): ``layer_problems``, what enable's hook checks first.
- ``ds-engine``: inside ``deepspeed.initialize`` on 2 gloo ranks: a ``pipeline_degree`` word with no, a corrupt, a
  foreign or another version's cost profile cached, sections that contradict the ds_config or the world.
- ``megatron``: a section valid alone that contradicts Megatron-LM's parsed arguments (``enable_from_args``).
- ``mg-profile``: the Megatron layer's profile check (``plugin_problems`` with the layer's cache lookup).
- ``lina``: a Lina packing that does not divide the layout it packs.
- ``cli``: ``moe-plugins`` command lines (launch, verify, plan) with bad files or flags.

A hypothesis test then feeds random JSON sections to the DeepSpeed enable path and the Megatron flag: only
ValueError, naming every unknown key, and the host untouched.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

import moe_plugins  # noqa: E402
from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.lina.config import LinaConfig  # noqa: E402
from moe_plugins.patches import deepspeed as ds_adapter  # noqa: E402
from moe_plugins.patches import megatron as mg_adapter  # noqa: E402
from moe_plugins.patches.megatron_config import plugin_problems  # noqa: E402
from moe_plugins.plugins import default_registry  # noqa: E402
from tests.workers.bad_configs import HostState  # noqa: E402

from tests.bad_config_refusals import (DEGREE_RULE, DS_COMMAND, DS_PROFILE, KEYS, MG_COMMAND, MG_PROFILE,  # noqa: E402
                                       TMP, CHECKS, Context, bad_section, choices, row)


# ---- the table -----------------------------------------------------------------------------------------------

TABLE = [
    # wrong types
    bad_section("enabled-string", {"enabled": "yes"}, "$.enabled ('yes') must be true or false"),
    bad_section("schedule-number", {"schedule": 3}, "$.schedule (3) must be a schedule name (a non-empty string)"),
    bad_section("schedule-empty", {"schedule": ""}, "$.schedule ('') must be a schedule name"),
    bad_section("esp-bool", {"esp": True}, "$.esp (True) must be an integer >= 1, or null to derive it"),
    bad_section("esp-float", {"esp": 2.0}, "$.esp (2.0) must be an integer >= 1"),
    bad_section("ranks-per-node-string", {"ranks_per_node": "8"}, "$.ranks_per_node ('8') must be an integer >= 1"),
    bad_section("lina-list", {"lina": [1, 2]}, "$.lina ([1, 2]) must be a JSON object (see docs/lina.md) or null"),
    bad_section("fssdp-number", {"fssdp": 0}, "$.fssdp (0) must be true or false"),
    bad_section("section-list", ["baseline"], "must be a JSON object", "baseline"),
    # unknown keys and names
    bad_section("typo-schedul", {"schedul": "baseline"}, "$.schedul: unknown key (did you mean 'schedule'?)", KEYS),
    bad_section("typo-pipline-degree", {"pipline_degree": 2},
                "$.pipline_degree: unknown key (did you mean 'pipeline_degree'?)"),
    bad_section("dashed-ranks-per-node", {"ranks-per-node": 8},
                "$.ranks-per-node: unknown key (did you mean 'ranks_per_node'?)"),
    bad_section("junk-key", {"zzz": 1}, "$.zzz: unknown key; " + KEYS),
    bad_section("schedule-misspelt", {"schedule": "baselin"},
                "$.schedule ('baselin') must be one of baseline, baseline-tp,", "(did you mean 'baseline'?)"),
    # degrees out of range
    bad_section("degree-0", {"pipeline_degree": 0}, "$.pipeline_degree (0) " + DEGREE_RULE),
    bad_section("degree-minus-1", {"pipeline_degree": -1}, "$.pipeline_degree (-1) " + DEGREE_RULE),
    bad_section("degree-fast", {"pipeline_degree": "fast"}, "$.pipeline_degree ('fast') " + DEGREE_RULE),
    bad_section("degree-Auto", {"pipeline_degree": "Auto"}, "$.pipeline_degree ('Auto') must be an integer >= 1",
                "(did you mean 'auto'?)"),
    bad_section("degree-float", {"pipeline_degree": 2.5}, "$.pipeline_degree (2.5) " + DEGREE_RULE),
    bad_section("degree-bool", {"pipeline_degree": True}, "$.pipeline_degree (True) " + DEGREE_RULE),
    bad_section("esp-0-ranks-per-node-negative", {"esp": 0, "ranks_per_node": -2},
                "$.esp (0) must be an integer >= 1", "$.ranks_per_node (-2) must be an integer >= 1"),
    # reserved keys
    bad_section("overlap-on", {"overlap": True}, "$.overlap (True) is reserved for Lancet's overlap"),
    bad_section("fssdp-on", {"fssdp": True}, "$.fssdp (True) is reserved for Hecate's fully sharded"),
    # the lina sub-section
    bad_section("lina-micro-op-0", {"lina": {"micro_op_mb": 0}}, "$.lina.micro_op_mb (0) must be a number of MB > 0"),
    bad_section("lina-micro-op-negative", {"lina": {"micro_op_mb": -1.5}},
                "$.lina.micro_op_mb (-1.5) must be a number of MB > 0"),
    bad_section("lina-micro-op-infinite", {"lina": {"micro_op_mb": float("inf")}}, "$.lina.micro_op_mb (inf) must be"),
    bad_section("lina-micro-op-word", {"lina": {"micro_op_mb": "big"}}, "$.lina.micro_op_mb ('big') must be a number"),
    bad_section("lina-packing-0", {"lina": {"packing": 0}}, "$.lina.packing (0) must be an integer >= 1"),
    bad_section("lina-packing-float", {"lina": {"packing": 2.0}}, "$.lina.packing (2.0) must be an integer >= 1"),
    bad_section("lina-priority-string", {"lina": {"priority": "yes"}}, "$.lina.priority ('yes') must be true or false"),
    bad_section("lina-unknown-key", {"lina": {"micro_op": 1}},
                "$.lina.micro_op is unknown; allowed: priority, micro_op_mb, packing, inference (did you mean "
                "'micro_op_mb'?)"),
    bad_section("lina-inference-fields", {"lina": {"inference": {"table": "", "start_layer": -1, "max_experts": 4,
                                                                 "estimation": 1, "expert_weights": "host"}}},
                "$.lina.inference.table ('') must be the path of a popularity table",
                "$.lina.inference.start_layer (-1) must be an integer >= 0",
                "$.lina.inference.max_experts is unknown; allowed: table, start_layer, max_experts_per_device, "
                "estimation, expert_weights (did you mean 'max_experts_per_device'?)",
                "$.lina.inference.estimation (1) must be true",
                "$.lina.inference.expert_weights ('host') must be \"all\""),
    bad_section("lina-inference-no-table", {"lina": {"inference": {"start_layer": 4}}},
                "$.lina.inference.table is missing: estimation (true) needs the popularity table"),
    bad_section("exchange-misspelt", {"exchange": "raged"},
                "$.exchange ('raged') must be 'padded' or 'ragged' (did you mean 'ragged'?)"),
    bad_section("exchange-bool", {"exchange": True}, "$.exchange (True) must be 'padded' or 'ragged'"),
    bad_section("hecate-bad-fields", {"hecate": {"extra_experts": 0, "reshard_every": -1, "prefetch": "yes"}},
                "$.hecate.extra_experts (0) must be an integer >= 1", "$.hecate.reshard_every (-1) must be an integer >= 0",
                "$.hecate.prefetch ('yes') must be true or false"),
    bad_section("lancet-dense-without-defer", {"lancet": {"defer_wgrad": False, "dense_wgrad": True}},
                "$.lancet.dense_wgrad (True) needs $.lancet.defer_wgrad true"),
    # everything at once
    bad_section("every-problem-at-once",
                {"schedul": "baseline", "pipeline_degree": 0, "esp": True, "overlap": True,
                 "lina": {"micro_op_mb": 0, "chunks": 2}},
                "$.schedul: unknown key (did you mean 'schedule'?)", "$.pipeline_degree (0)", "$.esp (True)",
                "$.overlap (True)", "$.lina.micro_op_mb (0)", "$.lina.chunks is unknown"),

    # valid alone, but not on this DeepSpeed layer and world: (section, layer facts, world, data-before-expert)
    row("ds-layer", "ep-3-on-world-4", ({}, {"ep": 3, "num_experts": 6}, 4, False),
        "world (4) must be divisible by ep*esp (3*1=3)"),
    row("ds-layer", "esp-3-on-world-4", ({"esp": 3}, {"ffn": 18}, 4, False),
        "world (4) must be divisible by ep*esp (2*3=6)"),
    row("ds-layer", "experts-6-over-ep-4", ({}, {"ep": 4, "num_experts": 6}, 8, False),
        "num_experts (6) must be divisible by ep (4)"),
    row("ds-layer", "ffn-18-over-esp-4", ({"esp": 4}, {"ffn": 18}, 8, False), "ffn (18) must be divisible by esp (4)"),
    row("ds-layer", "k-over-experts", ({}, {"k": 5}, 4, False), "k (5) must not exceed num_experts (4)"),
    row("ds-layer", "ranks-per-node-3-on-world-4", ({"ranks_per_node": 3}, {}, 4, False),
        "world (4) must be divisible by ranks_per_node (3)"),
    row("ds-layer", "ranks-per-node-8-over-world-4", ({"ranks_per_node": 8}, {}, 4, False),
        "world (4) must be divisible by ranks_per_node (8)"),
    row("ds-layer", "esp-not-the-expert-tp", ({"esp": 4}, {"expert_tp": True, "tp": 2, "tp_ranks": (0, 1)}, 8, False),
        "$.esp (4) must equal the tensor-parallel degree (2) that enable_expert_tensor_parallelism shards"),
    row("ds-layer", "esp-on-unsliceable-experts", ({"esp": 2}, {"ffn_activation": None}, 4, False),
        "$.esp (2) > 1 without DeepSpeed's expert tensor parallelism needs every expert to be nn.Sequential"),
    row("ds-layer", "every-host-problem", ({"ranks_per_node": 3}, {"use_tutel": True, "pp": 2}, 4, True),
        "use_data_before_expert_parallelism (true) is not supported", "use_tutel (true) is not supported",
        "pipeline parallel degree (2) must be 1", "world (4) must be divisible by ranks_per_node (3)"),

    # inside deepspeed.initialize on 2 ranks: (section, config given to enable, ds_config keys, cached profile)
    row("ds-engine", "auto-no-profile", ({"pipeline_degree": "auto"}, None, {}, "none"),
        "$.pipeline_degree ('auto') needs a cost profile for this layout, and none is cached", DS_COMMAND),
    row("ds-engine", "tune-no-profile", ({"pipeline_degree": "tune"}, None, {}, "none"),
        "$.pipeline_degree ('tune') needs a cost profile for this layout", DS_COMMAND),
    row("ds-engine", "auto-corrupt-profile", ({"pipeline_degree": "auto"}, None, {}, "garbage"),
        "$.pipeline_degree ('auto') reads the cost profile cached for this layout, which cannot be used",
        DS_PROFILE + "' cannot be used: not a cost profile of version 1 (JSONDecodeError"),
    row("ds-engine", "auto-foreign-profile", ({"pipeline_degree": "auto"}, None, {}, "foreign"),
        DS_PROFILE + "' holds the profile of w4-n2-mp1-ep4-esp1-gloo-cpu, not w2-n2-mp1-ep2-esp1-gloo-cpu"),
    row("ds-engine", "parm-auto-other-version", ({"schedule": "parm-auto"}, None, {}, "version"),
        "$.schedule ('parm-auto') reads the cost profile",
        DS_PROFILE + "' cannot be used: profile version (7) is not 1"),
    row("ds-engine", "ranks-per-node-3-and-data-before-expert",
        ({"ranks_per_node": 3}, None, {"use_data_before_expert_parallelism": True}, "none"),
        "use_data_before_expert_parallelism (true) is not supported",
        "world (2) must be divisible by ranks_per_node (3)"),
    row("ds-engine", "ranks-per-node-4-over-world-2", ({"ranks_per_node": 4}, None, {}, "none"),
        "world (2) must be divisible by ranks_per_node (4)"),
    row("ds-engine", "esp-2-over-world-2", ({"esp": 2}, None, {}, "none"),
        "world (2) must be divisible by ep*esp (2*2=4)"),
    row("ds-engine", "no-profile-and-data-before-expert",
        ({"pipeline_degree": "auto"}, None, {"use_data_before_expert_parallelism": True}, "none"),
        "use_data_before_expert_parallelism (true) is not supported", "$.pipeline_degree ('auto') needs a cost profile"),
    row("ds-engine", "lina-packing-on-zero-3",
        ({"lina": {"packing": 2, "micro_op_mb": 1}}, None, {"zero_optimization": {"stage": 3}}, "none"),
        "$.lina.packing (2) runs on zero_optimization.stage 0, 1 or 2, and it is 3",
        "$.lina needs zero_optimization.stage 0, 1 or 2 (got 3)"),
    row("ds-engine", "lina-packing-with-a-degree-word",
        ({"pipeline_degree": "tune", "lina": {"packing": "auto", "micro_op_mb": 1}}, None,
         {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}},
         "none"),
        "$.lina.packing ('auto') needs an integer $.pipeline_degree (got 'tune')",
        "$.lina.packing ('auto') does not rebuild DeepSpeed's BF16_Optimizer",
        "$.lina does not support bf16 with data_types.grad_accum_dtype fp32 at ZeRO 1"),
    row("ds-engine", "lina-packing-3-over-ep-2", ({"lina": {"packing": 3, "micro_op_mb": 1}}, None, {}, "none"),
        "$.lina.packing (3) must divide ep (2)"),
    row("ds-engine", "section-contradicts-enable", ({"schedule": "baseline-tp"}, {"schedule": "baseline"}, {}, "none"),
        "the ds_config 'moe_plugins' section", "conflicts with the config given to moe_plugins.enable"),

    # valid alone, but not with Megatron-LM's arguments: (section, argument overrides)
    row("megatron", "esp-not-expert-tp", ({"esp": 1}, {"expert_tensor_parallel_size": 2}),
        "$.esp (1) must equal expert_tensor_parallel_size (2)"),
    row("megatron", "ranks-per-node-3-on-world-4", ({"ranks_per_node": 3}, {}),
        "world (4) must be divisible by ranks_per_node (3)"),
    row("megatron", "ranks-per-node-8-over-world-4", ({"ranks_per_node": 8}, {}),
        "world (4) must be divisible by ranks_per_node (8)"),
    row("megatron", "ep-3-on-world-4", ({}, {"expert_model_parallel_size": 3}),
        "world (4) must be divisible by ep*esp (3*2=6)"),
    row("megatron", "experts-6-over-ep-4", ({}, {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 4,
                                                 "num_experts": 6}), "num_experts (6) must be divisible by ep (4)"),
    row("megatron", "ffn-15-over-expert-tp-2", ({}, {"moe_ffn_hidden_size": 15}),
        "ffn (15) must be divisible by esp (2)"),
    row("megatron", "baseline-tp-on-token-layout", ({"schedule": "baseline-tp"}, {}),
        "$.schedule on Megatron's token layout"),
    row("megatron", "no-moe-layer", ({}, {"num_experts": None}), "num_moe_experts (None)", "has no MoE layer"),
    row("megatron", "hecate-reshard-biases-under-sp", ({"hecate": {"reshard_every": 2}},
        {"bf16": True, "use_distributed_optimizer": True, "sequence_parallel": True}),
        "hecate.reshard_every (2) cannot run with add_bias_linear and sequence_parallel at "
        "tensor_model_parallel_size 2"),
    row("megatron", "lina-with-distributed-optimizer-instances", ({"lina": {}},
                                                                   {"use_distributed_optimizer": True,
                                                                    "num_distributed_optimizer_instances": 2}),
        "num_distributed_optimizer_instances (2) must be 1 with $.lina"),
    row("megatron", "every-argument-problem",
        ({"esp": 4}, {"moe_token_dispatcher_type": "flex", "context_parallel_size": 2, "moe_input_jitter_eps": 0.1}),
        "moe_token_dispatcher_type ('flex') must be one of alltoall, allgather", "context_parallel_size (2) must be 1",
        "$.esp (4) must equal expert_tensor_parallel_size (2)", "moe_input_jitter_eps must be off"),

    # the Megatron layer's cost-profile lookup: (section, cached profile)
    row("mg-profile", "auto-no-profile", ({"pipeline_degree": "auto"}, "none"),
        "$.pipeline_degree ('auto') needs a cost profile for this layout, and none is cached", MG_COMMAND),
    row("mg-profile", "auto-corrupt-profile", ({"pipeline_degree": "auto"}, "garbage"),
        MG_PROFILE + "' cannot be used: not a cost profile of version 1 (JSONDecodeError", MG_COMMAND),
    row("mg-profile", "tune-foreign-profile", ({"pipeline_degree": "tune"}, "foreign"),
        MG_PROFILE + "' holds the profile of w8-n2-mp1-ep4-esp2-gloo-cpu, not w4-n2-mp1-ep2-esp2-gloo-cpu"),
    row("mg-profile", "auto-other-version", ({"pipeline_degree": "auto"}, "version"),
        MG_PROFILE + "' cannot be used: profile version (7) is not 1"),
    row("mg-profile", "auto-key-fields-missing", ({"pipeline_degree": "auto"}, "fields"),
        MG_PROFILE + "' cannot be used: not a cost profile of version 1 (TypeError"),
    row("mg-profile", "parm-auto-corrupt-profile", ({"schedule": "parm-auto"}, "garbage"),
        "$.schedule ('parm-auto') reads the cost profile cached for this layout", MG_PROFILE),

    # Lina's packing against its layout: (section, layout degrees)
    row("lina", "packing-3-over-ep-4", ({"lina": {"packing": 3}}, {"ep": 4}),
        "$.lina.packing (3) must divide ep (4)"),
    row("lina", "packing-4-over-ep-2", ({"lina": {"packing": 4}}, {"ep": 2, "esp": 2}),
        "$.lina.packing (4) must divide ep (2)"),

    # command lines: (argv, files written under TMP first)
    row("cli", "launch-ds-config-not-json", (["launch", "--config", "TMP/ds.json", "--dry-run", "--", "python", "t.py"],
                                             {"ds.json": "{\"moe_plugins\": "}),
        "ds_config 'TMP/ds.json' cannot be read as JSON"),
    row("cli", "launch-ds-config-missing", (["launch", "--config", "TMP/none.json", "--dry-run", "--", "python"], {}),
        "ds_config ('TMP/none.json') is not a file"),
    row("cli", "launch-section-in-command-config",
        (["launch", "--dry-run", "--", "deepspeed", "t.py", "--deepspeed_config", "TMP/ds.json"],
         {"ds.json": {"train_batch_size": 8, "moe_plugins": {"schedule": "nope", "esp": 0, "lina": {"packing": 0}}}}),
        "moe_plugins.schedule ('nope') must be one of", "moe_plugins.esp (0)", "moe_plugins.lina.packing (0)"),
    row("cli", "launch-megatron-arguments",
        (["launch", "--megatron", "{\"esp\": 1}", "--dry-run", "--", "torchrun", "pretrain_gpt.py", "--num-experts",
          "4", "--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
          "--pipeline-model-parallel-size", "2", "--moe-shared-expert-overlap"], {}),
        "moe_plugins.esp (1) must equal expert_tensor_parallel_size (2)", "moe_token_dispatcher_type ('flex')",
        "pipeline_model_parallel_size (2) must be 1", "moe_shared_expert_overlap (True) must be False"),
    row("cli", "launch-megatron-section-twice",
        (["launch", "--megatron", "{}", "--dry-run", "--", "torchrun", "t.py", "--moe-plugins", "{}"], {}),
        "the section is given twice"),
    row("cli", "launch-megatron-flag-not-json",
        (["launch", "--dry-run", "--", "torchrun", "t.py", "--moe-plugins", "{schedule: baseline}"], {}),
        "--moe-plugins (in the command) is not valid JSON"),
    row("cli", "launch-megatron-file-not-json",
        (["launch", "--megatron", "TMP/plugins.json", "--dry-run", "--", "torchrun", "t.py"],
         {"plugins.json": "{\"schedule\": "}), "--megatron (TMP/plugins.json) is not valid JSON"),
    row("cli", "verify-every-layer-flag",
        (["verify", "--world", "4", "--ep", "2", "--experts", "6", "--k", "7", "--tokens", "0", "--schedule",
          "parm-s9"], {}),
        "k (7) must not exceed num_experts (6)", "schedule ('parm-s9') is unknown", "tokens (0) must be >= 1"),
    row("cli", "verify-layout", (["verify", "--world", "4", "--ep", "3", "--esp", "2"], {}),
        "world (4) must be divisible by ep*esp (3*2=6)"),
    row("cli", "verify-world-not-an-int", (["verify", "--world", "four"], {}),
        "argument --world: invalid int value: 'four'"),
    row("cli", "plan-profile-not-a-profile",
        (["plan", "pipemoe", "--B", "2", "--L", "8", "--M", "8", "--H", "16", "--E", "4", "--P", "2", "--profile",
          "TMP/p.json"], {"p.json": "[]"}),
        "cost profile 'TMP/p.json' cannot be used: not a cost profile of version 1"),
    row("cli", "plan-cached-profile-other-version",
        (["plan", "pipemoe", "--B", "2", "--L", "8", "--M", "8", "--H", "16", "--E", "4", "--P", "2", "--cache-dir",
          "TMP/cache"], {"cache/profile-w2-n1-mp1-ep2-esp1-gloo-cpu.json": {"version": 2, "key": {}}}),
        "profile-w2-n1-mp1-ep2-esp1-gloo-cpu.json' cannot be used: profile version (2) is not 1"),
]


# ---- the tests -----------------------------------------------------------------------------------------------

@pytest.fixture
def untouched_host():
    """The host state before a test; asserts afterwards that nothing in it changed."""
    before = HostState.capture(megatron=True)
    yield before
    moe_plugins.disable()          # a test that enabled by mistake must not leak into the next one
    mg_adapter.disable()
    assert before.differences(HostState.capture(megatron=True)) == []


@pytest.fixture
def context(tmp_path: Path, capsys: Any, world: Callable[[int], Any], monkeypatch: pytest.MonkeyPatch) -> Context:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)      # the Megatron flag path reads it at the boundary
    monkeypatch.delenv("MOE_PLUGINS_CONFIG", raising=False)    # launch falls back to it without --config
    return Context(tmp=tmp_path, capsys=capsys, world=world)


def test_the_table_is_large_and_its_ids_unique():
    ids = [p.id for p in TABLE]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)
    assert {i.split(":")[0] for i in ids} == set(CHECKS)


@pytest.mark.parametrize("kind, given, expected", TABLE)
def test_bad_config_is_refused_naming_every_problem(kind: str, given: Any, expected: Tuple[str, ...],
                                                     context: Context, untouched_host: HostState):
    refusals = CHECKS[kind](given, context)
    assert refusals and expected
    for refusal in refusals:
        if refusal.exit_code is not None:
            assert refusal.exit_code == 2, refusal
        for fragment in expected:
            wanted = fragment.replace("$", refusal.path)
            assert wanted in refusal.message, f"{refusal.route}: {wanted!r} not in {refusal.message!r}"


# ---- fuzz: random JSON sections --------------------------------------------------------------------------------

REAL_KEYS = [f for f in PluginConfig.__dataclass_fields__] + [f for f in LinaConfig.__dataclass_fields__]
WORDS = ["auto", "tune", "baseline", "parm-auto", "parm-s1", "", " auto"]
JSON_KEYS = st.sampled_from(REAL_KEYS) | st.text(max_size=6)
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-3, 9) | st.integers() | st.sampled_from(WORDS)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(JSON_KEYS, inner, max_size=4), max_leaves=12)
LINA_SECTIONS = st.fixed_dictionaries({}, optional={
    "priority": st.booleans() | JSON_SCALARS, "micro_op_mb": st.just("auto") | st.floats(0.001, 8) | JSON_SCALARS,
    "packing": st.just("auto") | st.integers(1, 4) | JSON_SCALARS})
NEAR_VALID = st.fixed_dictionaries({}, optional={          # each key valid about half the time, so some pass
    "enabled": st.booleans() | JSON_SCALARS,
    "schedule": st.sampled_from(default_registry().schedule_names()) | JSON_SCALARS,
    "pipeline_degree": st.integers(1, 4) | st.sampled_from(["auto", "tune"]) | JSON_SCALARS,
    "esp": st.none() | st.integers(1, 4) | JSON_SCALARS, "ranks_per_node": st.none() | st.integers(1, 8) | JSON_SCALARS,
    "lina": st.none() | LINA_SECTIONS | JSON_VALUES, "fssdp": st.just(False) | JSON_SCALARS,
    "overlap": st.just(False) | JSON_SCALARS})
SECTIONS = NEAR_VALID | st.builds(lambda near, junk: {**near, **junk}, NEAR_VALID,
                                  st.dictionaries(JSON_KEYS, JSON_VALUES, max_size=2)) \
    | st.dictionaries(JSON_KEYS, JSON_VALUES, max_size=6)


def unknown_keys(section: Dict[str, Any]) -> List[str]:
    return [key for key in section if key not in PluginConfig.__dataclass_fields__]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=SECTIONS)
def test_random_sections_raise_only_value_errors_and_never_patch_on_error(section: Dict[str, Any]):
    before = HostState.capture(megatron=True)
    try:
        handle = moe_plugins.enable({"train_batch_size": 8, "moe_plugins": section})
    except ValueError as exc:
        event("refused")
        assert all(f"moe_plugins.{key}: unknown key" in str(exc) for key in unknown_keys(section)), str(exc)
        assert before.differences(HostState.capture(megatron=True)) == []
    else:
        event("enabled, then disabled")
        assert unknown_keys(section) == [] and ds_adapter.active() is handle
        handle.disable()
        assert before.differences(HostState.capture(megatron=True)) == []
    try:
        accepted = mg_adapter.resolve_plugin(json.dumps(section), mg_adapter.FLAG)
    except ValueError as exc:
        assert all(f"{mg_adapter.FLAG}.{key}: unknown key" in str(exc) for key in unknown_keys(section)), str(exc)
    else:
        from moe_plugins.patches.megatron_config import config_choices as megatron_choices
        written = PluginConfig.from_dict(section, **megatron_choices())     # Megatron's rules (its Lancet)
        # a section naming no exchange may run Megatron's own flow, the ragged one (patches/megatron_config.py)
        assert accepted == (written if "exchange" in section else replace(written, exchange=accepted.exchange))
    assert before.differences(HostState.capture(megatron=True)) == []
