"""Parm's dedicated schedules for MP+EP+ESP (parm.txt §III): S1, S2, S2 with SAA, and the automatic choice.

    baseline     ESP-AllGather -> gate -> EP-A2A -> experts -> ESP-AllReduce -> EP-A2A -> combine -> ESP-Split
    parm-s1      MP-Split(tokens) -> gate -> dump -> EP&ESP-A2A -> expert partials -> EP&ESP-A2A
    (Fig. 3b)      -> local combine (sum of the ESP partials) -> combine -> MP-AllGather(tokens)
    parm-s2      gate -> dispatch -> MP-Split(capacity) -> dump -> EP&ESP-A2A -> expert partials
    (Fig. 3c)      -> EP&ESP-A2A -> local combine -> MP-AllGather(capacity) -> combine
    parm-s2-saa  parm-s2 with the EP&ESP-A2A and the MP-AllGather beside it run as one overlapped
                 collective (SAA, moe_plugins/parm/saa.py), in forward and in backward
    parm-auto    per layer and token count, S1 or S2 with SAA by Algorithm 1 (moe_plugins/parm/auto.py)
    parm-tune    parm-auto's pick checked by timing the layer (moe_plugins/parm/tune.py)

What pausing MP buys: each MP rank sends a distinct 1/N_MP of the group's work, so no expert computes a
row twice; the dump + one EP&ESP all-to-all (Fig. 4c) replaces ESP-AllGather + EP-AlltoAll, and the
all-to-all back + local combine (Fig. 4d) replaces ESP-AllReduce + EP-AlltoAll + ESP-Split. Backward
mirrors it: MP-Split <-> MP-AllGather, dump <-> sum, all-to-all <-> all-to-all.

Exactness. S1 gates only this MP rank's token block, 1/N_MP of the MP group's tokens, as Fig. 3b does
(``LayerParams.block_router``, the core's ``router.route_token_block``). Capacity positions, drops and the
aux loss are reconciled over MP with O(E) numbers, not tokens: an all-gather of every block's route counts
per (route rank, expert) (k E integers per rank) gives each route its position in GShard's order on the
whole block, and an all-reduce of the gate sums (E floats) gives the aux loss. So exactly the baseline's
routes are dropped, with its combine weights and aux loss. The gate weight's gradient is then a partial sum
over MP; ``copy_to`` all-reduces it in backward (E M elements), so every MP rank holds the full gradient as
in the baseline. A host whose gate cannot be split (random or opaque: DeepSpeed's TopKGate, Megatron's
router) supplies no block router, and S1 gates the whole block on every MP rank instead
(:func:`whole_block_routing`; the S x K combine-weight gradients are then all-gathered in backward).

S1's buffer. Each rank dispatches only the kept routes of its own tokens, in the baseline's slot order,
into C_l slots per expert, C_l = the largest per-expert count of kept routes over the MP group's token
blocks (known on every MP rank) made uniform over the EP&ESP group by one integer max. With balanced
routing C_l ~ C / N_MP, the paper's T / N_MP; it is never above C.

Shapes: S tokens of the MP group (s = S' / P per rank after padding S to S' = a multiple of P), E experts
(E_l per EP rank), C capacity (c a chunk), M model dim, K routes per token, G = N_EP * N_ESP members of
the fused group, P = N_MP. S1 moves d_EcM; S2 moves d_EPcM (its MP axis is split on the wire to size 1:
w_GE1cM), which is how the shared exchange steps tell the two apart.

The shared steps are in :mod:`moe_plugins.parm.steps`; each schedule's ragged form (``"exchange": "ragged"``) in
:mod:`moe_plugins.parm.ragged` and :mod:`moe_plugins.parm.saa_ragged`.
"""

from __future__ import annotations

import torch

from moe_plugins.core.schedule import Dispatched, LayerParams
from moe_plugins.parm.ragged import RaggedParmS1Schedule, RaggedParmS2Schedule
from moe_plugins.parm.saa_ragged import RaggedParmS2SAASchedule
from moe_plugins.parm.steps import (S2Form, _ParmSchedule, _S1Watch, block_counts, expert_partials,  # noqa: F401
                                    local_slots, mp_block_slots, sharded_expert_partials, whole_block_routing)


class ParmS1Schedule(_ParmSchedule):
    """Fig. 3b: pause MP before the experts by splitting tokens; gather the combined output."""

    name = "parm-s1"

    @classmethod
    def exchange_variant(cls, exchange: str):
        return {"padded": ParmS1Schedule, "ragged": RaggedParmS1Schedule}.get(exchange)

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        return self._prepare_tokens(x_SM, params)


class ParmS2Schedule(_ParmSchedule):
    """Fig. 3c: pause MP after the gate by splitting the capacity axis; gather it before the combine."""

    name = "parm-s2"

    @classmethod
    def exchange_variant(cls, exchange: str):
        return {"padded": ParmS2Schedule, "ragged": RaggedParmS2Schedule}.get(exchange)

    def prepare(self, x_SM: torch.Tensor, params: LayerParams) -> Dispatched:
        return self._prepare_capacity(x_SM, params)


class ParmS2SAASchedule(ParmS2Schedule):
    """S2 whose EP&ESP all-to-all and MP all-gather overlap slice by slice (§III-D)."""

    name = "parm-s2-saa"
    saa = True

    @classmethod
    def exchange_variant(cls, exchange: str):
        return {"padded": ParmS2SAASchedule, "ragged": RaggedParmS2SAASchedule}.get(exchange)
