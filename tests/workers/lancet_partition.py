"""Pool jobs for tests/test_lancet_partition.py: the core MoE layer called whole and cut into batch partitions
(moe_plugins/lancet/partition.py), on the same weights, tokens and engine.

Shapes: B samples, L tokens per sample, S = B L tokens, M model dim.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from moe_plugins.tools.verify import AUX_COEF, VerifySpec


def _grads(layer) -> List[Any]:
    return [p.grad.clone() for p in (layer.wg_EM, layer.w1_EMH, layer.b1_EH, layer.w2_EHM, layer.b2_EM)]


def whole_and_parts(jobs: List[Tuple[VerifySpec, int, bool]]) -> List[Dict[str, Any]]:
    """Per (spec, partitions, lane): this rank's outputs, input and parameter gradients, aux loss and dropped routes
    of the layer called whole and of the same layer cut into ``partitions`` (samples of 4 tokens), plus the
    partitioned call's exchanges in the engine's timeline (lane: the engine has a pipeline lane)."""
    import torch

    from moe_plugins.core.engine import CommEngine, build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.layer import MoELayer
    from moe_plugins.lancet.partition import layer_start
    from moe_plugins.plugins import default_registry
    from moe_plugins.tools.verify import make_problem

    out = []
    for spec, parts, lane in jobs:
        with process_groups(spec.layout()) as groups:
            engine = build_engine(groups, pipeline=True, timeout_s=60, record_timeline=True) if lane else \
                CommEngine(record_timeline=True)
            try:
                prob = make_problem(spec)
                layer = MoELayer(spec.moe_config(), groups, schedule="baseline", dtype=torch.float64,
                                 registry=default_registry(), engine=engine)
                layer.load_full(prob.wg_EM, prob.full)
                coords = spec.layout().coords(groups.global_rank)
                x_BLM = prob.x_DSM[coords["dp"]].reshape(-1, 4, spec.hidden)
                g_BLM = prob.g_DSM[coords["dp"]].reshape(x_BLM.shape)
                res: Dict[str, Any] = {}
                for name in ("whole", "parts"):
                    layer.zero_grad(set_to_none=True)
                    x = x_BLM.clone().requires_grad_(True)
                    if name == "whole":
                        o = layer(x)
                        y, aux, dropped, counts = o.y, o.aux_loss, int(o.dropped), o.exp_counts_E
                    else:
                        before = len(engine.timeline)
                        call = layer_start(layer, x, parts, rows_per_sample=4)
                        y = torch.cat([call.output(p) for p in range(len(call))]).view(x.shape)
                        aux, dropped, counts = call.aux_loss, int(call.dropped), call.exp_counts_E
                        res["exchanges"] = [(r.op, r.lane, r.phase) for r in engine.timeline[before:]]
                    ((y * g_BLM).sum() + AUX_COEF * aux).backward()
                    if name == "parts":           # the backward's reverse exchanges, and how many flew at once
                        res["backward"] = [r.lane for r in engine.timeline[before:] if r.phase == "backward"
                                           and r.op == "all_to_all"]
                        res["peak"], res["in_flight"] = call.backlog.peak, call.backlog.in_flight
                    res[name] = {"y": y.detach(), "grad_x": x.grad, "aux": aux.detach(), "dropped": dropped,
                                 "counts": counts, "grads": _grads(layer)}
                out.append(res)
            finally:
                engine.close()
    return out
