"""Pool jobs for the PipeMoE tests (run on every rank of a gloo pool)."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from moe_plugins.plugins import default_registry
from moe_plugins.core.costmodel import PipeCosts
from moe_plugins.core.groups import process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.ledger import CommLedger
from moe_plugins.pipemoe.degree import AutoDegree
from moe_plugins.core.engine import build_engine
from moe_plugins.pipemoe.runner import Pipelined, build_executor, run_pipelined
from moe_plugins.tools.profiler import ProfileSpec, profile_rank
from moe_plugins.core.schedule import LayerParams, run_schedule, with_exchange
from moe_plugins.core.baseline import BaselineSchedule
from moe_plugins.tools.verify import DTYPES, VerifySpec, make_problem, run_rank


def verify_many(specs: List[VerifySpec]):
    return [run_rank(spec) for spec in specs]


# ---- overlap probes: stages that only finish if another stage runs at the same time -----------------------

class Probe:
    """Rendezvous points between stages of different chunks. ``meet(a, b)`` marks ``a`` as running and waits
    until ``b`` is running too; a runner that does not overlap them times out."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._events: Dict[Tuple[str, int], threading.Event] = {}
        self._counts: Dict[str, int] = {}
        self._lock = threading.Lock()

    def event(self, key: Tuple[str, int]) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def next_index(self, stage: str) -> int:
        with self._lock:
            i = self._counts.get(stage, 0)
            self._counts[stage] = i + 1
            return i

    def meet(self, mine: Tuple[str, int], other: Tuple[str, int]) -> None:
        self.event(mine).set()
        if not self.event(other).wait(self.timeout_s):
            raise TimeoutError(f"{mine} never ran together with {other}")


class _Meet(torch.autograd.Function):
    """Identity; backward meets ``other`` (placed last in a stage, so it runs first in its backward)."""

    @staticmethod
    def forward(ctx, x, probe, mine, other):
        ctx.args = (probe, mine, other)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        probe, mine, other = ctx.args
        if other is not None:
            probe.meet(mine, other)
        return g, None, None, None


def probed_schedule(probe: Probe, r: int):
    """Baseline with rendezvous: forward D(i+1)||E(i) and C(r-2)||E(r-1); backward Cb(j)||Eb(j+1)."""

    class Probed(BaselineSchedule):
        def exchange_in(self, d):
            i = probe.next_index("D")
            if i >= 1:
                probe.meet(("D", i), ("E", i - 1))
            return super().exchange_in(d)

        def expert(self, e, params):
            i = probe.next_index("E")
            if i <= r - 2:
                probe.meet(("E", i), ("D", i + 1))
            if i == r - 1:
                probe.meet(("E", i), ("C", r - 2))
            y = super().expert(e, params)
            return _Meet.apply(y, probe, ("Eb", i), ("Cb", i - 1) if i >= 1 else None)

        def exchange_out(self, o):
            i = probe.next_index("C")
            if i == r - 2:
                probe.meet(("C", i), ("E", r - 1))
            y = super().exchange_out(o)
            return _Meet.apply(y, probe, ("Cb", i), ("Eb", i + 1) if i <= r - 2 else None)

    return Probed


def overlap_probe(r: int, pipelined: bool, timeout_s: float) -> str:
    """Forward + backward of one layer with the probed schedule; "ok" or the probe's timeout message."""
    spec = VerifySpec(world=4, ranks_per_node=2, ep=4, k=2, tokens=32, schedule="baseline")
    with process_groups(spec.layout()) as groups:
        return _overlap_probe(spec, groups, r, pipelined, timeout_s)


def _overlap_probe(spec: VerifySpec, groups, r: int, pipelined: bool, timeout_s: float) -> str:
    layout = spec.layout()
    layer = MoELayer(spec.moe_config(), groups, dtype=torch.float64)
    prob = make_problem(spec)
    layer.load_full(prob.wg_EM, prob.full)
    probe = Probe(timeout_s)
    schedule = probed_schedule(probe, r)(layer.config, groups, layer.rec)
    engine = build_engine(groups, pipeline=True) if pipelined else None
    lane = Pipelined(r, engine) if pipelined else None
    x = prob.x_DSM[layout.coords(groups.global_rank)["dp"]].clone().requires_grad_(True)
    params = _params(layer)
    try:
        if pipelined:
            y, _ = run_pipelined(schedule, x, params, r, lane)
        else:
            y, _ = run_schedule(schedule, x, params, r)
        y.sum().backward()
        return "ok"
    except TimeoutError as exc:
        return f"timeout: {exc}"
    finally:
        if engine is not None:
            engine.close()


