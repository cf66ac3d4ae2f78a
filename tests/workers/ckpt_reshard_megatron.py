"""Jobs for tests/test_ckpt_reshard_megatron.py, run on 4 pool ranks under the CPU shims: one Megatron MoE layer
(stock ``MoELayer`` or the plugin's ``PluginMoELayer``, both from their spec providers) saved through
``megatron.core.dist_checkpointing`` with its ``sharded_state_dict()`` at TP 2 / EP 2 and loaded at TP 1 / EP 4.

The same 4 ranks hold both layouts: the job builds the saving layout's groups, saves, destroys them, then builds
the loading layout's groups and loads. What is compared is layout-free:

- full weights: every parameter gathered over its tensor-parallel group (``partition_dim``) and named by
  *global* expert (``experts.<g>.<suffix>``, g = EP rank * local experts + local index, Megatron's placement),
  then collected from every rank (replicas must agree);
- outputs: the same global token set split the same way over the 4 ranks (rank r feeds rows
  [r S, (r+1) S); under sequence parallelism those are that TP rank's own tokens), outputs gathered back.
  Nothing couples tokens (no capacity, so no drops), so the full output does not depend on the layout.

Weights are redrawn per global expert after construction (Megatron's CPU init gives the same experts on every
EP rank from one seed, which would hide a misplaced expert), from seeds that differ between the saving and the
loading layer, so a load that does nothing shows up.

Shapes: S tokens per rank, M model dim, H FFN hidden, E experts.
"""

from __future__ import annotations

import multiprocessing
import re
import zlib
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.layout import ParallelLayout
from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config

WORLD, RANKS_PER_NODE = 4, 2
S, M, H, E, K = 6, 8, 16, 4, 2
DTYPE = "float64"
EXPERT_NAME = re.compile(r"^experts\.local_experts\.(?P<local>\d+)\.(?P<suffix>.+)$")


def spec(tp: int, ep: int, etp: int) -> MegatronVerifySpec:
    """A 4-rank layout of the test layer (fp64, top-2 of 4 experts, no capacity)."""
    return MegatronVerifySpec(world=WORLD, ranks_per_node=RANKS_PER_NODE, mp=tp, ep=ep, esp=etp, experts=E, k=K,
                              drop=False, tokens=S, hidden=M, ffn=H, dtype=DTYPE)


def _config(s: MegatronVerifySpec, bias: bool):
    return transformer_config(s, add_bias_linear=bias)


def build_layer(kind: str, s: MegatronVerifySpec, config: Any, groups: Any) -> torch.nn.Module:
    """The stock layer from Megatron's spec provider, or the plugin's from ``get_moe_module_spec``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec

    from moe_plugins.patches.megatron import get_moe_module_spec
    from moe_plugins.patches.megatron_specs import build_layer as build_spec
    if kind == "stock":
        module_spec = stock_spec(use_te=False, num_experts=s.experts)
        layer = build_spec(module_spec, config, pg_collection=groups.pg_collection)
    elif kind == "plugin":
        layer = build_spec(get_moe_module_spec(use_te=False, num_experts=s.experts, plugin={"schedule": "baseline"},
                                               groups=groups), config)
    else:
        raise ValueError(f"kind ({kind!r}) must be 'stock' or 'plugin'")
    layer.set_layer_number(1)
    return layer


def _global_params(layer: torch.nn.Module, pgc: Any) -> List[Tuple[str, torch.nn.Parameter, Any]]:
    """(global name, parameter, its tensor-parallel group or None) of every parameter."""
    ep_rank, local = pgc.ep.rank(), layer.num_local_experts
    out = []
    for name, p in layer.named_parameters():
        match = EXPERT_NAME.match(name)
        if match:
            name = f"experts.{ep_rank * local + int(match['local'])}.{match['suffix']}"
        split = getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) >= 0
        out.append((name, p, (pgc.expt_tp if match else pgc.tp) if split else None))
    return out


def _full_shape(p: torch.Tensor, tp_group: Any) -> List[int]:
    shape = list(p.shape)
    if tp_group is not None:
        shape[p.partition_dim] *= tp_group.size()
    return shape


def redraw(layer: torch.nn.Module, pgc: Any, seed: int) -> None:
    """Every parameter set from a full tensor drawn from (seed, global name), this rank keeping its TP slice."""
    with torch.no_grad():
        for name, p, tp_group in _global_params(layer, pgc):
            gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
            full = 0.3 * torch.randn(_full_shape(p, tp_group), generator=gen, dtype=torch.float64)
            if tp_group is not None:
                full = full.chunk(tp_group.size(), dim=p.partition_dim)[tp_group.rank()]
            p.copy_(full.to(p.dtype))


def full_weights(layer: torch.nn.Module, pgc: Any) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Unsharded weights by global name (gathered over TP, collected from every rank), and every name whose copies
    on different ranks disagree (replicas must be equal)."""
    mine = {}
    for name, p, tp_group in _global_params(layer, pgc):
        t = p.detach().clone()
        if tp_group is not None:
            parts = [torch.empty_like(t) for _ in range(tp_group.size())]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=p.partition_dim)
        mine[name] = t
    every: List[Dict[str, torch.Tensor]] = [None] * dist.get_world_size()    # type: ignore[list-item]
    dist.all_gather_object(every, mine)
    full, disagree = {}, set()
    for per_rank in every:
        for name, t in per_rank.items():
            if name in full and not torch.equal(full[name], t):
                disagree.add(name)
            full.setdefault(name, t)
    return full, sorted(disagree)


