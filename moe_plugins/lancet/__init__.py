"""Lancet: weight-gradient and non-MoE computation overlapped with the MoE all-to-all. docs/lancet.md explains it.

Part 1 (#26), deferred weight gradients, as a standalone mechanism (not yet wired into the layer, the engine or
the hosts):

- :mod:`moe_plugins.lancet.wgrad_queue`: :class:`WgradQueue`, an explicit object (one per model; no module
  state) holding deferred dW work. ``run_some(budget)`` runs the items that fit, greedy best fit by estimated
  FLOPs; ``run_while(handle)`` runs items while a communication handle (``core.ops.Handle``) is in flight;
  ``flush()`` runs the rest; and whatever is left when the backward pass that queued it ends is flushed by an
  autograd engine callback (``Variable._execution_engine.queue_callback``). Gradients are delivered through a
  re-entrant ``torch.autograd.backward`` on the weight (a leaf through ``w.view_as(w)``), reaching the
  parameter's own AccumulateGrad node, so DeepSpeed ZeRO-1/2's and Megatron DDP's hooks fire as in stock,
  once per parameter and backward: each forward use is counted on the parameters behind the weight, and a
  parameter's gradients are delivered together once its uses in this backward are all computed (a weight
  stacked per call or used in several chunks included). ``.grad`` is never written; the deferred GEMM's
  Function sees the weight detached, so the outer graph never reaches its AccumulateGrad with None.
- :mod:`moe_plugins.lancet.wgrad`: the deferred GEMMs: ``deferred_bmm`` and ``deferred_partial_ffn`` (the
  core's expert FFN), ``deferred_linear``. Backward computes dX at once and queues dW.
- :mod:`moe_plugins.lancet.dense`: ``dense_wgrad(queue, named_modules)``, a context manager that wraps plain
  ``nn.Linear`` modules so their dW is deferred too, refusing (ValueError naming module and type) any other.

How the layer will call it (integration, not done here). The MoE layer's backward issues an exchange on an
engine lane, which returns a ``Handle``, and, before waiting on it, runs queued work:

    handle = engine.submit(exchange_backward, lane="pipeline")   # the dispatch-gradient all-to-all
    queue.run_while(handle, tags={f"experts.{layer}"})          # this layer's own expert dW
    grad = handle.wait()

The dispatch-gradient exchange (the last of a layer's backward) overlaps the layer's own expert dW, queued just
before it; the combine-gradient exchange (the first) overlaps dense dW queued by the layers after it
(``tags={"dense"}``). ``budget=`` (the exchange's estimated duration, in the items' cost unit) makes the pick a
greedy best fit, as in the paper. On CPU the engine runs urgent ops issued from the caller's thread inline,
so their handles are done on return and ``run_while`` runs nothing: the overlap needs a lane.

Hosts, still to wire: the layer's experts call ``deferred_partial_ffn`` where the core calls ``partial_ffn``
(DeepSpeed's per-expert Linears stacked per call work as targets); ``dense_wgrad`` wraps the dense Linears the
config names. DeepSpeed's ``engine.backward`` needs nothing more; ``loss.backward()`` under ZeRO needs the
adapter to flush the queue ahead of ZeRO's post-backward callback (see ``wgrad_queue``'s docstring).
"""

from moe_plugins.lancet.dense import dense_wgrad
from moe_plugins.lancet.wgrad import deferred_bmm, deferred_linear, deferred_partial_ffn
from moe_plugins.lancet.wgrad_queue import WgradItem, WgradQueue, best_fit

__all__ = ["WgradItem", "WgradQueue", "best_fit", "deferred_bmm", "deferred_linear", "deferred_partial_ffn",
           "dense_wgrad", "register"]


def register(registry) -> None:
    """Add Lancet's config section (``"lancet": {...}``, :mod:`moe_plugins.lancet.config`) to ``registry``."""
    from moe_plugins.lancet.config import NAME, SECTION_RULES
    registry.add_section(NAME, SECTION_RULES, paper=NAME)
