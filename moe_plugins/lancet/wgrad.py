"""Lancet's deferred weight gradients: GEMMs whose backward computes dX at once (the critical path) and queues
dW = X^T dY (and the bias gradient) on a :class:`~moe_plugins.lancet.wgrad_queue.WgradQueue`.

Shapes: E experts, N rows per expert (or tokens), M model dim, H FFN hidden, K in-features, O out-features.

- :func:`deferred_bmm`: ``x_ENK @ w_EKH (+ b_EH)``, the expert FFN's GEMMs (``torch.baddbmm`` / ``torch.bmm``);
- :func:`deferred_partial_ffn`: the core's ``experts.partial_ffn`` (b2 stays with the caller, after the ESP sum);
- :func:`deferred_linear`: ``F.linear`` (``nn.Linear``'s forward; :func:`moe_plugins.lancet.dense.dense_wgrad`
  wraps modules with it);
- :func:`deferred_addmm`: ``torch.addmm(b, x, w)`` with the weight stored (in, out), transformers' ``Conv1D``
  forward (HF GPT-2's attention and MLP projections; ``dense_wgrad`` wraps those with it).

The autograd Function sees the weight and bias *detached*: the host's parameter never gets an edge in the
outer graph, so its AccumulateGrad (and the hooks there) runs only when the queue delivers the gradient through
a re-entrant backward. A Function's backward returns None for them, and dX for the input. Where the input needs
no gradient (the first layer), an empty anchor tensor that does keeps the Function in the graph. The formulas are
the ones stock autograd uses (``mm_mat2_backward``, ``baddbmm``'s), so the gradients agree to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from moe_plugins.core.experts import ACTIVATIONS, ExpertWeights
from moe_plugins.lancet.wgrad_queue import Grads, Use, WgradItem, WgradQueue, best_fit, leaves_of

__all__ = ["WgradItem", "WgradQueue", "best_fit", "leaves_of", "deferred_addmm", "deferred_bmm", "deferred_linear",
           "deferred_partial_ffn"]


@dataclass(eq=False)
class _Deferral:
    """What a deferred GEMM's backward hands the queue: the real (non-detached) weight and bias targets."""

    queue: WgradQueue
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    name: str
    tag: str
    use: Optional[Use] = None


def _pairs(d: _Deferral, dw: torch.Tensor, db: Optional[torch.Tensor]) -> Grads:
    out = [(d.weight, dw)] if d.weight.requires_grad else []
    if d.bias is not None and d.bias.requires_grad and db is not None:
        out.append((d.bias, db))
    return out


def _bmm_wgrad(x_ENK: torch.Tensor, dy_ENH: torch.Tensor, d: _Deferral) -> Grads:
    dw_EKH = torch.bmm(x_ENK.transpose(1, 2), dy_ENH)
    return _pairs(d, dw_EKH, dy_ENH.sum(1) if d.bias is not None else None)


def _linear_wgrad(x_NK: torch.Tensor, dy_NO: torch.Tensor, d: _Deferral) -> Grads:
    dw_OK = dy_NO.t().mm(x_NK)
    return _pairs(d, dw_OK, dy_NO.sum(0) if d.bias is not None else None)


def _addmm_wgrad(x_NK: torch.Tensor, dy_NO: torch.Tensor, d: _Deferral) -> Grads:
    dw_KO = x_NK.t().mm(dy_NO)
    return _pairs(d, dw_KO, dy_NO.sum(0) if d.bias is not None else None)


