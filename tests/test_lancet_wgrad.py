"""Lancet's deferred weight gradients (moe_plugins/lancet/wgrad*.py, dense.py) against stock autograd in fp64:
gradients, each parameter's hooks (a post-accumulate-grad hook, as DeepSpeed ZeRO-1/2 registers it, and a hook on
the AccumulateGrad node, as Megatron DDP does) counted, gradient accumulation, the queue's scheduling rule, runs
part-way through backward, re-entrant checkpointing, bad input; and DeepSpeed ZeRO-2 on 2 gloo ranks.

Shapes: E experts, N rows, M model dim, H FFN hidden.
"""

from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_plugins.core.experts import ExpertWeights, partial_ffn
from moe_plugins.core.ops import Handle
from moe_plugins.lancet import WgradQueue, deferred_bmm, deferred_partial_ffn, dense_wgrad
from tests.workers import lancet_wgrad as jobs

E, N, M, H = 3, 5, 4, 6
TOL = 1e-12
F64 = torch.float64


class HookCounter:
    """Counts, per parameter, its post-accumulate-grad hook and the hook on its AccumulateGrad node (the node is
    kept alive here, as the hosts keep it)."""

    def __init__(self, named: Dict[str, torch.Tensor]):
        self.post: Dict[str, int] = {name: 0 for name in named}
        self.node: Dict[str, int] = {name: 0 for name in named}
        self.nodes = []
        for name, p in named.items():
            p.register_post_accumulate_grad_hook(lambda _p, name=name: self._bump(self.post, name))
            acc = p.view_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda *_, name=name: self._bump(self.node, name))
            self.nodes.append(acc)

    @staticmethod
    def _bump(counts: Dict[str, int], name: str) -> None:
        counts[name] += 1

    def assert_each(self, times: int) -> None:
        assert set(self.post.values()) == {times}, self.post
        assert set(self.node.values()) == {times}, self.node


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a is not None and b is not None
    return float((a - b).abs().max())


def _expert_params(seed: int = 0) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1_EMH": (E, M, H), "b1_EH": (E, H), "w2_EHM": (E, H, M)}
    return {k: torch.randn(s, generator=gen, dtype=F64).requires_grad_() for k, s in shapes.items()}


def _weights(p: Dict[str, torch.Tensor]) -> ExpertWeights:
    return ExpertWeights(w1_EMH=p["w1_EMH"], b1_EH=p["b1_EH"], w2_EHM=p["w2_EHM"], b2_EM=torch.zeros(E, M, dtype=F64))


def _expert_run(deferred: bool):
    params = _expert_params()
    hooks = HookCounter(params)
    x_ENM = torch.randn(E, N, M, generator=torch.Generator().manual_seed(1), dtype=F64).requires_grad_()
    queue = WgradQueue()
    seen: List[int] = []
    x_ENM.register_hook(lambda g: seen.append(queue.pending) and None)   # when dX reaches the input
    ffn = deferred_partial_ffn(x_ENM, _weights(params), "gelu", queue) if deferred else \
        partial_ffn(x_ENM, _weights(params), "gelu")
    (ffn.square().sum() + ffn.sum()).backward()
    return params, x_ENM, hooks, queue, seen


def test_expert_ffn_gradients_equal_stock_and_hooks_fire_once():
    stock, x_stock, stock_hooks, _, _ = _expert_run(deferred=False)
    ours, x_ours, hooks, queue, seen = _expert_run(deferred=True)
    assert _max_err(x_stock.grad, x_ours.grad) <= TOL
    for name in stock:
        assert _max_err(stock[name].grad, ours[name].grad) <= TOL, name
    stock_hooks.assert_each(1)
    hooks.assert_each(1)
    assert seen == [2], "both GEMMs' dW were still queued when dX reached the input (deferred, not computed)"
    assert queue.empty() and queue.items_run == 2


