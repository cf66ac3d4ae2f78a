"""Pool job: host reads per training step of the core MoE layer, counted by tests/host_reads.HostReads on the
main thread and in the closures the engine's lanes run (PipeMoE's chunks)."""

from __future__ import annotations

from collections import Counter
from typing import Dict, List

import torch
import torch.distributed as dist

from moe_plugins.core.engine import CommEngine, build_engine
from moe_plugins.core.groups import process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.schedule import with_exchange
from moe_plugins.pipemoe.runner import build_executor
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, make_problem
from tests.host_reads import HostReads


def reads_per_step(spec: VerifySpec, steps: int) -> List[Dict[str, int]]:
    """Forward + backward ``steps`` times; per step, the host reads as {"kind at file:line function": count}."""
    prob = make_problem(spec)
    dp = spec.layout().coords(dist.get_rank())["dp"]
    out = []
    with process_groups(spec.layout()) as groups:
        engine = build_engine(groups, pipeline=spec.pipeline_degree != 1)
        submit = CommEngine.submit
        try:
            schedule = with_exchange(default_registry().schedule_class(spec.schedule), spec.exchange)
            layer = MoELayer(spec.moe_config(), groups, registry=default_registry(), schedule=schedule,
                             dtype=torch.float64, engine=engine,
                             executor=build_executor(spec.pipeline_degree, None, engine))
            layer.load_full(prob.wg_EM, prob.full)
            for _ in range(steps):
                x = prob.x_DSM[dp].clone().requires_grad_(True)
                counter = HostReads()
                CommEngine.submit = lambda self, fn, *args, **kw: submit(self, counter.in_thread(fn), *args, **kw)
                try:
                    with counter:
                        o = layer(x)
                        (o.y * prob.g_DSM[dp]).sum().add(o.aux_loss).backward()
                finally:
                    CommEngine.submit = submit
                out.append({f"{kind} at {where}": n for (kind, where), n in Counter(counter.reads).items()})
        finally:
            engine.close()
    return out
