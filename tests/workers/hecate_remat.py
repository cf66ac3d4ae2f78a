"""Pool jobs for tests/test_hecate_remat.py: Hecate's re-materialisation (``rematerialize``) in the core layer (one
layer against the reference; a stack of L layers trained with it on, off, and with the ragged baseline, with the
copy-memory ledgers read after every forward and backward) and on DeepSpeed (ZeRO training against stock)."""

from __future__ import annotations

import gc
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.verify import AUX_COEF, VerifySpec, make_problem
from tests.workers.hecate_layer import _layer


def _variants(extra_experts: Any = "auto"):
    from moe_plugins.core.schedule import with_exchange
    from moe_plugins.hecate.config import HecateConfig
    from moe_plugins.hecate.schedule import HecateSchedule
    from moe_plugins.plugins import default_registry

    return {"remat": HecateSchedule.configured(HecateConfig(extra_experts=extra_experts, rematerialize=True)),
            "hecate": HecateSchedule.configured(HecateConfig(extra_experts=extra_experts)),
            "ragged": with_exchange(default_registry().schedule_class("baseline"), "ragged")}


def _counted(params) -> Counter:
    """Gradient accumulations per parameter name (the event DeepSpeed ZeRO's hooks run on)."""
    counts: Counter = Counter()
    for name, p in params:
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.update([name]))
    return counts


def one_layer(specs: List[VerifySpec]) -> List[Dict[str, Dict[str, Any]]]:
    """Per spec, one layer's forward and backward with each variant: what ``tools.verify.compare`` reads, the
    communication ledger and the copy-memory ledger's summary."""
    from moe_plugins.core.groups import process_groups

    out = []
    for spec in specs:
        with process_groups(spec.layout()) as groups:
            coords = spec.layout().coords(groups.global_rank)
            runs = {}
            for name, schedule in _variants().items():
                ledger = CommLedger()
                layer, prob = _layer(spec, groups, schedule, ledger)
                counts = _counted(layer.named_parameters())
                x = prob.x_DSM[coords["dp"]].clone().requires_grad_(True)
                o = layer(x)
                ((o.y * prob.g_DSM[coords["dp"]]).sum() + AUX_COEF * o.aux_loss).backward()
                runs[name] = {"rank": groups.global_rank, "coords": coords, "y": o.y.detach(), "grad_x": x.grad,
                              "aux": o.aux_loss.detach(), "counts": o.exp_counts_E, "dropped": int(o.dropped),
                              "grad_wg": layer.wg_EM.grad, "ledger": ledger.summary(), "accumulated": dict(counts),
                              "grad_experts": [p.grad for p in (layer.w1_EMH, layer.b1_EH, layer.w2_EHM, layer.b2_EM)]}
                if name != "ragged":
                    runs[name]["memory"] = layer.schedule.memory.summary()
                    runs[name]["copies_E"] = layer.schedule.last.placement.copies_E
                del layer
            out.append(runs)
    return out


def _stack(spec: VerifySpec, groups, schedule, layers: int, ledger: CommLedger,
           engine: Any = None) -> List[torch.nn.Module]:
    """``layers`` core MoE layers named moe0, moe1, ..., each with its own weights (seed + 17 i); with an
    ``engine`` (a pipeline lane), on it and linked into one re-gather chain."""
    from moe_plugins.core.layer import MoELayer
    from moe_plugins.hecate.regather import link
    from moe_plugins.plugins import default_registry

    out = []
    for i in range(layers):
        layer = MoELayer(spec.moe_config(), groups, schedule=schedule, dtype=torch.float64, ledger=ledger,
                         registry=default_registry(), name=f"moe{i}", engine=engine)
        prob = make_problem(replace(spec, seed=spec.seed + 17 * i))
        layer.load_full(prob.wg_EM, prob.full)
        out.append(layer)
    if engine is not None:
        link([layer.schedule for layer in out])
    return out


