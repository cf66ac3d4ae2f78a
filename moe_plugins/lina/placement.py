"""Lina's two-phase expert placement for inference (§5.2 "Two-phase scheduling", §6.2), as pure functions.

Every rank calls these with the same inputs (an all-gathered estimate, summed in rank order, or the gate's
all-gathered counts) and gets the same placement: nothing here is random, every tie is broken by a rule below,
and no process group is touched.

**Phase one** (:func:`plan_placement`), from the estimated tokens per expert ``loads_E`` on ``N`` devices
(EP ranks), at most ``m = max_experts_per_device`` experts per device (§7.1: 4):

1. Shares. ``s_e = N * load_e / sum(load)``: the devices expert ``e`` is worth (eq. 1). All loads zero: every
   ``s_e = 0``.
2. Popular experts (``s_e >= 1``) get ``floor(s_e)`` devices of their own, one replica on each.
3. Room. The other ``U`` experts need ``ceil(U / m)`` of the ``K`` devices left. While they do not fit, take a
   replica back from the popular expert whose per-replica share after that, ``s_e / (r_e - 1)``, is smallest
   (ties: the lower id); when every popular expert has one replica, the least popular (ties: the higher id)
   joins the others. Each such step is counted in ``Placement.trimmed``.
4. Packing (first-fit decreasing). The other experts with ``s_e > 0``, by share descending (ties: lower id),
   each go to the first device (lowest index) where the summed share stays <= 1 and fewer than ``m`` experts
   sit, or else to a new device while fewer than ``K`` are open, or else (overfull) to the open device with
   room and the smallest summed share (ties: fewer experts, lower device).
5. Devices for experts without an estimate (``s_e = 0``): only as many new ones as the free slots of the packed
   devices lack.
6. Left-over devices go one by one to the expert with the largest share per replica ``s_e / r_e`` (ties: lower
   id). Only popular experts can win them (the sum of shares is ``N``), so ``floor(s_e) <= r_e <= ceil(s_e)``
   for every popular expert when nothing was trimmed.
7. Experts without an estimate go, in id order, to the packing/reserved device with the fewest experts (ties:
   smaller summed share, lower device); when no expert has an estimate, every device is such a device. The
   paper puts them on free devices "if any"; here free devices first add replicas of the busiest experts
   (step 6), whose tokens are the estimated ones.

Devices are numbered in that order: popular replicas (experts by share descending, ties lower id), packed,
reserved, then step 6's extra replicas.

**Splits** (:func:`split_tokens`): a replicated expert's tokens split evenly over its replicas. With
``C_e`` tokens in all (``counts_RE`` summed over source ranks) and ``n`` replicas on devices ``d_0 < ... <
d_{n-1}``, replica ``j`` gets ``C_e // n`` tokens, one more for ``j < C_e % n``. Sources fill the replicas in rank
order, each source's tokens of ``e`` in their order: the first go to the lowest device still short. The send
buffer of a source is ordered by destination device, then expert id.

**Phase two** (:func:`phase_two`): after the gate, re-plan from the actual counts only when the ``top`` most
loaded experts (ties: lower id) by the actual counts differ, as a set, from those of the estimate (§5.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from moe_plugins.lina.popularity import DEFAULT_TOP, top_matches, top_set

DEFAULT_MAX_EXPERTS_PER_DEVICE = 4     # §7.1
FIT_EPS = 1e-9


@dataclass(frozen=True, kw_only=True)
class Placement:
    num_devices: int
    max_experts_per_device: int
    loads: Tuple[float, ...]                      # the loads planned from (estimate or actual), per expert
    shares: Tuple[float, ...]                     # s_e, devices each expert is worth
    assignments: Tuple[Tuple[int, int], ...]      # (expert, device), sorted
    trimmed: int                                  # replicas taken back / experts demoted in step 3

    @property
    def num_experts(self) -> int:
        return len(self.loads)

    def replicas(self, expert: int) -> Tuple[int, ...]:
        """The devices holding ``expert``, ascending."""
        return tuple(d for e, d in self.assignments if e == expert)

    def experts_on(self, device: int) -> Tuple[int, ...]:
        return tuple(e for e, d in self.assignments if d == device)

    @property
    def replica_counts(self) -> Tuple[int, ...]:
        counts = [0] * self.num_experts
        for e, _ in self.assignments:
            counts[e] += 1
        return tuple(counts)

    def device_shares(self) -> Tuple[float, ...]:
        """Summed share per device, a replicated expert's share split evenly over its replicas."""
        r = self.replica_counts
        out = [0.0] * self.num_devices
        for e, d in self.assignments:
            out[d] += self.shares[e] / r[e]
        return tuple(out)