def test_stacked_weights_used_in_two_chunks_deliver_once_per_parameter():
    """PipeMoE's shape of use: per-expert parameters stacked on each call, the FFN run on two row chunks. Stock
    autograd sums both uses before each AccumulateGrad runs once; the queue delivers them together."""
    def run(deferred: bool):
        gen = torch.Generator().manual_seed(3)
        per_expert = {f"w{e}": torch.randn(M, H, generator=gen, dtype=F64).requires_grad_() for e in range(E)}
        per_expert.update({f"b{e}": torch.randn(H, generator=gen, dtype=F64).requires_grad_() for e in range(E)})
        hooks = HookCounter(per_expert)
        x_ENM = torch.randn(E, 2 * N, M, generator=gen, dtype=F64)
        queue = WgradQueue()
        outs = []
        for chunk in x_ENM.chunk(2, dim=1):
            w_EMH = torch.stack([per_expert[f"w{e}"] for e in range(E)])
            b_EH = torch.stack([per_expert[f"b{e}"] for e in range(E)])
            outs.append(deferred_bmm(chunk, w_EMH, b_EH, queue) if deferred else
                        torch.baddbmm(b_EH.unsqueeze(1), chunk, w_EMH))
        torch.cat(outs, 1).tanh().sum().backward()
        return per_expert, hooks, queue
    stock, stock_hooks, _ = run(False)
    ours, hooks, queue = run(True)
    for name in stock:
        assert _max_err(stock[name].grad, ours[name].grad) <= TOL, name
    stock_hooks.assert_each(1)
    hooks.assert_each(1)
    assert queue.empty() and queue.items_run == 2 and queue.deliveries == 1


def test_two_forwards_before_their_backwards_deliver_once_per_backward():
    """Pipeline parallelism's order (1F1B): two micro-batches' forwards, then their backwards one by one. Each
    backward delivers each parameter once (its two chunk uses together), though the other micro-batch's uses are
    still counted; a forward whose graph is dropped without backward leaves no use behind."""
    gen = torch.Generator().manual_seed(4)
    per_expert = {f"w{e}": torch.randn(M, H, generator=gen, dtype=F64).requires_grad_() for e in range(E)}
    queue = WgradQueue()

    def forward(x_ENM: torch.Tensor, deferred: bool) -> torch.Tensor:
        outs = []
        for chunk in x_ENM.chunk(2, dim=1):
            w_EMH = torch.stack([per_expert[f"w{e}"] for e in range(E)])
            outs.append(deferred_bmm(chunk, w_EMH, None, queue) if deferred else torch.bmm(chunk, w_EMH))
        return torch.cat(outs, 1).tanh().sum()

    xs = [torch.randn(E, 2 * N, M, generator=gen, dtype=F64) for _ in range(2)]
    for x in xs:
        forward(x, deferred=False).backward()
    stock = {name: p.grad.clone() for name, p in per_expert.items()}
    for p in per_expert.values():
        p.grad = None
    hooks = HookCounter(per_expert)
    losses = [forward(x, deferred=True) for x in xs]
    assert queue.outstanding_uses == 2 * 2 * E              # 2 micro-batches x 2 chunks, on each expert's weight
    losses[0].backward()
    hooks.assert_each(1)
    assert queue.outstanding_uses == 2 * E and queue.empty()
    losses[1].backward()
    hooks.assert_each(2)
    for name in stock:
        assert _max_err(stock[name], per_expert[name].grad) <= TOL, name
    dropped = forward(xs[0], deferred=True)
    assert queue.outstanding_uses == 2 * E
    del dropped
    assert queue.outstanding_uses == 0 and queue.empty()


