"""One Hecate layer call's data flow as pure functions of host integers, and the experts' flat parameters.

- :func:`route_plan`: given every EP member's kept routes per expert (``counts_RE``, all-gathered once per call)
  and the placement, what this rank sends and receives: each source splits its routes for an expert among the
  expert's copies (:func:`~moe_plugins.hecate.plan.dispatch_counts`: local copy, same node, remote; even), the
  routes of a copy being a contiguous run of the expert's kept routes (lower copy rank first); the rows travel
  destination by destination, expert by expert, in one uneven all-to-all. Every rank computes every source's
  split from the same integers, so no second exchange of split sizes is needed.
- :func:`piece_plans`: the call cut into PipeMoE's chunks, each routed on its own (degree 1: the whole call).
- :func:`flat_experts` / :func:`unflat_experts`: an expert's parameters as one flat row of F = M H + H + H M + M
  elements (w1, b1, w2, b2), the unit spAG copies.
- :func:`ffn_activation_problems`: whether the copies' FFN (the core's ``partial_ffn``) has a host experts'
  activation (``"gelu_tanh"`` included: GPT-2's ``gelu_new``).

Letters: R ranks of the EP group (sources and destinations), E experts, C experts copied on this rank (its own
included, in expert order), X kept routes of this rank, M model dim, H FFN hidden, F elements per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from moe_plugins.core.experts import ACTIVATIONS, ExpertWeights
from moe_plugins.core.ragged import offsets
from moe_plugins.core.schedule import chunk_bounds
from moe_plugins.hecate.plan import Placement, dispatch_counts


@dataclass(frozen=True)
class RoutePlan:
    """This rank's part of one call: ``perm_X`` (its kept rows in send order, indices into its rows in (expert,
    slot) order), split sizes ``send`` / ``recv`` per member, ``experts`` (the copies it holds, in expert order)
    and ``recv_RC`` (rows source r sends for copy c), ``rows_C`` (rows it computes per copy)."""

    perm_X: Tuple[int, ...]
    send: Tuple[int, ...]
    recv: Tuple[int, ...]
    experts: Tuple[int, ...]
    recv_RC: Tuple[Tuple[int, ...], ...]

    @property
    def rows_C(self) -> Tuple[int, ...]:
        return tuple(sum(col) for col in zip(*self.recv_RC)) if self.recv_RC else ()


def route_plan(counts_RE: Sequence[Sequence[int]], rank: int, placement: Placement) -> RoutePlan:
    """``rank``'s sends and receives for kept routes ``counts_RE[r][e]`` (every member's, the same on all)."""
    ranks = placement.num_ranks
    if len(counts_RE) != ranks or any(len(row) != len(placement.copies_E) for row in counts_RE):
        raise ValueError(f"counts_RE must hold {ranks} rows of {len(placement.copies_E)} counts, one per member "
                         f"and expert; got {[len(row) for row in counts_RE]}")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank ({rank}) must lie in [0, {ranks})")
    send_SER = [dispatch_counts(row, s, placement) for s, row in enumerate(counts_RE)]
    mine = send_SER[rank]
    starts_E = offsets(counts_RE[rank])                                      # this rank's rows per expert
    offset_ER = [[sum(row[:r]) for r in range(ranks)] for row in mine]       # copies of lower rank first
    perm = [i for r in range(ranks) for e, row in enumerate(mine)
            for i in range(starts_E[e] + offset_ER[e][r], starts_E[e] + offset_ER[e][r] + row[r])]
    experts = placement.experts_on(rank)
    return RoutePlan(perm_X=tuple(perm), send=tuple(sum(row[r] for row in mine) for r in range(ranks)),
                     recv=tuple(sum(row[rank] for row in send_SER[s]) for s in range(ranks)), experts=experts,
                     recv_RC=tuple(tuple(send_SER[s][e][rank] for e in experts) for s in range(ranks)))


def expert_numel(model_dim: int, ffn: int) -> int:
    """F: one expert's elements, w1 (M H), b1 (H), w2 (H M), b2 (M)."""
    return 2 * model_dim * ffn + ffn + model_dim


def flat_experts(w: ExpertWeights) -> torch.Tensor:
    """w_owned_O: the experts of ``w`` flattened and concatenated, expert by expert (autograd flows back)."""
    return torch.cat([w.w1_EMH.flatten(1), w.b1_EH, w.w2_EHM.flatten(1), w.b2_EM], dim=1).reshape(-1)


def unflat_experts(w_CF: torch.Tensor, model_dim: int, ffn: int) -> ExpertWeights:
    """The (C, F) rows of :func:`flat_experts` as ExpertWeights of C experts (views)."""
    num, m, h = w_CF.shape[0], model_dim, ffn
    if w_CF.dim() != 2 or w_CF.shape[1] != expert_numel(m, h):
        raise ValueError(f"w_CF (shape {tuple(w_CF.shape)}) must be (C, {expert_numel(m, h)}) for M {m}, H {h}")
    cuts = [m * h, h, h * m, m]
    w1, b1, w2, b2 = torch.split(w_CF, cuts, dim=1)
    return ExpertWeights(w1_EMH=w1.reshape(num, m, h), b1_EH=b1, w2_EHM=w2.reshape(num, h, m), b2_EM=b2)


def ffn_activation_problems(activation: str) -> List[str]:
    """Why the copies cannot use ``activation`` (empty when they can): one of the core's activations."""
    if activation in ACTIVATIONS:
        return []
    return [f"activation ({activation!r}) must be one of {sorted(ACTIVATIONS)}"]


@dataclass(frozen=True)
class PiecePlan:
    """One piece of a call (the whole call, or one of PipeMoE's chunks): ``rows``, the rows this rank sends in
    it, in send order (indices into its kept rows in (expert, slot) order), and the piece's :class:`RoutePlan`."""

    rows: Tuple[int, ...]
    plan: RoutePlan


def piece_plans(counts_RE: Sequence[Sequence[int]], rank: int, placement: Placement, degree: int) -> List[PiecePlan]:
    """The call cut into ``degree`` pieces (pure). Piece [a, b) (``chunk_bounds`` over the largest count any
    source has for any expert, so every rank cuts the same) takes, of each source's kept routes for each expert,
    those ranked a..min(n, b)-1, and is routed on its own (:func:`route_plan` of its counts): each source splits
    each piece's routes over the expert's copies. Degree 1: the whole call, one piece."""
    if not (isinstance(degree, int) and degree >= 1):
        raise ValueError(f"degree ({degree!r}) must be an integer >= 1")
    if degree == 1:
        whole = route_plan(counts_RE, rank, placement)
        return [PiecePlan(whole.perm_X, whole)]
    slots = max((n for row in counts_RE for n in row), default=0)
    starts_E = offsets(counts_RE[rank])
    pieces = []
    for a, b in chunk_bounds(slots, degree):
        counts_c = [[max(0, min(n, b) - a) for n in row] for row in counts_RE]
        local = [starts_E[e] + a + j for e, n in enumerate(counts_c[rank]) for j in range(n)]
        plan = route_plan(counts_c, rank, placement)
        pieces.append(PiecePlan(tuple(local[i] for i in plan.perm_X), plan))
    return pieces


def rows_per_expert(pieces: List[PiecePlan], num_experts: int) -> Tuple[int, ...]:
    """Rows this rank computes per expert over the pieces (0 for experts it holds no copy of)."""
    rows_E = [0] * num_experts
    for piece in pieces:
        for e, n in zip(piece.plan.experts, piece.plan.rows_C):
            rows_E[e] += n
    return tuple(rows_E)
