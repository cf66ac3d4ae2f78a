"""Lancet: weight-gradient and non-MoE computation overlapped with the MoE all-to-all. docs/lancet.md explains it.

Part 1 (#26), deferred weight gradients, wired into the core layer and the DeepSpeed host behind the config's
``"lancet"`` section (Part 2, batch partitions, is not built):

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
- :mod:`moe_plugins.lancet.config`: the ``"lancet"`` section (``defer_wgrad``; ``partitions`` 1 only;
  ``dense_wgrad`` false only), registered by :func:`register`.
- :mod:`moe_plugins.lancet.overlap`: :class:`~moe_plugins.lancet.overlap.ExchangeOverlap`, the callback a layer's
  ``core.comm.Recorder`` carries as ``while_in_flight``: the core's all-to-all backward issues the exchange on the
  engine's pipeline lane and calls it before waiting; it runs everything queued, in queue order (the same on every
  rank, so the hosts' gradient hooks fire in the same order). The combine-gradient exchange runs what later layers
  queued; the dispatch-gradient exchange runs this layer's own expert dW. Pure overlap measures on intervals.
- :mod:`moe_plugins.lancet.layer`: :class:`~moe_plugins.lancet.layer.LancetMoELayer`, the core layer with its
  experts' dW deferred. The DeepSpeed host's part is ``patches/deepspeed_lancet.py``. docs/lancet.md says what is
  overlapped, what is tested and what is not built (Megatron, dense_wgrad on hosts, batch partitions, the bench).
- :mod:`moe_plugins.lancet.plan`: Part 2's planner, pure: the operator partition pass (which runs of ops to split
  into k batch partitions) over a stage-major one-thread, one-lane executor model; ``moe-plugins plan lancet``
  (:mod:`moe_plugins.lancet.plan_cli`, registered by :func:`register`, imported when asked for) prints it.
"""

from moe_plugins.lancet.dense import dense_wgrad
from moe_plugins.lancet.wgrad import deferred_bmm, deferred_linear, deferred_partial_ffn
from moe_plugins.lancet.wgrad_queue import WgradItem, WgradQueue, best_fit

__all__ = ["WgradItem", "WgradQueue", "best_fit", "deferred_bmm", "deferred_linear", "deferred_partial_ffn",
           "dense_wgrad", "register"]


def _planner(subparsers) -> None:
    from moe_plugins.lancet import plan_cli     # imported when `moe-plugins plan lancet` is asked for
    plan_cli.register(subparsers)


def register(registry) -> None:
    """Add Lancet's config section (``"lancet": {...}``, :mod:`moe_plugins.lancet.config`) and its planner
    (``moe-plugins plan lancet``) to ``registry``."""
    from moe_plugins.lancet.config import NAME, SECTION_RULES
    registry.add_section(NAME, SECTION_RULES, paper=NAME)
    registry.add_planner("lancet", _planner)
