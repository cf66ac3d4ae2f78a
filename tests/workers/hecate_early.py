"""Pool jobs for Hecate's early gather (tests/test_hecate_early.py): the core layer with ``prefetch`` on an engine
with a pipeline lane, beside the ragged baseline on the same weights and batches."""

from __future__ import annotations

from typing import Any, Dict, List

from moe_plugins.tools.verify import VerifySpec


def training(spec: VerifySpec, steps: int, work_s: float, fail_at: int = -1) -> Dict[str, Any]:
    """``steps`` Adam steps of the core layer with ``hecate`` + ``prefetch`` (``layer.prefetch()``, then
    ``work_s`` seconds of other work, then the layer) and of the ragged baseline: per step this rank's loss,
    output and input gradient, Hecate's extra copies and agreed overlap degree, and the ledger's spAG records.
    ``fail_at``: at that step the prefetched call is abandoned first (the layer is called on no tokens, which it
    refuses), as when the work before the layer fails after the block's hook issued the gather."""
    import time

    import torch

    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.layer import MoELayer
    from moe_plugins.core.ledger import CommLedger
    from moe_plugins.core.schedule import with_exchange
    from moe_plugins.hecate.config import HecateConfig
    from moe_plugins.hecate.schedule import HecateSchedule
    from moe_plugins.plugins import default_registry
    from moe_plugins.tools.verify import make_problem
    from tests.workers.hecate_layer import adam_step

    schedules = {"early": HecateSchedule.configured(HecateConfig(prefetch=True)),
                 "ragged": with_exchange(default_registry().schedule_class("baseline"), "ragged")}
    out: Dict[str, Any] = {}
    with process_groups(spec.layout()) as groups:
        coords = spec.layout().coords(groups.global_rank)
        engine = build_engine(groups, pipeline=True)
        try:
            for name, schedule in schedules.items():
                ledger = CommLedger()
                layer = MoELayer(spec.moe_config(), groups, schedule=schedule, dtype=torch.float64, ledger=ledger,
                                 registry=default_registry(), engine=engine if name == "early" else None)
                prob = make_problem(spec)
                layer.load_full(prob.wg_EM, prob.full)
                opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
                gen = torch.Generator().manual_seed(spec.seed + 99)
                run: Dict[str, List[Any]] = {"losses": [], "y": [], "grad_x": [], "extra": [], "overlap": [],
                                             "refused": []}
                for step in range(steps):
                    x_DSM = prob.x_DSM + 0.1 * torch.randn(prob.x_DSM.shape, generator=gen, dtype=torch.float64)
                    if step == fail_at and name == "early":
                        layer.prefetch()
                        try:
                            layer(x_DSM[coords["dp"]][:0])
                        except ValueError as exc:
                            run["refused"].append(str(exc))
                    layer.prefetch()
                    time.sleep(work_s)                  # the work before the layer (attention, in a block)
                    x = x_DSM[coords["dp"]].clone().requires_grad_(True)
                    o = layer(x)
                    run["losses"].append(adam_step(layer, opt, o, prob.g_DSM[coords["dp"]], groups))
                    run["y"].append(o.y.detach())
                    run["grad_x"].append(x.grad)
                    last = getattr(layer.schedule, "last", None)
                    run["extra"].append(last.extra_copies() if last is not None else 0)
                    run["overlap"].append(getattr(getattr(layer.schedule, "_state", None), "overlap", None))
                run["params"] = [p.detach().clone() for p in layer.parameters()]
                run["spag"] = [(r.lane, r.phase, r.bytes) for r in ledger.records if r.op == "spag"]
                run["notes"] = layer.schedule.notes()
                out[name] = run
        finally:
            engine.close()
    return out
