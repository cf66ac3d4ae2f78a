"""``moe-plugins launch`` for Megatron-core (issue 5): the section (``--megatron`` or the command's ``--moe-plugins``)
and the command's Megatron-LM arguments are checked before anything starts; in every rank the launch shim enables
``moe_plugins.patches.megatron`` once ``megatron.core`` is imported, so Megatron's own GPT layer spec builds the
plugin's MoE layer (end to end: 2 ranks under torchrun, no change to the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moe_plugins.tools.cli import main as cli_main
from moe_plugins.tools.cli.launch_megatron import flag_from_argv, megatron_args, prepare
from moe_plugins.tools.launch_shim import CONFIG_ENV, MEGATRON_ENV, SHIM_DIR
from moe_plugins.core.plugin_config import PluginConfig

TORCHRUN = ["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py"]
MOE_ARGS = ["--num-experts", "8", "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"]


def test_flag_is_found_and_taken_out_of_the_command():
    assert flag_from_argv(["a.py", "--moe-plugins", "{}", "--lr", "1"]) == ("{}", ["a.py", "--lr", "1"])
    assert flag_from_argv(["a.py", "--moe-plugins=x.json", "--moe-plugins", "y.json"]) == ("y.json", ["a.py"])
    assert flag_from_argv(["a.py", "--moe-plugins-other", "1"]) == (None, ["a.py", "--moe-plugins-other", "1"])
    with pytest.raises(ValueError, match="--moe-plugins in the command has no value"):
        flag_from_argv(["a.py", "--moe-plugins"])


def test_megatron_arguments_of_the_command():
    args = megatron_args(TORCHRUN + MOE_ARGS + ["--tensor-model-parallel-size", "2", "--moe-shared-expert-overlap"])
    assert (args.num_experts, args.expert_model_parallel_size, args.tensor_model_parallel_size) == (8, 4, 2)
    assert args.moe_shared_expert_overlap is True and args.moe_router_topk == 2           # Megatron-LM's default
    assert megatron_args(TORCHRUN + ["--hidden-size", "1024"]) is None


def test_prepare_from_the_command_flag(tmp_path):
    section = tmp_path / "plugins.json"
    section.write_text(json.dumps({"moe_plugins": {"schedule": "baseline-tp", "ranks_per_node": 8}}))
    plugin, cmd, notes = prepare(None, TORCHRUN + MOE_ARGS + ["--moe-plugins", str(section)])
    assert plugin == PluginConfig(schedule="baseline-tp", ranks_per_node=8, exchange="ragged")
    assert cmd == TORCHRUN + MOE_ARGS and "taken out of the command" in notes[0]
    with pytest.raises(ValueError, match="the section is given twice"):
        prepare("{}", TORCHRUN + ["--moe-plugins", "{}"])


def launch(*args):
    return subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "launch", *args], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, MEGATRON_ENV)})


def test_dry_run_prints_the_environment_and_command():
    out = launch("--dry-run", "--", *TORCHRUN, *MOE_ARGS, "--moe-plugins", '{"schedule": "baseline", "esp": 1}')
    assert out.returncode == 0, out.stderr
    variable, pythonpath, command = out.stdout.strip().splitlines()
    assert json.loads(variable[len(MEGATRON_ENV) + 1:]) == PluginConfig(esp=1, exchange="ragged").to_dict()
    assert pythonpath.startswith(f"PYTHONPATH={SHIM_DIR}")
    assert command == " ".join(TORCHRUN + MOE_ARGS)                  # the flag is out: Megatron-LM rejects it
    assert "moe-plugins launch: Megatron-core, moe_plugins {" in out.stderr


def test_bad_section_lists_every_problem_and_exits_2(capsys):
    cmd = ["--", *TORCHRUN]
    assert cli_main(["launch", "--megatron", '{"schedule": "nope", "fssdp": true, "degree": 2}', *cmd]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-plugins launch: error: invalid --megatron section")
    for problem in ("--megatron.schedule ('nope') must be one of", "--megatron.fssdp (True) is reserved for Hecate",
                    "--megatron.degree: unknown key"):
        assert problem in err[0]
    assert cli_main(["launch", "--megatron", "missing.json", *cmd]) == 2
    assert "must be a JSON object or the path of a JSON file" in capsys.readouterr().err


def test_command_arguments_the_plugin_cannot_run_exit_2(capsys):
    cmd = ["--", *TORCHRUN, "--num-experts", "8", "--moe-token-dispatcher-type", "flex",
           "--pipeline-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    assert cli_main(["launch", "--megatron", '{"esp": 1}', *cmd]) == 2
    err = capsys.readouterr().err
    for problem in ("moe_token_dispatcher_type ('flex') must be one of alltoall, allgather",
                    "pipeline_model_parallel_size (2) must be 1",
                    "moe_plugins.esp (1) must equal expert_tensor_parallel_size (2)"):
        assert problem in err
    assert cli_main(["launch", "--megatron", "{}", "--config", "ds.json", *cmd]) == 2
    assert "a Megatron-core job takes --megatron" in capsys.readouterr().err


CHILD = """
import sys
before = "moe_plugins.patches.megatron" in sys.modules
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from moe_plugins.patches.megatron_cpu import megatron_on_cpu  # test-only: Megatron has no CPU path

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(expert_model_parallel_size=2, create_gloo_process_groups=False)
spec = get_gpt_layer_local_spec(num_experts=4)                    # Megatron's own GPT layer spec, unchanged
with megatron_on_cpu():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                               expert_model_parallel_size=2, use_cpu_initialization=True, add_bias_linear=False)
    layer = TransformerLayer(config, submodules=spec.submodules, layer_number=1)
    y, _ = layer.mlp(torch.randn(8, 1, 16))
    y.sum().backward()