class _DeferredBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ENK, w_EKH, b_EH, anchor, d: _Deferral):
        ctx.d = d
        ctx.save_for_backward(x_ENK, w_EKH)
        if b_EH is None:
            return torch.bmm(x_ENK, w_EKH)
        return torch.baddbmm(b_EH.unsqueeze(1), x_ENK, w_EKH)

    @staticmethod
    def backward(ctx, dy_ENH):
        x_ENK, w_EKH = ctx.saved_tensors
        d: _Deferral = ctx.d
        dx_ENK = torch.bmm(dy_ENH, w_EKH.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        e, n, k = x_ENK.shape
        cost = 2.0 * e * n * k * w_EKH.shape[2] + (e * n * w_EKH.shape[2] if d.bias is not None else 0)
        d.queue.defer(d.name, cost, partial(_bmm_wgrad, x_ENK, dy_ENH, d), tag=d.tag, use=d.use)
        return dx_ENK, None, None, None, None


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK, w_OK, b_O, anchor, d: _Deferral):
        ctx.d = d
        ctx.save_for_backward(x_NK, w_OK)
        return F.linear(x_NK, w_OK, b_O)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NK, w_OK = ctx.saved_tensors
        d: _Deferral = ctx.d
        dx_NK = dy_NO.matmul(w_OK) if ctx.needs_input_grad[0] else None
        x_flat = x_NK.reshape(-1, x_NK.shape[-1])
        dy_flat = dy_NO.reshape(-1, dy_NO.shape[-1])
        n, k = x_flat.shape
        o = dy_flat.shape[1]
        cost = 2.0 * n * k * o + (n * o if d.bias is not None else 0)
        d.queue.defer(d.name, cost, partial(_linear_wgrad, x_flat, dy_flat, d), tag=d.tag, use=d.use)
        return dx_NK, None, None, None, None


class _DeferredAddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK, w_KO, b_O, anchor, d: _Deferral):
        ctx.d = d
        ctx.save_for_backward(x_NK, w_KO)
        return torch.mm(x_NK, w_KO) if b_O is None else torch.addmm(b_O, x_NK, w_KO)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NK, w_KO = ctx.saved_tensors
        d: _Deferral = ctx.d
        dx_NK = dy_NO.mm(w_KO.t()) if ctx.needs_input_grad[0] else None
        n, k = x_NK.shape
        o = w_KO.shape[1]
        cost = 2.0 * n * k * o + (n * o if d.bias is not None else 0)
        d.queue.defer(d.name, cost, partial(_addmm_wgrad, x_NK, dy_NO, d), tag=d.tag, use=d.use)
        return dx_NK, None, None, None, None


def _needs_deferral(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))


def _record(queue: WgradQueue, weight: torch.Tensor, bias: Optional[torch.Tensor], name: str,
            tag: str) -> _Deferral:
    """The GEMM's record, with its forward use counted on the queue (released when the record is freed, if
    its backward never ran)."""
    if not isinstance(queue, WgradQueue):
        raise ValueError(f"queue ({type(queue).__name__}) for {name!r} must be a moe_plugins.lancet.WgradQueue")
    d = _Deferral(queue=queue, weight=weight, bias=bias, name=name, tag=tag)
    d.use = queue.track([weight, bias], owner=d)
    return d


def _anchor(x: torch.Tensor) -> Optional[torch.Tensor]:
    """An empty tensor that needs a gradient, when ``x`` does not: the Function must stay in the graph."""
    return None if x.requires_grad else x.new_empty(0).requires_grad_()


def _apply_deferred(fn: type, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    queue: WgradQueue, name: str, tag: str) -> torch.Tensor:
    """``fn`` (a deferred GEMM Function) on ``x`` and the detached weight and bias, with the GEMM's record."""
    d = _record(queue, weight, bias, name, tag)
    return fn.apply(x, weight.detach(), bias.detach() if bias is not None else None, _anchor(x), d)


def _check_bmm(x_ENK: torch.Tensor, w_EKH: torch.Tensor, b_EH: Optional[torch.Tensor], name: str) -> None:
    problems = []
    if x_ENK.dim() != 3 or w_EKH.dim() != 3:
        problems.append(f"x {tuple(x_ENK.shape)} and w {tuple(w_EKH.shape)} must both be 3-d (E, N, K), (E, K, H)")
    elif x_ENK.shape[0] != w_EKH.shape[0] or x_ENK.shape[2] != w_EKH.shape[1]:
        problems.append(f"x {tuple(x_ENK.shape)} does not multiply w {tuple(w_EKH.shape)}: need (E, N, K) @ (E, K, H)")
    elif b_EH is not None and tuple(b_EH.shape) != (w_EKH.shape[0], w_EKH.shape[2]):
        problems.append(f"b {tuple(b_EH.shape)} must be (E, H) = {(w_EKH.shape[0], w_EKH.shape[2])}")
    if problems:
        raise ValueError(f"deferred_bmm {name!r}: " + "; ".join(problems))


