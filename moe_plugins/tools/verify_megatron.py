"""``moe-plugins verify --host megatron``: the plugin against Megatron-core's stock ``MoELayer``, same process groups.

Every rank builds Megatron's ``MoELayer`` (SequentialMLP experts, the ``alltoall`` dispatcher) and the plugin's
layer from :func:`moe_plugins.patches.megatron.get_moe_module_spec`, loads the stock layer's state dict into the
plugin's, and runs both forward and backward on the same tokens with the same upstream gradient. Megatron's
aux and z losses are on (coefficients 0.01 and 0.001) and reach the gradients through its own hooks. Rank 0
reports the largest differences of outputs, input gradients, every parameter gradient (by name), the tracked
load-balancing loss, and whether the two routers made the same routing maps.

Layout: ``--mp`` is Megatron's tensor parallelism (sequence parallel on when > 1, so every rank holds distinct
tokens: ``--tokens`` per rank), ``--ep`` its expert parallelism and ``--esp`` its expert tensor parallelism.
``--drop`` uses ``moe_expert_capacity_factor = --capacity-factor`` (``--pad`` pads to capacity), ``--no-drop``
is dropless. On a CPU-only machine the test-only shims of :mod:`moe_plugins.patches.megatron_cpu` are active
around the run (Megatron-core has no CPU path); with CUDA they are not used.

Shapes: s tokens per rank (Megatron's [s, b=1, M] layout), M model dim.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_plugins.core.layout import ParallelLayout, layout_problems
from moe_plugins.core.ledger import CommLedger
from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import DTYPES, TOLERANCE, VerifySpec

AUX_COEF, Z_COEF = 0.01, 1e-3


@dataclass(frozen=True, kw_only=True)
class MegatronVerifySpec(VerifySpec):
    """VerifySpec read Megatron's way (see the module docstring), plus padding to capacity."""

    pad: bool = False


def host_spec_problems(spec: MegatronVerifySpec) -> List[str]:
    """Every reason this spec cannot run stock Megatron and the plugin side by side (the plugin's own checks run
    when its layer is built)."""
    problems = layout_problems(spec.world, spec.ranks_per_node, spec.mp, spec.ep, spec.esp)
    if spec.schedule not in default_registry().schedule_names():
        problems.append(f"schedule ({spec.schedule!r}) is unknown; allowed: "
                        f"{', '.join(default_registry().schedule_names())}")
    if spec.experts % spec.ep:
        problems.append(f"experts ({spec.experts}) must be divisible by ep ({spec.ep})")
    if spec.ffn % spec.esp:
        problems.append(f"ffn ({spec.ffn}) must be divisible by esp ({spec.esp}): Megatron's expert-TP shards H")
    if not 1 <= spec.k <= spec.experts:
        problems.append(f"k ({spec.k}) must be between 1 and experts ({spec.experts})")
    if spec.dtype not in DTYPES:
        problems.append(f"dtype ({spec.dtype!r}) must be one of {sorted(DTYPES)}")
    if spec.tokens < 1:
        problems.append(f"tokens ({spec.tokens}) must be >= 1")
    if spec.min_capacity:
        problems.append(f"min_capacity ({spec.min_capacity}) must be 0: Megatron's capacity has no minimum")
    if spec.skew:
        problems.append(f"skew ({spec.skew}) is not supported with --host megatron")
    if spec.pad and not spec.drop:
        problems.append("pad (true) needs drop: Megatron pads expert inputs to the capacity of a capacity factor")
    if spec.drop and spec.pad and spec.k * spec.capacity_factor > spec.experts:
        problems.append(f"k * capacity_factor ({spec.k} * {spec.capacity_factor}) must not exceed experts "
                        f"({spec.experts}) with pad: stock Megatron cannot pad an expert past the token count")
    if spec.pipeline_degree < 1:
        problems.append(f"pipeline_degree ({spec.pipeline_degree}) must be >= 1")
    return problems


@contextlib.contextmanager
def host_on_this_machine() -> Iterator[None]:
    """Megatron's CUDA calls stubbed for CPU (test/bench-only shims) when there is no GPU; nothing with one."""
    if torch.cuda.is_available():
        yield
        return
    from moe_plugins.patches.megatron_cpu import megatron_on_cpu
    with megatron_on_cpu():
        yield


