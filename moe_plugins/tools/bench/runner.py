"""The rank side of ``moe-plugins bench``: build the rows of each case and time them side by side.

For every case the rows are built once, from the same weights and tokens; then for every link rate:

1. round 0 (untimed): each row runs one forward+backward with its traffic meter on, between barriers,
   giving its inter-node bytes per rank (model) and, on an emulated cluster, the bytes that left each
   node's NIC (wire); its output is compared with the first row's (max |difference| over all ranks);
2. rounds 1 .. warmup-1: untimed warm-up;
3. ``iters`` timed rounds. The rows are interleaved: round i runs every row once, in an order shuffled
   from (seed, i), the same on every rank. Slow drifts of a shared machine then hit every row alike, and
   no row always follows the same row (a fixed rotation did that: what a row leaves behind on the link
   and in the caches fell on the same neighbour every round). Each measurement is barrier, time the
   forward+backward, max-reduce over ranks: the slowest rank's time. The row's traffic meter is on in every
   timed step too, so that its all-to-all intervals give each rank's exposed all-to-all time (the all-to-all
   time its compute hid not: :mod:`.lancet_exposure`).

Rank 0 returns raw measurements; :mod:`.report` turns them into statistics and ratios.
"""

from __future__ import annotations

import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.costmodel import CostProfile
from moe_plugins.core.groups import MoEProcessGroups, build_process_groups, destroy_process_groups
from moe_plugins.core.layout import ParallelLayout
from moe_plugins.plugins import default_registry
from moe_plugins.tools.bench.cluster import Cluster, set_rate
from moe_plugins.tools.bench.matrix import BenchPlan, CaseConfig, RowSpec
from moe_plugins.tools.bench.profiles import (gemm_spec_for, link_spec_for, measure_profile, merge_profiles, profile_measurements,
                       profile_summary)
from moe_plugins.core.engine import CommEngine, build_engine
from moe_plugins.tools.bench.case import CaseData, Row, close_rows, fwd_bwd, make_case_data
from moe_plugins.tools.bench.lancet_exposure import begin_exposure, step_exposure
from moe_plugins.tools.bench.ranks import max_over_ranks
from moe_plugins.tools.bench.rows import HECATE, LANCET, LANE, PROFILE, STOCK_ROWS, build_row, needs_profile
from moe_plugins.tools.bench.traffic import nic_tx_bytes


@dataclass(frozen=True, kw_only=True)
class RankJob:
    plan: BenchPlan
    cluster: Optional[Cluster]          # None: loopback run, rates cannot be applied
    progress_path: Optional[str] = None
    timeline_prefix: Optional[str] = None   # each rank writes its engine ops to <prefix>.rank<r>.json


def _emit(job: RankJob, event: Dict[str, Any]) -> None:
    if job.progress_path and dist.get_rank() == 0:
        with open(job.progress_path, "a") as f:
            f.write(json.dumps(event) + "\n")


def _pipelines(spec: RowSpec) -> bool:
    """Whether a row needs the pipeline lane: a plugin row's ``@r=`` other than 1 (stock rows never), every
    ``lancet`` row, and a ``hecate`` row with ``remat=1`` re-gathering early. A bad degree needs no lane: building
    that row fails, and the row is skipped with the reason."""
    if spec.name == LANCET:           # its backward exchanges fly on the lane while the dW runs
        return True
    if spec.name == HECATE and spec.option("remat", "0") == "1" and spec.option("regather", "early") == "early":
        return True
    if spec.name in STOCK_ROWS:       # deepspeed@plugin=...,r=N: the adapter builds its own lane, as for a user
        return False
    try:
        return spec.option("r") is not None and default_registry().needs_lane(spec.option("r"))
    except ValueError:
        return False


def _layout_key(case: CaseConfig) -> Tuple[int, int, int]:
    return case.mp, case.ep, case.esp


def build_rows(specs: Sequence[RowSpec], data: CaseData) -> Tuple[List[Row], Dict[str, str]]:
    """Build every row; a row that fails on any rank is skipped on all ranks, with the reason."""
    rows, skipped = [], {}
    for spec in specs:
        row, error = None, None
        try:
            row = build_row(spec, data)
        except Exception as exc:  # reported in the results as the row's skip reason
            error = f"{type(exc).__name__}: {exc}"
        error = _agree(error)
        if error is not None:
            skipped[spec.label] = error
        else:
            rows.append(row)
    return rows, skipped


