"""Hecate's re-materialisation (hecate.txt §3.2, §5.4; ``"hecate": {"rematerialize": true}``): the expert copies
spAG materialised are freed after the layer's forward and gathered again right before its backward needs them.

How (one :class:`Rematerialiser` per layer call):

- **Forward.** The layer's expert step runs inside :meth:`Rematerialiser.hooks`, PyTorch's
  ``saved_tensors_hooks``. Autograd saves the copies' weights for the backward of the expert GEMMs (views of the
  copy tensor ``w_copies_CF``); the pack hook replaces each of those by its view geometry (size, stride,
  offset) and passes every other saved tensor (activations, token rows) through, detached (autograd re-attaches
  it on unpack; the tensor itself would make a saved output hold its own node). Nothing else holds the copy
  tensor past the expert step, so it is freed there.
- **Backward.** The first unpack of a copy view takes the copies re-gathered early on the engine's pipeline lane
  (:meth:`Rematerialiser.start_early`, started by a gradient hook: moe_plugins/hecate/regather.py) or, if none
  was started, re-runs spAG now for the same placement from the same owners' shards
  (:func:`~moe_plugins.hecate.sparse.spag_raw`, no autograd; ledger op ``spag`` in phase ``backward``), and
  serves every view from that one tensor; the tensor is dropped once all views saved in forward were
  unpacked (autograd frees the views after their GEMM's backward). A second backward (``retain_graph``)
  re-gathers again.
- **Gradients** are untouched: the graph still runs from the copies' views to ``W_copies = spAG(W_owned)``,
  whose backward is spRS into the owners (each owner parameter gets its gradient once, through autograd).

What is kept for the re-gather is the plan (placement, shards, group) and a way to read the owned experts
again (:class:`OwnedRead`): a host's :class:`RereadableWeights` (DeepSpeed's stacked experts: re-stacked from
its own parameters, nothing held), else the owned tensors themselves, detached (the core layer's parameters:
nothing extra). The owned tensors' in-place version counters are checked at the re-gather, so a change between
forward and backward (which would make the re-gathered copies differ) raises instead of computing silently.

The saved-tensor hooks apply to the expert step only; outer hooks (activation offloading) do not see the
tensors saved inside it. Letters: C experts copied on this rank, F elements per expert.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from moe_plugins.core.experts import ExpertWeights


@dataclass(frozen=True)
class RereadableWeights(ExpertWeights):
    """ExpertWeights a host can build again on demand: ``reread()`` returns the same weights (no autograd) from
    its own parameters ``sources``, so a re-gather need not keep the built tensors alive."""

    reread: Optional[Callable[[], ExpertWeights]] = None
    sources: Tuple[torch.Tensor, ...] = ()


def stacked_ffn(fc1s: Sequence[torch.nn.Module], fc2s: Sequence[torch.nn.Module],
                like: Optional[Tuple[torch.nn.Module, torch.nn.Module]] = None) -> RereadableWeights:
    """A host's local FFN experts (their first and second linear modules, each with ``weight`` (out, in) and a
    ``bias`` or None) as ExpertWeights, built from the parameters themselves (each gets its gradient once through
    autograd) and stacked again without autograd by ``reread()``. A missing bias is a zero tensor. No experts
    (a rank holding none of a layer's, Hecate's pooled slots): empty stacks shaped as ``like``'s pair, leaves that
    require a gradient (so that the spAG's backward, a collective, runs on this rank too; no parameter gets one)."""
    if not fc1s:
        if like is None:
            raise ValueError("stacked_ffn: no experts, and no module pair to shape the empty stacks like")
        empty = _restacked([like[0]], [like[1]])
        w = ExpertWeights(*(t[:0].clone().requires_grad_(torch.is_grad_enabled())
                            for t in (empty.w1_EMH, empty.b1_EH, empty.w2_EHM, empty.b2_EM)))
        return RereadableWeights(w.w1_EMH, w.b1_EH, w.w2_EHM, w.b2_EM, reread=lambda: w, sources=())
    w = _stacked(fc1s, fc2s)
    sources = tuple(t for fc in list(fc1s) + list(fc2s) for t in (fc.weight, getattr(fc, "bias", None))
                    if t is not None)
    return RereadableWeights(w.w1_EMH, w.b1_EH, w.w2_EHM, w.b2_EM, reread=partial(_restacked, fc1s, fc2s),
                             sources=sources)


def _stacked(fc1s: Sequence[torch.nn.Module], fc2s: Sequence[torch.nn.Module]) -> ExpertWeights:
    return ExpertWeights(w1_EMH=torch.stack([fc.weight.t() for fc in fc1s]),
                         b1_EH=torch.stack([_bias(fc) for fc in fc1s]),
                         w2_EHM=torch.stack([fc.weight.t() for fc in fc2s]),
                         b2_EM=torch.stack([_bias(fc) for fc in fc2s]))


def _bias(fc: torch.nn.Module) -> torch.Tensor:
    bias = getattr(fc, "bias", None)
    return bias if bias is not None else fc.weight.new_zeros(fc.weight.shape[0])


def _restacked(fc1s: Sequence[torch.nn.Module], fc2s: Sequence[torch.nn.Module]) -> ExpertWeights:
    with torch.no_grad():
        return _stacked(fc1s, fc2s)


def _tensors(w: ExpertWeights) -> Tuple[torch.Tensor, ...]:
    return (w.w1_EMH, w.b1_EH, w.w2_EHM, w.b2_EM)


class OwnedRead:
    """This rank's owned experts as a re-gather reads them in backward (module docstring), with the in-place
    versions of what it reads, taken at forward."""

    def __init__(self, w: ExpertWeights) -> None:
        if isinstance(w, RereadableWeights) and w.reread is not None:
            self._read, watched = w.reread, tuple(w.sources)
        else:
            held = ExpertWeights(*(t.detach() for t in _tensors(w)))      # aliases: no copy, same versions
            self._read, watched = (lambda: held), _tensors(held)
        self._watched = tuple(t.detach() for t in watched)
        self._versions = tuple(t._version for t in self._watched)

    def read(self) -> ExpertWeights:
        now = tuple(t._version for t in self._watched)
        if now != self._versions:
            raise RuntimeError(f"Hecate rematerialize: this rank's owned expert tensors were modified in place between "
                               f"the layer's forward and its backward (versions {list(self._versions)} -> {list(now)}); "
                               "the re-gathered copies would differ from the forward's. Step the optimizer after "
                               "backward, or set rematerialize to false")
        return self._read()


@dataclass(frozen=True)
class _CopyView:
    """What autograd keeps instead of a view of the copies: where it lies in the copy tensor."""

    size: torch.Size
    stride: Tuple[int, ...]
    offset: int


class Rematerialiser:
    """One layer call's copies, freed after its expert step and re-gathered in backward (a fresh contiguous
    (C, F) tensor equal to ``w_copies_CF``): by ``early()`` (a handle to one computed elsewhere, which told
    ``on_gather`` itself) once :meth:`start_early` is called, else by ``regather()`` at the first unpack, then
    told to ``on_gather(w)`` (the memory ledger). ``gathers``: re-gathers so far; ``early_gathers``: how many of
    them were started early; ``counts``: what the caller counts them by."""

    def __init__(self, w_copies_CF: torch.Tensor, regather: Callable[[], torch.Tensor],
                 on_gather: Callable[[torch.Tensor], Any], early: Optional[Callable[[], Any]] = None,
                 counts: Optional[Counter] = None) -> None:
        if w_copies_CF.dim() != 2 or not w_copies_CF.is_contiguous() or w_copies_CF.storage_offset() != 0:
            raise RuntimeError(f"Hecate rematerialize needs the copies as one contiguous (C, F) tensor at offset 0; "
                               f"got shape {tuple(w_copies_CF.shape)}, offset {w_copies_CF.storage_offset()}")
        self._ptr = w_copies_CF.untyped_storage().data_ptr()
        self._shape = tuple(w_copies_CF.shape)
        self._regather, self._on_gather = regather, on_gather
        self._lock = threading.Lock()
        self._packed = self._left = 0
        self._cache: Optional[torch.Tensor] = None
        self._early, self._handle = early, None
        self.counts = Counter() if counts is None else counts     # re-gathers by what started them (regather.py)
        self.gathers = self.early_gathers = 0

    def start_early(self) -> bool:
        """Start the re-gather now (the backward has not needed it yet); False where there is no early way,
        it started already, this backward has served the copies, or nothing was saved."""
        with self._lock:
            if self._early is None or self._handle is not None or self.gathers or not self._packed:
                return False
            self._handle = self._early()
            return True

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context the expert step runs in (forward only)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() != self._ptr:
            return t.detach()     # not ``t``: an op's saved output would hold its own grad_fn (a reference cycle)
        self._packed += 1
        return _CopyView(t.size(), t.stride(), t.storage_offset())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _CopyView):
            return packed
        with self._lock:
            if self._cache is None:
                handle, self._handle = self._handle, None
                w_CF = self._regather() if handle is None else handle.wait()
                if tuple(w_CF.shape) != self._shape or not w_CF.is_contiguous() or w_CF.storage_offset():
                    raise RuntimeError(f"Hecate rematerialize: the re-gathered copies have shape {tuple(w_CF.shape)}, "
                                       f"offset {w_CF.storage_offset()}, not the forward's contiguous {self._shape}")
                if handle is None:
                    self._on_gather(w_CF)
                self._cache, self._left = w_CF, self._packed
                self.gathers += 1
                self.early_gathers += handle is not None
            view = self._cache.as_strided(packed.size, packed.stride, packed.offset)
            self._left -= 1
            if self._left == 0:
                self._cache = None          # every saved view served: the tensor lives only in autograd's hands
        return view
