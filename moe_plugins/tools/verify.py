"""``moe-plugins verify``: run one MoE layer on real process groups and compare it with the reference.

Every rank builds the layer for the layout and schedule, loads the same full weights (drawn from the seed),
runs forward and backward on its token block, and sends its results to rank 0. Rank 0 recomputes every
DP block with :func:`moe_plugins.core.reference.reference_moe` and reports the largest errors.

Loss convention (Megatron's): the tokens of an MP group are one logical copy and each DP block's loss counts
once: J = sum_d <y_d, g_d> + aux_coef * aux_d, with g_d the same on the MP ranks of block d. Hence the
checks: each rank's output and input gradient equal its block's; each rank's gate gradient equals its
block's; an expert shard's gradient summed over its expert-DP replicas equals the reference's slice.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from moe_plugins.core.registry import Registry
from moe_plugins.plugins import default_registry
from moe_plugins.core.config import MoEConfig, moe_config_problems
from moe_plugins.core.costmodel import CostProfile, ProfileKey, cache_path
from moe_plugins.core.engine import build_engine
from moe_plugins.core.experts import ExpertWeights, init_full_weights, shard_weights
from moe_plugins.core.groups import process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.profile_ops import cached_profile, profile_key
from moe_plugins.core.reference import reference_moe
from moe_plugins.core.schedule import exchange_problems, with_exchange
from moe_plugins.core.timeline import chrome_trace

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
AUX_COEF = 0.01
log = logging.getLogger("moe_plugins.verify")


@dataclass(frozen=True, kw_only=True)
class VerifySpec:
    world: int
    ranks_per_node: int
    mp: int = 1
    ep: int = 1
    esp: int = 1
    experts: int = 4
    k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 0
    drop: bool = True
    tokens: int = 16
    hidden: int = 8
    ffn: int = 16
    schedule: str = "baseline"
    pipeline_degree: Union[int, str] = 1    # an int >= 1, or a registered word ("auto", "tune"): needs profile_dir
    exchange: str = "padded"               # "ragged": only occupied capacity slots travel (core/ragged.py)
    dtype: str = "float64"
    seed: int = 0
    skew: float = 0.0      # > 0 biases the gate towards expert 0 (forces drops / empty ranks)
    timeline: bool = False  # the report gets "timeline": every rank's collectives as a Chrome trace
    profile_dir: Optional[str] = None   # cached cost profiles (`moe-plugins profile`): profiled schedules and
                                        # pipeline_degree words read the layout's; None: no profile (defaults)

    def layout(self) -> ParallelLayout:
        return ParallelLayout(world=self.world, ranks_per_node=self.ranks_per_node, mp=self.mp, ep=self.ep,
                              esp=self.esp)

    def moe_config(self) -> MoEConfig:
        return MoEConfig(hidden=self.hidden, ffn=self.ffn, num_experts=self.experts, k=self.k,
                         capacity_factor=self.capacity_factor, min_capacity=self.min_capacity,
                         drop_tokens=self.drop)

    def profile_key(self) -> ProfileKey:
        """The cached profile this spec reads from ``profile_dir``: verify always runs on CPU gloo ranks."""
        return profile_key(self.layout(), "gloo", torch.device("cpu"))

    def profile(self) -> Optional[CostProfile]:
        """The layout's cached profile in ``profile_dir`` (None without a directory or a cached file)."""
        return cached_profile(self.profile_dir, self.layout(), "gloo", torch.device("cpu"))


def spec_problems(spec: VerifySpec, registry: Optional[Registry] = None) -> List[str]:
    """Every problem with the spec, each naming the flag and its value."""
    registry = default_registry() if registry is None else registry
    problems = layout_problems(spec.world, spec.ranks_per_node, spec.mp, spec.ep, spec.esp)
    if problems:
        return problems
    layout = spec.layout()
    problems += moe_config_problems(spec.moe_config(), layout) + registry.schedule_problems(spec.schedule, layout)
    if spec.schedule in registry.schedule_names():
        problems += exchange_problems(registry.schedule_class(spec.schedule), spec.exchange, spec.pipeline_degree)
    if spec.tokens < 1:
        problems.append(f"tokens ({spec.tokens}) must be >= 1")
    if spec.dtype not in DTYPES:
        problems.append(f"dtype ({spec.dtype!r}) must be one of {sorted(DTYPES)}")
    return problems + _degree_problems(spec, registry)


