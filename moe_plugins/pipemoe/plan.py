"""``moe-plugins plan pipemoe``: the pipeline degree r PipeMoE picks for one MoE layer, and why.

Inputs (pipemoe.txt Table I): B samples per rank, L tokens per sample, M model dim, H FFN hidden, E experts,
k routes per token, f capacity factor, P expert-parallel ranks (the all-to-all group).

Derived sizes (per rank):
  C   = ceil(k f B L / E)                  capacity, slots per expert
  n_d = E C M * element_bytes              bytes one rank sends in one dispatch (and one combine)
  n_e = (E/P) (P C) M H = E C M H          multiply-adds of one expert GEMM over the rank's E/P experts

Costs (where they come from is printed): ``--alpha-a`` [s] and ``--beta-a`` [s/byte] for one all-to-all,
``--alpha-e`` [s] and ``--beta-e`` [s/mac] for the expert forward (two GEMMs: 2 alpha_gemm, 2 beta_gemm);
or ``--profile FILE``; or the profile cached for this machine (``moe-plugins profile``) with ep == P;
or, failing all, the paper's 16-GPU testbed (Fig. 6). Times are seconds.

Exchange pricing: a profile also holds the all-to-all's measured medians per size. With
``--exchange-pricing curve`` (the default) an exchange of x bytes costs the isotonic fit of those medians at x
(``exchange_curve`` in the JSON: sizes in bytes, seconds), and the degree is the recurrence's minimum over every
r; ``linear`` plans with alpha_a + beta_a x and Theorem 1. The manual flags and the paper default are lines.
Where the profile also timed exchanges back to back (``all_to_all_stream``), a pipelined chunk behind another
is priced from that curve (``stream_curve``) and only the first dispatch from the isolated one. With a
``chunk`` model the runner's step of pipelining at all is in ``costs.pipeline_step``.

Objective: ``training`` (default; what ``pipeline_degree: auto`` uses when autograd records) is the
forward pipeline plus the mirrored backward one whose expert stage costs ``--backward-factor`` x the forward
(4 GEMMs vs 2); ``forward`` is the paper's Theorem 1 alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Tuple

from moe_plugins.core.costmodel import (EXCHANGE_PRICING, PAPER_TESTBED, PAPER_TESTBED_SOURCE, CostProfile, ExchangeCurve,
                         PipeCosts, default_cache_dir)
from moe_plugins.core.profile_ops import newest_cached, this_device
from moe_plugins.pipemoe.model import (OBJECTIVES, R_MAX, TIE_TOLERANCE, chunk_costs, choose_degree, objective_time,
                                      plan_workload)

MANUAL = ("alpha_a", "beta_a", "alpha_e", "beta_e")
UNITS = {"n_d": "bytes per rank per dispatch", "n_e": "multiply-adds per expert GEMM, this rank's experts",
         "alpha_a": "s", "beta_a": "s/byte", "alpha_e": "s", "beta_e": "s/mac", "time": "s",
         "pipeline_step": "s per forward + backward with r >= 2 (the forward objective charges a third)"}


def register(sub) -> None:
    p = sub.add_parser("pipemoe", help="PipeMoE's optimal pipeline degree for one MoE layer",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, help_ in (("--B", int, "samples per rank"), ("--L", int, "tokens per sample"),
                              ("--M", int, "model dim"), ("--H", int, "FFN hidden dim"),
                              ("--E", int, "experts"), ("--P", int, "expert-parallel ranks")):
        p.add_argument(flag, type=kind, required=True, help=help_)
    p.add_argument("--k", type=int, default=1, help="routes per token (top-k)")
    p.add_argument("--f", type=float, default=1.0, help="capacity factor")
    p.add_argument("--element-bytes", type=int, default=4, help="bytes per element exchanged (fp32: 4)")
    for name in MANUAL:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=UNITS[name])
    p.add_argument("--profile", default=None, help="a profile JSON from `moe-plugins profile`")
    p.add_argument("--exchange-pricing", default="curve", choices=EXCHANGE_PRICING,
                   help="with a profile: price exchanges from its measured curve (default) or its fitted line")
    p.add_argument("--cache-dir", default=None, help="where cached profiles live (default: "
                   "$MOE_PLUGINS_CACHE or ~/.cache/moe_plugins)")
    p.add_argument("--objective", default="training", choices=OBJECTIVES)
    p.add_argument("--backward-factor", type=float, default=2.0, help="expert backward / forward time")
    p.add_argument("--r-max", type=int, default=R_MAX, help="largest degree considered")
    p.add_argument("--tie-tolerance", type=float, default=TIE_TOLERANCE,
                   help="degrees predicted within this fraction of the optimum are ties, broken towards fewer "
                        "chunks (0: Theorem 1's optimum itself)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def resolve_costs(args: argparse.Namespace) -> Tuple[PipeCosts, str]:
    given = {n: getattr(args, n) for n in MANUAL if getattr(args, n) is not None}
    if given and args.profile:
        raise ValueError("give either --alpha-a/--beta-a/--alpha-e/--beta-e or --profile, not both")
    if given:
        missing = [f"--{n.replace('_', '-')}" for n in MANUAL if n not in given]
        if missing:
            raise ValueError(f"the manual costs need all four flags; missing: {', '.join(missing)}")
        return PipeCosts(**given).check(), "flags"
    if args.profile:
        profile = CostProfile.load(Path(args.profile))
        return PipeCosts.from_profile(profile, pricing=args.exchange_pricing).check(), f"profile {args.profile}"
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    found = newest_cached(cache_dir, this_device(), ("all_to_all@ep",), ep=args.P)
    if found is not None:
        path, profile = found
        return PipeCosts.from_profile(profile, pricing=args.exchange_pricing).check(), f"cached profile {path}"
    return PAPER_TESTBED, PAPER_TESTBED_SOURCE + f" (no cached profile with ep={args.P} in {cache_dir})"



def plan(args: argparse.Namespace) -> dict:
    costs, source = resolve_costs(args)
    w = plan_workload(B=args.B, L=args.L, M=args.M, H=args.H, E=args.E, k=args.k, f=args.f, P=args.P,
                      element_bytes=args.element_bytes)
    choice = choose_degree(costs, w.n_d, w.n_e, objective=args.objective, r_max=args.r_max,
                           backward_factor=args.backward_factor, tie_tolerance=args.tie_tolerance)
    curve = [[r, objective_time(costs, w.n_d, w.n_e, r, args.objective, args.backward_factor)]
             for r in range(1, args.r_max + 1)]
    return {"planner": "pipemoe", "objective": args.objective, "costs_source": source,
            "inputs": {k: getattr(args, k) for k in ("B", "L", "M", "H", "E", "k", "f", "P", "element_bytes",
                                                      "backward_factor", "r_max", "tie_tolerance")},
            "costs": {n: getattr(costs, n) for n in MANUAL + ("pipeline_step",)},
            "exchange_curve": None if costs.exchange_curve is None else asdict(costs.exchange_curve),
            "stream_curve": None if costs.stream_curve is None else asdict(costs.stream_curve),
            "capacity": w.capacity, "n_d": w.n_d, "n_e": w.n_e,
            "degree": choice.degree, "predicted_time_s": choice.predicted_time_s, "case": choice.case,
            "candidates": [{"r": c.r, "time_s": c.time_s, "case": c.case} for c in choice.candidates],
            "curve": curve, "units": UNITS}


def run(args: argparse.Namespace) -> int:
    out = plan(args)
    if args.json:
        print(json.dumps(out))
    else:
        print(explain(out))
    sys.stdout.flush()
    return 0


def explain(out: dict) -> str:
    """The choice in words."""
    c, r, t1 = out["costs"], out["degree"], out["curve"][0][1]
    curve, stream = (None if out.get(k) is None else ExchangeCurve(
        x=tuple(out[k]["x"]), seconds=tuple(out[k]["seconds"]), beta_tail=out[k]["beta_tail"])
        for k in ("exchange_curve", "stream_curve"))
    costs = PipeCosts(**c, exchange_curve=curve, stream_curve=stream)
    d1, e1 = chunk_costs(costs, out["n_d"], out["n_e"], r)
    passes = "forward + backward" if out["objective"] == "training" else "forward"
    lines = [
        f"PipeMoE plan: pipeline degree r = {r} (predicted {out['predicted_time_s'] * 1e3:.3f} ms, {passes})",
        f"  costs from {out['costs_source']}:",
        f"    all-to-all t = {c['alpha_a']:.3g} s + {c['beta_a']:.3g} s/byte * bytes{' (fitted line)' if curve else ''}; "
        f"expert forward t = {c['alpha_e']:.3g} s + {c['beta_e']:.3g} s/mac * macs",
        f"  layer: capacity C = {out['capacity']} slots per expert; each rank sends n_d = {out['n_d']:.4g} bytes per "
        f"dispatch and its experts do n_e = {out['n_e']:.4g} macs per GEMM",
        *([] if curve is None else [
            f"    exchanges priced from the measured all-to-all curve instead of the line: {len(curve.x)} sizes "
            f"from {curve.x[0]:.4g} to {curve.x[-1]:.4g} bytes (isotonic fit of the medians), e.g. "
            f"{curve.time(out['n_d']) * 1e3:.3f} ms for all n_d at once, the line says "
            f"{(c['alpha_a'] + c['beta_a'] * out['n_d']) * 1e3:.3f} ms"]),
        *([] if stream is None else [
            f"    chunks behind another priced from the back-to-back curve: e.g. n_d / 4 takes "
            f"{stream.time(out['n_d'] / 4) * 1e3:.3f} ms in a stream, {curve.time(out['n_d'] / 4) * 1e3:.3f} ms "
            f"after idle link time"]),
        *([] if not c.get("pipeline_step") else [
            f"    the profile's runner points add a step of {c['pipeline_step'] * 1e3:.3f} ms (forward + backward) "
            f"to every r >= 2: the pipeline's lane, twin groups and autograd islands, beyond their per-chunk cost"]),
        f"  r = 1 (no pipelining) takes {t1 * 1e3:.3f} ms: dispatch, experts and combine one after another.",
    ]
    if r == 1:
        lines.append("  Cutting the capacity into chunks does not pay: every chunk adds the start-up time alpha to "
                     "each exchange and to the expert GEMMs, more than the overlap hides.")
    else:
        bound = "communication" if 2 * (r - 1) * d1 >= r * e1 else "computation"
        lines.append(f"  With r = {r} chunks one dispatch takes {d1 * 1e3:.3f} ms and one expert step "
                     f"{e1 * 1e3:.3f} ms; dispatch(i+1), experts(i) and combine(i-1) overlap and the pipeline is "
                     f"{bound}-bound, {100 * (1 - out['predicted_time_s'] / t1):.1f}% faster than r = 1.")
        if out["case"].startswith("fewest chunks"):
            lines.append(f"  The predicted optimum is flat: {out['case']}; more chunks would gain less than "
                         f"{out['inputs']['tie_tolerance']:.1%} in the model and pay costs it leaves out.")
        else:
            lines.append("  More chunks would add start-up costs (alpha) faster than they hide the rest.")
    lines.append("  candidates (Theorem 1, each re-timed with the Eq. 9-12 recurrence):" if curve is None else
                 "  candidates (every r timed with the Eq. 9-12 recurrence; Theorem 1 assumes the line):")
    for cand in out["candidates"]:
        mark = "  <- chosen" if cand["r"] == r else ""
        lines.append(f"    r = {cand['r']:3d}  {cand['time_s'] * 1e3:10.3f} ms  {cand['case']}{mark}")
    return "\n".join(lines)