def round_order(rows: List[Row], seed: int, round_index: int) -> List[Row]:
    """The rows in round ``round_index``'s order: a permutation drawn from (seed, round), so every rank
    runs the rows in the same order without talking (pure)."""
    return random.Random(f"{seed}:{round_index}").sample(rows, len(rows))


def _agree(error: Optional[str]) -> Optional[str]:
    """Collective: the first error any rank reports (None when every rank succeeded)."""
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _difference(y: torch.Tensor, part: Optional[slice], ref: torch.Tensor, ref_part: Optional[slice]) -> float:
    """max |y - ref| on the tokens both cover (a sequence-parallel row holds a slice of them)."""
    if part == ref_part:
        a, b = y, ref
    elif ref_part is None:
        a, b = y, ref[part]
    elif part is None:
        a, b = y[ref_part], ref
    else:
        return float("nan")
    return float((a - b).abs().max()) if a.numel() else 0.0


def _metered_step(row: Row, data: CaseData, ifname: Optional[str], round_index: int = 0):
    """One step of ``row`` between barriers with its traffic meter on: (its output or the error's text, model bytes,
    NIC bytes or None)."""
    dist.barrier()
    tx0 = nic_tx_bytes(ifname)
    row.meter.start()
    error = None
    try:
        out = fwd_bwd(row, data, round_index)
    except Exception as exc:  # reported as the row's skip reason
        error = f"failed in its first step: {type(exc).__name__}: {exc}"
    finally:
        model_bytes = row.meter.stop()
    error = _agree(error)
    if error is not None:
        return error, model_bytes, None
    dist.barrier()
    tx1 = nic_tx_bytes(ifname)
    return out, model_bytes, None if tx0 is None or tx1 is None else tx1 - tx0


def _traffic_round(rows: List[Row], data: CaseData, ifname: Optional[str],
                   failed: Dict[str, str]) -> Dict[str, Dict[str, Any]]:
    """First step of every row (its output checked against the first row's, its bytes metered). A row whose step
    raises (on any rank; deterministic errors raise on all of them before their collectives) is recorded in
    ``failed`` and dropped from ``rows``."""
    out, ref_y = {}, None
    for row in list(rows):
        y_SM, model_bytes, nic = _metered_step(row, data, ifname)
        if isinstance(y_SM, str):
            failed[row.label] = y_SM
            rows.remove(row)
            continue
        if ref_y is None:
            ref_y, ref_part = y_SM.float(), row.tokens
        diff = _difference(y_SM.float(), row.tokens, ref_y, ref_part)
        out[row.label] = {"model_bytes": model_bytes, "source": row.meter.source, "nic_tx_bytes": nic,
                          "max_abs_diff": max_over_ranks(diff)}
    scale = max_over_ranks(float(ref_y.abs().max())) if ref_y is not None else 0.0
    for v in out.values():
        v["ref_max_abs"] = scale
    return out


