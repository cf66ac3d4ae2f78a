"""SAA: Parm's simultaneous all-to-all and all-gather (parm.txt §III-D, Fig. 5), autograd-correct.

In S2 the combine-side EP&ESP all-to-all (inter-node dominated) is followed by the MP all-gather
(intra-node). SAA runs them together, slice by slice: the all-to-all is posted as point-to-point sends and
receives on the fused EP&ESP group; as soon as the slices of one EP peer block (its N_ESP expert shards)
have arrived they are summed (Parm's local combine) and the all-gather of that block starts on the MP
group, asynchronously, while the other blocks are still in flight. Blocks are taken in order of
locality (:func:`block_order`, the same on every MP rank since the gathers are collectives), so
intra-node gathers start while inter-node slices are still arriving.

    saa(w)         = AG_MP( sum_ESP( A2A_EP&ESP(w) ) )        forward of the combine side
    saa_adjoint(g) = A2A_EP&ESP( dump_ESP( own MP block of g ) )

Each is the other's backward, so the dispatch side of S2 (adjoint forward, SAA backward) overlaps in
backward too. Two different process groups carry the two halves, so gloo runs them on separate
threads (and NCCL on separate streams); nothing here depends on the backend.

Shapes: G = N_EP * N_ESP members of the fused group, E_l local experts, P = N_MP, c capacity slots of the
chunk, M model dim. Wire tensors are w_GE1cM (the 1 is this rank's MP block), results r_EPcM.
"""

from __future__ import annotations

import logging
from typing import List, Sequence

import torch
import torch.distributed as dist

from moe_plugins.core.comm import Recorder
from moe_plugins.core.engine import now_ns
from moe_plugins.core.groups import Group

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

logger = logging.getLogger("moe_plugins.parm")


def block_order(layout, mp: Group, esp: int) -> List[int]:
    """The order in which EP peer blocks are combined and all-gathered. It must be the same on every
    member of the MP group (the gathers are collectives on it), so it is computed from the MP group's
    first rank: blocks with fewest members off that rank's node first (their slices arrive first), then
    ring order from that rank's own block."""
    anchor = mp.ranks[0]
    fused = layout.group_of("ep_esp", anchor)
    ep, here, start = len(fused) // esp, layout.node_of(anchor), layout.coords(anchor)["ep"]

    def remote(b: int) -> int:
        return sum(1 for r in fused[b * esp:(b + 1) * esp] if layout.node_of(r) != here)

    return sorted(range(ep), key=lambda b: (remote(b), (b - start) % ep))


def saa_raw(w_GEXM: torch.Tensor, *, ep_esp: Group, mp: Group, esp: int, order: Sequence[int], rec: Recorder,
            phase: str, overlap: bool = True) -> torch.Tensor:
    """The forward of SAA, without autograd: w (G, E_l, 1, c, M) -> r (E_l*EP, P, c, M). ``overlap=False``
    waits for the whole all-to-all before the first all-gather (same transport, no overlap: the benchmark's
    control). A composite of point-to-point ops and async gathers: it holds the engine (an urgent op in
    flight) and records its two halves itself. A failed send, receive or gather (a peer gone) is a CommError
    naming the layer, the schedule and SAA, logged as an error."""
    with rec.engine.hold():
        try:
            return _saa_raw(w_GEXM, ep_esp=ep_esp, mp=mp, esp=esp, order=order, rec=rec, phase=phase,
                            overlap=overlap)
        except RuntimeError as exc:                  # gloo/NCCL: the group's timeout, or a connection lost
            error = rec.failed(f"SAA (all_to_all@{ep_esp.kind} + all_gather@{mp.kind}, {phase}) failed: {exc}")
            logger.error("moe_plugins: %s", error)
            raise error from exc


