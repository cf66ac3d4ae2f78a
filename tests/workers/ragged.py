"""Pool jobs for the ragged exchange tests (tests/test_ragged_exchange.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import List

from moe_plugins.tools.verify import VerifySpec, collect_rank


def padded_and_ragged(specs: List[VerifySpec]):
    """Every spec run with the padded and with the ragged exchange; rank 0 returns [(padded, ragged)] per spec,
    each the per-rank results of ``collect_rank``."""
    out = [(collect_rank(replace(s, exchange="padded")), collect_rank(replace(s, exchange="ragged"))) for s in specs]
    return out


def sequential_chunks(spec: VerifySpec, degree: int):
    """The core layer on this rank with the ragged exchange under the Sequential executor cut into ``degree``
    pieces, and the padded exchange whole: each's output, input gradient and parameter gradients."""
    import torch
    import torch.distributed as dist

    from moe_plugins.core.executor import Sequential
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.layer import MoELayer
    from moe_plugins.core.schedule import with_exchange
    from moe_plugins.plugins import default_registry
    from moe_plugins.tools.verify import make_problem

    prob, out = make_problem(spec), {}
    dp = spec.layout().coords(dist.get_rank())["dp"]
    with process_groups(spec.layout()) as groups:
        for exchange, r in (("padded", 1), ("ragged", degree)):
            schedule = with_exchange(default_registry().schedule_class("baseline"), exchange, r)
            layer = MoELayer(spec.moe_config(), groups, schedule=schedule, dtype=torch.float64, executor=Sequential(r))
            layer.load_full(prob.wg_EM, prob.full)
            x = prob.x_DSM[dp].clone().requires_grad_(True)
            o = layer(x)
            ((o.y * prob.g_DSM[dp]).sum() + o.aux_loss).backward()
            out[exchange] = [o.y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    return out
