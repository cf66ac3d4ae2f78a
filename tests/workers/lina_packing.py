"""Pool jobs for Lina's expert packing: a small model (dense layer, two core MoE layers, head) trained with Adam
on gloo ranks, once never packed and once packed p = 2 (and back to 1) by ``PackingController``, compared
step by step in fp64 with expert tensors matched by global expert id; the ``"auto"`` rule's agreement across
ranks; checkpoint conversion between packings.

Shapes: S tokens, M hidden, E experts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.config import MoEConfig
from moe_plugins.core.experts import ExpertWeights
from moe_plugins.core.groups import MoEProcessGroups, process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.core.ledger import CommLedger
from moe_plugins.lina.packer import PackingController
from moe_plugins.lina.packing import EXPERT_KEYS, MicroOpTimes, convert_state_dicts, expert_block, packed_layout

M, S, E = 8, 16, 8
DTYPE = torch.float64


class Net(torch.nn.Module):
    def __init__(self, groups: MoEProcessGroups, ledger: Optional[CommLedger] = None):
        super().__init__()
        config = MoEConfig(hidden=M, ffn=2 * M, num_experts=E, k=2, capacity_factor=1.0)
        self.inp, self.head = torch.nn.Linear(M, M, dtype=DTYPE), torch.nn.Linear(M, 1, dtype=DTYPE)
        self.moe = torch.nn.ModuleList(MoELayer(config, groups, name=f"moe{i}", dtype=DTYPE, ledger=ledger)
                                       for i in range(2))
        g = torch.Generator().manual_seed(0)
        for module in (self.inp, self.head):
            for p in module.parameters():
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=DTYPE) * 0.3)
        for layer in self.moe:
            full = ExpertWeights(*(torch.randn(*shape, generator=g, dtype=DTYPE) * 0.3 for shape in
                                   ((E, M, 2 * M), (E, 2 * M), (E, 2 * M, M), (E, M))))
            layer.load_full(torch.randn(E, M, generator=g, dtype=DTYPE), full)

    def forward(self, x_SM: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        x_SM, ys = torch.tanh(self.inp(x_SM)), []
        aux = 0.0
        for layer in self.moe:
            out = layer(x_SM)
            ys.append(out.y)
            x_SM, aux = x_SM + out.y, aux + out.aux_loss
        return self.head(x_SM).pow(2).mean() + 0.01 * aux, ys


def train_step(net: Net, opt: torch.optim.Optimizer, step: int) -> Tuple[float, List[torch.Tensor]]:
    """Forward, backward, gradient sums (dense over DP, experts over expert-DP of the layers' current layout),
    optimizer step. Returns the local loss and the MoE outputs."""
    x_SM = torch.randn(S, M, dtype=DTYPE, generator=torch.Generator().manual_seed(step * 100 + dist.get_rank()))
    opt.zero_grad(set_to_none=True)
    loss, ys = net(x_SM)
    loss.backward()
    groups = net.moe[0].groups
    experts = {id(getattr(layer, k)) for layer in net.moe for k in EXPERT_KEYS}
    for p in net.parameters():
        pg = groups.expert_dp.pg if id(p) in experts else groups.dp.pg
        if pg is not None:
            dist.all_reduce(p.grad, group=pg)
    opt.step()
    return float(loss.detach()), [y.detach().clone() for y in ys]


def by_expert_id(net: Net, opt: torch.optim.Optimizer, what: str) -> Dict[Tuple[str, str, int, int], torch.Tensor]:
    """This rank's expert tensors (``"data"``, ``"grad"``, or an optimizer state key) keyed by (layer, weight,
    global expert id, ESP index)."""
    out = {}
    for layer in net.moe:
        c = layer.groups.layout.coords(dist.get_rank())
        ids = expert_block(E, layer.groups.ep.size, c["ep"])
        for name in EXPERT_KEYS:
            p = getattr(layer, name)
            t = p.data if what == "data" else p.grad if what == "grad" else opt.state[p][what]
            for local, e in enumerate(ids):
                out[(layer.name, name, e, c["esp"])] = t[local].clone()
    return out


def gathered_diff(a: Dict[Any, torch.Tensor], b: Dict[Any, torch.Tensor]) -> float:
    """Largest difference between every rank's ``a`` and every rank's ``b`` entry of the same key (so: by global
    expert id, over all replicas); every key must appear on both sides."""
    got_a: List[Dict] = [{} for _ in range(dist.get_world_size())]
    got_b: List[Dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(got_a, a)
    dist.all_gather_object(got_b, b)
    keys_a = {k for d in got_a for k in d}
    keys_b = {k for d in got_b for k in d}
    if keys_a != keys_b:
        raise AssertionError(f"expert keys differ: {sorted(keys_a ^ keys_b)[:5]}")
    worst = 0.0
    for da in got_a:
        for k, ta in da.items():
            for db in got_b:
                if k in db:
                    worst = max(worst, float((ta - db[k]).abs().max()))
    return worst


def packed_training(world: int, ep: int, esp: int, steps: int, pack_at: int, unpack_at: int) -> Dict[str, Any]:
    """Two identical models; one is packed p = 2 after ``pack_at`` steps and unpacked after ``unpack_at``. Per
    step: the loss difference, MoE output difference and expert gradient difference by global id; at the
    pack boundary, Adam's exp_avg/exp_avg_sq and the weights by global id; the checkpoint conversion both ways."""
    torch.manual_seed(0)
    layout = ParallelLayout(world=world, ranks_per_node=max(1, world // 2), ep=ep, esp=esp)
    res: Dict[str, Any] = {"loss": [], "y": [], "grad": [], "ep": [], "moved": {}}
    ledger = CommLedger()
    with process_groups(layout) as groups:
        ref, packed = Net(groups), Net(groups, ledger)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt_packed = torch.optim.Adam(packed.parameters(), lr=1e-2)
        ctl = PackingController(packed.moe, groups, packing=1, optimizer=opt_packed)
        try:
            for step in range(steps):
                if step == pack_at:
                    ctl.set_packing(2)
                    for what in ("data", "exp_avg", "exp_avg_sq"):
                        res["moved"][what] = gathered_diff(by_expert_id(packed, opt_packed, what),
                                                           by_expert_id(ref, opt_ref, what))
                    res["moved"]["step_state"] = max(
                        abs(float(opt_packed.state[getattr(a, k)]["step"]) - float(opt_ref.state[getattr(b, k)]["step"]))
                        for a, b in zip(packed.moe, ref.moe) for k in EXPERT_KEYS)
                    # checkpoints: saved at p = 2 load into p = 1 by global id, and the other way
                    res["ckpt_2to1"] = _ckpt_diff(packed.state_dict(), packed_layout(layout, 2), layout, ref.state_dict())
                    res["ckpt_1to2"] = _ckpt_diff(ref.state_dict(), layout, packed_layout(layout, 2),
                                                  packed.state_dict())
                    res["opt_2to1"] = _ckpt_diff(_exp_avg(packed, opt_packed), packed_layout(layout, 2), layout,
                                                 _exp_avg(ref, opt_ref))
                if step == unpack_at:
                    ctl.set_packing(1)
                loss_ref, y_ref = train_step(ref, opt_ref, step)
                loss_packed, y_packed = train_step(packed, opt_packed, step)
                res["ep"].append(packed.moe[0].groups.ep.size)
                res["loss"].append(abs(loss_ref - loss_packed))
                res["y"].append(max(float((a - b).abs().max()) for a, b in zip(y_ref, y_packed)))
                # gradients after the step's reduction (still on .grad), by global id
                res["grad"].append(gathered_diff(by_expert_id(packed, opt_packed, "grad"),
                                                 by_expert_id(ref, opt_ref, "grad")))
            res["regroup_records"] = [r.phase + ":" + r.op + "@" + r.group for r in ledger.records
                                      if r.phase == "regroup"]
        finally:
            ctl.close()
    return res


def _exp_avg(net: Net, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Adam's exp_avg of every parameter, keyed like the state dict (expert ones convert like weights)."""
    return {name: opt.state[p]["exp_avg"] for name, p in net.named_parameters()}


def _ckpt_diff(state: Dict[str, torch.Tensor], layout_from: ParallelLayout, layout_to: ParallelLayout,
               expected: Dict[str, torch.Tensor]) -> float:
    """Gather every rank's ``state`` (saved under ``layout_from``), convert this rank's to ``layout_to`` and
    compare with ``expected`` (this rank's, under ``layout_to``): the largest difference over all keys."""
    states: List[Dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(states, {k: v.detach().clone() for k, v in state.items()})
    converted = convert_state_dicts(dict(enumerate(states)), layout_from, layout_to, dist.get_rank())
    if set(converted) != set(expected):
        raise AssertionError(f"keys differ: {sorted(set(converted) ^ set(expected))}")
    return max(float((converted[k] - expected[k].detach()).abs().max()) for k in expected)


def auto_decisions(world: int, steps: int, fake: Optional[Sequence[Sequence[Tuple[float, float]]]]) -> Dict[str, Any]:
    """``packing: "auto"`` with checks at steps 2, 4, 6 ...: ``fake[step][rank]`` = (expert s, a2a s) that rank
    reports for the step (None: the probe's real timings). Per step boundary: the packing returned, the EP
    size the layers run on, and the agreed decisions; the training runs on after each regroup."""
    layout = ParallelLayout(world=world, ranks_per_node=max(1, world // 2), ep=world)
    rank, out = dist.get_rank(), {"returned": [], "ep": [], "loss": []}
    with process_groups(layout) as groups:
        net = Net(groups)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        ctl = PackingController(net.moe, groups, packing="auto", optimizer=opt, start=2, every=2)
        try:
            for step in range(steps):
                loss, _ = train_step(net, opt, step)
                out["ep"].append(net.moe[0].groups.ep.size)     # what the step ran on
                times = None
                if fake is not None:
                    expert_s, a2a_s = fake[step][rank]
                    times = MicroOpTimes(expert_s, 1, a2a_s, 1)
                out["returned"].append(ctl.step_end(times))
                out["loss"].append(loss)
            out["decisions"] = [(s, t.expert_s, t.expert_n, t.a2a_s, t.a2a_n, a, b) for s, t, a, b in ctl.decisions]
            out["final_ep"] = net.moe[0].groups.ep.size
            if ctl.packing != 1:
                ctl.set_packing(1)
        finally:
            ctl.close()
    return out


def bad_packing(world: int, packing: Any) -> str:
    """The error a PackingController gives for ``packing`` on an ep = world layout ("" when accepted)."""
    layout = ParallelLayout(world=world, ranks_per_node=max(1, world // 2), ep=world)
    with process_groups(layout) as groups:
        net = Net(groups)
        try:
            ctl = PackingController(net.moe, groups, packing=packing)
        except ValueError as exc:
            return str(exc)
        ctl.set_packing(1)
        ctl.close()
        return ""


def mismatched_move(world: int) -> str:
    """Rank 0 alone has expert gradients when the regroup starts: every rank must refuse (no hang), and the
    layers stay as they were. Returns the error ("" when none)."""
    layout = ParallelLayout(world=world, ranks_per_node=max(1, world // 2), ep=world)
    with process_groups(layout) as groups:
        net = Net(groups)
        ctl = PackingController(net.moe, groups, packing=1)
        if dist.get_rank() == 0:
            for layer in net.moe:
                layer.w1_EMH.grad = torch.zeros_like(layer.w1_EMH)
        try:
            ctl.set_packing(2)
            message = ""
        except ValueError as exc:
            message = str(exc)
        still = [layer.groups.ep.size for layer in net.moe] + [ctl.packing]
        ctl.close()
        return f"{still} {message}"
