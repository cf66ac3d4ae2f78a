"""Expert replicas for Lina's inference placement: which rank holds which expert's weights, and moving them.

Every EP rank (device ``d``) holds its own experts (its *home* experts, ``d * E_l .. (d + 1) * E_l - 1``, as the
host placed them). A placement may put other experts on ``d`` too: their weights come from their home rank, as
one flat vector per expert (parameters and buffers in the expert module's order), by one uneven
``all_to_all_single`` over the EP group, and stay *resident* on ``d`` while the placements keep them there:

- a new placement moves only the (expert, device) pairs it adds; pairs it drops are freed, so a device never
  holds more than ``max_experts_per_device`` experts' weights;
- every rank applies the same placements in the same order, so every rank knows what every other holds (no
  request messages): each rank computes the same send and receive sizes, and no collective runs when nothing
  moves;
- a home rank's weights are identified by a fingerprint (each tensor's storage address and in-place version
  counter), all-gathered with the gate's counts every scheduled batch: when a home rank's fingerprint changes
  (an optimizer step, ``load_state_dict``, a replaced ``.data``), every replica of its experts is dropped and
  moved again. Writes that bypass the version counter (through ``.data`` aliases or a foreign flat buffer) are
  not seen: call :meth:`ExpertStore.clear` (``moe_plugins.lina.clear_inference_replicas``) after such a change.
  A forward in training mode clears the store too.

With ``keep_all`` (the section's ``"expert_weights": "all"``, the default: the paper's §6.2, "each device saves
the weights of all experts in their host DRAM"), the first placement that needs a replica anywhere all-gathers
every expert's weights once over the EP group into a host-memory copy on every rank, and replicas are then
swapped in from it (a host-to-device copy on a GPU, the copy itself on a CPU): no weights cross the network
per placement. A changed fingerprint drops the copy with the replicas; the next move gathers it again.

A replica computes with the home module's code on the moved tensors (``torch.func.functional_call`` on one
copy of the expert module kept on the meta device), a home expert with the module itself.

Shapes: E experts, E_l local experts, N EP ranks, W elements of one expert's weights, n rows.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.func import functional_call

from moe_plugins.core.comm import Recorder
from moe_plugins.core.groups import Group
from moe_plugins.core.ragged import uneven_all_to_all
from moe_plugins.lina.placement import Placement


def expert_tensors(expert: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The tensors that define an expert: its parameters, then its buffers, by name."""
    return list(expert.named_parameters()) + [(n, b) for n, b in expert.named_buffers() if b is not None]


def store_problems(experts: Sequence[torch.nn.Module]) -> List[str]:
    """Why these local experts cannot be replicated (empty when they can): one dtype, the same names and shapes."""
    if not experts:
        return ["the layer has no local experts"]
    first = [(n, tuple(t.shape), t.dtype) for n, t in expert_tensors(experts[0])]
    problems = []
    dtypes = sorted({str(d) for _, _, d in first})
    if len(dtypes) != 1:
        problems.append(f"lina inference moves an expert's tensors as one vector: its parameters and buffers must "
                        f"share one dtype (found {', '.join(dtypes)})")
    if any([(n, tuple(t.shape), t.dtype) for n, t in expert_tensors(e)] != first for e in experts[1:]):
        problems.append("lina inference needs every local expert to have the same parameters and buffers (names, "
                        "shapes, dtypes)")
    return problems


def fingerprint(experts: Sequence[torch.nn.Module]) -> int:
    """A 62-bit number that changes when a local expert's tensor is replaced or modified in place."""
    key = tuple((t.data_ptr(), t._version) for e in experts for _, t in expert_tensors(e))
    return hash(key) & ((1 << 62) - 1)


