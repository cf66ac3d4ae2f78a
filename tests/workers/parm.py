"""Pool jobs for the Parm tests (tests/test_parm.py)."""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig
from moe_plugins.core.engine import build_engine
from moe_plugins.core.experts import init_full_weights, sharded_experts
from moe_plugins.core.groups import build_process_groups, process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.router import route_token_block, route_tokens
from moe_plugins.parm.saa import block_order, saa_adjoint_raw, saa_raw
from moe_plugins.parm.cost import ParmCosts
from moe_plugins.core.schedule import LayerParams, run_schedule
from moe_plugins.plugins import build_registry, default_registry
from moe_plugins.parm.auto import ParmAutoSchedule
from moe_plugins.pipemoe.runner import build_executor
from moe_plugins.tools.verify import VerifySpec, make_problem, run_rank


def verify_many(specs: List[VerifySpec]):
    """Run several verify specs in one job; rank 0 returns their reports (None elsewhere)."""
    return [run_rank(spec) for spec in specs]


def verify_auto_with_costs(name: str, costs: ParmCosts, specs: List[VerifySpec]):
    """verify_many for parm-auto with the given costs, registered as ``name`` in this job's own registry."""
    cls = ParmAutoSchedule.with_costs(costs, f"test costs ({name})")
    registry = build_registry(lambda r: r.add_schedule(cls, paper="test", name=name))
    return [run_rank(spec, registry) for spec in specs]


def balanced_ledgers(layout: Tuple[int, int, int], k: int, schedules: List[str], tokens: int = 16):
    """Run each schedule once on an input whose routing is perfectly balanced (token i goes to expert i mod E,
    then i+1 mod E), so every token block has the same count per expert. Rank 0 returns
    {schedule: ledger summary of the layer}."""
    mp, ep, esp = layout
    world = dist.get_world_size()
    groups = build_process_groups(ParallelLayout(world=world, ranks_per_node=2, mp=mp, ep=ep, esp=esp))
    cfg = MoEConfig(hidden=8, ffn=16, num_experts=4, k=k, capacity_factor=1.0, min_capacity=0)
    gen = torch.Generator().manual_seed(0)
    full = init_full_weights(cfg.num_experts, cfg.hidden, cfg.ffn, gen, torch.float64)
    wg_EM = torch.zeros(cfg.num_experts, cfg.hidden, dtype=torch.float64)
    wg_EM[:, :cfg.num_experts] = torch.eye(cfg.num_experts, dtype=torch.float64)
    idx = torch.arange(tokens)
    x_SM = 0.1 * torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    x_SM[:, :cfg.num_experts] = 0.0
    x_SM[idx, idx % cfg.num_experts] = 3.0
    x_SM[idx, (idx + 1) % cfg.num_experts] = 1.0
    out = {}
    for name in schedules:
        ledger = CommLedger()
        layer = MoELayer(cfg, groups, registry=default_registry(), schedule=name, ledger=ledger, name=name,
                         dtype=torch.float64)
        layer.load_full(wg_EM, full)
        x = x_SM.clone().requires_grad_(True)
        result = layer(x)
        assert result.dropped == 0
        result.y.sum().backward()
        out[name] = ledger.summary()[name]
    return out if dist.get_rank() == 0 else None


def chunked_equals_whole(layout: Tuple[int, int, int], schedule: str, degrees: List[int], tokens: int = 12):
    """``run_schedule`` with capacity chunks equals the unchunked run (output and input gradient), for the
    same routing with drops. Every rank returns the largest difference it saw."""
    mp, ep, esp = layout
    groups = build_process_groups(ParallelLayout(world=dist.get_world_size(), ranks_per_node=2, mp=mp, ep=ep,
                                                 esp=esp))
    cfg = MoEConfig(hidden=8, ffn=16, num_experts=4, k=2, capacity_factor=0.75, min_capacity=0)
    gen = torch.Generator().manual_seed(1)
    full = init_full_weights(cfg.num_experts, cfg.hidden, cfg.ffn, gen, torch.float64)
    wg_EM = torch.randn(cfg.num_experts, cfg.hidden, generator=gen, dtype=torch.float64)
    x_SM = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    layer = MoELayer(cfg, groups, registry=default_registry(), schedule=schedule, dtype=torch.float64)
    layer.load_full(wg_EM, full)
    rec = Recorder(None, "chunks")
    params = LayerParams(
        router=partial(route_tokens, wg_EM=layer.wg_EM, config=cfg, groups=groups, rec=rec),
        experts=partial(sharded_experts, weights=layer.expert_weights, activation=cfg.activation, esp=groups.esp,
                        rec=rec),
        block_router=partial(route_token_block, wg_EM=layer.wg_EM, config=cfg, groups=groups, rec=rec))
    results = []
    for degree in [1] + degrees:
        x = x_SM.clone().requires_grad_(True)
        y, _ = run_schedule(layer.schedule, x, params, degree)
        y.pow(2).sum().backward()
        results.append((y.detach(), x.grad))
    return max(float((y - results[0][0]).abs().max()) + float((g - results[0][1]).abs().max())
               for y, g in results[1:])