def _forward(stack, x_SM: torch.Tensor, g_SM: torch.Tensor):
    """The model: h <- tanh(h + MoE(h)) per layer; loss = <h, g> + AUX_COEF * (sum of the layers' aux losses)."""
    h, aux = x_SM, 0.0
    for layer in stack:
        o = layer(h)
        h, aux = torch.tanh(h + o.y), aux + o.aux_loss
    return h, (h * g_SM).sum() + AUX_COEF * aux


def stack_training(spec: VerifySpec, layers: int, steps: int) -> Dict[str, Dict[str, Any]]:
    """Per variant, ``steps`` Adam steps of a stack of ``layers`` MoE layers from the same weights on the same
    batches (new tokens every step): the first step's output and every gradient, the losses, the final
    parameters, the communication ledger, and the copy memory: bytes alive after each forward and each backward
    (the ledgers' live counts, after a garbage collection), the peak per step (stamps around each step), per
    layer call rows and each layer's summary."""
    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.hecate.memory import call_rows, live_peak, step_peaks
    from moe_plugins.hecate.schedule import HecateSchedule

    out: Dict[str, Dict[str, Any]] = {}
    with process_groups(spec.layout()) as groups, ExitStack() as closing:
        dp = spec.layout().coords(groups.global_rank)["dp"]
        engine = build_engine(groups, pipeline=True)          # collective
        closing.callback(engine.close)
        variants = _variants()
        need = HecateSchedule.configured(replace(variants["remat"].options, regather="at_need"))
        for name, schedule in {**variants, "early": variants["remat"], "at_need": need}.items():
            ledger = CommLedger()
            stack = _stack(spec, groups, schedule, layers, ledger, engine if name in ("early", "at_need") else None)
            params = [p for layer in stack for p in layer.parameters()]
            counts = _counted([(f"{layer.name}.{n}", p) for layer in stack for n, p in layer.named_parameters()])
            memories = [layer.schedule.memory for layer in stack] if name != "ragged" else []
            opt = torch.optim.Adam(params, lr=1e-2)
            prob, gen = make_problem(spec), torch.Generator().manual_seed(spec.seed + 99)
            run: Dict[str, Any] = {"losses": [], "live_forward": [], "live_backward": [], "bounds": []}
            for step in range(steps):
                run["bounds"].append(time.perf_counter_ns())
                x_SM = (prob.x_DSM[dp] + 0.1 * torch.randn(prob.x_DSM[dp].shape, generator=gen,
                                                           dtype=torch.float64)).requires_grad_(True)
                h, loss = _forward(stack, x_SM, prob.g_DSM[dp])
                gc.collect()
                run["live_forward"].append(sum(m.live_bytes for m in memories))
                opt.zero_grad()
                run["losses"].append(float(loss.detach()))
                loss.backward()
                del loss
                gc.collect()
                run["live_backward"].append(sum(m.live_bytes for m in memories))
                for layer in stack:        # the gate is replicated: average its gradient over DP as a host would
                    dist.all_reduce(layer.wg_EM.grad, group=groups.dp.pg)
                    layer.wg_EM.grad /= groups.dp.size
                if step == 0:
                    run.update(y=h.detach(), grad_x=x_SM.grad, grads=[p.grad.clone() for p in params])
                opt.step()
            run["bounds"].append(time.perf_counter_ns())
            run.update(params=[p.detach().clone() for p in params], ledger=ledger.summary(),
                       accumulated=dict(counts), names=sorted(counts))
            if memories:
                run.update(peak=live_peak(memories), step_peaks=step_peaks(memories, run["bounds"]),
                           calls=call_rows(memories), memory=[m.summary() for m in memories],
                           extra=[layer.schedule.last.extra_copies() for layer in stack],
                           regathers=[layer.schedule.regathers for layer in stack])
            out[name] = run
            del stack, opt
    return out