class ExpertStore:
    """One layer's experts on this EP rank: the home modules and the resident replicas (module docstring)."""

    def __init__(self, experts: Sequence[torch.nn.Module], group: Group, rec: Recorder, num_experts: int, *,
                 keep_all: bool = False):
        problems = store_problems(experts)
        if problems:
            raise ValueError("; ".join(problems))
        self.local, self.group, self.rec, self.num_experts = list(experts), group, rec, num_experts
        self.e_l = len(self.local)
        spec = expert_tensors(self.local[0])
        self.names = [n for n, _ in spec]
        self.shapes = [tuple(t.shape) for _, t in spec]
        self.numel = sum(t.numel() for _, t in spec)
        self.template = copy.deepcopy(self.local[0]).to("meta")
        self.held: List[Set[int]] = [set() for _ in range(group.size)]     # replicas each device holds
        self.replicas: Dict[int, Dict[str, torch.Tensor]] = {}            # this device's: expert -> tensors
        self.fingerprints: Optional[Tuple[int, ...]] = None
        self.moved = 0                                                    # (expert, device) pairs moved so far
        self.keep_all = keep_all
        self.host_EW: Optional[torch.Tensor] = None                       # keep_all: every expert, host memory
        self.gathers = 0                                                  # keep_all: host copies gathered

    def home(self, expert: int) -> int:
        return expert // self.e_l

    def home_experts(self, device: int) -> Set[int]:
        return set(range(device * self.e_l, (device + 1) * self.e_l))

    def clear(self) -> None:
        """Forget every replica (on every device: all ranks clear together, or the knowledge diverges)."""
        self.held = [set() for _ in range(self.group.size)]
        self.replicas.clear()
        self.fingerprints = None
        self.host_EW = None

    def fingerprint(self) -> int:
        return fingerprint(self.local)

    def check_fingerprints(self, fingerprints: Sequence[int]) -> List[int]:
        """Drop every replica of the home ranks whose weights changed since the replicas were moved (all ranks
        see the same all-gathered fingerprints). Returns those ranks."""
        new = tuple(int(f) for f in fingerprints)
        changed = [] if self.fingerprints is None else [d for d, (a, b) in enumerate(zip(self.fingerprints, new))
                                                         if a != b]
        self.fingerprints = new
        if changed:
            self.host_EW = None                       # every rank sees the same change: all gather again
        for device in changed:
            stale = self.home_experts(device)
            for held in self.held:
                held -= stale
            for expert in stale:
                self.replicas.pop(expert, None)
        return changed

    def move(self, placement: Placement) -> int:
        """Hold exactly the replicas ``placement`` puts on each device: move the missing ones from their home
        ranks (one uneven all-to-all, only when something moves anywhere) and free the others. Returns the
        (expert, device) pairs moved."""
        me = self.group.rank
        need = [set(placement.experts_on(d)) - self.home_experts(d) for d in range(self.group.size)]
        fetch = [sorted(need[d] - self.held[d]) for d in range(self.group.size)]
        count = sum(len(f) for f in fetch)
        if count and self.keep_all:
            host_EW = self._host_copy()               # a collective only when the copy is missing, on every rank
            device = self._empty().device
            for expert in fetch[me]:
                self.replicas[expert] = self._views(host_EW[expert].to(device))
        elif count:
            send = [[e for e in fetch[d] if self.home(e) == me] for d in range(self.group.size)]
            flats = [self._flat(e) for d in range(self.group.size) for e in send[d]]
            x_W = torch.cat(flats) if flats else self._empty()
            recv = [[e for e in fetch[me] if self.home(e) == src] for src in range(self.group.size)]
            got_W = uneven_all_to_all(x_W, [len(s) * self.numel for s in send], [len(r) * self.numel for r in recv],
                                      self.group, self.rec)
            received = [e for src in range(self.group.size) for e in recv[src]]
            for i, expert in enumerate(received):
                self.replicas[expert] = self._views(got_W[i * self.numel:(i + 1) * self.numel])
        for expert in list(self.replicas):
            if expert not in need[me]:
                del self.replicas[expert]
        self.held = need
        self.moved += count
        return count

    def compute(self, expert: int, x_nM: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` on rows held here (a home expert or a resident replica), as the stock layer calls
        DeepSpeed's experts: one (1, 1, n, M) block, the first output of a tuple."""
        x = x_nM.view(1, 1, *x_nM.shape)
        if self.home(expert) == self.group.rank:
            out = self.local[expert - self.group.rank * self.e_l](x)
        elif expert in self.replicas:
            out = functional_call(self.template, self.replicas[expert], (x,), strict=True)
        else:
            raise RuntimeError(f"expert {expert} is neither local nor resident on EP rank {self.group.rank}: the "
                               "placement and the replicas disagree")
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(x_nM.shape[0], -1)

    def _host_copy(self) -> torch.Tensor:
        """Every expert's weights, (E, W), in host memory: this rank's home experts all-gathered over the EP group
        (rank r's block holds experts r E_l .. (r + 1) E_l - 1, so row e is expert e). Gathered when missing."""
        if self.host_EW is None:
            mine_W = torch.cat([self._flat(e) for e in sorted(self.home_experts(self.group.rank))])
            flat = mine_W if self.group.size == 1 else self.rec.issue("all_gather", self.group, mine_W, "forward")
            self.host_EW = flat.view(self.num_experts, self.numel).to("cpu")
            self.gathers += 1
        return self.host_EW

    def _flat(self, expert: int) -> torch.Tensor:
        module = self.local[expert - self.group.rank * self.e_l]
        return torch.cat([t.detach().reshape(-1) for _, t in expert_tensors(module)])

    def _empty(self) -> torch.Tensor:
        first = expert_tensors(self.local[0])[0][1]
        return first.new_empty(0)

    def _views(self, flat_W: torch.Tensor) -> Dict[str, torch.Tensor]:
        views, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = 1
            for s in shape:
                n *= s
            views[name] = flat_W[start:start + n].view(shape)
            start += n
        return views