def saa_matches_sequential(layout: Tuple[int, int, int]) -> Optional[float]:
    """SAA and its adjoint against the sequential all-to-all, ESP sum and MP all-gather (and dump)."""
    mp, ep, esp = layout
    groups = build_process_groups(ParallelLayout(world=dist.get_world_size(), ranks_per_node=2, mp=mp, ep=ep,
                                                 esp=esp))
    rec = Recorder(None, "saa")
    gen = torch.Generator().manual_seed(dist.get_rank())
    g_size, e_l, c, m = groups.ep_esp.size, 2, 3, 4
    w = torch.randn(g_size, e_l, 1, c, m, generator=gen, dtype=torch.float64)
    order = block_order(groups.layout, groups.mp, esp)
    got = saa_raw(w, ep_esp=groups.ep_esp, mp=groups.mp, esp=esp, order=order, rec=rec, phase="forward")
    r = comm.all_to_all(w, groups.ep_esp, rec)
    r = r.reshape(g_size // esp, esp, e_l, 1, c, m).sum(1).reshape(g_size // esp * e_l, 1, c, m)
    want = comm.all_gather(r, groups.mp, rec, dim=1)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    adj = saa_adjoint_raw(g, ep_esp=groups.ep_esp, mp=groups.mp, esp=esp, rec=rec, phase="backward")
    own = g[:, groups.mp.rank:groups.mp.rank + 1]
    dumped = own.reshape(g_size // esp, 1, e_l, 1, c, m).expand(g_size // esp, esp, e_l, 1, c, m)
    adj_want = comm.all_to_all(dumped.reshape(g_size, e_l, 1, c, m), groups.ep_esp, rec)
    return max(float((got - want).abs().max()), float((adj - adj_want).abs().max()))



def fallback_equals_block_router(layout: Tuple[int, int, int], drop: bool, tokens: int = 13) -> float:
    """parm-s1 with a host-style opaque gate (``block_router`` None: the whole block is gated on every MP
    rank) against the split gate: output, input and gate-weight gradients, aux loss, exp_counts and drops.
    Every rank returns the largest difference (inf when the routing statistics differ)."""
    mp, ep, esp = layout
    groups = build_process_groups(ParallelLayout(world=dist.get_world_size(), ranks_per_node=2, mp=mp, ep=ep,
                                                 esp=esp))
    cfg = MoEConfig(hidden=8, ffn=16, num_experts=4, k=2, capacity_factor=0.75, min_capacity=0, drop_tokens=drop)
    gen = torch.Generator().manual_seed(2 + groups.layout.coords(groups.global_rank)["dp"])
    full = init_full_weights(cfg.num_experts, cfg.hidden, cfg.ffn, torch.Generator().manual_seed(2), torch.float64)
    wg_EM = torch.randn(cfg.num_experts, cfg.hidden, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x_SM = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    g_SM = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    layer = MoELayer(cfg, groups, registry=default_registry(), schedule="parm-s1", dtype=torch.float64)
    layer.load_full(wg_EM, full)
    rec = Recorder(None, "fallback")
    router = partial(route_tokens, wg_EM=layer.wg_EM, config=cfg, groups=groups, rec=rec)
    experts = partial(sharded_experts, weights=layer.expert_weights, activation=cfg.activation, esp=groups.esp,
                      rec=rec)
    block = partial(route_token_block, wg_EM=layer.wg_EM, config=cfg, groups=groups, rec=rec)
    results = []
    for params in (LayerParams(router=router, experts=experts),
                   LayerParams(router=router, experts=experts, block_router=block)):
        layer.zero_grad(set_to_none=True)
        x = x_SM.clone().requires_grad_(True)
        y, d = run_schedule(layer.schedule, x, params)
        ((y * g_SM).sum() + 0.1 * d.aux_loss).backward()
        results.append((y.detach(), x.grad, layer.wg_EM.grad.clone(), d.aux_loss.detach(), d.exp_counts_E,
                        d.dropped))
    (y0, gx0, gw0, aux0, counts0, drop0), (y1, gx1, gw1, aux1, counts1, drop1) = results
    if not torch.equal(counts0, counts1) or drop0 != drop1:
        return float("inf")
    return max(float((a - b).abs().max()) for a, b in ((y0, y1), (gx0, gx1), (gw0, gw1), (aux0, aux1)))


def tuned_parm(spec: VerifySpec, degree: int, steps: int) -> dict:
    """``steps`` training calls of parm-tune (pipeline degree ``degree``) beside parm-s1: what each call ran,
    the largest difference of outputs, input gradients, aux losses and drop counts, and the search's state."""
    with process_groups(spec.layout()) as groups:
        return _tuned_parm(spec, degree, steps, groups)


def _tuned_parm(spec: VerifySpec, degree: int, steps: int, groups) -> dict:
    prob = make_problem(spec)
    dp = spec.layout().coords(groups.global_rank)["dp"]
    engine = build_engine(groups, pipeline=True)
    layers = {name: MoELayer(spec.moe_config(), groups, registry=default_registry(), schedule=name,
                             dtype=torch.float64, engine=engine,
                             executor=build_executor(r, None, engine))
              for name, r in (("parm-tune", degree), ("parm-s1", 1))}
    for layer in layers.values():
        layer.load_full(prob.wg_EM, prob.full)
    tuned = layers["parm-tune"].schedule
    out = {"ran": [], "max_diff": 0.0}
    try:
        for _ in range(steps):
            res = {}
            for name, layer in layers.items():
                x = prob.x_DSM[dp].clone().requires_grad_(True)
                o = layer(x)
                (o.y * prob.g_DSM[dp]).sum().add(o.aux_loss).backward()
                res[name] = (o.y.detach(), x.grad, o.aux_loss.detach(), torch.tensor(float(o.dropped)))
            (search,) = tuned.searches.values()
            out["ran"].append(search.decided or search.probe.candidate)
            out["max_diff"] = max(out["max_diff"], *((a - b).abs().max().item()
                                                     for a, b in zip(res["parm-tune"], res["parm-s1"])))
    finally:
        engine.close()
    out["start"], out["times"], out["decided"] = search.start, dict(search.times_s), search.decided
    out["notes"] = tuned.notes()
    return out


def auto_watches_s1_buffer(costs: ParmCosts, layout: Tuple[int, int, int], calls: int = 4,
                           tokens: int = 16):
    """parm-auto (with ``costs``, observe_every 2) on a skewed routing: each MP rank's token block sends all
    its tokens to two experts, so S1's buffer is twice balanced routing's. Runs ``calls`` forward+backward
    calls and, on the same input, parm-s1 and parm-s2 once. Rank 0 returns, per call, the choice that ran
    and the C_l it was priced with, the agreed C_l, the largest output and input-gradient differences from
    parm-s1, and S1's real buffer."""
    mp, ep, esp = layout
    world = dist.get_world_size()
    groups = build_process_groups(ParallelLayout(world=world, ranks_per_node=2, mp=mp, ep=ep, esp=esp))
    cfg = MoEConfig(hidden=8, ffn=16, num_experts=4, k=2, capacity_factor=1.0, min_capacity=0)
    gen = torch.Generator().manual_seed(1)
    full = init_full_weights(cfg.num_experts, cfg.hidden, cfg.ffn, gen, torch.float64)
    wg_EM = torch.zeros(cfg.num_experts, cfg.hidden, dtype=torch.float64)
    wg_EM[:, :cfg.num_experts] = torch.eye(cfg.num_experts, dtype=torch.float64)
    x_SM = 0.1 * torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    x_SM[:, :cfg.num_experts] = 0.0
    block = torch.arange(tokens) * mp // tokens             # MP block of each token: experts 2b, 2b + 1
    x_SM[torch.arange(tokens), (2 * block) % cfg.num_experts] = 3.0
    x_SM[torch.arange(tokens), (2 * block + 1) % cfg.num_experts] = 1.0
    auto_cls = type("ParmAutoSchedule", (ParmAutoSchedule.with_costs(costs, "test costs"),), {"observe_every": 2})

    def run(schedule):
        ledger = CommLedger()
        layer = MoELayer(cfg, groups, registry=default_registry(), schedule=schedule, ledger=ledger, name="moe",
                         dtype=torch.float64)
        layer.load_full(wg_EM, full)
        return layer, ledger

    def step(layer):
        x = x_SM.clone().requires_grad_(True)
        result = layer(x)
        (result.y * torch.arange(result.y.numel(), dtype=torch.float64).view_as(result.y)).sum().backward()
        return result.y.detach(), x.grad

    def s1_marks(ledger) -> int:     # only S1's split gate all-reduces the gate weight's gradient over MP
        return ledger.summary().get("moe", {}).get("backward:all_reduce@mp", {"count": 0})["count"]

    ref = {}
    for name in ("parm-s1", "parm-s2"):
        layer, ledger = run(name)
        ref[name] = step(layer)
        if name == "parm-s1":
            row = ledger.summary()["moe"]["forward:all_to_all@ep_esp"]      # numel per op: E C_l M N_ESP
            s1_c_l = row["numel"] / (row["count"] * cfg.num_experts * cfg.hidden * esp)
    layer, ledger = run(auto_cls)
    out = []
    for _ in range(calls):
        before = s1_marks(ledger)
        y, g = step(layer)
        c = layer.schedule.choose(tokens)
        out.append({"ran": "parm-s1" if s1_marks(ledger) > before else "parm-s2",
                    "priced_c_l": c.s1_slots, "source": c.s1_source,
                    "err_y": float((y - ref["parm-s1"][0]).abs().max()),
                    "err_grad": float((g - ref["parm-s1"][1]).abs().max())})
    agreed = layer.schedule.watch[tokens].agreed
    return ({"calls": out, "agreed": agreed, "s1_c_l": s1_c_l, "made": sorted(layer.schedule.made)}
            if dist.get_rank() == 0 else None)
