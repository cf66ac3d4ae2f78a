"""``moe-plugins plan parm``: which of Parm's schedules (S1 or S2), or DeepSpeed's own flow, a layer should
use, and why.

Inputs (parm.txt Table I): B samples and L tokens per sample on each rank, M model dim, H FFN hidden,
E experts, k routes per token, f capacity factor, and the degrees --mp --ep --esp.

Sizes (elements): x = B L M, T = k f B L / E slots per expert, y = E T M N_ESP, y1 = E C_l M N_ESP with
C_l S1's slots per expert (moe_plugins.parm.cost.s1_slots: T / N_MP at f = 1, up to T when f < 1 / N_MP).
Times (seconds, one direction; the backward repeats them):
  t_baseline = AG_ESP(x N_ESP) + AR_ESP(y) + 2 A2A_EP(y)                       (Eq. 1)
  t_s1       = 2 A2A_EP&ESP(y1) + AG_MP(x)                                     (Eq. 11)
  t_s2       = A2A_EP&ESP(y / N_MP) + SAA(y / N_MP)  with an SAA term, else
               2 A2A_EP&ESP(y / N_MP) + AG_MP(E T M)                           (Eq. 7, 14)
  t_baseline_tp = 2 A2A_EP(E T M / N_MP) + [AG_ESP + AR_ESP](E T M) + AG_MP(E T M)   (DeepSpeed's flow)
choice: parm-s1 if t_s1 <= t_s2, else parm-s2 (Algorithm 1; moe_plugins/parm/cost.py lists the paper's
typos that are not copied), replaced by baseline-tp when esp is 1 or mp and t_baseline_tp is at most 2%
above the pick. Collectives on groups of size 1 cost nothing.

Costs: every op is alpha [s] + beta [s/element] * elements. Where they come from, in order: a profile
file (--profile, from `moe-plugins profile`; its per-byte betas are converted with --element-bytes), the
newest profile cached for this machine with the same mp/ep/esp, or the built-in placeholders (measured on
the project's 2-core CPU development machine, not a cluster). Any --alpha-*/--beta-* pair given on the
command line replaces that term (and its curve). The paper publishes only the MP all-gather's terms: testbed A
--alpha-ag 6.64e-4 --beta-ag 5.38e-10, testbed B --alpha-ag 1.09e-4 --beta-ag 7.14e-10.

Pricing: a profile also holds each op's measured medians per size. With ``--exchange-pricing curve`` (the
default) the EP&ESP all-to-all, the MP all-gather and SAA cost the isotonic fit of those medians at their size
(``curves`` in the JSON: sizes in elements, seconds); ``linear`` uses alpha + beta n alone. The break-even
T is then found numerically. The flags and the built-in placeholders are lines.

--s1-slots prices S1's buffer at an observed C_l (slots per expert per MP block) instead of balanced
routing's, as parm-auto does once it has watched the layer's routing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from moe_plugins.core.costmodel import EXCHANGE_PRICING
from moe_plugins.core.profile_ops import newest_cached, this_device
from moe_plugins.parm.cost import (DEFAULT_COSTS, DEFAULT_COSTS_SOURCE, AlphaBeta, ParmCosts, ParmShape, break_even_T,
                         choose_schedule, s1_slots, shape_problems)

# cost field -> flag stem and what it is
TERMS = {
    "a2a_ep_esp": ("a2a", "EP&ESP all-to-all"),
    "ag_mp": ("ag", "MP all-gather"),
    "saa": ("o", "overlapped EP&ESP all-to-all + MP all-gather (SAA), per all-to-all element"),
    "ag_esp": ("ag-esp", "ESP all-gather (baseline)"),
    "ar_esp": ("ar-esp", "ESP all-reduce (baseline)"),
    "a2a_ep": ("a2a-ep", "EP all-to-all (baseline)"),
}
UNITS = {"x": "elements", "T": "slots per expert", "y": "elements", "t_*": "s", "alpha": "s",
         "beta": "s/element"}


def register(sub) -> None:
    p = sub.add_parser("parm", help="Parm's S1/S2 choice for one MoE layer", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, help_ in (("--B", "samples per rank"), ("--L", "tokens per sample"), ("--M", "model dim"),
                        ("--H", "FFN hidden dim"), ("--E", "experts")):
        p.add_argument(flag, type=int, required=True, help=help_)
    p.add_argument("--k", type=int, default=1, help="routes per token (top-k)")
    p.add_argument("--f", type=float, default=1.0, help="capacity factor")
    for flag in ("--mp", "--ep", "--esp"):
        p.add_argument(flag, type=int, default=1, help=f"{flag[2:].upper()} degree")
    for field, (stem, what) in TERMS.items():
        p.add_argument(f"--alpha-{stem}", type=float, default=None, help=f"{what}: start-up time [s]")
        p.add_argument(f"--beta-{stem}", type=float, default=None, help=f"{what}: time per element [s]")
    p.add_argument("--profile", default=None, help="a profile JSON from `moe-plugins profile`")
    p.add_argument("--cache-dir", default=None, help="where cached profiles live (default: $MOE_PLUGINS_CACHE "
                   "or ~/.cache/moe_plugins)")
    p.add_argument("--element-bytes", type=int, default=4, help="bytes per element (fp32: 4), for profiles")
    p.add_argument("--exchange-pricing", default="curve", choices=EXCHANGE_PRICING,
                   help="with a profile: price ops from its measured curves (default) or its fitted lines")
    p.add_argument("--s1-slots", type=float, default=None,
                   help="S1's observed buffer, slots per expert (default: balanced routing's)")
    p.add_argument("--no-saa", dest="saa", action="store_false", help="cost S2 without SAA")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def shape_from_args(args: argparse.Namespace) -> ParmShape:
    return ParmShape(B=args.B, L=args.L, M=args.M, H=args.H, E=args.E, k=args.k, f=args.f, mp=args.mp,
                     ep=args.ep, esp=args.esp)


def flag_terms(args: argparse.Namespace) -> Tuple[Dict[str, AlphaBeta], List[str]]:
    """The alpha/beta pairs given on the command line, and a problem for each half pair."""
    out, problems = {}, []
    for field, (stem, _) in TERMS.items():
        alpha, beta = (getattr(args, f"{part}_{stem.replace('-', '_')}") for part in ("alpha", "beta"))
        if (alpha is None) != (beta is None):
            problems.append(f"--alpha-{stem} and --beta-{stem} must be given together")
        elif alpha is not None:
            out[field] = AlphaBeta(alpha=alpha, beta=beta)
    return out, problems


def check_args(args: argparse.Namespace) -> Tuple[ParmShape, Dict[str, AlphaBeta]]:
    """The shape and the flag costs, or one ValueError listing every problem with both."""
    shape = shape_from_args(args)
    given, problems = flag_terms(args)
    problems = shape_problems(shape) + problems
    if args.element_bytes < 1:
        problems.append(f"--element-bytes ({args.element_bytes}) must be >= 1")
    if args.s1_slots is not None and not (math.isfinite(args.s1_slots) and args.s1_slots >= 0):
        problems.append(f"--s1-slots ({args.s1_slots}) must be a finite number >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    return shape, given


def base_costs(args: argparse.Namespace) -> Tuple[ParmCosts, str]:
    from moe_plugins.core.costmodel import CostProfile, default_cache_dir
    if args.profile:
        return ParmCosts.from_profile(CostProfile.load(Path(args.profile)), args.element_bytes,
                                      args.exchange_pricing), \
            f"profile {args.profile}"
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    found = newest_cached(cache_dir, this_device(), ("all_to_all@ep_esp", "all_gather@mp"), mp=args.mp, ep=args.ep,
                          esp=args.esp)     # the newest with Algorithm 1's two models
    if found is not None:
        path, profile = found
        return ParmCosts.from_profile(profile, args.element_bytes, args.exchange_pricing), f"cached profile {path}"
    return DEFAULT_COSTS, DEFAULT_COSTS_SOURCE + f" (no cached profile with mp={args.mp} ep={args.ep} " \
                                                  f"esp={args.esp} in {cache_dir})"


def resolve_costs(args: argparse.Namespace, given: Dict[str, AlphaBeta]) -> Tuple[ParmCosts, str]:
    costs, source = base_costs(args)
    if given:
        kept = tuple((name, curve) for name, curve in costs.curves if name not in given)
        costs = dataclasses.replace(costs, **given, curves=kept)
        source = f"flags ({', '.join(sorted(given))}) over {source}"
    return costs.check(), source


def plan(args: argparse.Namespace) -> dict:
    shape, given = check_args(args)
    costs, source = resolve_costs(args, given)
    c = choose_schedule(shape, costs, saa=args.saa, c_l=args.s1_slots)
    return {"planner": "parm", "inputs": dataclasses.asdict(shape), "x": c.x, "T": c.T, "y": c.y,
            "s1_slots": c.s1_slots, "s1_slots_source": c.s1_source, "s1_slots_balanced": s1_slots(shape),
            "t_baseline": c.t_baseline, "t_s1": c.t_s1, "t_s2": c.t_s2, "t_baseline_tp": c.t_tp,
            "s2_form": c.s2_form, "choice": c.choice, "t_chosen": c.t_chosen,
            "break_even_T": break_even_T(shape, costs, saa=args.saa), "costs_source": source,
            "costs": {name: (dataclasses.asdict(t) if t is not None else None) for name, t in costs.lines().items()},
            "curves": {name: {"x": list(c.x), "seconds": list(c.seconds), "beta_tail": c.beta_tail}
                       for name, c in costs.curves},
            "units": UNITS}


def explain(out: dict) -> str:
    s, ms = out["inputs"], 1e3
    lines = [f"Parm plan: {out['choice']} (t_s1 = {out['t_s1'] * ms:.3f} ms, t_s2 = {out['t_s2'] * ms:.3f} ms "
             f"[{out['s2_form']}], one direction)",
             f"  costs from {out['costs_source']}",
             f"  layer: x = B L M = {out['x']:.6g} elements, T = k f B L / E = {out['T']:.6g} slots, "
             f"y = E T M N_ESP = {out['y']:.6g} elements; mp={s['mp']} ep={s['ep']} esp={s['esp']}",
             f"  S1 buffer: C_l = {out['s1_slots']:.6g} slots per expert per MP block ("
             + ("balanced routing" if out["s1_slots_source"] == "balanced" else
                f"observed, given; balanced routing gives {out['s1_slots_balanced']:.6g}")
             + f"; the paper's T / N_MP = {out['T'] / s['mp']:.6g}), S2: T / N_MP",
             "  " + pricing_line(out)]
    if out["t_baseline_tp"] is not None:
        lines.append(f"  DeepSpeed's flow (baseline-tp): {out['t_baseline_tp'] * ms:.3f} ms; it is chosen when "
                     "priced no dearer than Parm's pick (within 2%)")
    elif s["mp"] > 1:
        lines.append("  DeepSpeed's flow (baseline-tp) is not a candidate: it needs esp 1 or mp, and costs for the "
                     "EP all-to-all (and the ESP all-gather and all-reduce when esp > 1)")
    if out["t_baseline"] is not None:
        lines.append(f"  baseline (Eq. 1): {out['t_baseline'] * ms:.3f} ms; the chosen schedule is "
                     f"{out['t_baseline'] / out['t_chosen']:.2f}x faster by the model")
    if s["mp"] == 1:
        lines.append("  With mp = 1 nothing is split: S1 and S2 both send the fused EP&ESP all-to-all only.")
    else:
        lines.append("  S1 gathers the combined output (x elements) over MP after the experts; S2 gathers the "
                     "capacity buffer (E T M elements)" + (", overlapped with its all-to-all (SAA)."
                                                           if out["s2_form"] == "saa" else "."))
    if out["break_even_T"] is not None and out["break_even_T"] > 0:
        lines.append(f"  The two cross at T = {out['break_even_T']:.6g} slots per expert for this shape.")
    return "\n".join(lines)


def pricing_line(out: dict) -> str:
    if not out["curves"]:
        return "Every op is priced by its line, alpha + beta n."
    return (f"Priced from the profile's measured times (isotonic fit, interpolated): {', '.join(out['curves'])}; "
            f"the rest by their lines.")


def run(args: argparse.Namespace) -> int:
    out = plan(args)
    print(json.dumps(out) if args.json else explain(out))
    sys.stdout.flush()
    return 0
