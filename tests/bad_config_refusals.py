"""The machinery of tests/test_bad_configs.py: what one row's refusal looks like, the contexts and cost
profiles the rows need, and one function per row kind that feeds the row to every entry point taking it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

import moe_plugins  # noqa: E402
from moe_plugins.core.costmodel import CostProfile, LinearModel, ProfileKey, cache_path, load_cached  # noqa: E402
from moe_plugins.core.layout import ParallelLayout  # noqa: E402
from moe_plugins.core.plugin_config import PluginConfig  # noqa: E402
from moe_plugins.core.profile_ops import profile_key  # noqa: E402
from moe_plugins.lina.config import LinaConfig  # noqa: E402
from moe_plugins.lina.packing import packing_layout_problems  # noqa: E402
from moe_plugins.patches import deepspeed as ds_adapter  # noqa: E402
from moe_plugins.patches import megatron as mg_adapter  # noqa: E402
from moe_plugins.patches.megatron_config import facts_from_args, plugin_problems, token_layout  # noqa: E402
from moe_plugins.plugins import default_registry  # noqa: E402
from moe_plugins.tools.cli import main as cli_main  # noqa: E402
from tests.test_megatron import megatron_args  # noqa: E402  (Megatron-LM's parsed arguments: one definition)
from tests.workers import bad_configs as jobs  # noqa: E402

WORLD, RPN = 4, 2                  # the world the pure layer checks run against
ENGINE_WORLD, ENGINE_EP = 2, 2     # the ds-engine rows: 2 gloo ranks, DeepSpeed's MoE(ep_size=2)
JOB_TIMEOUT_S = 900
TMP = "TMP"                        # in a cli row's argv: the test's temporary directory
DEGREE_RULE = "must be an integer >= 1, \"auto\" (the cost model's pick) or \"tune\" (that pick checked by timing"
KEYS = "allowed keys: enabled, schedule, pipeline_degree, exchange, esp, ranks_per_node, lina, fssdp, overlap"
MG_PROFILE = "profile-w4-n2-mp1-ep2-esp2-gloo-cpu.json"        # Megatron's token layout of megatron_args()
DS_PROFILE = "profile-w2-n2-mp1-ep2-esp1-gloo-cpu.json"        # the ds-engine model's layout
DS_COMMAND = "moe-plugins profile --world 2 --ranks-per-node 2 --mp 1 --ep 2 --esp 1"
MG_COMMAND = "moe-plugins profile --world 4 --ranks-per-node 2 --mp 1 --ep 2 --esp 2"


# ---- what one row's refusal looks like -----------------------------------------------------------------------

@dataclass(frozen=True)
class Refusal:
    route: str                 # the entry point, for failure messages
    path: str                  # how it spells the section's path ("$" in the expected fragments)
    message: str
    exit_code: Optional[int] = None     # command lines only


@dataclass(frozen=True)
class Context:
    tmp: Path
    capsys: Any
    world: Callable[[int], Any]


def choices() -> Dict[str, Any]:
    return default_registry().config_choices()


def value_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def run_cli(argv: Sequence[str], capsys: Any) -> Tuple[int, str]:
    """``moe-plugins`` in this process: (exit code, stderr); argparse's own errors exit through SystemExit."""
    capsys.readouterr()
    try:
        code = cli_main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def parse_megatron_flag(text: str, capsys: Any) -> Tuple[int, str]:
    """Megatron-LM's argument parsing with the adapter's ``--moe-plugins``: (exit code, stderr)."""
    parser = mg_adapter.extra_args_provider(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        parser.parse_args([mg_adapter.FLAG, text])
    return info.value.code, capsys.readouterr().err


def write_json(path: Path, value: Any) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def ds_facts(**kw: Any) -> ds_adapter.HostLayerFacts:
    """One DeepSpeed MoE layer as the adapter reads it (E = 4 over ep 2, plain FFN experts of H = 16)."""
    base = dict(name="layers.0.moe", hidden=8, num_experts=4, ep=2, k=1, capacity_factor=1.0, min_capacity=0,
                drop_tokens=True, expert_tp=False, tp=1, pp=1, tp_ranks=(), use_tutel=False, ffn=16,
                ffn_activation="gelu")
    base.update(kw)
    return ds_adapter.HostLayerFacts(**base)


# ---- cost profiles in a cache directory ----------------------------------------------------------------------

def a_profile(key: ProfileKey) -> CostProfile:
    line = LinearModel(alpha=1e-5, beta=1e-9, unit="byte")
    return CostProfile(key=key, dtype="float32", source="test",
                       models={"all_to_all@ep": line, "gemm": LinearModel(alpha=1e-5, beta=1e-12, unit="mac")})


def cache_profile(cache: Path, key: ProfileKey, state: str) -> None:
    """Put a profile of ``state`` where ``key``'s is looked up: none, garbage (not JSON), foreign (a valid profile
    of another layout), version (another format version) or fields (the key's fields missing)."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache_path(cache, key)
    foreign = ProfileKey(**{**key.__dict__, "world": key.world * 2, "ep": key.ep * 2})
    text = {"none": None, "garbage": "{\"version\": 1, \"key\": ", "foreign": a_profile(foreign).to_json(),
            "version": json.dumps({**json.loads(a_profile(key).to_json()), "version": 7}),
            "fields": json.dumps({"version": 1, "key": {"world": key.world}, "dtype": "float32", "models": {}})}[state]
    if text is not None:
        path.write_text(text)


# ---- each kind of row, through every entry point that takes it ----------------------------------------------

def section_refusals(section: Any, ctx: Context) -> List[Refusal]:
    text = json.dumps(section)
    found = [Refusal("PluginConfig.from_dict", "moe_plugins", value_error(PluginConfig.from_dict, section,
                                                                          **choices())),
             Refusal("moe_plugins.enable(ds_config)", "moe_plugins",
                     value_error(moe_plugins.enable, {"train_batch_size": 8, "moe_plugins": section})),
             Refusal("patches.megatron.enable", "moe_plugins", value_error(mg_adapter.enable, section))]
    code, err = parse_megatron_flag(text, ctx.capsys)
    found.append(Refusal("Megatron-LM --moe-plugins", mg_adapter.FLAG, err, code))
    ds_json = write_json(ctx.tmp / "ds.json", {"train_batch_size": 8, "moe_plugins": section})
    code, err = run_cli(["launch", "--config", ds_json, "--dry-run", "--", "python", "train.py"], ctx.capsys)
    found.append(Refusal("moe-plugins launch --config", "moe_plugins", err, code))
    code, err = run_cli(["launch", "--megatron", text, "--dry-run", "--", "torchrun", "pretrain_gpt.py"], ctx.capsys)
    found.append(Refusal("moe-plugins launch --megatron", "--megatron", err, code))
    return found


def ds_layer_refusals(case: Tuple[Dict[str, Any], Dict[str, Any], int, bool], ctx: Context) -> List[Refusal]:
    section, facts, world, data_before_expert = case
    cfg = PluginConfig.from_dict(section, **choices())                    # valid on its own
    rpn = cfg.ranks_per_node or world
    problems = ds_adapter.layer_problems(ds_facts(**facts), cfg, world, 0, rpn, data_before_expert)
    return [Refusal("DeepSpeed layer_problems", "moe_plugins", "; ".join(problems))]


def ds_engine_refusals(case: Tuple[Dict[str, Any], Optional[Dict[str, Any]], Dict[str, Any], str],
                       ctx: Context) -> List[Refusal]:
    section, given, extra, profile = case
    PluginConfig.from_dict(section, **choices())                          # valid on its own
    cache = ctx.tmp / "cache"
    layout = ParallelLayout(world=ENGINE_WORLD, ranks_per_node=ENGINE_WORLD, ep=ENGINE_EP)
    cache_profile(cache, profile_key(layout, "gloo", torch.device("cpu")), profile)
    results = ctx.world(ENGINE_WORLD).run(jobs.refused_engine, section, given, extra, str(cache), ENGINE_EP,
                                          timeout_s=JOB_TIMEOUT_S)
    assert [r["changed"] for r in results] == [[]] * ENGINE_WORLD, results     # each rank's host untouched
    return [Refusal(f"deepspeed.initialize, rank {rank}", "moe_plugins", r["message"] or "(nothing refused)")
            for rank, r in enumerate(results)]


def megatron_refusals(case: Tuple[Dict[str, Any], Dict[str, Any]], ctx: Context) -> List[Refusal]:
    section, overrides = case
    from moe_plugins.patches.deepspeed_hecate import config_choices as deepspeed_choices
    PluginConfig.from_dict(section, **deepspeed_choices())                # valid on its own (DeepSpeed runs it)
    args = megatron_args(moe_plugins=json.dumps(section), **overrides)
    return [Refusal("patches.megatron.enable_from_args", "moe_plugins",
                    value_error(mg_adapter.enable_from_args, args))]


def mg_profile_refusals(case: Tuple[Dict[str, Any], str], ctx: Context) -> List[Refusal]:
    """The check the Megatron layer runs when it is built, with its lookup (``find_profile`` on gloo/CPU)."""
    section, profile = case
    cfg = PluginConfig.from_dict(section, **choices())
    facts = facts_from_args(megatron_args())
    cache = ctx.tmp / "cache"
    cache_profile(cache, profile_key(token_layout(facts, WORLD, RPN), "gloo", torch.device("cpu")), profile)

    def lookup(layout: ParallelLayout) -> Optional[CostProfile]:
        return load_cached(cache, profile_key(layout, "gloo", torch.device("cpu")))
    problems = plugin_problems(facts, cfg, world=WORLD, ranks_per_node=RPN, profile=lookup)
    return [Refusal("Megatron layer check", "moe_plugins", "; ".join(problems))]


def lina_refusals(case: Tuple[Dict[str, Any], Dict[str, int]], ctx: Context) -> List[Refusal]:
    """Lina's packing against the layout it packs (what PackingController checks before regrouping)."""
    section, layout = case
    cfg = PluginConfig.from_dict(section, **choices())
    lina = LinaConfig.from_dict(cfg.lina)
    problems = packing_layout_problems(lina.packing, ParallelLayout(world=WORLD, ranks_per_node=RPN, **layout),
                                       num_experts=8)
    return [Refusal("lina packing_layout_problems", "moe_plugins", "; ".join(problems))]


def cli_refusals(case: Tuple[List[str], Dict[str, Any]], ctx: Context) -> List[Refusal]:
    argv, files = case
    for name, content in files.items():
        write_json(ctx.tmp / name, content)
    argv = [arg.replace(TMP, str(ctx.tmp)) for arg in argv]
    code, err = run_cli(argv, ctx.capsys)
    return [Refusal("moe-plugins " + " ".join(argv[:2]), "moe_plugins", err.replace(str(ctx.tmp), TMP), code)]


CHECKS: Dict[str, Callable[[Any, Context], List[Refusal]]] = {
    "section": section_refusals, "ds-layer": ds_layer_refusals, "ds-engine": ds_engine_refusals,
    "megatron": megatron_refusals, "mg-profile": mg_profile_refusals, "lina": lina_refusals, "cli": cli_refusals}


def row(kind: str, name: str, given: Any, *expected: str) -> Any:
    return pytest.param(kind, given, expected, id=f"{kind}:{name}")


def bad_section(name: str, value: Any, *expected: str) -> Any:
    return row("section", name, value, *expected)