class Probe(torch.autograd.Function):
    """Identity; its backward calls ``action()`` (a point in the middle of backward, like a layer's exchange)."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


class DenseStack(nn.Module):
    """Linear -> tanh -> shared Linear (used twice) -> probe -> Linear head."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.head = nn.Linear(M, H), nn.Linear(H, H), nn.Linear(H, 2)
        self.action = lambda: None

    def forward(self, x_NM: torch.Tensor) -> torch.Tensor:
        h_NH = torch.tanh(self.inp(x_NM))
        h_NH = torch.tanh(self.shared(torch.tanh(self.shared(h_NH))))
        return self.head(Probe.apply(h_NH, self.action))


def _linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _dense_pair(seed: int = 0):
    torch.manual_seed(seed)
    stock = DenseStack().double()
    return stock, copy.deepcopy(stock)


def _batches(steps: int):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2, N, M, generator=gen, dtype=F64) for _ in range(steps)]


def _compare_params(stock: nn.Module, ours: nn.Module) -> None:
    for (name, a), (_, b) in zip(stock.named_parameters(), ours.named_parameters()):
        assert _max_err(a.grad, b.grad) <= TOL, name


def test_dense_wgrad_two_micro_steps_equal_stock_hooks_once_per_backward():
    stock, ours = _dense_pair()
    stock_hooks = HookCounter(dict(stock.named_parameters()))
    hooks = HookCounter(dict(ours.named_parameters()))
    queue = WgradQueue()
    pending_at_probe: List[int] = []
    ours.action = lambda: pending_at_probe.append(queue.pending)
    for x in _batches(2):
        stock(x).square().mean().backward()
    with dense_wgrad(queue, _linears(ours)):
        for x in _batches(2):
            ours(x).square().mean().backward()
            assert queue.empty()
    _compare_params(stock, ours)
    stock_hooks.assert_each(2)
    hooks.assert_each(2)
    assert pending_at_probe == [1, 1], "the head's dW was queued, not computed, when backward passed the probe"
    assert queue.items_run == 2 * 4          # inp, shared twice, head per micro-step
    assert all("forward" not in vars(m) for _, m in _linears(ours)), "the wrap is undone"


@pytest.mark.parametrize("how", ["run_some", "run_while", "run_while_handle"])
def test_partial_runs_before_the_end_give_the_same_result(how):
    """At the probe (mid-backward) the queue holds the head's dW; the shared layer's two uses come later. Running
    part of the queue there changes nothing in the result or the hook counts."""
    stock, ours = _dense_pair(seed=1)
    stock_hooks = HookCounter(dict(stock.named_parameters()))
    hooks = HookCounter(dict(ours.named_parameters()))
    queue, ran = WgradQueue(), []
    checks = iter([True, False])
    actions = {"run_some": lambda: ran.extend(queue.run_some(1e9)),
               "run_while": lambda: ran.extend(queue.run_while(lambda: next(checks))),
               "run_while_handle": lambda: ran.extend(queue.run_while(Handle("pending exchange")))}
    ours.action = actions[how]
    x = _batches(1)[0]
    stock(x).sum().backward()
    with dense_wgrad(queue, _linears(ours)):
        ours(x).sum().backward()
    _compare_params(stock, ours)
    stock_hooks.assert_each(1)
    hooks.assert_each(1)
    assert ran == ["head"] and queue.empty()


def test_reentrant_checkpoint_and_end_of_backward_flush():
    """A wrapped layer inside torch.utils.checkpoint(use_reentrant=True): its dW is queued in the checkpoint's
    inner backward (a nested graph task) and flushed; hooks still fire once."""
    torch.manual_seed(2)
    stock = nn.Sequential(nn.Linear(M, H), nn.Tanh(), nn.Linear(H, 1)).double()
    ours = copy.deepcopy(stock)
    stock_hooks, hooks = HookCounter(dict(stock.named_parameters())), HookCounter(dict(ours.named_parameters()))
    x = _batches(1)[0].requires_grad_()
    checkpoint(stock, x, use_reentrant=True).sum().backward()
    queue = WgradQueue()
    with dense_wgrad(queue, _linears(ours)):
        checkpoint(ours, x, use_reentrant=True).sum().backward()
    _compare_params(stock, ours)
    stock_hooks.assert_each(1)
    hooks.assert_each(1)
    assert queue.empty() and queue.items_run == 2