def _degree_problems(spec: VerifySpec, registry: Registry) -> List[str]:
    """pipeline_degree: a positive int, or a registered word with the layout's cached profile."""
    degree, words = spec.pipeline_degree, registry.degree_policies()
    if isinstance(degree, str) and degree in words:
        if spec.profile_dir is None:
            return [f"pipeline_degree ({degree!r}) needs a cost profile: pass profile_dir (--cache-dir), where "
                    "`moe-plugins profile` cached one for this layout"]
        path = cache_path(Path(spec.profile_dir), spec.profile_key())
        return [] if path.is_file() else [f"pipeline_degree ({degree!r}) needs a cost profile: none cached at {path}"]
    if not (isinstance(degree, int) and not isinstance(degree, bool) and degree >= 1):
        return [f"pipeline_degree ({degree!r}) must be a positive integer or one of {', '.join(map(repr, words))}"]
    return []


@dataclass(frozen=True)
class _Problem:
    wg_EM: torch.Tensor
    full: ExpertWeights
    x_DSM: torch.Tensor      # one token block per DP group
    g_DSM: torch.Tensor      # upstream gradient per DP group


def make_problem(spec: VerifySpec) -> _Problem:
    """Weights and data from the seed alone, so every rank (and the reference) draws the same numbers."""
    dtype = DTYPES[spec.dtype]
    gen = torch.Generator().manual_seed(spec.seed)
    full = init_full_weights(spec.experts, spec.hidden, spec.ffn, gen, dtype)
    wg = torch.randn(spec.experts, spec.hidden, generator=gen, dtype=torch.float64).to(dtype)
    dp = spec.world // spec.mp
    x = torch.randn(dp, spec.tokens, spec.hidden, generator=gen, dtype=torch.float64).to(dtype)
    if spec.skew:
        wg[0] += spec.skew * x.mean((0, 1)) / x.mean((0, 1)).norm()
        x = x + x.mean((0, 1))
    g = torch.randn(dp, spec.tokens, spec.hidden, generator=gen, dtype=torch.float64).to(dtype)
    return _Problem(wg, full, x, g)


def run_rank(spec: VerifySpec, registry: Optional[Registry] = None) -> Optional[Dict[str, Any]]:
    """Collective over the default group: run the layer, gather to rank 0, return the report there (with
    ``spec.timeline``, its "timeline" is the Chrome trace of every rank's collectives)."""
    gathered = collect_rank(spec, registry)
    if gathered is None:
        return None
    report = compare(spec, gathered)
    if spec.timeline:
        report["timeline"] = chrome_trace([r["timeline"] for r in gathered])
    return report


def collect_rank(spec: VerifySpec, registry: Optional[Registry] = None) -> Optional[List[Dict[str, Any]]]:
    """Collective: run forward and backward on this rank; rank 0 gets every rank's results. ``registry``
    resolves ``spec.schedule`` (default: every paper's schedules)."""
    layout = spec.layout()
    with process_groups(layout) as groups:
        mine = _run_layer(spec, layout, groups, default_registry() if registry is None else registry)
    gathered: List[Any] = [None] * layout.world
    dist.all_gather_object(gathered, mine)
    return gathered if dist.get_rank() == 0 else None


def _run_layer(spec: VerifySpec, layout: ParallelLayout, groups, registry: Registry) -> Dict[str, Any]:
    ledger, profile, dtype = CommLedger(), spec.profile(), DTYPES[spec.dtype]
    schedule = registry.host_schedule_class(spec.schedule, profile, torch.tensor([], dtype=dtype).element_size(),
                                            layout.mp, log)
    schedule = with_exchange(schedule, spec.exchange, spec.pipeline_degree)
    engine = build_engine(groups, pipeline=registry.needs_lane(spec.pipeline_degree))     # collective
    try:
        executor = registry.build_executor(spec.pipeline_degree, profile, engine)
        layer = MoELayer(spec.moe_config(), groups, registry=registry, schedule=schedule,
                         ledger=ledger, dtype=dtype, executor=executor, engine=engine)
        prob = make_problem(spec)
        layer.load_full(prob.wg_EM, prob.full)
        coords = layout.coords(groups.global_rank)
        x = prob.x_DSM[coords["dp"]].clone().requires_grad_(True)
        out = layer(x)
        ((out.y * prob.g_DSM[coords["dp"]]).sum() + AUX_COEF * out.aux_loss).backward()
    finally:
        engine.close()          # the pipeline lane's groups: free them with the job's
    return {"timeline": list(ledger.records) if spec.timeline else None,
            "rank": groups.global_rank, "coords": coords, "y": out.y.detach(), "grad_x": x.grad,
            "aux": out.aux_loss.detach(), "counts": out.exp_counts_E, "dropped": int(out.dropped),
            "grad_wg": layer.wg_EM.grad,
            "grad_experts": [p.grad for p in (layer.w1_EMH, layer.b1_EH, layer.w2_EHM, layer.b2_EM)],
            "ledger": ledger.summary(), "ran": sorted(layer.schedule.ran()), "degrees": _degrees_run(executor)}


