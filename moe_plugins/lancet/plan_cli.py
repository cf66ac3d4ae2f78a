"""``moe-plugins plan lancet``: Lancet's operator partition pass for a GPT-2-MoE stack, and why.

The stack (moe_plugins/lancet/plan.py, gpt2_moe_ops): per block, attention (4 B L M^2 + 2 B L^2 M macs), then a
dense FFN (2 B L M H) or, in an MoE block (block i, from 0, when (i + 1) % moe-every == 0), the gate (B L M E macs,
a barrier: it sees the whole batch), the dispatch all-to-all (E C M element-bytes, C = ceil(k f B L / E)), the
experts (2 E C M H macs) and the combine all-to-all (the same bytes).

The plan: consecutive ops are grouped into segments; each segment runs as k equal batch partitions on one
compute thread and one FIFO communication lane, stage-major (an op for every partition, then the next op), so a
partition's all-to-all runs under another partition's computation, and each op pays its start-up alpha k times.
A segment with k >= 2 holds no gate. k runs over 1..--max-partitions and must divide --batch (default --B). The
segments are found by dynamic programming (lancet-slides: T(n) = min_i T(i) + min_k P(i, n, k)).

Costs: --alpha-a [s] and --beta-a [s/byte] for one all-to-all, --alpha-c [s] and --beta-c [s/mac] for one GEMM
(an op's alpha counts its GEMM launches: attention 6, FFN 2, gate 1, experts 2); or --profile FILE; or the profile
cached for this machine (`moe-plugins profile`) with ep == P, whose fitted lines all_to_all@ep and gemm are used
(not its measured curves); or, failing all, the PipeMoE paper's 16-GPU testbed. Times are seconds.

Objective: training (default) adds each segment's mirrored backward with the same k (ops reversed, compute work
x --backward-factor, all-to-alls unchanged); forward plans the forward pass alone.

What runs (``"partitions": "auto"``): the block executor cannot cut free segments (the gate needs the whole batch);
it pipelines the ranges from each gate to the next, each with its own k (moe_plugins/lancet/choice.py): printed
after the plan, with every candidate's time per range.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Tuple

from moe_plugins.core.costmodel import (PAPER_TESTBED, PAPER_TESTBED_SOURCE, CostProfile, default_cache_dir,
                                        model_problems)
from moe_plugins.core.profile_ops import newest_cached, this_device
from moe_plugins.lancet.choice import choose_partitions, executor_ranges, executor_time
from moe_plugins.lancet.partition import MAX_PARTITIONS
from moe_plugins.lancet.plan import (BACKWARD_FACTOR, COST_TERMS, INT_SIZES, NOT_ALLOWED, OBJECTIVES, GPT2MoESizes,
                                     LancetCosts, attention_macs, capacity, cost_problems, exchange_bytes,
                                     expert_macs, ffn_macs, gate_macs, gpt2_moe_ops, is_moe_block, plan_segments,
                                     size_problems)

UNITS = {"alpha_a": "s", "beta_a": "s/byte", "alpha_c": "s per GEMM", "beta_c": "s/mac", "time_s": "s",
         "exchange_bytes": "bytes per rank per dispatch (and per combine)", "macs": "multiply-adds per rank"}
SIZE_HELP = {"B": "samples per rank", "L": "tokens per sample", "M": "model dim", "H": "FFN hidden dim",
             "heads": "attention heads", "E": "experts", "P": "expert-parallel ranks"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def register(sub) -> None:
    p = sub.add_parser("lancet", help="Lancet's batch partitions for a GPT-2-MoE stack (operator partition pass)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, help_ in SIZE_HELP.items():
        p.add_argument(flag(name), dest=name, type=int, required=True, help=help_)
    p.add_argument("--k", type=int, default=1, help="routes per token (top-k)")
    p.add_argument("--f", type=float, default=1.0, help="capacity factor")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks")
    p.add_argument("--moe-every", dest="moe_every", type=int, default=2,
                   help="block i (from 0) is an MoE block when (i + 1) %% moe-every == 0")
    p.add_argument("--element-bytes", dest="element_bytes", type=int, default=4,
                   help="bytes per element exchanged (fp32: 4)")
    for name in COST_TERMS:
        p.add_argument(flag(name), dest=name, type=float, default=None, help=UNITS[name])
    p.add_argument("--profile", default=None, help="a profile JSON from `moe-plugins profile`")
    p.add_argument("--cache-dir", default=None, help="where cached profiles live (default: "
                   "$MOE_PLUGINS_CACHE or ~/.cache/moe_plugins)")
    p.add_argument("--max-partitions", dest="max_partitions", type=int, default=MAX_PARTITIONS,
                   help="the most batch partitions a segment may use")
    p.add_argument("--batch", type=int, default=None, help="what the executor splits: k must divide it "
                   "(default: --B)")
    p.add_argument("--objective", default="training", choices=OBJECTIVES)
    p.add_argument("--backward-factor", dest="backward_factor", type=float, default=BACKWARD_FACTOR,
                   help="compute backward / forward work")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def check_inputs(args: argparse.Namespace) -> None:
    """Every bad flag at once, one line, each naming the flag, its value and what is allowed."""
    problems = size_problems(vars(args), flag)
    if args.max_partitions < 1:
        problems.append(f"--max-partitions ({args.max_partitions}) must be an integer >= 1")
    if args.batch is not None and args.batch < 1:
        problems.append(f"--batch ({args.batch}) must be an integer >= 1")
    if not (math.isfinite(args.backward_factor) and args.backward_factor > 0):
        problems.append(f"--backward-factor ({args.backward_factor}) must be a finite number > 0")
    if problems:
        raise ValueError("invalid Lancet plan: " + "; ".join(problems))


def resolve_costs(args: argparse.Namespace) -> Tuple[LancetCosts, str]:
    given = {n: getattr(args, n) for n in COST_TERMS if getattr(args, n) is not None}
    if given and args.profile:
        raise ValueError("give either --alpha-a/--beta-a/--alpha-c/--beta-c or --profile, not both")
    if given:
        missing = [flag(n) for n in COST_TERMS if n not in given]
        if missing:
            raise ValueError(f"the manual costs need all four flags; missing: {', '.join(missing)}")
        problems = cost_problems(given, flag)
        if problems:
            raise ValueError("invalid Lancet costs: " + "; ".join(problems))
        return LancetCosts(**given), "flags"
    if args.profile:
        return costs_from_profile(CostProfile.load(Path(args.profile))), f"profile {args.profile}"
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    found = newest_cached(cache_dir, this_device(), ("all_to_all@ep", "gemm"), ep=args.P)
    if found is not None:
        path, profile = found
        return costs_from_profile(profile), f"cached profile {path}"
    t = PAPER_TESTBED
    return (LancetCosts(alpha_a=t.alpha_a, beta_a=t.beta_a, alpha_c=t.alpha_e / 2, beta_c=t.beta_e / 2),
            PAPER_TESTBED_SOURCE + f" (no cached profile with ep={args.P} in {cache_dir})")


def costs_from_profile(profile: CostProfile) -> LancetCosts:
    """The fitted lines of the all-to-all on the EP group and of one GEMM."""
    a2a, gemm = profile.model("all_to_all", "ep"), profile.model("gemm")
    problems = model_problems("all_to_all@ep", a2a) + model_problems("gemm", gemm)
    if problems:
        raise ValueError(f"profile {profile.key.slug()} cannot plan: " + "; ".join(problems))
    return LancetCosts(alpha_a=a2a.alpha, beta_a=a2a.beta, alpha_c=gemm.alpha, beta_c=gemm.beta)


def plan(args: argparse.Namespace) -> dict:
    check_inputs(args)
    costs, source = resolve_costs(args)
    sizes = GPT2MoESizes(**{n: getattr(args, n) for n in INT_SIZES + ("f",)})
    batch = args.B if args.batch is None else args.batch
    ops = gpt2_moe_ops(sizes, costs)
    result = plan_segments(ops, args.max_partitions, lambda k: batch % k == 0, objective=args.objective,
                           backward_factor=args.backward_factor)
    run_ks, run_times = choose_partitions(ops, list(result.ks), args.objective)
    s = sizes
    C = capacity(B=s.B, L=s.L, E=s.E, k=s.k, f=s.f)
    return {
        "planner": "lancet", "objective": args.objective, "costs_source": source,
        "inputs": {**asdict(sizes), "batch": batch, "max_partitions": args.max_partitions,
                   "backward_factor": args.backward_factor},
        "costs": asdict(costs),
        "layer": {"capacity": C, "exchange_bytes": exchange_bytes(E=s.E, C=C, M=s.M, element_bytes=s.element_bytes),
                  "attention_macs": attention_macs(B=s.B, L=s.L, M=s.M),
                  "ffn_macs": ffn_macs(B=s.B, L=s.L, M=s.M, H=s.H), "gate_macs": gate_macs(B=s.B, L=s.L, M=s.M, E=s.E),
                  "expert_macs": expert_macs(E=s.E, C=C, M=s.M, H=s.H),
                  "moe_blocks": [i for i in range(s.layers) if is_moe_block(i, s.moe_every)]},
        "allowed_k": list(result.ks),
        "ops": [asdict(op) for op in ops],
        "segments": [{**{f: getattr(seg, f) for f in ("start", "end", "k", "time_s", "forward_s", "backward_s")},
                      "ops": [op.name for op in ops[seg.start:seg.end]],
                      "candidates": [asdict(c) for c in seg.candidates]} for seg in result.segments],
        "executor": {"ranges": [{"start": a, "end": b, "ops": [op.name for op in ops[a:b]], "k": k,
                                 "candidates": {str(c): t for c, t in times.items()}}
                                for (a, b), k, times in zip(executor_ranges(ops), run_ks, run_times)],
                     "time_s": executor_time(ops, run_ks, args.objective, args.backward_factor)},
        "time_s": result.time_s, "serial_s": result.serial_s,
        "saving": 1 - result.time_s / result.serial_s if result.serial_s > 0 else 0.0,
        "units": UNITS,
    }


def run(args: argparse.Namespace) -> int:
    out = plan(args)
    print(json.dumps(out) if args.json else explain(out))
    sys.stdout.flush()
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def explain(out: dict) -> str:
    """The plan in words: every segment, its ops, every candidate k, and the total against no pipelining."""
    c, lay, inp = out["costs"], out["layer"], out["inputs"]
    passes = "forward + backward" if out["objective"] == "training" else "forward"
    piped = [s for s in out["segments"] if s["k"] > 1]
    lines = [
        f"Lancet plan ({passes}): {len(out['segments'])} segments, {len(piped)} pipelined; predicted "
        f"{_ms(out['time_s'])} vs {_ms(out['serial_s'])} without pipelining ({out['saving']:.1%} less)",
        f"  costs from {out['costs_source']}:",
        f"    all-to-all t = {c['alpha_a']:.3g} s + {c['beta_a']:.3g} s/byte * bytes; "
        f"GEMM t = {c['alpha_c']:.3g} s + {c['beta_c']:.3g} s/mac * macs",
        f"  per block: attention {lay['attention_macs']:.4g} macs; dense FFN {lay['ffn_macs']:.4g} macs; MoE blocks "
        f"{lay['moe_blocks']}: gate {lay['gate_macs']:.4g} macs, C = {lay['capacity']} slots per expert, dispatch and "
        f"combine {lay['exchange_bytes']:.4g} bytes each, experts {lay['expert_macs']:.4g} macs",
        f"  k may be {', '.join(map(str, out['allowed_k']))} (1..--max-partitions {inp['max_partitions']}, dividing "
        f"--batch {inp['batch']}); a segment holding a gate (a barrier) runs with k = 1",
    ]
    for n, seg in enumerate(out["segments"], 1):
        names = seg["ops"] if len(seg["ops"]) <= 6 else seg["ops"][:3] + ["..."] + seg["ops"][-2:]
        lines.append(f"  segment {n}: ops {seg['start']}..{seg['end'] - 1} [{', '.join(names)}]: k = {seg['k']}, "
                     f"{_ms(seg['time_s'])}" + (f" ({_ms(seg['forward_s'])} forward)" if passes != "forward" else ""))
        barred = [cand["k"] for cand in seg["candidates"] if cand["time_s"] is None]
        if barred:
            ks = str(barred[0]) if len(barred) == 1 else f"{barred[0]}..{barred[-1]}"
            lines.append(f"      k = {ks}: excluded, the segment {seg['candidates'][barred[0] - 1]['excluded']}")
        for cand in seg["candidates"]:
            if cand["time_s"] is None:
                continue
            if cand["excluded"] == NOT_ALLOWED:
                why = f"{_ms(cand['time_s'])}, not allowed: {cand['k']} does not divide --batch {inp['batch']}"
            else:
                why = _ms(cand["time_s"]) + ("  <- chosen" if cand["k"] == seg["k"] else "")
            lines.append(f"      k = {cand['k']:2d}  {why}")
    lines.append("  Segments run one after another; within one, partitions overlap an all-to-all with another "
                 "partition's compute, and every op pays its start-up alpha once per partition.")
    run = out["executor"]
    lines.append(f"What runs (\"partitions\": \"auto\"): the block executor pipelines each range from a gate to the "
                 f"next gate, with its own k; predicted {_ms(run['time_s'])}")
    for n, rng in enumerate(run["ranges"], 1):
        names = rng["ops"] if len(rng["ops"]) <= 6 else rng["ops"][:3] + ["..."] + rng["ops"][-2:]
        cands = ", ".join(f"k = {k}: {_ms(t)}" for k, t in rng["candidates"].items())
        lines.append(f"  range {n}: ops {rng['start']}..{rng['end'] - 1} [{', '.join(names)}]: k = {rng['k']} "
                     f"({cands})")
    return "\n".join(lines)