def deferred_bmm(x_ENK: torch.Tensor, w_EKH: torch.Tensor, b_EH: Optional[torch.Tensor], queue: WgradQueue, *,
                 name: str = "bmm", tag: str = "experts") -> torch.Tensor:
    """``torch.baddbmm(b_EH.unsqueeze(1), x_ENK, w_EKH)`` (``torch.bmm`` without a bias) with dW and db deferred
    to ``queue``. ``w_EKH``/``b_EH`` may be parameters or tensors built from them (a stack, a slice)."""
    _check_bmm(x_ENK, w_EKH, b_EH, name)
    if not _needs_deferral(w_EKH, b_EH):
        return torch.bmm(x_ENK, w_EKH) if b_EH is None else torch.baddbmm(b_EH.unsqueeze(1), x_ENK, w_EKH)
    return _apply_deferred(_DeferredBmm, x_ENK, w_EKH, b_EH, queue, name, tag)


def deferred_linear(x_NK: torch.Tensor, w_OK: torch.Tensor, b_O: Optional[torch.Tensor], queue: WgradQueue, *,
                    name: str = "linear", tag: str = "dense") -> torch.Tensor:
    """``F.linear(x_NK, w_OK, b_O)`` (any leading dims in x) with dW and db deferred to ``queue``."""
    if w_OK.dim() != 2 or x_NK.dim() < 1 or x_NK.shape[-1] != w_OK.shape[1]:
        raise ValueError(f"deferred_linear {name!r}: x {tuple(x_NK.shape)} does not match weight "
                         f"{tuple(w_OK.shape)} (out-features, in-features)")
    if not _needs_deferral(w_OK, b_O):
        return F.linear(x_NK, w_OK, b_O)
    return _apply_deferred(_DeferredLinear, x_NK, w_OK, b_O, queue, name, tag)


def deferred_addmm(x_NK: torch.Tensor, w_KO: torch.Tensor, b_O: Optional[torch.Tensor], queue: WgradQueue, *,
                   name: str = "addmm", tag: str = "dense") -> torch.Tensor:
    """``torch.addmm(b_O, x_NK, w_KO)`` (``torch.mm`` without a bias; x 2-d, the weight (in, out) as transformers'
    ``Conv1D`` stores it) with dW and db deferred to ``queue``."""
    if w_KO.dim() != 2 or x_NK.dim() != 2 or x_NK.shape[1] != w_KO.shape[0]:
        raise ValueError(f"deferred_addmm {name!r}: x {tuple(x_NK.shape)} does not match weight "
                         f"{tuple(w_KO.shape)} (x 2-d (N, in), weight (in, out))")
    if not _needs_deferral(w_KO, b_O):
        return torch.mm(x_NK, w_KO) if b_O is None else torch.addmm(b_O, x_NK, w_KO)
    return _apply_deferred(_DeferredAddmm, x_NK, w_KO, b_O, queue, name, tag)


def deferred_partial_ffn(x_ENM: torch.Tensor, w: ExpertWeights, activation: str, queue: WgradQueue, *,
                         name: str = "experts", tag: str = "experts") -> torch.Tensor:
    """The core's ``partial_ffn`` (act(x w1 + b1) w2, no b2) with both GEMMs' weight gradients deferred."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation ({activation!r}) must be one of {sorted(ACTIVATIONS)}")
    h_ENH = ACTIVATIONS[activation](deferred_bmm(x_ENM, w.w1_EMH, w.b1_EH, queue, name=f"{name}.w1", tag=tag))
    return deferred_bmm(h_ENH, w.w2_EHM, None, queue, name=f"{name}.w2", tag=tag)