def _degrees_run(executor) -> List[int]:
    """The pipeline degrees the layer ran: the executor's int, or what its degree policy decided."""
    degree = executor.degree
    return [degree] if isinstance(degree, int) else sorted(set(getattr(degree, "decisions", {}).values()))


def _maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def compare(spec: VerifySpec, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    prob, cfg, layout = make_problem(spec), spec.moe_config(), spec.layout()
    refs = []
    grad_experts = [torch.zeros_like(t) for t in (prob.full.w1_EMH, prob.full.b1_EH, prob.full.w2_EHM,
                                                    prob.full.b2_EM)]
    for d in range(layout.dp):
        x = prob.x_DSM[d].clone().requires_grad_(True)
        wg = prob.wg_EM.clone().requires_grad_(True)
        ws = [t.clone().requires_grad_(True) for t in (prob.full.w1_EMH, prob.full.b1_EH, prob.full.w2_EHM,
                                                       prob.full.b2_EM)]
        y, routing = reference_moe(x, wg, ExpertWeights(*ws), cfg)
        ((y * prob.g_DSM[d]).sum() + AUX_COEF * routing.aux_loss).backward()
        refs.append({"y": y.detach(), "grad_x": x.grad, "grad_wg": wg.grad, "aux": routing.aux_loss.detach(),
                     "counts": routing.exp_counts_E, "dropped": int(routing.dropped)})
        for acc, w in zip(grad_experts, ws):
            acc += w.grad
    err = {"max_err_out": 0.0, "max_err_grad_in": 0.0, "max_err_grad_w": 0.0, "max_err_aux": 0.0}
    routing_ok = True
    for r in ranks:
        ref = refs[r["coords"]["dp"]]
        err["max_err_out"] = max(err["max_err_out"], _maxerr(r["y"], ref["y"]))
        err["max_err_grad_in"] = max(err["max_err_grad_in"], _maxerr(r["grad_x"], ref["grad_x"]))
        err["max_err_grad_w"] = max(err["max_err_grad_w"], _maxerr(r["grad_wg"], ref["grad_wg"]))
        err["max_err_aux"] = max(err["max_err_aux"], _maxerr(r["aux"], ref["aux"]))
        routing_ok &= bool(torch.equal(r["counts"], ref["counts"])) and r["dropped"] == ref["dropped"]
    err["max_err_grad_w"] = max(err["max_err_grad_w"], _expert_grad_error(ranks, layout, grad_experts))
    tol = TOLERANCE[spec.dtype]
    ok = routing_ok and all(v <= tol for v in err.values())
    return {"ok": ok, **err, "tolerance": tol, "routing_equal": routing_ok,
            "dropped_routes": sum(ref["dropped"] for ref in refs), "spec": asdict(spec),
            "layout": layout.describe(), "ledger": ranks[0]["ledger"], "ran": ranks[0].get("ran", []),
            "degrees": ranks[0].get("degrees", [])}


def _expert_grad_error(ranks: List[Dict[str, Any]], layout: ParallelLayout, grad_full: List[torch.Tensor]) -> float:
    """Sum each shard's gradient over its expert-DP replicas and compare with the reference's slice."""
    worst = 0.0
    full = ExpertWeights(*grad_full)
    for ep_rank in range(layout.ep):
        for esp_rank in range(layout.esp):
            owners = [r for r in ranks if r["coords"]["ep"] == ep_rank and r["coords"]["esp"] == esp_rank]
            summed = [sum(r["grad_experts"][i] for r in owners) for i in range(4)]
            ref = shard_weights(full, ep_rank, layout.ep, esp_rank, layout.esp)
            for got, want in zip(summed, (ref.w1_EMH, ref.b1_EH, ref.w2_EHM, ref.b2_EM)):
                worst = max(worst, _maxerr(got, want))
    return worst
