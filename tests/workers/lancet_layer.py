"""Pool jobs for tests/test_lancet_layer.py: the core MoE layer with Lancet's deferred expert weight gradients
(moe_plugins/lancet/layer.py) next to the same layer without it, on the same weights, tokens and engine.

Shapes: S tokens, M model dim.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

from moe_plugins.tools.verify import AUX_COEF, VerifySpec


class _Sleep:
    """Identity whose backward sleeps ``delay_s`` first (a slow peer: its next backward exchange starts late)."""

    @staticmethod
    def apply(x, delay_s: float):
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                time.sleep(delay_s)
                return g

        return Fn.apply(x)


def _layers(spec: VerifySpec, groups, engine, queue, ledger=None):
    """The plain core layer and the Lancet one, same weights, same engine (and executor kind)."""
    import torch

    from moe_plugins.core.layer import MoELayer
    from moe_plugins.lancet.layer import LancetMoELayer
    from moe_plugins.pipemoe.runner import build_executor
    from moe_plugins.plugins import default_registry
    from moe_plugins.tools.verify import make_problem

    prob = make_problem(spec)
    built = []
    for cls, extra in ((MoELayer, {}), (LancetMoELayer, {"queue": queue})):
        executor = build_executor(spec.pipeline_degree, None, engine)
        layer = cls(spec.moe_config(), groups, schedule=spec.schedule, dtype=torch.float64, registry=default_registry(),
                    executor=executor, engine=engine, ledger=ledger, **extra)
        layer.load_full(prob.wg_EM, prob.full)
        built.append(layer)
    return built[0], built[1], prob


def _params(layer) -> Dict[str, Any]:
    return {"wg_EM": layer.wg_EM, "w1_EMH": layer.w1_EMH, "b1_EH": layer.b1_EH, "w2_EHM": layer.w2_EHM,
            "b2_EM": layer.b2_EM}


def one_call(specs: List[VerifySpec]) -> List[Dict[str, Any]]:
    """Per spec, this rank's plain and Lancet layers: one forward and backward (the fields
    ``moe_plugins.tools.verify.compare`` reads), then a second micro-step accumulated; each Lancet parameter's
    post-accumulate-grad hook counted per backward; the queue's state after each backward."""
    import torch

    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.lancet.wgrad_queue import WgradQueue

    out = []
    for spec in specs:
        with process_groups(spec.layout()) as groups:
            engine = build_engine(groups, pipeline=True, timeout_s=60)
            try:
                queue = WgradQueue()
                plain, lancet, prob = _layers(spec, groups, engine, queue)
                hooks: Dict[str, int] = {name: 0 for name in _params(lancet)}
                for name, p in _params(lancet).items():
                    p.register_post_accumulate_grad_hook(lambda _p, name=name: hooks.__setitem__(name, hooks[name] + 1))
                coords = spec.layout().coords(groups.global_rank)
                runs: Dict[str, Any] = {"hooks": [], "queue_empty": [], "outstanding": []}
                for micro in range(2):
                    x_SM = prob.x_DSM[coords["dp"]] * (1.0 + 0.5 * micro)
                    g_SM = prob.g_DSM[coords["dp"]]
                    for name, layer in (("plain", plain), ("lancet", lancet)):
                        x = x_SM.clone().requires_grad_(True)
                        o = layer(x)
                        ((o.y * g_SM).sum() + AUX_COEF * o.aux_loss).backward()
                        if micro == 0:
                            runs[name] = {"rank": groups.global_rank, "coords": coords, "y": o.y.detach(),
                                          "grad_x": x.grad, "aux": o.aux_loss.detach(), "counts": o.exp_counts_E,
                                          "dropped": int(o.dropped), "ledger": {},
                                          "grad_wg": layer.wg_EM.grad.clone(),
                                          "grad_experts": [p.grad.clone() for p in (layer.w1_EMH, layer.b1_EH,
                                                                                     layer.w2_EHM, layer.b2_EM)]}
                        else:
                            runs[name]["y2"], runs[name]["grad_x2"] = o.y.detach(), x.grad
                    runs["hooks"].append(dict(hooks))
                    runs["queue_empty"].append(queue.empty())
                    runs["outstanding"].append(queue.outstanding_uses)
                runs["accumulated"] = {name: {k: p.grad.clone() for k, p in _params(layer).items()}
                                       for name, layer in (("plain", plain), ("lancet", lancet))}
                runs["items_run"] = queue.items_run
                runs["overlap_calls"] = lancet.rec.while_in_flight.calls
                del plain, lancet
            finally:
                engine.close()
        out.append(runs)
    return out


