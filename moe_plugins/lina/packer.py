"""Lina's expert packing coordinator (§6.1): times the forward micro-ops of a model's MoE layers, and at the
check steps (from step 10, every 4: ``packing.is_check_step``) agrees with every rank on the summed timings
(one all-reduce of four numbers) and doubles the packing while the expert micro-op is the shorter
(``packing.decide_packing``). The regroup then happens on every rank at the same step boundary
(``regroup.regroup_layers``).

A training loop (a host) calls :meth:`PackingController.step_end` once per optimizer step, after
``optimizer.step()``; when it returns a packing, the layers now run on :attr:`PackingController.groups`, and
whatever else reduces the expert gradients (over ``groups.expert_dp``) must use those groups from then on.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from moe_plugins.core.groups import MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.lina.packing import (AUTO, EVERY_STEPS, START_STEP, MicroOpTimes, decide_packing, is_check_step,
                                      next_packing, packed_layout, packing_layout_problems)
from moe_plugins.lina.probe import PackingProbe
from moe_plugins.lina.regroup import regroup_layers

log = logging.getLogger(__name__)


def agree_times(times: MicroOpTimes, group: Optional[dist.ProcessGroup] = None) -> MicroOpTimes:
    """The sums over every rank of ``group`` (default: the world): the same numbers, hence the same decision,
    on every rank. Collective."""
    t = torch.tensor([times.expert_s, times.expert_n, times.a2a_s, times.a2a_n], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return MicroOpTimes(float(t[0]), int(t[1]), float(t[2]), int(t[3]))


class PackingController:
    """Packs the experts of ``layers`` (core ``MoELayer``s built on ``groups``, the unpacked layout).

    ``packing``: an int p (regroup once, now: collective) or ``"auto"`` (the paper's rule at the check steps).
    ``optimizer``: whose state moves with the expert parameters. ``max_packing``: the paper's cap on experts
    per device (default: all on every device). ``group``: where the timings are agreed (default: the world).
    Groups it builds for a packing are kept for a return to it and destroyed by :meth:`close`. A host passes
    ``regroup(layers, groups, optimizer)`` (its own move; default: the core layers') and ``groups_for(packing)``
    (groups it builds, registers and frees itself; default: built here)."""

    def __init__(self, layers: Sequence[Any], groups: MoEProcessGroups, *, packing: Union[int, str] = AUTO,
                 optimizer: Optional[Any] = None, start: int = START_STEP, every: int = EVERY_STEPS,
                 max_packing: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
                 path: str = "moe_plugins.lina", regroup: Callable[..., None] = regroup_layers,
                 groups_for: Optional[Callable[[int], MoEProcessGroups]] = None):
        if not layers:
            raise ValueError("PackingController needs at least one MoE layer")
        problems = packing_layout_problems(packing, groups.layout, layers[0].config.num_experts, path)
        if max_packing is not None and not (isinstance(max_packing, int) and max_packing >= 1):
            problems.append(f"max_packing ({max_packing!r}) must be a positive integer")
        if start < 1 or every < 1:
            problems.append(f"start ({start}) and every ({every}) must be >= 1 steps")
        if any(layer.groups.layout != groups.layout for layer in layers):
            problems.append("every layer must be built on the controller's (unpacked) groups")
        if problems:
            raise ValueError("invalid packing: " + "; ".join(problems))
        self.layers, self.optimizer, self.group = list(layers), optimizer, group
        self.auto, self.start, self.every, self.max_packing = packing == AUTO, start, every, max_packing
        self.base_ep = groups.layout.ep
        self.packing, self.groups, self.steps = 1, groups, 0
        self._groups: Dict[int, MoEProcessGroups] = {1: groups}
        self._regroup, self._groups_for, self._owned = regroup, groups_for, set()
        self._window: Deque[MicroOpTimes] = deque(maxlen=every)
        self.decisions: List[Tuple[int, MicroOpTimes, int, int]] = []   # (step, agreed times, from, to)
        self.probe = PackingProbe()
        if self.auto:
            for layer in self.layers:
                self.probe.attach(layer)
        elif packing != 1:
            self.set_packing(int(packing))

    def step_end(self, times: Optional[MicroOpTimes] = None) -> Optional[int]:
        """Call after every optimizer step, on every rank. ``times``: this rank's micro-op timings of the step
        when the host measured them itself (CUDA events); default: the probe's. Returns the new packing when
        this boundary regrouped the layers, else None. Collective at check steps (``"auto"`` only)."""
        self.steps += 1
        measured = self.probe.take()
        self._window.append(measured if times is None else times)
        if not self.auto or not is_check_step(self.steps, self.start, self.every):
            return None
        if next_packing(self.packing, self.base_ep, self.max_packing) is None:
            return None                          # at the cap: nothing to agree on (same packing on every rank)
        window = MicroOpTimes()
        for t in self._window:
            window = window + t
        agreed = agree_times(window, self.group)
        new = decide_packing(self.packing, agreed, self.base_ep, self.max_packing)
        self.decisions.append((self.steps, agreed, self.packing, new))
        log.info("lina packing at step %d: expert micro-op %.3g ms, all-to-all micro-op %.3g ms (means over "
                 "ranks): packing %d -> %d", self.steps, agreed.expert_mean_s * 1e3, agreed.a2a_mean_s * 1e3,
                 self.packing, new)
        if new == self.packing:
            return None
        self.set_packing(new)
        return new

    def set_packing(self, packing: int) -> None:
        """Regroup every layer (and its optimizer state) to ``packing`` now. Collective: every rank, at a step
        boundary, with the same value."""
        problems = packing_layout_problems(packing, self._groups[1].layout, self.layers[0].config.num_experts)
        if packing == AUTO:
            problems.append('set_packing takes a packing (an integer), not "auto"')
        if problems:
            raise ValueError("; ".join(problems))
        if packing == self.packing:
            return
        if packing not in self._groups:         # collective over the default group, like every group build
            if self._groups_for is not None:
                self._groups[packing] = self._groups_for(packing)
            else:
                self._groups[packing] = build_process_groups(packed_layout(self._groups[1].layout, packing))
                self._owned.add(packing)
        self._regroup(self.layers, self._groups[packing], self.optimizer)
        self.packing, self.groups = packing, self._groups[packing]
        self._window.clear()                    # timings of the old layout say nothing about the new one

    @contextmanager
    def unpacked(self) -> Iterator[None]:
        """Inside: the layers on the unpacked layout, e.g. to write or read stock checkpoints (collective on the
        way in and out when packed); after: the packing they had."""
        packing = self.packing
        if packing != 1:
            self.set_packing(1)
        try:
            yield
        finally:
            if packing != 1:
                self.set_packing(packing)

    def close(self) -> None:
        """Destroy the groups this controller built (collective). The layers must be back on the unpacked
        groups first, or no longer used."""
        if self.packing != 1:
            raise ValueError(f"close() with the layers packed ({self.packing}): set_packing(1) first, or drop them")
        for packing in sorted(self._owned):
            destroy_process_groups(self._groups.pop(packing))
        self._owned.clear()
        for layer in self.layers:
            PackingProbe.detach(layer)
