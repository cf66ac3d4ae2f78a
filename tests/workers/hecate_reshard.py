"""Pool jobs for Hecate's re-sharding tests (tests/test_hecate_reshard.py): the core layer with schedule ``hecate``
trained with and without Algorithm 2's re-homing, from the same weights on the same batches."""

from __future__ import annotations

from typing import Any, Dict, List

from moe_plugins.tools.verify import VerifySpec
from tests.workers.hecate_layer import _layer, adam_step

KEYS = ("w1_EMH", "b1_EH", "w2_EHM", "b2_EM")


def _slots(layer, local: int):
    return [[(getattr(layer, key), i) for key in KEYS] for i in range(local)]


def reshard_training(spec: VerifySpec, steps: int, every: int, extra_experts: Any = 1,
                     prefetch: bool = False) -> Dict[str, Any]:
    """``steps`` Adam steps of the core Hecate layer, plain and re-sharded every ``every`` steps: this rank's
    losses, its experts' parameters and Adam moments keyed by global expert id, the homes after each step, the
    re-shard bytes in the ledger, and (re-sharded run) the parameters read inside ``Resharder.stock_homes``.
    ``prefetch``: with Hecate's early gather on a pipeline lane, issued right after each optimizer step, so
    that a re-shard finds a gather planned on the old homes pending (it must drop it)."""
    import torch
    import torch.distributed as dist

    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.ledger import CommLedger
    from moe_plugins.hecate.config import HecateConfig
    from moe_plugins.hecate.rehome import Resharder
    from moe_plugins.hecate.reshard import local_experts
    from moe_plugins.hecate.schedule import HecateSchedule

    schedule = HecateSchedule.configured(HecateConfig(extra_experts=extra_experts, prefetch=prefetch))
    out: Dict[str, Any] = {}
    with process_groups(spec.layout()) as groups:
        coords = spec.layout().coords(groups.global_rank)
        local = spec.experts // groups.ep.size
        engine = build_engine(groups, pipeline=True) if prefetch else None
        for name in ("plain", "reshard"):
            ledger = CommLedger()
            layer, prob = _layer(spec, groups, schedule, ledger, engine=engine)
            opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
            resharder = Resharder([(layer.schedule, lambda: _slots(layer, local))], every, world=dist.group.WORLD)
            gen = torch.Generator().manual_seed(spec.seed + 99)
            losses: List[float] = []
            homes: List[tuple] = []
            for _ in range(steps):
                x_DSM = prob.x_DSM + 0.1 * torch.randn(prob.x_DSM.shape, generator=gen, dtype=torch.float64)
                o = layer(x_DSM[coords["dp"]])
                losses.append(adam_step(layer, opt, o, prob.g_DSM[coords["dp"]], groups))
                if prefetch:
                    layer.prefetch()                          # the next call's gather, planned on these homes
                if name == "reshard":
                    resharder.step_end(opt)
                homes.append(layer.schedule.homes)
            ids = local_experts(layer.schedule.homes, groups.ep.rank)
            run = {"losses": losses, "homes": homes, "ledger": ledger.summary(),
                   "experts": {e: [getattr(layer, k)[i].detach().clone() for k in KEYS] for i, e in enumerate(ids)},
                   "moments": {e: [opt.state[getattr(layer, k)]["exp_avg"][i].clone() for k in KEYS]
                               for i, e in enumerate(ids)}}
            if name == "reshard":
                run["moves"] = resharder.rounds
                with resharder.stock_homes(opt):
                    stock = local_experts(layer.schedule.homes, groups.ep.rank)
                    run["stock"] = {e: [getattr(layer, k)[i].detach().clone() for k in KEYS]
                                    for i, e in enumerate(stock)}
                run["after_stock"] = {e: [getattr(layer, k)[i].detach().clone() for k in KEYS]
                                      for i, e in enumerate(local_experts(layer.schedule.homes, groups.ep.rank))}
            out[name] = run
        if engine is not None:
            engine.close()
    return out
