"""A bench case's data (weights, tokens, gradients, per-case host objects) and a built row's interface,
shared by the plugin rows (rows.py) and the stock rows (stock_deepspeed.py, stock_megatron.py).

Shapes: S tokens, M model dim, E experts, H FFN hidden.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from moe_plugins.core.experts import ExpertWeights, init_full_weights
from moe_plugins.core.groups import MoEProcessGroups
from moe_plugins.tools.bench.matrix import CaseConfig

AUX_COEF = 0.01
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CaseData:
    """What every row of a case is built from and fed with (this rank's share)."""

    case: CaseConfig
    groups: MoEProcessGroups
    wg_EM: torch.Tensor
    full: ExpertWeights          # all E experts, unsharded; each row takes its own shard
    x_SM: torch.Tensor           # this rank's tokens (the same on the MP ranks of one DP block)
    g_SM: torch.Tensor           # upstream gradient for those tokens
    dtype: torch.dtype
    extras: Dict[str, object] = field(default_factory=dict)   # per-case host objects, e.g. singleton groups
    x_hot: Tuple[torch.Tensor, ...] = ()   # with drift: the tokens with expert e hot, per e (x_SM is e = 0's)

    def tokens(self, round_index: int) -> torch.Tensor:
        """The tokens of round ``round_index`` (0: the traffic round): ``x_SM``, or with drift the set whose hot
        expert is ``(round_index // drift) % E``."""
        if not self.x_hot:
            return self.x_SM
        return self.x_hot[(round_index // self.case.drift) % len(self.x_hot)]


def make_case_data(case: CaseConfig, groups: MoEProcessGroups, seed: int, dtype: str) -> CaseData:
    """Weights from ``seed`` (same on every rank); tokens from ``seed`` and this rank's DP block."""
    gen = torch.Generator().manual_seed(seed)
    full = init_full_weights(case.experts, case.hidden, case.ffn, gen, torch.float32)
    wg_EM = torch.randn(case.experts, case.hidden, generator=gen) / case.hidden ** 0.5
    block = groups.layout.coords(groups.global_rank)["dp"]
    gen_x = torch.Generator().manual_seed(seed * 100_003 + 1 + block)
    x_SM = torch.randn(case.tokens, case.hidden, generator=gen_x)
    g_SM = torch.randn(case.tokens, case.hidden, generator=gen_x)
    td = TORCH_DTYPES[dtype]
    if case.skew and case.drift:
        hot, wg_EM = drift_gate(x_SM, wg_EM, case.skew, torch.Generator().manual_seed(seed * 100_003))
        x_hot = tuple(x.to(td) for x in hot)
        return CaseData(case=case, groups=groups, wg_EM=wg_EM, full=full, x_SM=x_hot[0], g_SM=g_SM.to(td), dtype=td,
                        x_hot=x_hot)
    if case.skew:
        x_SM, wg_EM = skew_gate(x_SM, wg_EM, case.skew, torch.Generator().manual_seed(seed * 100_003))
    return CaseData(case=case, groups=groups, wg_EM=wg_EM, full=full, x_SM=x_SM.to(td), g_SM=g_SM.to(td), dtype=td)


def skew_gate(x_SM: torch.Tensor, wg_EM: torch.Tensor, share: float, gen: torch.Generator,
              margin: float = 3.0):
    """Tokens and gate where expert 0 is the first choice of the first ``round(share S)`` tokens and of no other:
    along a unit direction u (drawn from ``gen``, the same on every rank), the hot tokens get +``margin``, the
    others -``margin``, expert 0's gate row gets ``margin`` and the other rows none, so expert 0's logit moves
    by +-margin^2 (9 against unit-scale logits) and the others' are unchanged (pure)."""
    u_M = torch.randn(x_SM.shape[1], generator=gen)
    u_M = u_M / u_M.norm()
    hot_S = torch.full((x_SM.shape[0], 1), -margin)
    hot_S[:round(share * x_SM.shape[0])] = margin
    x_SM = x_SM - (x_SM @ u_M).unsqueeze(1) * u_M + hot_S * u_M
    wg_EM = wg_EM - (wg_EM @ u_M).unsqueeze(1) * u_M
    wg_EM[0] += margin * u_M
    return x_SM, wg_EM


def drift_gate(x_SM: torch.Tensor, wg_EM: torch.Tensor, share: float, gen: torch.Generator,
               margin: float = 3.0) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """One token set per expert e in which e is the first choice of the first ``round(share S)`` tokens and of no
    other, for one gate (pure). Each expert gets a unit direction u_e of its own (orthonormal, drawn from ``gen``,
    E <= M): the gate row e holds ``margin`` u_e and nothing else along the directions; in set e the hot tokens hold
    +``margin`` along u_e, the others -``margin``, and none holds anything along the other directions: expert e's
    logit moves by +-margin^2 and the others' are unchanged, as :func:`skew_gate` does for expert 0."""
    U_EM = torch.linalg.qr(torch.randn(x_SM.shape[1], wg_EM.shape[0], generator=gen))[0].T
    base_SM = x_SM - (x_SM @ U_EM.T) @ U_EM
    wg_EM = wg_EM - (wg_EM @ U_EM.T) @ U_EM + margin * U_EM
    hot = round(share * x_SM.shape[0])
    sets = []
    for e in range(wg_EM.shape[0]):
        sign_S1 = torch.full((x_SM.shape[0], 1), -margin)
        sign_S1[:hot] = margin
        sets.append(base_SM + sign_S1 * U_EM[e])
    return sets, wg_EM


@dataclass
class Row:
    """A built row: ``forward(x_SM) -> (y_SM, aux_loss)``; ``scope()`` is entered around construction-free
    work (forward and backward), for hosts that need shims or scoped settings; ``meter`` measures the
    inter-node bytes of one step."""

    label: str
    kind: str                     # plugin | stock
    module: nn.Module
    forward: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
    meter: object                 # LedgerMeter or traffic.CollectiveCounter (start() / stop() -> bytes)
    scope: Callable[[], ContextManager] = contextlib.nullcontext
    tokens: Optional[slice] = None    # the rows of x_SM this rank feeds (sequence parallelism); None: all
    notes: Tuple[str, ...] = ()
    describe: Callable[[], Tuple[str, ...]] = tuple   # after the timed rounds: what an auto row chose
    ran_as: Callable[[], Optional[str]] = lambda: None  # after the timed rounds: the fixed row an auto row ran as
    close: Callable[[], None] = lambda: None   # undo what building it changed outside the row (collective)
    # exposed all-to-all time (:mod:`.lancet_exposure`): how it is measured (spans | inline | unmeasured), and the
    # compute spans the row recorded since the last call ((start_ns, end_ns, kind); None: it records none)
    exposure: str = "inline"
    compute_spans: Optional[Callable[[], List[Tuple[int, int, str]]]] = None


def close_rows(rows: Sequence[Row]) -> None:
    """Close every row in order (the same order on every rank: closing may be collective), even when one fails;
    the first failure is raised after the others are closed."""
    failure: Optional[BaseException] = None
    for row in rows:
        try:
            row.close()
        except Exception as exc:  # the others are still closed; this one is raised below
            failure = failure or exc
    if failure is not None:
        raise failure


def fwd_bwd(row: Row, data: CaseData, round_index: int = 0) -> torch.Tensor:
    """One forward and backward of ``row`` on this rank's tokens of round ``round_index``; returns the output
    (detached)."""
    row.module.zero_grad(set_to_none=True)
    part = row.tokens if row.tokens is not None else slice(None)
    x_SM = data.tokens(round_index)[part].detach().clone().requires_grad_(True)
    with row.scope():
        y_SM, aux = row.forward(x_SM)
        ((y_SM * data.g_SM[part]).float().sum() + AUX_COEF * aux.float()).backward()
    return y_SM.detach()
