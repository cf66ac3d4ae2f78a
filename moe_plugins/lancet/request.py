"""What both host adapters share to run Lancet's batch partitions on a model (docs/lancet.md): the request the block
executor arms for the next MoE layer forward (:class:`PartitionRequest`), the model's stack of blocks around the
host's MoE layers (:func:`partition_stack`) and the partition policy (:func:`partition_policy`: a count, ``"auto"``
from the cached cost profile, or ``"tune"``).

The host's MoE layer, seeing the request armed, gates the whole batch, starts the partitioned call
(:func:`~moe_plugins.lancet.partition.start_partitions`) and hands it back with :meth:`PartitionRequest.hand_back`,
returning a placeholder tensor laid out as its stock output; the block's MoE module must return that placeholder
or a view of all of it (Megatron's layer is sequence-first, and the recipes' wrapper transposes its output back to
batch-first). The executor then hands each partition's output to the block in that memory layout, and replays a
dropout's mask on it in that layout, as stock draws it (:func:`~moe_plugins.lancet.blocks.in_layout`).

Shapes: B samples, L tokens per sample, M model dim.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from moe_plugins.core.config import MoEConfig
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.core.profile_ops import cached_profile
from moe_plugins.lancet.auto import AutoPartitions, StackFacts, moe_every_of
from moe_plugins.lancet.block_kinds import kind_of
from moe_plugins.lancet.blocks import memory_order
from moe_plugins.lancet.config import AUTO, TUNE, WORDS
from moe_plugins.lancet.partition import PartitionedCall, partitions_problem
from moe_plugins.lancet.plan_cli import costs_from_profile
from moe_plugins.lancet.tune import TunedPartitions


def _view_of(out: Any, placeholder: torch.Tensor, shape: torch.Size) -> bool:
    """Whether ``out`` is ``placeholder`` or a view of all of it (a transpose) shaped ``shape``."""
    return out is placeholder or (isinstance(out, torch.Tensor) and out.shape == shape
                                  and out.data_ptr() == placeholder.data_ptr() and out.numel() == placeholder.numel()
                                  and sorted(out.stride()) == sorted(placeholder.stride()))


class PartitionRequest:
    """The block executor's request to the next MoE layer forward of ``host`` ("DeepSpeed", "Megatron-core"): start a
    partitioned call of :attr:`parts` partitions and hand it back (:meth:`hand_back`), returning a placeholder to
    the block's MoE module, which must return it, or a view of all of it (a transpose: ``returns`` says which)."""

    def __init__(self, host: str, returns: str = "the layer's output as is") -> None:
        self.host, self.returns = host, returns
        self.parts, self.call, self.placeholder = 0, None, None

    @property
    def armed(self) -> bool:
        """Whether the next MoE layer forward is to start a partitioned call (and none has yet)."""
        return bool(self.parts) and self.call is None

    def hand_back(self, call: PartitionedCall, placeholder: torch.Tensor) -> torch.Tensor:
        """The layer's side: ``call`` started; the layer returns ``placeholder`` (laid out as its stock output)."""
        self.call, self.placeholder = call, placeholder
        return placeholder

    def start(self, block: nn.Module, h_BLM: torch.Tensor, parts: int) -> PartitionedCall:
        """The block's MoE call (``block.mlp(h_BLM)`` in GPT-2, ``block.output.block(h_BLM)`` in the recipes' BERT)
        with the request armed: the partitioned call its MoE layer started."""
        kind = kind_of(block)
        self.parts, self.call, self.placeholder = parts, None, None
        try:
            out = kind.moe_call(block, h_BLM)
        finally:
            call, placeholder, self.parts, self.call, self.placeholder = self.call, self.placeholder, 0, None, None
        where = f"{type(block).__name__}.{kind.moe_path}"
        if call is None:
            raise ValueError(f"Lancet's batch partitions: {where} did not call a {self.host} MoE layer the plugin "
                             "runs")
        if not _view_of(out, placeholder, h_BLM.shape):
            raise ValueError(f"Lancet's batch partitions: {where} changes the MoE layer's output (a residual MoE, a "
                             f"scale, a copy...); partitions need it to return {self.returns}; use partitions 1")
        call.block_order = memory_order(out)       # the block's later ops (a dropout) see the output laid out so
        return call


def partition_stack(model: nn.Module, mine: Sequence[nn.Module], parts: Union[int, str],
                    micro_batch: Optional[int], field: str) -> Tuple[List[nn.Module], List[int]]:
    """The blocks of the one ``torch.nn.ModuleList`` of ``model`` that holds the MoE layers ``mine``, and the indices
    of those holding one; a ValueError naming ``field`` where ``parts`` does not divide ``micro_batch`` (None: not
    known yet; checked per batch) or the layers are not in one such list."""
    problem = None if parts in WORDS or micro_batch is None else partitions_problem(int(micro_batch), parts, field)
    ids = {id(m) for m in mine}
    stacks = [s for s in model.modules() if isinstance(s, nn.ModuleList)
              and any(any(id(m) in ids for m in b.modules()) for b in s)]
    if problem is None and len(stacks) != 1:
        problem = (f"{field} ({parts}): Lancet's batch partitions need the model's MoE layers in one "
                   f"torch.nn.ModuleList of blocks; found {len(stacks)}")
    if problem is not None:
        raise ValueError(problem)
    blocks = list(stacks[0])
    return blocks, [i for i, b in enumerate(blocks) if any(id(m) in ids for m in b.modules())]


def auto_partitions(blocks: List[nn.Module], moe: List[int], cfg: MoEConfig, groups: MoEProcessGroups,
                    profile_dir: Optional[str], field: str) -> AutoPartitions:
    """``"partitions": "auto"``'s policy for a GPT-2 or BERT stack whose MoE layers have config ``cfg`` on
    ``groups``: the planner's model priced by the cost profile cached in ``profile_dir`` for the layout (a ValueError
    naming the command that measures it when there is none)."""
    first = blocks[moe[0]]
    param = next(first.parameters())
    profile = cached_profile(profile_dir, groups.layout, torch.distributed.get_backend(), param.device)
    if profile is None:
        raise ValueError(f"{field} ('auto') needs the cost profile of layout {groups.layout.describe()} cached in "
                         f"{profile_dir}: run `moe-plugins profile` on these ranks first, or give an integer")
    facts = StackFacts(M=cfg.hidden, H=cfg.ffn, heads=kind_of(first).heads(first), E=cfg.num_experts, k=cfg.k,
                       f=cfg.capacity_factor, P=groups.ep.size, layers=len(blocks),
                       moe_every=moe_every_of(moe, len(blocks)), element_bytes=param.element_size())
    return AutoPartitions(facts, costs_from_profile(profile), f"profile {profile.key.slug()}")


def partition_policy(parts: Union[int, str], blocks: List[nn.Module], moe: List[int], cfg: MoEConfig,
                     groups: MoEProcessGroups, profile_dir: Optional[str], field: str) -> Any:
    """The executor's ``parts``: the count, or the policy the word names (``"auto"``, ``"tune"``)."""
    if parts == AUTO:
        return auto_partitions(blocks, moe, cfg, groups, profile_dir, field)
    if parts == TUNE:
        return TunedPartitions(groups)
    return parts
