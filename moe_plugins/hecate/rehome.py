"""Moving experts to new homes (Algorithm 2's plan, :mod:`moe_plugins.hecate.reshard`): values, gradients and
optimizer state, whole experts, one uneven all-to-all per layer and dtype; and :class:`Resharder`, which plans
and moves every ``reshard_every`` optimizer steps.

A host describes a layer's storage as **slots**: local slot i holds the i-th of the rank's experts (ascending
id), as a list of ``(parameter, index)``: the parameter's ``[index]`` (the core layer's stacked ``w1_EMH`` ...)
or the whole parameter (``index`` None: DeepSpeed's one ``nn.Linear`` per expert). What moves with a slot, in
a fixed order: each parameter's values, its gradient when it has one, and its optimizer state tensors shaped
like it (Adam's moments); scalar state (Adam's ``step``) stays. Everything is copied **in place**, so the
parameters, their hooks and the optimizer's groups stay valid. Global expert ids never change; a host that
writes checkpoints by slot moves the experts back to the stock homes around the write
(:meth:`Resharder.stock_homes`).

Collective over the FSSDP group (the layer's EP group), at a step boundary; every rank plans from the same
integers (loads all-reduced over the whole job), and the plans are compared across the job before anything
moves, so that expert-DP replicas keep holding the same experts.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group, int_spread
from moe_plugins.hecate.reshard import Homes, local_experts, move_counts, shard_plan

log = logging.getLogger(__name__)

Slot = Sequence[Tuple[torch.nn.Parameter, Optional[int]]]
PHASE = "reshard"


Extra = Callable[[torch.nn.Parameter], List[torch.Tensor]]


def slot_tensors(slots: Sequence[Slot], optimizer: Optional[Any],
                 extra: Optional[Extra] = None) -> List[List[torch.Tensor]]:
    """Per local slot, the tensors that move with it (module docstring), as views of the storage; ``extra(param)``:
    more views shaped like the parameter that move with it (a host's master copy and its optimizer state kept
    elsewhere, as DeepSpeed ZeRO 1/2's flat fp32 partition)."""
    out = []
    for slot in slots:
        tensors = []
        for param, index in slot:
            state = optimizer.state.get(param, {}) if optimizer is not None else {}
            found = [param.data] + ([param.grad] if param.grad is not None else [])
            found += [state[k] for k in sorted(state, key=str) if torch.is_tensor(state[k]) and
                      state[k].shape == param.shape]
            found += extra(param) if extra is not None else []
            tensors += [t if index is None else t[index] for t in found]
        out.append(tensors)
    return out


def rehome(tensors_S: List[List[torch.Tensor]], old_E: Homes, new_E: Homes, group: Group, rec: Recorder) -> int:
    """Move this rank's slots (:func:`slot_tensors`, for homes ``old_E``) to homes ``new_E``, in place; returns the
    elements sent. Collective over ``group`` (each member's slots the same widths: checked first)."""
    rank, ranks = group.rank, group.size
    old_ids, new_ids = local_experts(old_E, rank), local_experts(new_E, rank)
    if len(old_ids) != len(tensors_S) or len(new_ids) != len(tensors_S):
        raise ValueError(f"rank {rank} stores {len(tensors_S)} experts; homes give it {len(old_ids)} before and "
                         f"{len(new_ids)} after (the experts a rank stores cannot change in number)")
    _same_everywhere(tensors_S, group)
    sends = move_counts(old_E, new_E, rank, ranks)
    recvs = [move_counts(old_E, new_E, s, ranks)[rank] for s in range(ranks)]
    sent = 0
    for dtype in sorted({t.dtype for t in tensors_S[0]}, key=str):
        cols = [i for i, t in enumerate(tensors_S[0]) if t.dtype == dtype]
        rows = {e: torch.cat([tensors_S[i][c].reshape(-1) for c in cols]) for i, e in enumerate(old_ids)}
        width = sum(tensors_S[0][c].numel() for c in cols)
        send_XW = torch.stack([rows[e] for s in range(ranks) for e in sends[s]]) if any(sends) else \
            tensors_S[0][cols[0]].new_empty(0, width)
        got_XW = send_XW
        if ranks > 1:
            got_XW = rec.issue("all_to_all", group, send_XW, PHASE, splits=([len(s) for s in sends],
                                                                            [len(r) for r in recvs]))
        arrived = dict(zip([e for r in recvs for e in r], got_XW.unbind(0))) if got_XW.numel() else {}
        new_rows = [arrived[e] if e in arrived else rows[e].clone() for e in new_ids]
        for i, row in enumerate(new_rows):
            start = 0
            for c in cols:
                target = tensors_S[i][c]
                target.copy_(row[start:start + target.numel()].view_as(target))
                start += target.numel()
        sent += send_XW.numel()
    return sent


def _same_everywhere(tensors_S: List[List[torch.Tensor]], group: Group) -> None:
    """Every member must move slots of the same widths (else the all-to-all's splits disagree)."""
    mine = [len(tensors_S), sum(t.numel() for t in tensors_S[0]) if tensors_S else 0,
            len(tensors_S[0]) if tensors_S else 0]
    high, low = int_spread(mine, group.pg)
    if high != mine or low != mine:
        raise ValueError(f"expert slots to move differ across the FSSDP group {list(group.ranks)}: (slots, elements "
                         f"per slot, tensors) here {mine}, max {high}, min {low}; re-shard at a step boundary with "
                         "the same gradients and optimizer state on every rank")


class Resharder:
    """Re-shards ``layers`` every ``every`` optimizer steps (call :meth:`step_end` after each). A layer is
    ``(schedule, slots)``: its :class:`~moe_plugins.hecate.schedule.HecateSchedule` and a callable returning its
    storage slots (module docstring). ``world``: the process group every rank of the job is in (None: one
    process), over which the loads are summed and the plans compared."""

    def __init__(self, layers: Sequence[Tuple[Any, Callable[[], Sequence[Slot]]]], every: int,
                 world: Optional[Any] = None, pooled: bool = False) -> None:
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every ({every!r}) must be an integer >= 1 (optimizer steps between re-shardings)")
        self.layers, self.every, self.world, self.pooled = list(layers), every, world, pooled
        self.steps = 0
        self.rounds = 0          # re-shard rounds run (collective; a round may leave every layer where it was)
        self.layers_moved = 0    # layers those rounds moved

    def step_end(self, optimizer: Optional[Any], extra: Optional[Extra] = None) -> bool:
        """Count one optimizer step; every ``every``-th, re-shard (collective). Whether it re-sharded."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self.reshard(optimizer, extra=extra)
        return True

    def plan(self) -> Tuple[Homes, ...]:
        """Algorithm 2 on every layer's window load summed over the job (one all-reduce), the same everywhere."""
        loads = [list(s.window_load()) for s, _ in self.layers]
        if self.world is not None and dist.is_initialized() and dist.get_world_size(self.world) > 1:
            t = torch.tensor(loads, dtype=torch.int64)
            dist.all_reduce(t, group=self.world)
            loads = t.tolist()
        schedules = [s for s, _ in self.layers]
        nodes_R = schedules[0].fssdp_nodes()
        if any(s.fssdp_nodes() != nodes_R for s in schedules):
            raise ValueError("every re-sharded layer must run on the same FSSDP group")
        return shard_plan(loads, [s.overlappable(load) for s, load in zip(schedules, loads)], nodes_R,
                          [s.homes for s in schedules], pooled=self.pooled)

    def reshard(self, optimizer: Optional[Any], homes_LE: Optional[Sequence[Homes]] = None,
                extra: Optional[Extra] = None) -> None:
        """Move every layer to ``homes_LE`` (default: :meth:`plan`), checked the same on every rank first, with
        ``optimizer``'s state keyed by the parameters and the ``extra`` views (:func:`slot_tensors`); an ``extra``
        with a ``done()`` (tensors it gathered for the move rather than views) has it called after the moves."""
        homes_LE = self.plan() if homes_LE is None else tuple(tuple(h) for h in homes_LE)
        self._agree(homes_LE)
        moved = self._move_pool(homes_LE, optimizer, extra) if self.pooled else 0
        for (schedule, slots), homes in zip(self.layers if not self.pooled else (), homes_LE):
            if tuple(homes) == schedule.homes:
                continue
            tensors = slot_tensors(slots(), optimizer, extra)
            with torch.no_grad():
                moved += rehome(tensors, schedule.homes, tuple(homes), schedule.groups.ep, schedule.rec)
            schedule.set_homes(tuple(homes))
            self.layers_moved += 1
        done = getattr(extra, "done", None)       # a host's copies taken for the move, written back to its storage
        if done is not None:
            done()
        self.rounds += 1
        log.info("hecate: re-sharded %d layers at step %d (%d elements sent here); homes %s", len(self.layers),
                 self.steps, moved, [list(h) for h in homes_LE])

    def _move_pool(self, homes_LE: Sequence[Homes], optimizer: Optional[Any], extra: Optional[Extra]) -> int:
        """Pooled slots: the layers' slots, in layer order, are one storage whose i-th slot on a rank holds the
        i-th of the (layer, expert) pairs homed there (ascending); one move over it, so an expert may land in
        another layer's module. Every slot must move the same tensors (the layers' experts of one shape)."""
        schedules = [s for s, _ in self.layers]
        old = tuple(r for s in schedules for r in s.homes)
        new = tuple(r for homes in homes_LE for r in homes)
        if old == new:
            return 0
        groups = {tuple(s.groups.ep.ranks) for s in schedules}
        if len(groups) != 1:
            raise ValueError("hecate.pool_slots: the pooled layers must share one FSSDP (EP) group; their groups' "
                             f"ranks are {sorted(groups)}")
        tensors = [t for _, slots in self.layers for t in slot_tensors(slots(), optimizer, extra)]
        shapes = {tuple((tuple(t.shape), t.dtype) for t in slot) for slot in tensors}
        if len(shapes) != 1:
            raise ValueError(f"hecate.pool_slots: the layers' expert slots differ ({len(shapes)} shapes of what "
                             "moves with them); pooled slots need every layer's experts of one shape, with the same "
                             "gradients and optimizer state")
        with torch.no_grad():
            moved = rehome(tensors, old, new, schedules[0].groups.ep, schedules[0].rec)
        for schedule, homes in zip(schedules, homes_LE):
            if tuple(homes) != schedule.homes:
                schedule.set_homes(tuple(homes), pooled=True)
                self.layers_moved += 1
        return moved

    def to_stock(self, optimizer: Optional[Any], extra: Optional[Extra] = None) -> None:
        """Every layer's experts to expert parallelism's homes, to stay (before loading stock-layout state)."""
        self.reshard(optimizer, self._stock(), extra)

    def _stock(self) -> Tuple[Homes, ...]:
        return tuple(s.stock_homes() for s, _ in self.layers)

    @contextmanager
    def stock_homes(self, optimizer: Optional[Any], extra: Optional[Extra] = None) -> Iterator[None]:
        """Inside: every layer's experts on expert parallelism's homes (a checkpoint written here is stock's);
        after: back where they were (also when the body raised)."""
        current, stock = tuple(s.homes for s, _ in self.layers), self._stock()
        if current == stock:
            yield
            return
        self.reshard(optimizer, stock, extra)
        try:
            yield
        finally:
            self.reshard(optimizer, current, extra)

    def _agree(self, homes_LE: Sequence[Homes]) -> None:
        flat = [r for h in homes_LE for r in h]
        high, low = int_spread(flat, self.world if dist.is_initialized() else None)
        if high != flat or low != flat:
            raise ValueError("hecate re-sharding: the ranks' plans differ (their FSSDP groups' nodes differ?); "
                             "nothing was moved")