def overlap_run(spec: VerifySpec, delay_s: float, lane: bool) -> Dict[str, Any]:
    """The Lancet layer followed by a dense Linear whose dW is deferred too (``dense_wgrad``); rank 1 starts each
    backward exchange ``delay_s`` late, so on the other ranks both exchanges are long. ``lane``: the engine has a
    pipeline lane (else the exchanges run inline and nothing can overlap). This rank's backward all-to-all
    intervals (the engine's timeline), the queue's dW spans, and the gradients against the plain layer."""
    import torch

    from moe_plugins.core.engine import CommEngine, build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.lancet.dense import dense_wgrad
    from moe_plugins.lancet.overlap import exchange_intervals
    from moe_plugins.lancet.wgrad_queue import WgradQueue

    with process_groups(spec.layout()) as groups:
        engine = build_engine(groups, pipeline=True, timeout_s=60, record_timeline=True) if lane else \
            CommEngine(record_timeline=True)
        try:
            queue = WgradQueue(record_timeline=True)
            plain, lancet, prob = _layers(spec, groups, engine, queue)
            coords, rank = spec.layout().coords(groups.global_rank), groups.global_rank
            grads = {}
            for name, layer in (("plain", plain), ("lancet", lancet)):
                torch.manual_seed(7)
                head = torch.nn.Linear(spec.hidden, spec.hidden).double()
                if rank == 1 and name == "lancet":
                    inner_in = layer.schedule.exchange_in
                    layer.schedule.exchange_in = lambda d, f=inner_in: _Sleep.apply(f(d), delay_s)
                x = prob.x_DSM[coords["dp"]].clone().requires_grad_(True)
                with dense_wgrad(queue, {"head": head}) if name == "lancet" else _nothing():
                    y = layer(x).y
                    if rank == 1 and name == "lancet":
                        y = _Sleep.apply(y, delay_s)
                    if name == "lancet":
                        engine.timeline.clear() if engine.timeline is not None else None
                    (head(y) * prob.g_DSM[coords["dp"]]).sum().backward()
                grads[name] = [x.grad] + [p.grad for p in (*head.parameters(), *_params(layer).values())]
            err = max(float((a - b).abs().max()) for a, b in zip(grads["plain"], grads["lancet"]))
            return {"rank": rank, "exchanges": exchange_intervals(engine.timeline, phase="backward"),
                    "issued": exchange_intervals(engine.timeline, phase="backward", since="issue"),
                    "spans": [(s.name, s.tag, s.start_ns, s.end_ns, s.during) for s in queue.timeline],
                    "max_err": err, "queue_empty": queue.empty()}
        finally:
            if lane:
                engine.close()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def refused(spec: VerifySpec) -> str:
    """The ValueError a Lancet layer with ``spec.schedule`` raises (collective: builds the layout's groups)."""
    import torch

    from moe_plugins.core.groups import process_groups
    from moe_plugins.lancet.layer import LancetMoELayer
    from moe_plugins.lancet.wgrad_queue import WgradQueue
    from moe_plugins.plugins import default_registry

    with process_groups(spec.layout()) as groups:
        try:
            LancetMoELayer(spec.moe_config(), groups, schedule=spec.schedule, dtype=torch.float64,
                           registry=default_registry(), queue=WgradQueue())
        except ValueError as exc:
            return str(exc)
    return ""


def callback_fails(spec: VerifySpec) -> Dict[str, Any]:
    """The queue raises while the dispatch-gradient exchange flies: the error reaches ``backward()``, the exchange
    was still waited for (every rank took part), and after ``queue.clear()`` the next step runs and is exact."""
    import torch

    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.lancet.wgrad_queue import WgradQueue

    with process_groups(spec.layout()) as groups:
        engine = build_engine(groups, pipeline=True, timeout_s=60)
        try:
            queue = WgradQueue()
            plain, lancet, prob = _layers(spec, groups, engine, queue)
            x_SM = prob.x_DSM[spec.layout().coords(groups.global_rank)["dp"]]
            run_all = queue.run_all

            def boom(**kwargs):
                raise RuntimeError("dW failed")

            queue.run_all = boom
            message = ""
            try:
                lancet(x_SM.clone().requires_grad_(True)).y.sum().backward()
            except RuntimeError as exc:
                message = str(exc)
            queue.run_all = run_all
            queue.clear()
            for layer in (plain, lancet):
                for p in _params(layer).values():
                    p.grad = None
                layer(x_SM.clone().requires_grad_(True)).y.square().sum().backward()
            err = max(float((a.grad - b.grad).abs().max()) for a, b in zip(_params(plain).values(),
                                                                           _params(lancet).values()))
            return {"message": message, "max_err": err, "queue_empty": queue.empty()}
        finally:
            engine.close()