def deepspeed_training(stage: int, plugin: Optional[Dict[str, Any]], ep: int, k: int, seed: int,
                       steps: int) -> Dict[str, Any]:
    """tests/workers/deepspeed.py's training (``deepspeed.initialize``; the plugin on iff ``plugin``) with a
    communication ledger, each parameter's ZeRO hook calls, and the Hecate layer's copy memory."""
    import moe_plugins
    from moe_plugins.hecate.memory import step_peaks
    from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
    from tests.workers import deepspeed as jobs
    from tests.workers.hecate_deepspeed import _count_zero_hooks

    init_deepspeed_comm()
    ledger = CommLedger()
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        handle = stack.enter_context(moe_plugins.enable(ledger=ledger)) if plugin is not None else None
        engine = jobs.make_engine(stage, plugin, ep, k, seed)
        zero_hooks = _count_zero_hooks(engine, stack)
        layer = handle.swapped_layers[engine.module.moe.deepspeed_moe] if handle is not None else None
        memory = [layer.schedule.memory] if layer is not None else []
        bounds, losses, live_forward = [time.perf_counter_ns()], [], []
        for step in range(steps):             # jobs.train's step, with the copies alive read after the forward
            torch.manual_seed(seed * 31 + step)
            loss = engine(*jobs.batch(seed, step))
            gc.collect()
            live_forward.append(sum(m.live_bytes for m in memory))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            bounds.append(time.perf_counter_ns())
        out: Dict[str, Any] = {"losses": losses, "zero_hooks": dict(zero_hooks), "live_forward": live_forward,
                               "params": [n for n, p in engine.module.named_parameters() if p.requires_grad]}
        if layer is not None:
            del loss
            gc.collect()
            out.update(swaps=list(handle.swaps), ledger=ledger.summary(), memory=memory[0].summary(),
                       step_peaks=step_peaks(memory, bounds), notes=layer.schedule.notes(),
                       extra=layer.schedule.last.extra_copies(), regathers=layer.schedule.regathers)
        engine.destroy()
    return out


def deepspeed_on_and_off(stage: int, plugin: Dict[str, Any], ep: int, k: int, seed: int,
                         steps: int) -> Dict[str, Any]:
    return {"off": deepspeed_training(stage, None, ep, k, seed, steps),
            "on": deepspeed_training(stage, plugin, ep, k, seed, steps)}


def timed_stack(spec: VerifySpec, layers: int, rounds: int) -> Dict[str, Any]:
    """Step time (forward, backward, Adam; the slowest rank's) of a stack of ``layers`` Hecate layers with and
    without ``rematerialize``, the two alternating for ``rounds`` rounds after one warm-up step each (a timing
    probe for docs/hecate.md, not the bench): per variant the times, and the copy-memory peak."""
    from moe_plugins.core.groups import process_groups
    from moe_plugins.hecate.memory import live_peak

    out: Dict[str, Any] = {}
    with process_groups(spec.layout()) as groups:
        dp = spec.layout().coords(groups.global_rank)["dp"]
        prob = make_problem(spec)
        models = {}
        for name in ("remat", "hecate"):
            stack = _stack(spec, groups, _variants()[name], layers, CommLedger())
            models[name] = (stack, torch.optim.Adam([p for layer in stack for p in layer.parameters()], lr=1e-3))
        times: Dict[str, List[float]] = {name: [] for name in models}
        for step in range(rounds + 1):
            for name, (stack, opt) in models.items():
                dist.barrier()
                start = time.perf_counter()
                _, loss = _forward(stack, prob.x_DSM[dp], prob.g_DSM[dp])
                opt.zero_grad()
                loss.backward()
                opt.step()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step:
                    times[name].append(float(elapsed))
        for name, (stack, _) in models.items():
            out[name] = {"times": times[name], "peak": live_peak([layer.schedule.memory for layer in stack])}
    return out
