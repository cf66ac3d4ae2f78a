"""The ``moe_plugins`` section (PluginConfig), the ds_config forms ``enable`` accepts, and ``moe-plugins launch``:
pure, no process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moe_plugins.plugins import default_registry
from moe_plugins.tools.cli import main as cli_main
from moe_plugins.tools.cli.launch_cmd import launch_env
from moe_plugins.tools.launch_shim import CONFIG_ENV, SHIM_DIR, config_path_from_argv
from moe_plugins.core.plugin_config import PluginConfig, plugin_config_problems, resolve


def test_defaults_and_round_trip():
    cfg = PluginConfig.from_dict({})
    assert cfg == PluginConfig() and cfg.enabled and cfg.schedule == "baseline" and cfg.pipeline_degree == 1
    full = {"enabled": True, "schedule": "baseline-tp", "pipeline_degree": "auto", "esp": 2, "ranks_per_node": 8,
            "exchange": "ragged", "lina": {"priority": True, "micro_op_mb": 0.5, "packing": 1}, "fssdp": False,
            "overlap": False, "hecate": None, "lancet": {"defer_wgrad": False, "partitions": 1, "dense_wgrad": False}}
    assert PluginConfig.from_dict(full, **default_registry().config_choices()).to_dict() == full


def test_every_problem_in_one_error():
    bad = {"schedul": "baseline", "schedule": "fastest", "pipeline_degree": 0, "esp": True, "ranks_per_node": "8",
           "enabled": "yes", "lina": {"micro_op_mb": 0}, "fssdp": 1, "overlap": True}
    with pytest.raises(ValueError) as info:
        PluginConfig.from_dict(bad, path="ds.moe_plugins", **default_registry().config_choices())
    msg = str(info.value)
    for part in ("ds.moe_plugins.schedul: unknown key (did you mean 'schedule'?)",
                 "ds.moe_plugins.schedule ('fastest') must be one of", "baseline-tp",
                 "ds.moe_plugins.pipeline_degree (0) must be an integer >= 1, \"auto\" (the cost model's pick) or \"tune\"",
                 "ds.moe_plugins.esp (True) must be an integer >= 1",
                 "ds.moe_plugins.ranks_per_node ('8') must be an integer >= 1",
                 "ds.moe_plugins.enabled ('yes') must be true or false",
                 "ds.moe_plugins.lina.micro_op_mb (0) must be a number of MB > 0",
                 "ds.moe_plugins.fssdp (1) must be true or false",
                 "ds.moe_plugins.overlap (True) is reserved for Lancet"):
        assert part in msg, part
    assert len(plugin_config_problems(bad, "x", **default_registry().config_choices())) == 9


@pytest.mark.parametrize("value", ["2", 1.5, -1, "AUTO", "tuned", None, False])
def test_pipeline_degree_rejects(value):
    with pytest.raises(ValueError, match=r"moe_plugins\.pipeline_degree .* must be an integer >= 1, \"auto\" "
                                         r"\(the cost model's pick\) or \"tune\""):
        PluginConfig.from_dict({"pipeline_degree": value}, **default_registry().config_choices())


@pytest.mark.parametrize("value", [1, 8, "auto", "tune"])
def test_pipeline_degree_accepts(value):
    assert PluginConfig.from_dict({"pipeline_degree": value},
                                  **default_registry().config_choices()).pipeline_degree == value


@pytest.mark.parametrize("value", ["2", " auto", "", 1.5, 0, None])
def test_pipeline_degree_without_registry_checks_the_type(value):
    """The core knows no degree words: without the registry's, any word passes and only the type is checked."""
    assert PluginConfig.from_dict({"pipeline_degree": "tuned"}).pipeline_degree == "tuned"
    with pytest.raises(ValueError, match=r"pipeline_degree .* must be an integer >= 1 or a registered degree "
                                         r"policy's word"):
        PluginConfig.from_dict({"pipeline_degree": value})


def test_section_must_be_an_object():
    with pytest.raises(ValueError, match=r"moe_plugins \(\['baseline'\]\) must be a JSON object"):
        PluginConfig.from_dict(["baseline"])


def test_resolve_accepts_config_section_and_path(tmp_path):
    section = {"schedule": "baseline-tp"}
    expected = PluginConfig(schedule="baseline-tp")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "moe_plugins": section}))
    assert resolve(expected) is expected
    assert resolve(section) == resolve({"train_batch_size": 8, "moe_plugins": section}) == expected
    assert resolve(str(path)) == expected
    assert resolve(None) is None
    with pytest.raises(ValueError, match=r"has no 'moe_plugins' section"):
        resolve({"train_batch_size": 8, "zero_optimization": {"stage": 1}})
    (tmp_path / "plain.json").write_text(json.dumps({"train_batch_size": 8}))
    with pytest.raises(ValueError, match=r"plain.json' has no 'moe_plugins' section"):
        resolve(str(tmp_path / "plain.json"))


def test_config_path_from_argv():
    assert config_path_from_argv(["train.py", "--deepspeed_config", "a.json"]) == "a.json"
    assert config_path_from_argv(["train.py", "--ds-config=b.json", "--lr", "1"]) == "b.json"
    assert config_path_from_argv(["x", "--deepspeed-config", "a", "--ds_config", "c"]) == "c"   # last wins
    assert config_path_from_argv(["train.py", "--deepspeed_config"]) is None
    assert config_path_from_argv(["train.py", "--deepspeed"]) is None


def test_launch_env_puts_the_shim_first(tmp_path):
    env = launch_env(["python"], str(tmp_path / "ds.json"), {"PYTHONPATH": "/a:/b", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [SHIM_DIR, "/a", "/b"]
    assert env[CONFIG_ENV] == str(tmp_path / "ds.json") and env["HOME"] == "/h"
    assert os.path.isfile(os.path.join(SHIM_DIR, "sitecustomize.py"))


def test_launch_validates_before_starting(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"moe_plugins": {"schedule": "nope", "fssdp": True}}))
    assert cli_main(["launch", "--", sys.executable, "-c", "pass", "--deepspeed_config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "moe_plugins.schedule ('nope')" in err and "moe_plugins.fssdp (True) is reserved for Hecate" in err
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"train_batch_size": 8}))
    assert cli_main(["launch", "--config", str(plain), "--", sys.executable, "-c", "pass"]) == 2
    assert "has no 'moe_plugins' section" in capsys.readouterr().err
    assert cli_main(["launch", "--", sys.executable, "-c", "pass"]) == 2
    assert "no ds_config" in capsys.readouterr().err


CHILD = """
import sys
before = "moe_plugins.patches.deepspeed" in sys.modules
import deepspeed
from moe_plugins.patches import deepspeed as adapter
from deepspeed.moe.sharded_moe import MOELayer
plugin = adapter.active()
print("RESULT", before, plugin is not None and plugin.config.schedule, MOELayer.forward.__wrapped__ is not None)
"""


def test_launch_enables_the_plugin_when_deepspeed_is_imported(tmp_path):
    """End to end: ``moe-plugins launch`` execs the command; the shim enables the plugin right after the
    child's ``import deepspeed``, from the command's own --deepspeed_config."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "moe_plugins": {"schedule": "baseline-tp"}}))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    out = subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "launch", "--", sys.executable, str(script),
                          "--deepspeed_config", str(cfg)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT False baseline-tp True"], out.stdout[-2000:]