def _saa_raw(w_GEXM: torch.Tensor, *, ep_esp: Group, mp: Group, esp: int, order: Sequence[int], rec: Recorder,
             phase: str, overlap: bool) -> torch.Tensor:
    start_ns = now_ns()
    w = w_GEXM.contiguous()
    g_size, e_l = ep_esp.size, w.shape[1]
    ep, inner = g_size // esp, tuple(w.shape[3:])          # (c, M)
    got = torch.empty_like(w)
    recvs, sends = {}, []
    for g in range(g_size):
        if g == ep_esp.rank:
            got[g].copy_(w[g])
            continue
        peer = ep_esp.ranks[g]
        recvs[g] = dist.irecv(got[g], src=peer, group=ep_esp.pg)
        sends.append(dist.isend(w[g], dst=peer, group=ep_esp.pg))
    out = w.new_empty((ep, e_l, mp.size) + inner)
    gathers = []
    if not overlap:                    # a gloo p2p work must be waited exactly once: a second wait blocks
        for g in list(recvs):
            recvs.pop(g).wait()
        while sends:
            sends.pop().wait()
    for b in order:
        for g in range(b * esp, (b + 1) * esp):
            if g in recvs:
                recvs.pop(g).wait()
        block_ElcM = got[b * esp:(b + 1) * esp].sum(0).squeeze(1)          # Parm's local combine
        if mp.size == 1:
            out[b, :, 0] = block_ElcM
            continue
        buf = w.new_empty((mp.size,) + tuple(block_ElcM.shape))
        gathers.append((b, buf, _all_gather_flat(buf.view(-1), block_ElcM.contiguous().view(-1),
                                                 group=mp.pg, async_op=overlap)))
    for work in sends:
        work.wait()
    for b, buf, work in gathers:
        if work is not None:
            work.wait()
        out[b] = buf.transpose(0, 1)
    rec.record("all_to_all", ep_esp, w.numel(), w.element_size(), ep_esp.remote_peers * w.numel() / ep_esp.size,
               phase, start_ns=start_ns)
    if mp.size > 1:
        rec.record("all_gather", mp, out.numel(), out.element_size(), mp.remote_peers * out.numel() / mp.size, phase,
                   start_ns=start_ns)
    return out.view((ep * e_l, mp.size) + inner)


def saa_adjoint_raw(g_EPcM: torch.Tensor, *, ep_esp: Group, mp: Group, esp: int, rec: Recorder,
                    phase: str) -> torch.Tensor:
    """The adjoint of SAA, without autograd: r-shaped (E, P, c, M) -> w-shaped (G, E_l, 1, c, M)."""
    e, inner = g_EPcM.shape[0], tuple(g_EPcM.shape[2:])
    ep = ep_esp.size // esp
    own = g_EPcM[:, mp.rank].reshape((ep, 1, e // ep, 1) + inner)
    w = own.expand((ep, esp, e // ep, 1) + inner).reshape((ep_esp.size, e // ep, 1) + inner).contiguous()
    if ep_esp.size == 1:
        return w
    return rec.issue("all_to_all", ep_esp, w, phase)


class _SAAGather(torch.autograd.Function):
    """Forward SAA; backward its adjoint (the grad all-to-all of the combine side)."""

    @staticmethod
    def forward(ctx, w, ep_esp, mp, esp, order, rec):
        ctx.args = (ep_esp, mp, esp, rec)
        return saa_raw(w, ep_esp=ep_esp, mp=mp, esp=esp, order=order, rec=rec, phase="forward")

    @staticmethod
    def backward(ctx, g):
        ep_esp, mp, esp, rec = ctx.args
        return (saa_adjoint_raw(g, ep_esp=ep_esp, mp=mp, esp=esp, rec=rec, phase="backward"),
                None, None, None, None, None)


class _SAAScatter(torch.autograd.Function):
    """Forward the adjoint (the dispatch side of S2); backward SAA, so backward overlaps as well."""

    @staticmethod
    def forward(ctx, d, ep_esp, mp, esp, order, rec):
        ctx.args = (ep_esp, mp, esp, order, rec)
        return saa_adjoint_raw(d, ep_esp=ep_esp, mp=mp, esp=esp, rec=rec, phase="forward")

    @staticmethod
    def backward(ctx, g):
        ep_esp, mp, esp, order, rec = ctx.args
        return saa_raw(g, ep_esp=ep_esp, mp=mp, esp=esp, order=order, rec=rec, phase="backward"), \
            None, None, None, None, None


def saa_gather(w_GE1cM: torch.Tensor, *, ep_esp: Group, mp: Group, esp: int, order: Sequence[int],
               rec: Recorder) -> torch.Tensor:
    """Combine side of S2: w (G, E_l, 1, c, M) -> r (E, P, c, M), overlapped."""
    return _SAAGather.apply(w_GE1cM, ep_esp, mp, esp, tuple(order), rec)


def saa_scatter(d_EPcM: torch.Tensor, *, ep_esp: Group, mp: Group, esp: int, order: Sequence[int],
                rec: Recorder) -> torch.Tensor:
    """Dispatch side of S2: d (E, P, c, M) -> w (G, E_l, 1, c, M); its backward is the overlapped SAA."""
    return _SAAScatter.apply(d_EPcM, ep_esp, mp, esp, tuple(order), rec)