def _params(layer: MoELayer) -> LayerParams:
    from functools import partial

    from moe_plugins.core.experts import sharded_experts
    from moe_plugins.core.router import route_tokens
    return LayerParams(router=partial(route_tokens, wg_EM=layer.wg_EM, config=layer.config, groups=layer.groups,
                                      rec=layer.rec),
                       experts=partial(sharded_experts, weights=layer.expert_weights,
                                       activation=layer.config.activation, esp=layer.groups.esp, rec=layer.rec))


# ---- auto degree and inference through MoELayer --------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class _Recording(AutoDegree):
    """AutoDegree that also keeps the degrees it returned (test only)."""

    chosen: list = field(default_factory=list)

    def degree(self, schedule, dispatched, training):
        r = super().degree(schedule, dispatched, training)
        self.chosen.append(r)
        return r


def auto_layer(spec: VerifySpec, costs: Dict[str, PipeCosts]) -> dict:
    """Run the layer with AutoDegree (training, then no_grad) and with r = 1; report outputs, input grads
    and how many forward all-to-alls each call issued."""
    with process_groups(spec.layout()) as groups:
        return _auto_layer(spec, costs, groups)


def _auto_layer(spec: VerifySpec, costs: Dict[str, PipeCosts], groups) -> dict:
    layout = spec.layout()
    prob = make_problem(spec)
    x0 = prob.x_DSM[layout.coords(groups.global_rank)["dp"]]
    results = {}
    engine = build_engine(groups, pipeline=True)
    for label, degree in (("auto", _Recording(costs=costs)), ("one", 1)):
        ledger = CommLedger()
        layer = MoELayer(spec.moe_config(), groups, registry=default_registry(), schedule=spec.schedule,
                         ledger=ledger, dtype=DTYPES[spec.dtype],
                         executor=build_executor(degree, None, engine), engine=engine)
        layer.load_full(prob.wg_EM, prob.full)
        x = x0.clone().requires_grad_(True)
        out = layer(x)
        (out.y * prob.g_DSM[layout.coords(groups.global_rank)["dp"]]).sum().backward()
        fwd_a2a = sum(1 for rec in ledger.records if rec.op == "all_to_all" and rec.phase == "forward")
        ledger.clear()
        with torch.no_grad():
            y_eval = layer(x0).y
        eval_a2a = sum(1 for rec in ledger.records if rec.op == "all_to_all" and rec.phase == "forward")
        results[label] = {"y": out.y.detach(), "grad_x": x.grad, "y_eval": y_eval, "fwd_a2a": fwd_a2a,
                          "eval_a2a": eval_a2a, "chunks": list(getattr(degree, "chosen", []))}
    engine.close()
    return results


# ---- a tiny real profile --------------------------------------------------------------------------------------

def tiny_profile(spec: ProfileSpec):
    return profile_rank(spec, source="test", progress=False)


# ---- pipeline_degree="tune" -----------------------------------------------------------------------------------

def tuned_layer(spec: VerifySpec, costs: Dict[str, PipeCosts], steps: int) -> dict:
    """``steps`` training calls of a layer with TunedDegree next to r = 1, then two no_grad calls: the degree
    of every call (forward all-to-alls / 2, less the ragged exchange's counts), outputs and input gradients, and
    the tuner's state. ``spec.exchange`` is both layers' exchange."""
    with process_groups(spec.layout()) as groups:
        return _tuned_layer(spec, costs, steps, groups)


