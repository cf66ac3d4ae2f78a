"""Pool jobs for Hecate's layer tests (tests/test_hecate_layer.py): the core layer with schedule ``hecate`` and
with the baseline (ragged and padded exchanges), on the same weights and tokens."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from moe_plugins.tools.verify import AUX_COEF, VerifySpec


def _layer(spec: VerifySpec, groups, schedule, ledger=None, executor=None, engine=None):
    import torch

    from moe_plugins.core.layer import MoELayer
    from moe_plugins.plugins import default_registry
    from moe_plugins.tools.verify import make_problem

    degree = 1 if executor is None else executor.degree
    layer = MoELayer(spec.moe_config(), groups, schedule=schedule, dtype=torch.float64, registry=default_registry(),
                     ledger=ledger, pipeline_degree=degree, executor=executor, engine=engine)
    prob = make_problem(spec)
    layer.load_full(prob.wg_EM, prob.full)
    return layer, prob


def _schedules(extra_experts: Any):
    from moe_plugins.core.schedule import with_exchange
    from moe_plugins.hecate.config import HecateConfig
    from moe_plugins.hecate.schedule import HecateSchedule
    from moe_plugins.plugins import default_registry

    base = default_registry().schedule_class("baseline")
    return {"hecate": HecateSchedule.configured(HecateConfig(extra_experts=extra_experts)),
            "ragged": with_exchange(base, "ragged"), "padded": base}


def one_call(specs: List[VerifySpec], extra_experts: Any = "auto",
             degree: Any = 1) -> List[Dict[str, Dict[str, Any]]]:
    """Per spec, this rank's forward and backward with each schedule (``hecate``, ``ragged``, ``padded``): the
    fields ``moe_plugins.tools.verify.compare`` reads, plus Hecate's placement, load and computed rows. ``degree``
    > 1 (or a degree policy: pipemoe.degree.AutoDegree): Hecate runs PipeMoE's chunks (an executor on an engine
    with a pipeline lane), the others degree 1."""
    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.ledger import CommLedger
    from moe_plugins.pipemoe.runner import build_executor

    out = []
    for spec in specs:
        with process_groups(spec.layout()) as groups:
            coords = spec.layout().coords(groups.global_rank)
            runs = {}
            engine = build_engine(groups, pipeline=True) if degree != 1 else None
            for name, schedule in _schedules(extra_experts).items():
                ledger = CommLedger()
                executor = build_executor(degree, None, engine) if engine is not None and name == "hecate" else None
                layer, prob = _layer(spec, groups, schedule, ledger, executor)
                x = prob.x_DSM[coords["dp"]].clone().requires_grad_(True)
                o = layer(x)
                ((o.y * prob.g_DSM[coords["dp"]]).sum() + AUX_COEF * o.aux_loss).backward()
                run = {"rank": groups.global_rank, "coords": coords, "y": o.y.detach(), "grad_x": x.grad,
                       "aux": o.aux_loss.detach(), "counts": o.exp_counts_E, "dropped": int(o.dropped),
                       "grad_wg": layer.wg_EM.grad, "ledger": ledger.summary(),
                       "grad_experts": [p.grad for p in (layer.w1_EMH, layer.b1_EH, layer.w2_EHM, layer.b2_EM)]}
                last = getattr(layer.schedule, "last", None)
                if last is not None:
                    run.update(copies_E=last.placement.copies_E, load_E=last.load_E, rows_E=last.rows_E,
                               extra=last.extra_copies(), notes=layer.schedule.notes())
                runs[name] = run
                del layer
            if engine is not None:
                engine.close()
            out.append(runs)
    return out


def training(spec: VerifySpec, steps: int, extra_experts: Any = "auto") -> Dict[str, List[float]]:
    """``steps`` Adam steps of the core layer with ``hecate`` and with the ragged baseline, each from the same
    weights on the same batches (new tokens every step, drawn from the seed): this rank's losses per step, and
    its expert parameters after the last step."""
    import torch

    from moe_plugins.core.groups import process_groups

    out: Dict[str, Any] = {}
    with process_groups(spec.layout()) as groups:
        coords = spec.layout().coords(groups.global_rank)
        for name, schedule in _schedules(extra_experts).items():
            if name == "padded":
                continue
            layer, prob = _layer(spec, groups, schedule)
            opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(spec.seed + 99)
            losses = []
            for _ in range(steps):
                x_DSM = prob.x_DSM + 0.1 * torch.randn(prob.x_DSM.shape, generator=gen, dtype=torch.float64)
                o = layer(x_DSM[coords["dp"]])
                losses.append(adam_step(layer, opt, o, prob.g_DSM[coords["dp"]], groups))
            out[name] = {"losses": losses, "params": [p.detach().clone() for p in layer.parameters()],
                         "extra": getattr(layer.schedule, "last").extra_copies() if name == "hecate" else 0}
    return out


def adam_step(layer, opt, o, g_SM, groups) -> float:
    """One optimizer step of a core layer's output ``o`` against upstream gradient ``g_SM``; returns the loss."""
    import torch.distributed as dist

    loss = (o.y * g_SM).sum() + AUX_COEF * o.aux_loss
    opt.zero_grad()
    loss.backward()
    # the layer's gate is replicated: average its gradient over DP as a host would
    dist.all_reduce(layer.wg_EM.grad, group=groups.dp.pg)
    layer.wg_EM.grad /= groups.dp.size
    opt.step()
    return float(loss.detach())


def refused(spec: VerifySpec, degree: int, remat: bool = False) -> Optional[str]:
    """The ValueError a Hecate core layer at ``degree`` (with ``rematerialize`` if ``remat``) raises when it is
    built (None: it was built)."""
    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.layer import MoELayer
    from moe_plugins.hecate.config import HecateConfig
    from moe_plugins.hecate.schedule import HecateSchedule
    from moe_plugins.pipemoe.runner import build_executor

    schedule = HecateSchedule.configured(HecateConfig(rematerialize=remat))
    with process_groups(spec.layout()) as groups:
        engine = build_engine(groups, pipeline=True)
        try:
            MoELayer(spec.moe_config(), groups, schedule=schedule, pipeline_degree=degree,
                     executor=build_executor(degree, None, engine))
        except ValueError as exc:
            return str(exc)
        finally:
            engine.close()
    return None
