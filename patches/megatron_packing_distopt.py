"""Lina's packing regrouping mid-training (``"packing": "auto"``) under Megatron-core's distributed optimizer
(patches/megatron_lina_packing.py).

``DistributedOptimizer`` shards the experts' param-and-grad buffers over expert-DP: each rank steps a piece of
each expert parameter (a flat fp32 master in bf16/fp16, a flat view of the fp32 parameter otherwise, with its
Adam moments; patches/megatron_pieces.py). A regroup changes the experts each rank holds, their buffers (a new
DDP over the experts, on the packed expert-DP group) and so every piece, hence:

1. Before the move, :meth:`DistributedExperts.carried` makes each expert parameter's master and moments whole (one
   sum over the old expert-DP group per parameter) as ``carried`` entries of
   :func:`moe_plugins.lina.modules.regroup_modules`, which moves them with the expert.
2. After the new buffers, :meth:`DistributedExperts.rebuild` runs ``DistributedOptimizer.__init__`` again on the
   same object (so whatever holds it, Megatron's ``ChainedOptimizer`` or the training loop, keeps it): over a new
   torch optimizer of the same class and defaults, whose groups are Megatron's (their current hyper-parameters;
   a cloned expert's parameter joins its template's group, a dropped one leaves), and the buffers the model's DDP
   now holds, on the packed expert-DP group. Each parameter's values are then written from its whole master (the
   regroup runs inside the optimizer step, before Megatron all-gathers the parameters, when only each rank's own
   range held the stepped values), and each new piece's master and moments from the whole, with Adam's ``step``.

The groups as Megatron made them (every model parameter's, before the optimizer shards them) are recorded when it
builds the optimizer (:func:`record_patch`).

The optimizer's own ``data_parallel_group``, its gloo twin (which Megatron's legacy checkpoint formats gather
over: ``save_parameter_state``, ``dp_zero_gather_scatter``) and ``data_parallel_group_idx`` (which names its
state in ``dist_checkpointing``: expert-DP peers must share it) follow the packed layout: a fixed p builds the
buffers on the packed expert-DP group before Megatron builds the optimizer with its stock groups (the packer sets
the three after), and a rebuild passes them; the gloo twin (:func:`gloo_for`) is Megatron's own on the stock
ranks, the group itself on gloo (CPU), and none for a packed layout on NCCL (save inside ``stock_homes()``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.patcher import Patch
from moe_plugins.patches.megatron_masters import MAIN
from moe_plugins.patches.megatron_pieces import first_state, pieces, state_keys, whole_state, write_piece

Groups = List[Tuple[Dict[str, Any], List[torch.nn.Parameter]]]


class DistributedExperts:
    """The distributed optimizer ``opt`` holding one DDP's packed experts, and its torch optimizer's groups as
    Megatron made them (hyper-parameters, model parameters)."""

    def __init__(self, opt: Any, groups: Groups) -> None:
        self.opt, self.groups = opt, groups

    def carried(self, params: Sequence[torch.nn.Parameter]) -> Dict[int, Dict[str, torch.Tensor]]:
        """Per parameter id: its whole fp32 master (``MAIN``) and moments, flat (collective over expert-DP)."""
        found, keys = pieces(self.opt, params), state_keys(self.opt.optimizer)
        out = {}
        for p in params:
            whole = whole_state(found[id(p)], p, keys)
            out[id(p)] = {MAIN: whole[0].clone(), **{k: row.clone() for k, row in zip(keys, whole[1:])}}
        return out

    def rebuild(self, before: Sequence[torch.nn.Parameter], after: Sequence[torch.nn.Parameter],
                templates: Sequence[torch.nn.Parameter], carried: Dict[int, Dict[str, torch.Tensor]],
                dp: Tuple[Any, Optional[Any], int]) -> None:
        """The optimizer over the experts ``after`` a regroup (module docstring, 2): ``templates[i]`` the parameter
        ``after[i]`` is a clone of when new, ``carried`` the moved whole masters and moments keyed by ``after``'s
        ids, ``dp`` the packed layout's expert-DP group, its gloo twin (:func:`gloo_for`) and the index Megatron
        names this rank's optimizer state by (its rank in the packed expert model-parallel group, which expert-DP
        peers share)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        opt, torch_opt = self.opt, self.opt.optimizer
        scalars = {k: v for k, v in first_state(torch_opt).items() if not (torch.is_tensor(v) and v.dim() > 0)}
        index = {id(p): i for i, (_, params) in enumerate(self.groups) for p in params}
        dropped = {id(p) for p in before} - {id(p) for p in after}
        groups = [({k: v for k, v in live.items() if k != "params"}, [p for p in params if id(p) not in dropped])
                  for live, (_, params) in zip(torch_opt.param_groups, self.groups)]
        for p, template in zip(after, templates):
            if id(p) not in index:
                groups[index[id(template)]][1].append(p)
        accepted = inspect.signature(type(torch_opt).__init__).parameters      # each group keeps all its values
        defaults = {k: v for k, v in torch_opt.defaults.items() if k in accepted}
        new = type(torch_opt)([{**hyper, "params": params} for hyper, params in groups], **defaults)
        buffers = {i: chunk.expert_parallel_buffers for i, chunk in enumerate(opt.model_chunks)}
        DistributedOptimizer.__init__(opt, new, opt.config, opt.grad_scaler, opt.init_state_fn, opt.model_chunks,
                                      buffers, *dp,
                                      opt.distributed_optimizer_instance_id)
        found = pieces(opt, after)
        for p in after:
            moved = carried.pop(id(p))
            master = moved.pop(MAIN)
            write_piece(found[id(p)], p, master, moved, scalars)


def gloo_for(group: Any, stock: Tuple[Any, Optional[Any]]) -> Optional[Any]:
    """A gloo group over ``group``'s ranks: Megatron's own (``stock``: the expert-DP group it built the optimizer
    with, and that group's gloo twin) on the same ranks, ``group`` itself where it is gloo, else None."""
    if dist.get_process_group_ranks(group) == dist.get_process_group_ranks(stock[0]):
        return stock[1]
    return group if dist.get_backend(group) == "gloo" else None


def record_patch(on_built: Callable[[Any, Groups], None]) -> Patch:
    """The patch of ``DistributedOptimizer.__init__`` that calls ``on_built(opt, groups)`` after Megatron's, with
    the torch optimizer's groups as they were passed in (hyper-parameters, model parameters)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    original = DistributedOptimizer.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(opt, *args, **kwargs):
        optimizer = signature.bind(opt, *args, **kwargs).arguments["optimizer"]
        groups = [({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in optimizer.param_groups]
        original(opt, *args, **kwargs)
        on_built(opt, groups)
    return Patch(DistributedOptimizer, "__init__", __init__)


__all__ = ["DistributedExperts", "gloo_for", "record_patch"]