def placement_problems(loads_E: Sequence[float], num_devices: int, max_experts_per_device: int) -> List[str]:
    problems = []
    if not _is_int(num_devices, 1):
        problems.append(f"num_devices ({num_devices!r}) must be an integer >= 1")
    if not _is_int(max_experts_per_device, 1):
        problems.append(f"max_experts_per_device ({max_experts_per_device!r}) must be an integer >= 1")
    if len(loads_E) < 1:
        problems.append("loads must name at least one expert")
    bad = [(e, x) for e, x in enumerate(loads_E)
           if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0]
    if bad:
        problems.append("loads must be finite numbers >= 0; got " + ", ".join(f"loads[{e}] = {x!r}" for e, x in bad))
    if not problems and len(loads_E) > num_devices * max_experts_per_device:
        problems.append(f"{len(loads_E)} experts do not fit on num_devices ({num_devices}) x "
                        f"max_experts_per_device ({max_experts_per_device})")
    return problems


def plan_placement(loads_E: Sequence[float], num_devices: int, *,
                   max_experts_per_device: int = DEFAULT_MAX_EXPERTS_PER_DEVICE) -> Placement:
    """Phase one: replicate popular experts in proportion to their load, pack the rest (module docstring)."""
    problems = placement_problems(loads_E, num_devices, max_experts_per_device)
    if problems:
        raise ValueError("lina placement: " + "; ".join(problems))
    n_dev, cap, n_exp = num_devices, max_experts_per_device, len(loads_E)
    total = float(sum(loads_E))
    shares = tuple(n_dev * x / total if total > 0 else 0.0 for x in loads_E)
    # 2. popular experts: floor(share) devices each
    replicas: Dict[int, int] = {e: int(math.floor(s)) for e, s in enumerate(shares) if s >= 1.0}
    # 3. room for the others
    trimmed = 0
    while n_dev - sum(replicas.values()) < -(-(n_exp - len(replicas)) // cap):
        multi = [e for e, r in replicas.items() if r >= 2]
        if multi:
            e = min(multi, key=lambda e: (shares[e] / (replicas[e] - 1), e))
            replicas[e] -= 1
        else:
            del replicas[min(replicas, key=lambda e: (shares[e], -e))]
        trimmed += 1
    free = n_dev - sum(replicas.values())
    # 4. first-fit decreasing of the other experts with a share
    others = sorted((e for e in range(n_exp) if e not in replicas), key=lambda e: (-shares[e], e))
    bins: List[List[int]] = []
    bin_share: List[float] = []
    for e in (e for e in others if shares[e] > 0):
        fit = next((b for b in range(len(bins))
                    if len(bins[b]) < cap and bin_share[b] + shares[e] <= 1.0 + FIT_EPS), None)
        if fit is None and len(bins) < free:
            bins.append([])
            bin_share.append(0.0)
            fit = len(bins) - 1
        if fit is None:
            fit = min((b for b in range(len(bins)) if len(bins[b]) < cap),
                      key=lambda b: (bin_share[b], len(bins[b]), b))
        bins[fit].append(e)
        bin_share[fit] += shares[e]
    # 5. devices for the experts without an estimate
    unknown = [e for e in others if shares[e] <= 0]
    slots = sum(cap - len(b) for b in bins)
    for _ in range(-(-max(0, len(unknown) - slots) // cap)):
        bins.append([])
        bin_share.append(0.0)
    # 6. left-over devices: extra replicas of the experts with the largest share per replica
    extra: List[int] = []
    counts = {e: replicas.get(e, 0) + (1 if e not in replicas else 0) for e in range(n_exp)}
    for _ in range(free - len(bins)):
        loaded = [e for e in range(n_exp) if shares[e] > 0]
        if not loaded:                   # nothing estimated at all: spread the experts over every device
            bins.extend([] for _ in range(free - len(bins)))
            bin_share.extend(0.0 for _ in range(free - len(bin_share)))
            break
        e = min(loaded, key=lambda e: (-shares[e] / counts[e], e))
        counts[e] += 1
        extra.append(e)
    # 7. experts without an estimate onto the packing devices with the fewest experts
    for e in unknown:
        b = min((b for b in range(len(bins)) if len(bins[b]) < cap), key=lambda b: (len(bins[b]), bin_share[b], b))
        bins[b].append(e)
    # number the devices
    assignments: List[Tuple[int, int]] = []
    device = 0
    for e in sorted(replicas, key=lambda e: (-shares[e], e)):
        for _ in range(replicas[e]):
            assignments.append((e, device))
            device += 1
    for b in bins:
        assignments.extend((e, device) for e in b)
        device += 1
    for e in extra:
        assignments.append((e, device))
        device += 1
    return Placement(num_devices=n_dev, max_experts_per_device=cap, loads=tuple(float(x) for x in loads_E),
                     shares=shares, assignments=tuple(sorted(assignments)), trimmed=trimmed)


@dataclass(frozen=True, kw_only=True)
class Splits:
    """How each source rank's tokens go to the devices: ``pieces[r]`` lists (device, expert, tokens) in send
    order; ``send_RD[r][d]`` are the all-to-all split sizes (tokens); ``recv_DE[d][e]`` what each replica gets."""
    pieces: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    send_RD: Tuple[Tuple[int, ...], ...]
    recv_DE: Tuple[Tuple[int, ...], ...]


def split_tokens(placement: Placement, counts_RE: Sequence[Sequence[int]]) -> Splits:
    """The uneven all-to-all of a placement: each expert's tokens spread evenly over its replicas (module
    docstring). ``counts_RE[r][e]``: tokens of expert ``e`` on source rank ``r``, as the gate routed them."""
    n_exp = placement.num_experts
    for r, row in enumerate(counts_RE):
        if len(row) != n_exp or not all(_is_int(c, 0) for c in row):
            raise ValueError(f"counts[{r}] ({list(row)!r}) must be {n_exp} token counts >= 0, one per expert")
    if len(counts_RE) < 1:
        raise ValueError("counts must have one row per source rank (at least one)")
    recv = [[0] * n_exp for _ in range(placement.num_devices)]
    pieces: List[List[Tuple[int, int, int]]] = [[] for _ in counts_RE]
    for e in range(n_exp):
        devices = placement.replicas(e)
        total = sum(row[e] for row in counts_RE)
        quota = [total // len(devices) + (1 if j < total % len(devices) else 0) for j in range(len(devices))]
        j = 0
        for r, row in enumerate(counts_RE):
            left = row[e]
            while left > 0:
                while quota[j] == 0:
                    j += 1
                take = min(left, quota[j])
                pieces[r].append((devices[j], e, take))
                recv[devices[j]][e] += take
                quota[j] -= take
                left -= take
    send = [[0] * placement.num_devices for _ in counts_RE]
    for r, rows in enumerate(pieces):
        rows.sort()
        for d, _, n in rows:
            send[r][d] += n
    return Splits(pieces=tuple(tuple(p) for p in pieces), send_RD=tuple(tuple(s) for s in send),
                  recv_DE=tuple(tuple(x) for x in recv))


@dataclass(frozen=True, kw_only=True)
class PhaseTwo:
    reallocate: bool
    estimated_top: frozenset
    actual_top: frozenset
    placement: Placement            # phase one's when it stands, else the one planned from the actual counts


def phase_two(phase_one: Placement, actual_counts_E: Sequence[int], *, top: int = DEFAULT_TOP) -> PhaseTwo:
    """Keep phase one's placement when the actual top set equals the estimated one (:func:`top_matches`), else
    re-plan from the actual counts with the same rule."""
    if len(actual_counts_E) != phase_one.num_experts or not all(_is_int(c, 0) for c in actual_counts_E):
        raise ValueError(f"actual counts ({list(actual_counts_E)!r}) must be {phase_one.num_experts} token counts "
                         f">= 0, one per expert")
    estimated, actual = top_set(phase_one.loads, top), top_set(actual_counts_E, top)
    if top_matches(phase_one.loads, actual_counts_E, top):
        return PhaseTwo(reallocate=False, estimated_top=estimated, actual_top=actual, placement=phase_one)
    again = plan_placement(actual_counts_E, phase_one.num_devices,
                           max_experts_per_device=phase_one.max_experts_per_device)
    return PhaseTwo(reallocate=True, estimated_top=estimated, actual_top=actual, placement=again)


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def describe(placement: Placement) -> str:
    """One line per device: its experts and summed share."""
    shares = placement.device_shares()
    return "\n".join(f"device {d}: experts {list(placement.experts_on(d))} share {shares[d]:.2f}"
                     for d in range(placement.num_devices))