def measure(rows: List[Row], data: CaseData, plan: BenchPlan, ifname: Optional[str],
            failed: Dict[str, str]) -> Dict[str, Any]:
    """Collective: traffic round, warm-up, interleaved timed rounds. Every rank returns the same times;
    per-rank traffic is gathered (rank order). Rows that fail their first step move to ``failed``."""
    traffic = _traffic_round(rows, data, ifname, failed)
    for r in range(1, plan.warmup):
        for row in round_order(rows, plan.seed, r):
            if r < plan.warmup - 1:
                fwd_bwd(row, data, r)
                continue
            # the last warm-up round is metered again: a row whose traffic depends on earlier steps (Hecate's
            # copies planned from the load of earlier calls) moves its steady-state bytes there, not round 0's
            y_SM, model_bytes, nic = _metered_step(row, data, ifname, r)
            if isinstance(y_SM, str):
                raise RuntimeError(f"row {row.label}: {y_SM} (the last warm-up round)")
            traffic[row.label].update(model_bytes=model_bytes, nic_tx_bytes=nic)
    times: Dict[str, List[float]] = {row.label: [] for row in rows}
    exposure: Dict[str, List[Any]] = {row.label: [] for row in rows}
    for i in range(plan.iters):
        for row in round_order(rows, plan.seed, plan.warmup + i):
            dist.barrier()
            begin_exposure(row)
            row.meter.start()              # its all-to-all intervals, for the exposed time (lancet_exposure)
            try:
                t0 = time.perf_counter()
                fwd_bwd(row, data, plan.warmup + i)
                elapsed = time.perf_counter() - t0
            finally:
                row.meter.stop()
            times[row.label].append(max_over_ranks(elapsed))
            exposure[row.label].append(step_exposure(row))
    per_rank: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {k: (v["model_bytes"], v["nic_tx_bytes"], exposure[k])
                                      for k, v in traffic.items()})
    out = {}
    for row in rows:
        t = traffic[row.label]
        out[row.label] = {"kind": row.kind, "times_s": times[row.label], "traffic_source": t["source"],
                          "model_bytes_per_rank": [p[row.label][0] for p in per_rank],
                          "nic_tx_bytes_per_rank": [p[row.label][1] for p in per_rank],
                          "exposure": row.exposure, "exposure_per_rank": [p[row.label][2] for p in per_rank],
                          "max_abs_diff_vs_first": t["max_abs_diff"], "first_row_max_abs": t["ref_max_abs"],
                          "notes": list(row.notes) + list(row.describe()), "ran_as": row.ran_as()}
    return out


def _apply_rate(job: RankJob, rate: str) -> None:
    if job.cluster is not None and dist.get_rank() == 0:
        set_rate(job.cluster, rate)
    dist.barrier()


def _profile_for(job: RankJob, case: CaseConfig, data: CaseData, specs: List[RowSpec],
                 profiles: Dict[Tuple, CostProfile], rate: str) -> CostProfile:
    """Collective: ``case``'s profile at ``rate``, the link part (measured once per layout and rate, over
    every case of that layout) merged with the case's GEMM part (measured once per case)."""
    layout, dtype = data.groups.layout, job.plan.dtype
    same_layout = [c for c in job.plan.cases if _layout_key(c) == _layout_key(case)]
    parts, repeats = [], {} if job.plan.profile_repeats is None else {"repeats": job.plan.profile_repeats}
    for key, spec, source in (
            (("link", rate), link_spec_for(same_layout, layout, specs, dtype, **repeats),
             f"moe-plugins bench at {rate}: link, shared by the {len(same_layout)} case(s) of this layout"),
            (("gemm",), gemm_spec_for(case, layout, dtype, **repeats),
             f"moe-plugins bench: gemm of {case.label}")):
        if key + (spec,) not in profiles:
            profiles[key + (spec,)] = measure_profile(spec, data.groups, source=source)
        parts.append(profiles[key + (spec,)])
    return merge_profiles(*parts)


def _rows_for_rate(job: RankJob, case: CaseConfig, data: CaseData, fixed: List[Row], skipped: Dict[str, str],
                   profiles: Dict[Tuple, CostProfile], rate: str
                   ) -> Tuple[List[Row], Dict[str, str], Optional[CostProfile]]:
    """The rows timed at ``rate``, in the plan's order: the rate-independent ones built once per case, plus the
    auto rows rebuilt on a cost profile measured at this rate (:func:`_profile_for`)."""
    auto_specs = [s for s in job.plan.rows if needs_profile(s)]
    if not auto_specs:
        return list(fixed), dict(skipped), None
    profile = _profile_for(job, case, data, auto_specs, profiles, rate)
    data.extras[PROFILE] = profile
    auto, auto_skipped = build_rows(auto_specs, data)
    order = {s.label: i for i, s in enumerate(job.plan.rows)}
    rows = sorted(list(fixed) + auto, key=lambda row: order[row.label])
    return rows, {**skipped, **auto_skipped}, profile