def _fake_queue(costs: List[float]):
    targets = {f"t{i}": torch.zeros(2, dtype=F64, requires_grad=True) for i in range(len(costs))}
    queue = WgradQueue()
    for i, cost in enumerate(costs):
        target = targets[f"t{i}"]
        queue.defer(f"t{i}", cost, lambda target=target, i=i: [(target, torch.full((2,), float(i + 1), dtype=F64))],
                    tag="even" if i % 2 == 0 else "odd")
    return queue, targets


def test_run_some_is_greedy_best_fit():
    queue, targets = _fake_queue([5, 3, 8, 2, 4, 8])
    assert queue.run_some(10) == ["t2", "t3"]            # the costliest that fits (8, earliest of the two), then 2
    assert queue.run_some(9) == ["t5"]                   # 8; then nothing fits in 1
    assert queue.run_some(1) == []
    assert queue.run_some(12, tags={"even"}) == ["t0", "t4"]
    assert queue.names() == ["t1"] and queue.pending_cost == 3
    assert queue.flush() == ["t1"] and queue.empty()
    assert [float(targets[f"t{i}"].grad[0]) for i in range(6)] == [1, 2, 3, 4, 5, 6]   # delivered through autograd


def test_run_while_with_budget_and_handles():
    queue, _ = _fake_queue([5, 3, 8, 2])
    done = Handle("finished exchange")
    done._finish(None)
    assert queue.run_while(done) == []                                 # nothing in flight: nothing run
    assert queue.run_while(lambda: True, budget=7) == ["t0", "t3"]     # best fit into 7: 5, then 2
    assert queue.run_while(lambda: True) == ["t1", "t2"]               # no budget: queue order until empty


def test_bad_input_is_refused_with_clear_errors():
    class MyLinear(nn.Linear):
        pass
    model = nn.ModuleDict({"ok": nn.Linear(2, 2), "conv": nn.Conv1d(2, 2, 1), "sub": MyLinear(2, 2)})
    queue = WgradQueue()
    with pytest.raises(ValueError, match=r"conv \(torch\.nn\.modules\.conv\.Conv1d\) is not a plain torch\.nn\.Linear"
                                         r".*sub \(.*MyLinear\) is not a plain"):
        with dense_wgrad(queue, list(model.named_children())):
            pass
    assert "forward" not in vars(model["ok"]), "nothing was wrapped"
    with pytest.raises(ValueError, match="ok .* listed twice"):
        with dense_wgrad(queue, [("ok", model["ok"]), ("ok", model["ok"])]):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with dense_wgrad(queue, {"ok": model["ok"]}):
            assert "forward" in vars(model["ok"])
            raise RuntimeError("boom")
    assert "forward" not in vars(model["ok"]), "undone in finally"
    with pytest.raises(ValueError, match=r"budget \(-1\) must be a number >= 0"):
        queue.run_some(-1)
    with pytest.raises(ValueError, match="must be a handle with done"):
        queue.run_while(3)
    with pytest.raises(ValueError, match=r"deferred_bmm 'w1': x \(3, 5, 4\) does not multiply w \(3, 6, 4\)"):
        deferred_bmm(torch.zeros(E, N, M), torch.zeros(E, H, M, requires_grad=True), None, queue, name="w1")
    with pytest.raises(ValueError, match="activation"):
        deferred_partial_ffn(torch.zeros(E, N, M), _weights(_expert_params()), "tanh", queue)


@pytest.mark.parametrize("gas,torch_style", [(1, False), (2, False), (2, True)],
                         ids=["engine-backward", "engine-backward-gas2", "loss-backward-gas2"])
