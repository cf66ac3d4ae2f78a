"""Lancet's block executor (Part 2): the transformer blocks after an MoE layer's gate run partition by partition,
so that one partition's MoE exchange flies while another partition computes (docs/lancet.md).

A *range* starts at an MoE block's gate and ends at the next MoE block's gate (or at the end of the stack): the
gate needs the whole batch, so the pipeline stops there. For MoE block i with next MoE block j:

1. block i's part before its MoE layer (GPT-2: ln_1, attention, residual, ln_2; BERT: attention) on the whole
   batch, unless the previous range computed it;
2. the MoE layer gated on the whole batch, every partition's dispatch issued (``start_moe``, e.g.
   :func:`moe_plugins.lancet.partition.layer_start`), its experts run and its combine issued;
3. per partition p: its output lands, block i is finished (GPT-2: the residual; BERT: dropout, residual, LayerNorm),
   the dense blocks i+1 .. j-1 run on it whole, and block j's part before its MoE layer; meanwhile the combines of
   p+1 .. fly;
4. the partitions' results are joined; the host's loop then calls blocks i+1 .. j-1 (passed through: already
   run) and block j (its first half already run: it resumes at the gate).

Partitions cut the batch (the block kind's ``batch_dim``: 0 for HF's [B, L, M], 1 for Megatron's [L, B, M]) into
equal groups of samples, so attention (per sample) is unchanged. Dropout masks are replayed from the whole batch
(:class:`DropoutReplay`): partition 0 draws each mask for the whole batch in the order the unpartitioned forward
draws them, and every partition uses its rows. The result equals the unpartitioned model's (fp64: <= 1e-12),
dropout on.

Known blocks (:mod:`moe_plugins.lancet.block_kinds`): transformers' ``GPT2Block`` and ``BertLayer`` (its MoE blocks
with the recipes' MoE output), and Megatron-core's ``TransformerLayer`` (before: its attention part and pre-MLP
norm; after: the MoE output's bias-dropout-add); a stack is of one kind. A forward with a cache, cross-attention or
``use_cache`` runs stock (HF's GPT-2 passes a fresh cache in every forward unless ``use_cache=False`` or
``config.use_cache=False``: partitions cannot fill it per partition; a warning says so once).
:func:`block_problems` refuses other blocks, and attention dropout outside the eager attention (SDPA draws its
mask inside the kernel, where it cannot be replayed).

Shapes: B samples, L tokens per sample, M model dim.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.lancet.block_kinds import kind_of, stack_problems, unknown_problem

logger = logging.getLogger("moe_plugins.lancet")


def block_problems(block: nn.Module, where: str, moe: bool = False) -> List[str]:
    """Why the executor cannot run ``block`` (an MoE block when ``moe``) partition by partition (empty when it can)."""
    kind = kind_of(block)
    return [unknown_problem(block, where)] if kind is None else kind.problems(block, where, moe)


def memory_order(x: torch.Tensor) -> List[int]:
    """``x``'s dims from the slowest-varying in memory to the fastest (``range(x.dim())`` when contiguous). A dim of
    size 1 has any stride (torch calls such a tensor contiguous whatever it is, and ``contiguous()`` keeps it): it
    is ordered as in a contiguous tensor, just before the dim after it."""
    strides = list(x.stride())
    for d in reversed(range(x.dim())):
        if x.shape[d] == 1:
            strides[d] = strides[d + 1] * x.shape[d + 1] if d + 1 < x.dim() else 1
    return sorted(range(x.dim()), key=lambda d: (-strides[d], d))


def in_layout(x: torch.Tensor, order: Optional[Sequence[int]]) -> torch.Tensor:
    """``x``'s values laid out in memory in dim ``order`` (as :func:`memory_order` reads it; None: any): ``x`` itself
    when it already is, else a copy."""
    if order is None or x.dim() != len(order) or list(order) == memory_order(x):
        return x
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    return x.permute(*order).contiguous().permute(*inverse)


class DropoutReplay:
    """``torch.nn.functional.dropout`` while a range runs partitions (patched through the core Patcher, restored
    in ``finally``): partition 0 draws each call's mask on the whole batch, in call order, and every partition
    multiplies its rows by it, as the unpartitioned call does (bitwise: the same draws, the same product). A mask
    is drawn in memory order, so the whole-batch mask is laid out as the partition's input is (a transposed MoE
    output: :func:`in_layout`), as the unpartitioned input was. A partition of one sample cannot show where its
    batch dim lies in memory (any stride will do for a dim of size 1): :meth:`lay_out` tells the replay the
    layout of a tensor a dropout may get (the MoE output's). ``batch_dim``: where a dropout's input holds the batch
    (the block kind's ``dropout_dim``; dim 0 by default)."""

    def __init__(self, parts: int, batch_dim: Callable[[torch.Tensor], int] = lambda x: 0):
        self.parts, self.part, self.calls = parts, 0, 0
        self.masks: List[torch.Tensor] = []
        self._original = F.dropout
        self._batch_dim = batch_dim
        self._laid: Tuple[Optional[torch.Tensor], Optional[Sequence[int]]] = (None, None)

    def start(self, part: int) -> None:
        self.part, self.calls = part, 0

    def lay_out(self, x: torch.Tensor, order: Optional[Sequence[int]]) -> torch.Tensor:
        """``x`` in dim ``order`` (:func:`in_layout`), remembered as laid out so for a dropout on it."""
        x = in_layout(x, order)
        self._laid = (x, order)
        return x

    def dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or p == 0.0:
            return self._original(input, p, training, inplace)
        index, self.calls = self.calls, self.calls + 1
        dim = self._batch_dim(input)
        rows = input.shape[dim]
        shape = list(input.shape)
        shape[dim] = rows * self.parts
        if self.part == 0:
            laid, order = self._laid
            order = order if laid is input and order is not None else memory_order(input)
            whole = in_layout(torch.ones(shape, dtype=input.dtype, device=input.device), order)
            self.masks.append(self._original(whole, p, True, False))
        if index >= len(self.masks) or list(self.masks[index].shape) != shape:
            raise ValueError(f"partition {self.part}: dropout call {index} has {rows} rows, not 1/{self.parts} of the "
                             "whole batch's; every partition must run the same dropout calls in the same order")
        mask = self.masks[index].narrow(dim, self.part * rows, rows)
        return input.mul_(mask) if inplace else input * mask

    def patched(self) -> Patcher:
        return Patcher([Patch(F, "dropout", self.dropout)])          # per range call: not logged


def _rows(value: Any, batch: int, a: int, b: int) -> Any:
    """A block argument for samples [a, b): tensors of rank >= 2 with the batch as dim 0 (an attention mask) are
    cut, others kept."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch and batch > 1:
        return value[a:b]
    return value


StartMoE = Callable[[nn.Module, torch.Tensor, int], Any]     # (block, h_BLM, parts) -> a PartitionedCall
Parts = Union[int, Callable[[torch.Tensor, int], int]]       # a count, or a policy of (gate input h_BLM, range)


class BlockExecutor:
    """Runs ``blocks`` (an HF GPT-2 stack's ``h``, a BERT encoder's ``layer``) with batch partitions after each MoE
    block's gate. ``moe``: the indices of the MoE blocks; ``start_moe``: the host's partitioned MoE call for a block
    (its kind's ``moe_call`` with the host's request armed); ``parts``: the partition
    count, or a policy choosing it per call from the gate's input and the range's index, in MoE block order
    (``moe_plugins.lancet.auto.AutoPartitions``; it must divide the batch). :meth:`install` sets the blocks' instance forwards (core Patcher, undone by
    :meth:`remove`)."""

    def __init__(self, blocks: Sequence[nn.Module], moe: Sequence[int], start_moe: StartMoE, parts: Parts):
        problems = stack_problems(list(blocks), list(moe))
        if not moe:
            problems.append("the model has no MoE block for Lancet's batch partitions to follow")
        if problems:
            raise ValueError("; ".join(problems))
        self.blocks, self.moe, self.start_moe, self.parts = list(blocks), sorted(moe), start_moe, parts
        self.kind = kind_of(self.blocks[0])
        self._stash: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}   # block j: (input, x, h)
        self._passed: Dict[int, torch.Tensor] = {}           # dense block in a range: the tensor it passes on
        self._patcher: Optional[Patcher] = None
        self.ranges_run = 0
        self.chosen: List[int] = []                          # the partition count of each range run
        self.stock_calls = 0                                 # MoE blocks run stock (a cache, ...)

    def _choose(self, h_BLM: torch.Tensor, i: int) -> Tuple[int, Any]:
        """The partition count for the range of MoE block ``i``, and its clock when a tuning policy times it (else
        None)."""
        if isinstance(self.parts, int):
            return self.parts, None
        timed = getattr(self.parts, "timed", None)
        if timed is not None:
            parts, sample = timed(h_BLM)
            return int(parts), sample
        return int(self.parts(h_BLM, self.moe.index(i))), None

    def range_of(self, i: int) -> Tuple[List[int], Optional[int]]:
        """The dense blocks after MoE block i, and the next MoE block (None: the range ends with the stack)."""
        later = [j for j in self.moe if j > i]
        end = later[0] if later else len(self.blocks)
        return list(range(i + 1, end)), (later[0] if later else None)

    def install(self) -> "BlockExecutor":
        patches = []
        for i, block in enumerate(self.blocks):
            run = self._moe_forward if i in self.moe else self._dense_forward
            original = block.forward
            patches.append(Patch(block, "forward", lambda *a, _i=i, _o=original, _r=run, **k: _r(_i, _o, *a, **k)))
        self._patcher = Patcher(patches, logger=logger).apply()
        return self

    def remove(self) -> None:
        patcher, self._patcher = self._patcher, None
        self._stash.clear()
        self._passed.clear()
        if patcher is not None:
            patcher.restore()

    def _dense_forward(self, i: int, original: Callable, *args, **kwargs):
        passed = self._passed.pop(i, None)
        if passed is not None and (args[0] if args else kwargs.get("hidden_states")) is passed:
            return self.kind.output(passed)
        return original(*args, **kwargs)

    def _moe_forward(self, i: int, original: Callable, *args, **kwargs):
        kind, read = self.kind, self.kind.read(args, kwargs)
        if read.stock or self.parts == 1:
            self._stash.pop(i, None)
            if not self.stock_calls and self.parts != 1:
                logger.warning("moe_plugins: Lancet's batch partitions leave a forward with a KV cache, "
                               "use_cache or cross-attention stock (HF's GPT-2 builds a cache by default: pass "
                               "use_cache=False, or set config.use_cache=False, in training)")
            self.stock_calls += 1
            return original(*args, **kwargs)
        hidden, mask, extra = read.hidden, read.mask, read.extra
        stash = self._stash.pop(i, None)
        if stash is not None and stash[0] is hidden:
            x_BLM, h_BLM = stash[1], stash[2]
        else:
            x_BLM, h_BLM = kind.before(self.blocks[i], hidden, mask, extra)
        dense, nxt = self.range_of(i)
        parts, sample = self._choose(h_BLM, i)
        if sample is not None:            # "tune": this range is timed, from its gate input's gradient back
            h_BLM = sample.wrap_input(h_BLM)
        call = self.start_moe(self.blocks[i], h_BLM, parts)
        bd = kind.batch_dim                      # x_BLM is [L, B, M] when 1 (Megatron)
        batch = x_BLM.shape[bd]
        size = batch // parts
        rest = tuple(s for d, s in enumerate(x_BLM.shape) if d != bd)
        replay = DropoutReplay(parts, kind.dropout_dim)
        xs, hs = [], []
        with replay.patched():
            for p in range(parts):
                a, b = p * size, (p + 1) * size
                replay.start(p)
                mask_p = _rows(mask, batch, a, b)
                extra_p = {k: _rows(v, batch, a, b) for k, v in extra.items()} if kind.cut_extra else extra
                y_p = replay.lay_out(call.output(p).view(b - a, *rest).movedim(0, bd), call.block_order)
                x_p = kind.after(self.blocks[i], x_BLM.narrow(bd, a, b - a), y_p)
                for d in dense:                  # through the module (its hooks), on to the stock forward
                    x_p = kind.whole(self.blocks[d], x_p, mask_p, extra_p)
                if nxt is not None:
                    x_p, h_p = kind.before(self.blocks[nxt], x_p, mask_p, extra_p)
                    hs.append(h_p)
                xs.append(x_p)
        out, h_next = torch.cat(xs, dim=bd), (torch.cat(hs, dim=bd) if nxt is not None else None)
        if sample is not None:            # the range's forward ends here; its backward starts at these gradients
            out = sample.wrap_output(out)
            h_next = None if h_next is None else sample.wrap_output(h_next)
        for d in dense:
            self._passed[d] = out
        if nxt is not None:
            self._stash[nxt] = (out, out, h_next)
        self.ranges_run += 1
        self.chosen.append(parts)
        return kind.output(out)