from moe_plugins.patches import megatron as adapter  # only to inspect what the launcher enabled
handle = adapter.active()
result = ("RESULT", dist.get_rank(), before, type(layer.mlp).__name__, handle.plugin.schedule, handle.specs_built,
          list(layer.mlp.moe_groups.ep.ranks), tuple(y.shape))
with open(f"{sys.argv[1]}/result{dist.get_rank()}.txt", "w") as f:   # one file a rank: shared stdout interleaves
    f.write(" ".join(map(str, result)))
dist.destroy_process_group()
from moe_plugins.core.rank_exit import exit_rank
exit_rank(0)       # not interpreter finalization: gloo's exit abort (see moe_plugins.core.rank_exit)
"""


def test_launch_enables_the_plugin_in_every_rank(tmp_path):
    """End to end: 2 ranks under torchrun; the script imports Megatron and builds a TransformerLayer from
    ``get_gpt_layer_local_spec`` (its only moe_plugins code: the CPU shims, and the adapter to inspect the result),
    and gets the plugin's MoE layer."""
    pytest.importorskip("megatron.core")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    section = '{"schedule": "baseline-tp"}'
    out = subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "launch", "--megatron", section,
                          "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, MEGATRON_ENV)})
    assert out.returncode == 0, out.stderr[-3000:]
    result = [(tmp_path / f"result{r}.txt").read_text() for r in (0, 1)]
    assert result == [f"RESULT {r} False PluginMoELayer baseline-tp 1 [0, 1] (8, 1, 16)" for r in (0, 1)], out.stdout
    assert out.stderr.count("moe_plugins: Megatron-core MoE specs patched by moe-plugins launch") == 1


def test_launch_accepts_the_sections_both_adapters_run_and_refuses_partitions_with_a_pipeline_degree(tmp_path):
    """A ds_config with Hecate's or Lancet's section launches (the DeepSpeed adapter runs them); on Megatron-core,
    Lancet's batch partitions with a pipeline degree are refused before anything starts, and Hecate (its
    re-sharding and early gather included) and Lancet (deferred weight gradients, partitions) launch."""
    section = {"lancet": {"defer_wgrad": True, "partitions": 2}}
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "moe_plugins": section}))
    out = launch("--dry-run", "--config", str(config), "--", "python", "train.py")
    assert out.returncode == 0, out.stderr
    accepted = launch("--dry-run", "--", *TORCHRUN, *MOE_ARGS, "--moe-plugins", json.dumps(section))
    assert accepted.returncode == 0 and "'partitions': 2" in accepted.stderr, accepted.stderr
    refused = launch("--dry-run", "--", *TORCHRUN, *MOE_ARGS, "--moe-plugins", json.dumps({"pipeline_degree": 2,
                                                                                           **section}))
    wanted = ".pipeline_degree (2) cannot run with --moe-plugins (in the command).lancet.partitions (2): the partitions"
    assert refused.returncode != 0 and wanted in refused.stderr, refused.stderr
    accepted = launch("--dry-run", "--", *TORCHRUN, *MOE_ARGS, "--moe-plugins", json.dumps({"lancet": {}}))
    assert accepted.returncode == 0 and "'lancet': {}}" in accepted.stderr, accepted.stderr
    accepted = launch("--dry-run", "--", *TORCHRUN, *MOE_ARGS, "--moe-plugins", json.dumps({"hecate": {}}))
    assert accepted.returncode == 0 and "'hecate': {}" in accepted.stderr, accepted.stderr
    hecate = {"hecate": {"enabled": True, "reshard_every": 2, "prefetch": True}}
    accepted = launch("--dry-run", "--", *TORCHRUN, *MOE_ARGS, "--moe-plugins", json.dumps(hecate))
    assert accepted.returncode == 0 and "'reshard_every': 2" in accepted.stderr, accepted.stderr