def _tuned_layer(spec: VerifySpec, costs: Dict[str, PipeCosts], steps: int, groups) -> dict:
    from moe_plugins.pipemoe.tune import TunedDegree
    layout, prob = spec.layout(), make_problem(spec)
    dp = layout.coords(groups.global_rank)["dp"]
    tuned = TunedDegree(costs=costs, warmup_calls=1, timed_calls=2)
    layers = {}
    engine = build_engine(groups, pipeline=True)
    for label, degree in (("tune", tuned), ("one", 1)):
        schedule = with_exchange(default_registry().schedule_class(spec.schedule), spec.exchange, "tune")
        layers[label] = MoELayer(spec.moe_config(), groups, registry=default_registry(), schedule=schedule,
                                 ledger=CommLedger(),
                                 dtype=DTYPES[spec.dtype], executor=build_executor(degree, None, engine))
        layers[label].load_full(prob.wg_EM, prob.full)
    out = {"degrees": [], "eval_degrees": [], "max_diff": 0.0}
    try:
        for _ in range(steps):
            res = {}
            for label, layer in layers.items():
                layer.ledger.clear()
                x = prob.x_DSM[dp].clone().requires_grad_(True)
                y = layer(x).y
                (y * prob.g_DSM[dp]).sum().backward()
                res[label] = (y.detach(), x.grad)
            out["degrees"].append(_forward_exchanges(layers["tune"].ledger, spec.exchange) // 2)
            out["max_diff"] = max(out["max_diff"], *((a - b).abs().max().item()
                                                     for a, b in zip(res["tune"], res["one"])))
        for _ in range(2):
            layers["tune"].ledger.clear()
            with torch.no_grad():
                y_eval = layers["tune"](prob.x_DSM[dp]).y
            out["eval_degrees"].append(_forward_exchanges(layers["tune"].ledger, spec.exchange) // 2)
            out["max_diff"] = max(out["max_diff"], (y_eval - res["one"][0]).abs().max().item())
    finally:
        engine.close()
    out["climbs"] = {key[3]: (c.start, dict(c.times_s), c.decided) for key, c in tuned.searches.items()}
    out["r_max"] = {key[3]: c.propose.args[1] for key, c in tuned.searches.items()}   # partial(next_probe, start, r_max)
    out["decisions"] = {key[3]: r for key, r in tuned.decisions.items()}
    out["notes"] = tuned.notes()
    return out


def _forward_exchanges(ledger: CommLedger, exchange: str = "padded") -> int:
    """The forward all-to-alls that carry rows (the ragged exchange's counts go first, in one more)."""
    return sum(1 for rec in ledger.records if rec.op == "all_to_all" and rec.phase == "forward") - (
        exchange == "ragged")


# ---- nothing of a step outlives it ----------------------------------------------------------------------------

def live_stages_after(spec: VerifySpec, steps: int) -> Dict[str, int]:
    """``steps`` training calls of a pipelined layer, then a forward with grad whose output is dropped unused,
    then a no_grad call; after each kind, how many of the runner's stages are still alive once the
    step's tensors are gone and the collector has run."""
    with process_groups(spec.layout()) as groups:
        return _live_stages_after(spec, steps, groups)


def _live_stages(*kinds: type) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, kinds))


def _live_stages_after(spec: VerifySpec, steps: int, groups) -> Dict[str, int]:
    from moe_plugins.pipemoe.runner import _Stage
    prob = make_problem(spec)
    x0 = prob.x_DSM[spec.layout().coords(groups.global_rank)["dp"]]
    engine = build_engine(groups, pipeline=True)
    layer = MoELayer(spec.moe_config(), groups, registry=default_registry(), schedule=spec.schedule,
                     dtype=DTYPES[spec.dtype],
                     executor=build_executor(spec.pipeline_degree, None, engine))
    out = {}
    try:
        for _ in range(steps):
            x = x0.clone().requires_grad_(True)
            layer(x).y.sum().backward()
        del x
        out["training"] = _live_stages(_Stage)
        layer(x0.clone().requires_grad_(True))
        out["forward_unused"] = _live_stages(_Stage)
        with torch.no_grad():
            layer(x0)
        out["no_grad"] = _live_stages(_Stage)
    finally:
        engine.close()
    return out