def tokens() -> torch.Tensor:
    """The global token set, [WORLD * S, 1, M], the same on every rank."""
    return torch.randn(WORLD * S, 1, M, generator=torch.Generator().manual_seed(2024), dtype=torch.float64)


def outputs(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's output for the global token set (rank r feeds rows [r S, (r+1) S)), gathered: [WORLD * S, M]."""
    r = dist.get_rank()
    x = tokens()[r * S:(r + 1) * S].to(layer.router.weight.dtype)
    with torch.no_grad():
        y, _ = layer(x)
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts).reshape(-1, M).double()


@contextmanager
def cpu_saver():
    """What Megatron's torch_dist saver needs on a CPU pool rank, for the save only. (1) It calls
    ``torch.cuda.synchronize()`` before staging tensors (a no-op here: CPU work is ordered). (2) It writes from child
    processes (a forked writer per bucket, results through a
    spawned ``multiprocessing.Manager``); Python refuses children to a daemonic process, which pool ranks are.
    The flag is cleared for the save only: the writers are joined inside it, and the manager shuts down with the
    rank."""
    config = multiprocessing.current_process()._config          # noqa: SLF001 (no public setter on a live process)
    daemon, synchronize = config.get("daemon"), torch.cuda.synchronize
    config["daemon"] = False
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        config["daemon"] = daemon
        torch.cuda.synchronize = synchronize


def save_then_load_job(ckpt_dir: str, save_kind: str, load_kinds: List[str], save_layout: Tuple[int, int, int],
                       load_layout: Tuple[int, int, int], bias: bool) -> Dict[str, Any]:
    """Save a ``save_kind`` layer at ``save_layout`` (tp, ep, etp) with ``dist_checkpointing.save``, then load it
    into a fresh layer of every ``load_kinds`` at ``load_layout``. Returns the saved layer's full weights and
    outputs, and per loaded kind its full weights before and after loading, its outputs, and its state-dict keys."""
    from megatron.core import dist_checkpointing

    from moe_plugins.patches.megatron import megatron_groups

    def groups_of(s: MegatronVerifySpec):
        return megatron_groups(ParallelLayout(world=s.world, ranks_per_node=s.ranks_per_node, mp=s.mp, ep=s.ep,
                                              esp=s.esp))

    def metadata(groups: Any) -> Dict[str, Any]:      # parallel_state is not initialised: name the DP group
        return {"dp_cp_group": groups.pg_collection.dp_cp}

    out: Dict[str, Any] = {"loaded": {}}
    with ExitStack() as stack:
        stack.enter_context(megatron_on_cpu())
        s = spec(*save_layout)
        with groups_of(s) as groups:
            layer = build_layer(save_kind, s, _config(s, bias), groups)
            redraw(layer, groups.pg_collection, seed=1)
            weights, disagree = full_weights(layer, groups.pg_collection)
            out["saved"] = {"weights": weights, "disagree": disagree, "outputs": outputs(layer),
                            "keys": sorted(layer.state_dict())}
            with cpu_saver():
                dist_checkpointing.save(layer.sharded_state_dict(metadata=metadata(groups)), ckpt_dir)
            dist.barrier()
        s = spec(*load_layout)
        with groups_of(s) as groups:
            for kind in load_kinds:
                layer = build_layer(kind, s, _config(s, bias), groups)
                redraw(layer, groups.pg_collection, seed=2)
                before, _ = full_weights(layer, groups.pg_collection)
                state = dist_checkpointing.load(layer.sharded_state_dict(metadata=metadata(groups)), ckpt_dir)
                missing_unexpected = layer.load_state_dict(state, strict=True)
                after, disagree = full_weights(layer, groups.pg_collection)
                out["loaded"][kind] = {"before": before, "weights": after, "disagree": disagree,
                                       "outputs": outputs(layer), "keys": sorted(layer.state_dict()),
                                       "load_result": (list(missing_unexpected.missing_keys),
                                                       list(missing_unexpected.unexpected_keys))}
    return out
