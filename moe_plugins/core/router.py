"""The core's router: top-k gate plus capacity, with dropless capacity made uniform across ranks; and its
block form for Parm's S1, where each MP rank gates only its own 1/N_MP of the MP group's tokens."""

from __future__ import annotations

import torch

from moe_plugins.core import comm
from moe_plugins.core.comm import Recorder
from moe_plugins.core.config import MoEConfig
from moe_plugins.core.gating import (BlockRouting, Routing, apply_capacity, assign_topk, block_candidates, capacity, gate_logits,
                     route_block)
from moe_plugins.core.groups import MoEProcessGroups


def uniform_capacity(local_max: int, groups: MoEProcessGroups, rec: Recorder) -> int:
    """Dropless capacity: the largest expert count over the fused EP&ESP group and the MP group, which
    covers every rank whose buffers must have the same shape. O(1) integers, not tokens."""
    cap = comm.all_reduce_max(local_max, groups.ep_esp, rec)
    return max(1, comm.all_reduce_max(cap, groups.mp, rec))


def route_tokens(x_SM: torch.Tensor, *, wg_EM: torch.Tensor, config: MoEConfig, groups: MoEProcessGroups,
                 rec: Recorder) -> Routing:
    assign = assign_topk(gate_logits(x_SM, wg_EM), config.k)
    if config.drop_tokens:
        cap = capacity(x_SM.shape[0], config.num_experts, config.k, config.capacity_factor, config.min_capacity)
    else:
        cap = uniform_capacity(assign.max_count, groups, rec)
    return apply_capacity(assign, cap)


def route_token_block(x_sM: torch.Tensor, num_tokens: int, *, wg_EM: torch.Tensor, config: MoEConfig,
                      groups: MoEProcessGroups, rec: Recorder) -> BlockRouting:
    """Gate this MP rank's token block, rows [p s, (p+1) s) of the MP group's ``num_tokens`` tokens (rows at
    or past ``num_tokens`` are padding), with exactly the routing ``route_tokens`` gives on all of them.

    Collectives on the MP group, O(E) elements each: an all-gather of the block's route counts (k E
    integers), an all-reduce of its gate sums (E floats; forward sum, backward identity: the group's tokens
    are one logical copy, so each rank's aux-loss gradient reaches only its own rows), and, in backward, the
    all-reduce of the gate weight's gradient (``copy_to``: each rank's is a partial sum over its rows).
    Dropless capacity is made uniform as ``route_tokens`` does."""
    mp = groups.mp
    rows = x_sM.shape[0]
    if not (rows - 1) * mp.size < num_tokens <= rows * mp.size:
        raise ValueError(f"num_tokens ({num_tokens}) does not fit {mp.size} MP blocks of {rows} rows: it must "
                         f"be in ({(rows - 1) * mp.size}, {rows * mp.size}]")
    wg = comm.copy_to(wg_EM, mp, rec)
    valid_s = torch.arange(mp.rank * rows, (mp.rank + 1) * rows, device=x_sM.device) < num_tokens
    cand = block_candidates(gate_logits(x_sM, wg), config.k, valid_s)
    counts_PKE = comm.all_gather(cand.counts_KE.unsqueeze(0), mp, rec, dim=0)
    gate_total_E = comm.all_reduce(cand.gate_sum_E, mp, rec)
    if config.drop_tokens:
        cap = capacity(num_tokens, config.num_experts, config.k, config.capacity_factor, config.min_capacity)
    else:
        cap = uniform_capacity(int(counts_PKE.sum((0, 1)).max()), groups, rec)
    return route_block(cand, counts_PKE, mp.rank, gate_total_E, num_tokens, cap)