def _run_rate(job: RankJob, case: CaseConfig, data: CaseData, fixed: List[Row], skipped: Dict[str, str],
              profiles: Dict[Tuple, CostProfile], rate: str, ifname: Optional[str]) -> Dict[str, Any]:
    """Collective: time ``case``'s rows at ``rate``; the auto rows built for this rate are closed after."""
    _apply_rate(job, rate)
    rows, rate_skipped, profile = _rows_for_rate(job, case, data, fixed, skipped, profiles, rate)
    auto = [row for row in rows if not any(row is f for f in fixed)]
    try:
        measured = measure(rows, data, job.plan, ifname, rate_skipped) if rows else {}
    finally:
        close_rows(auto)
    record = {"case": asdict(case), "case_label": case.label, "rate": rate, "rows": measured,
              "skipped": rate_skipped}
    if profile is not None:
        record["profile"] = profile_summary(profile)
        record["profile_measurements"] = profile_measurements(profile)
    return record


def _run_cases(job: RankJob, layouts: Dict[Tuple[int, int, int], MoEProcessGroups],
               lanes: Dict[Tuple[int, int, int], CommEngine], singleton, ifname: Optional[str],
               records: List[Dict[str, Any]]) -> None:
    plan, world = job.plan, dist.get_world_size()
    done, total = 0, len(plan.cases) * len(plan.rates)
    profiles: Dict[Tuple, CostProfile] = {}
    for case in plan.cases:
        key = _layout_key(case)
        if key not in layouts:
            layouts[key] = build_process_groups(ParallelLayout(world=world, ranks_per_node=plan.ranks_per_node,
                                                               mp=case.mp, ep=case.ep, esp=case.esp))
            # one per layout (per row would leak gloo threads); a pipeline lane only when a row pipelines, so
            # rows that do not run on a layout without twin groups and a lane thread, as a user's would
            lanes[key] = build_engine(layouts[key], pipeline=any(map(_pipelines, plan.rows)),
                                      record_timeline=job.timeline_prefix is not None)
        data = make_case_data(case, layouts[key], plan.seed, plan.dtype)
        data.extras["singleton"] = singleton
        data.extras[LANE] = lanes[key]
        fixed, skipped = build_rows([s for s in plan.rows if not needs_profile(s)], data)
        built = list(fixed)
        try:
            for rate in plan.rates:
                records.append(_run_rate(job, case, data, fixed, skipped, profiles, rate, ifname))
                failed = {row.label for row in fixed if row.label in records[-1]["skipped"]}
                skipped.update({label: records[-1]["skipped"][label] for label in failed})
                fixed = [row for row in fixed if row.label not in failed]          # a failed row stays out
                done += 1
                _emit(job, {"done": done, "total": total, "case": case.label, "rate": rate})
        finally:
            close_rows(built)                   # the rows built once per case, failed ones included
        fixed = built = data = None
        gc.collect()         # rows hold layers that hold process groups in cycles; gloo frees threads on collection


def run_plan(job: RankJob) -> Optional[List[Dict[str, Any]]]:
    """Collective over the default group. Rank 0 returns one record per (case, rate); others None."""
    plan = job.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.world:
        raise ValueError(f"the plan needs {plan.world} ranks (nodes {plan.nodes} x ranks_per_node "
                         f"{plan.ranks_per_node}); this group has {world}")
    ifname = job.cluster.ifname if job.cluster is not None else None
    singleton = None
    if any(r.name == "megatron" for r in plan.rows):
        from moe_plugins.tools.bench.stock_megatron import singleton_groups
        singleton = singleton_groups(world, rank)
    layouts: Dict[Tuple[int, int, int], MoEProcessGroups] = {}
    lanes: Dict[Tuple[int, int, int], CommEngine] = {}
    records: List[Dict[str, Any]] = []
    try:
        _run_cases(job, layouts, lanes, singleton, ifname, records)
        if job.timeline_prefix is not None:
            ops = [asdict(r) for lane in lanes.values() for r in lane.timeline]
            with open(f"{job.timeline_prefix}.rank{rank}.json", "w") as f:
                json.dump(ops, f)
    finally:      # gloo keeps threads per group: free them (a reused worker pool would leak them)
        for lane in lanes.values():
            lane.close()
        for groups in layouts.values():
            destroy_process_groups(groups)
        if singleton is not None:
            dist.destroy_process_group(singleton)
    return records if rank == 0 else None