def transformer_config(spec: MegatronVerifySpec, **overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = dict(
        num_layers=1, hidden_size=spec.hidden, num_attention_heads=spec.mp, ffn_hidden_size=spec.ffn,
        moe_ffn_hidden_size=spec.ffn, num_moe_experts=spec.experts, moe_router_topk=spec.k,
        moe_router_pre_softmax=spec.k == 1,                     # Megatron's rule for top-1
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=spec.capacity_factor if spec.drop else None,
        moe_pad_expert_input_to_capacity=spec.drop and spec.pad,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX_COEF, moe_z_loss_coeff=Z_COEF,
        # Megatron 0.16.1 allows expert biases only with expert-TP 1, and with EP = expert-TP = 1 its MLP adds the
        # bias in place on a view (an autograd error in the stock layer too); biases are on elsewhere
        moe_grouped_gemm=False, add_bias_linear=spec.esp == 1 and spec.ep > 1,
        gated_linear_unit=False, activation_func=F.gelu,
        tensor_model_parallel_size=spec.mp, expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=spec.esp,
        sequence_parallel=spec.mp > 1, use_cpu_initialization=True, perform_initialization=True,
        params_dtype=DTYPES[spec.dtype])
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_pair(spec: MegatronVerifySpec, config: Any, megatron_groups: Any, ledger: Optional[CommLedger] = None,
               engines: Any = None):
    """Megatron's stock MoELayer and the plugin's layer (from the spec provider) holding the stock weights.
    ``engines``: the caller's LayoutEngines, for a pipeline degree other than 1."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as stock_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_plugins.patches.megatron import get_moe_module_spec
    from moe_plugins.patches.megatron_specs import build_layer, spec_submodules

    plugin_config = PluginConfig(schedule=spec.schedule, pipeline_degree=spec.pipeline_degree, exchange=spec.exchange)
    with torch.random.fork_rng(devices=[]):                  # the caller's random state is left as it was
        torch.manual_seed(1000 + spec.seed)
        stock = MoELayer(config, submodules=spec_submodules(stock_spec(use_te=False, num_experts=spec.experts)),
                         pg_collection=megatron_groups.pg_collection)
        plugin = build_layer(get_moe_module_spec(use_te=False, num_experts=spec.experts, plugin=plugin_config,
                                                 groups=megatron_groups, ledger=ledger, engines=engines),
                             config=config)
    plugin.load_state_dict(stock.state_dict())
    for layer in (stock, plugin):
        layer.set_layer_number(1)                     # Megatron tracks aux losses of numbered layers only
    return stock, plugin


def _maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _run(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Dict[str, Any]:
    """Forward and backward; the router's outputs and the tracked load-balancing loss are captured."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
    seen: List[Tuple[torch.Tensor, torch.Tensor]] = []
    hook = layer.router.register_forward_hook(lambda mod, inp, out: seen.append((out[0].detach(), out[1])))
    clear_aux_losses_tracker()
    try:
        x = x.clone().requires_grad_(True)
        y, bias = layer(x)
        (y * g).sum().backward()
    finally:
        hook.remove()
    aux = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].detach().clone()
    clear_aux_losses_tracker()
    return {"y": y.detach(), "grad_x": x.grad, "bias": bias, "probs": seen[0][0], "map": seen[0][1], "aux": aux,
            "grads": {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}}


def compare_on_rank(spec: MegatronVerifySpec, megatron_groups: Any) -> Dict[str, Any]:
    """One spec on this rank (collective): stock vs plugin errors, this rank's view."""
    from moe_plugins.patches.megatron_engines import LayoutEngines
    ledger = CommLedger()
    with LayoutEngines(ledger=ledger) as engines:             # pipelined: the plugin layer's lane (collective)
        stock, plugin = build_pair(spec, transformer_config(spec), megatron_groups, ledger, engines)
        dtype, rank = DTYPES[spec.dtype], dist.get_rank()
        gen = torch.Generator().manual_seed(10_000 * spec.seed + rank)
        x = torch.randn(spec.tokens, 1, spec.hidden, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.randn(spec.tokens, 1, spec.hidden, generator=gen, dtype=torch.float64).to(dtype)
        a, b = _run(stock, x, g), _run(plugin, x, g)
    shared = sorted(set(a["grads"]) & set(b["grads"]))
    kept = a["map"] & (a["probs"] != 0)
    return {"rank": rank, "max_err_out": _maxerr(a["y"], b["y"]), "max_err_grad_in": _maxerr(a["grad_x"], b["grad_x"]),
            "max_err_grad_w": max((_maxerr(a["grads"][n], b["grads"][n]) for n in shared), default=0.0),
            "max_err_aux": _maxerr(a["aux"], b["aux"]),
            "routing_equal": bool(torch.equal(a["map"], b["map"])) and _maxerr(a["probs"], b["probs"]) == 0.0,
            "grad_names_equal": sorted(a["grads"]) == sorted(b["grads"]) and len(shared) > 0,
            "bias_none": a["bias"] is None and b["bias"] is None,
            "dropped_routes": spec.tokens * spec.k - int(kept.sum()),
            "ledger": ledger.summary()}


def collect(spec: MegatronVerifySpec, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    tol = TOLERANCE[spec.dtype]
    err = {key: max(r[key] for r in ranks) for key in ("max_err_out", "max_err_grad_in", "max_err_grad_w",
                                                       "max_err_aux")}
    routing = all(r["routing_equal"] for r in ranks)
    names = all(r["grad_names_equal"] and r["bias_none"] for r in ranks)
    return {"ok": routing and names and all(v <= tol for v in err.values()), **err, "tolerance": tol,
            "routing_equal": routing, "grad_names_equal": names,
            "dropped_routes": sum(r["dropped_routes"] for r in ranks), "host": "megatron", "spec": asdict(spec),
            "layout": ParallelLayout(world=spec.world, ranks_per_node=spec.ranks_per_node, mp=spec.mp, ep=spec.ep,
                                     esp=spec.esp).describe(),
            "ledger": ranks[0]["ledger"]}


def run_rank(spec: MegatronVerifySpec) -> Optional[Dict[str, Any]]:
    """Collective over the default group; rank 0 returns the report."""
    from moe_plugins.patches.megatron import megatron_groups
    layout = ParallelLayout(world=spec.world, ranks_per_node=spec.ranks_per_node, mp=spec.mp, ep=spec.ep, esp=spec.esp)
    with host_on_this_machine(), megatron_groups(layout) as groups:
        mine = compare_on_rank(spec, groups)
    gathered: List[Any] = [None] * spec.world
    dist.all_gather_object(gathered, mine)
    return collect(spec, gathered) if dist.get_rank() == 0 else None