def test_deepspeed_zero2_two_ranks_equal_stock(world, gas, torch_style):
    """3 optimizer steps of ``gas`` micro-steps, ZeRO-2 on 2 gloo ranks (fp32: DeepSpeed on CPU reduces fp32):
    losses and this rank's reduced gradient partition equal stock's, and ZeRO-2's reduction hook runs once per
    parameter and micro-step, as in stock. The experts' and both Linears' dW were deferred and flushed.
    ``loss.backward()`` needs the flush ahead of DeepSpeed's epilogue callback (jobs.flush_before_epilogue)."""
    pytest.importorskip("deepspeed")
    stock, ours = world(2).run(jobs.train_pair, 3, gas, torch_style)[0]
    assert len(stock["losses"]) == len(ours["losses"]) == 3 * gas and len(ours["grads"]) == 3
    assert max(abs(a - b) for a, b in zip(stock["losses"], ours["losses"])) <= 1e-6, (stock["losses"], ours["losses"])
    for a, b in zip(stock["grads"], ours["grads"]):
        assert max(_max_err(x, y) for x, y in zip(a, b)) <= 1e-6
    assert stock["hook_calls"] == ours["hook_calls"], (stock["hook_calls"], ours["hook_calls"])
    assert [set(c.values()) for c in ours["hook_calls"]] == [{1}] * 3 * gas and len(ours["hook_calls"][0]) == 8
    assert ours["deferred_items"] == 3 * gas * 4 and ours["queue_empty"]    # w1, w2, inp, head per micro-step


def test_run_while_overlaps_an_engine_exchange_on_two_ranks(world):
    """The integration's call pattern with a real engine Handle: a backward issues an all-to-all on the pipeline
    lane and runs the queue until it completes. Rank 1 issues 0.3 s late, so on rank 0 the exchange is in flight
    and the head's dW runs under it; the exchange's result and the gradients are stock's."""
    results = world(2).run(jobs.run_while_exchange, 0.3)
    for rank, out in enumerate(results):
        assert out["exchanged"] == [float(rank), 10.0 + rank]
        assert out["max_err"] <= TOL and out["queue_empty"]
    assert results[0]["in_flight_before"] and results[0]["ran"] == ["head"]


def test_hf_conv1d_deferred_equals_stock_and_tied_weights_stay_stock():
    """transformers' Conv1D (HF GPT-2's projections, weight (in, out)) wrapped by dense_wgrad: fp64 gradients equal
    stock's, each hook once per backward, bias included, 3-d input. model_dense_modules finds Linear and Conv1D
    outside the excluded subtree and leaves a weight tied to another module's (an LM head) to stock."""
    from transformers.pytorch_utils import Conv1D

    from moe_plugins.lancet.dense import model_dense_modules
    torch.manual_seed(3)
    stock = nn.Sequential(Conv1D(H, M), nn.GELU(), Conv1D(M, H)).double()
    ours = copy.deepcopy(stock)
    stock_hooks, hooks = HookCounter(dict(stock.named_parameters())), HookCounter(dict(ours.named_parameters()))
    x = torch.randn(2, N, M, dtype=F64)
    stock(x).square().sum().backward()
    queue = WgradQueue()
    with dense_wgrad(queue, [(n, m) for n, m in ours.named_children() if isinstance(m, Conv1D)]):
        y = ours(x)
        assert torch.equal(y, stock(x))                   # the same addmm as Conv1D.forward: bitwise
        y.square().sum().backward()
    _compare_params(stock, ours)
    stock_hooks.assert_each(1)
    hooks.assert_each(1)
    assert queue.empty() and queue.items_run == 2 and all("forward" not in vars(m) for m in ours)

    emb, head, moe = nn.Embedding(5, M), nn.Linear(M, 5, bias=False), nn.ModuleDict({"wg": nn.Linear(M, 2)})
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "proj": Conv1D(M, M), "fc": nn.Linear(M, M), "moe": moe, "head": head})
    found, tied = model_dense_modules(model, [moe])
    assert [n for n, _ in found] == ["proj", "fc"] and tied == ["head"]
