"""Re-plan a committed PipeMoE bench run offline with the current planner: which degree each exchange pricing
picks, and what the fixed rows measured at that degree. An analysis of recorded data, not a measurement.

For each group of a ``moe-plugins bench`` JSON that carries the auto row's cost profile (``profile`` and
``profile_measurements``), this rebuilds the profile, plans the group's layer with
``PipeCosts.from_profile(..., pricing=P)`` for P in ``costmodel.EXCHANGE_PRICING`` (``curve``, the default the
``auto`` rows run, and ``linear``) through the same ``choose_degree``, and prints each pick next to the fixed
rows' medians. A pick with no fixed row of its degree shows "–". Only the baseline schedule with
``baseline@r=N`` fixed rows is handled. On the runs of the current planner (``pipemoe-2x{1,2}-additive{,-b}``)
the ``curve`` picks are the degrees the auto rows logged (``tests/test_bench_units.py``); runs of earlier
planners are in git history, with the planner of their commit.

    python benchmarks/reprice.py benchmarks/results/pipemoe-2x1-additive.json
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Dict, List, Optional, Tuple

from moe_plugins.core.costmodel import EXCHANGE_PRICING, CostProfile, LinearModel, Measurement, PipeCosts, ProfileKey
from moe_plugins.pipemoe.model import R_MAX, choose_degree, plan_workload

TOLERANCE = 1.05


def fixed_medians(rows: Dict[str, dict]) -> Dict[int, float]:
    """degree -> median ms of the fixed baseline rows (``baseline`` is r = 1)."""
    out = {1: rows["baseline"]["median_ms"]} if "baseline" in rows else {}
    for label, row in rows.items():
        m = re.fullmatch(r"baseline@r=(\d+)", label)
        if m:
            out[int(m.group(1))] = row["median_ms"]
    return out


def profile_of(group: dict, layout: dict) -> CostProfile:
    models = {k: LinearModel(alpha=v["alpha"], beta=v["beta"], unit=v["unit"], r2=v["r2"])
              for k, v in group["profile"].items()}
    measured = {k: Measurement(x=tuple(v["x"]), seconds=tuple(v["seconds"]))
                for k, v in group["profile_measurements"].items()}
    key = ProfileKey(world=layout["world"], ranks_per_node=layout["ranks_per_node"], mp=layout["mp"],
                     ep=layout["ep"], esp=layout["esp"], backend="gloo", device="cpu")
    return CostProfile(key=key, dtype="float32", models=models, measurements=measured)


def workload(case: dict):
    """The baseline layer's sizes (fp32) as AutoDegree reads them off d: pipemoe.plan_workload, one sample of
    ``tokens`` tokens on EP ranks."""
    if case["min_capacity"] or case["esp"] != 1:
        raise ValueError(f"reprice handles min_capacity 0 and esp 1 (got min_capacity {case['min_capacity']}, "
                         f"esp {case['esp']})")
    return plan_workload(B=1, L=case["tokens"], M=case["hidden"], H=case["ffn"], E=case["experts"], k=case["k"],
                         f=case["capacity_factor"], P=case["ep"])


PRICINGS = EXCHANGE_PRICING


def reprice(report: dict) -> List[dict]:
    plan = report["meta"]["plan"]
    out = []
    for g in report["groups"]:
        if not g.get("profile_measurements"):
            continue
        case = g["case"]
        layout = {"world": plan["nodes"] * plan["ranks_per_node"], "ranks_per_node": plan["ranks_per_node"],
                  **{k: case[k] for k in ("mp", "ep", "esp")}}
        profile, w = profile_of(g, layout), workload(case)
        fixed = fixed_medians(g["rows"])
        best = min(fixed.values())
        picks: Dict[str, Tuple[int, Optional[float]]] = {}
        for pricing in PRICINGS:
            costs = PipeCosts.from_profile(profile, "ep", pricing)
            r = choose_degree(costs, w.n_d, w.n_e, r_max=min(R_MAX, w.capacity)).degree
            picks[pricing] = (r, fixed[r] / best if r in fixed else None)
        out.append({"case": g["case_label"], "rate": g["rate"], "best": min(fixed, key=fixed.get), "picks": picks})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="bench JSON files")
    args = ap.parse_args()
    for path in args.json:
        with open(path) as f:
            rows = reprice(json.load(f))
        print(f"# {path}\n\n| case | rate | best fixed r | " + " | ".join(
            f"{p}: r (t_fixed(r) / t_best)" for p in PRICINGS) + " |")
        print("|---|---|---|" + "---|" * len(PRICINGS))
        within, judged = {p: 0 for p in PRICINGS}, {p: 0 for p in PRICINGS}
        for row in rows:
            cells = []
            for p in PRICINGS:
                r, ratio = row["picks"][p]
                cells.append(f"{r} ({'–' if ratio is None else f'{ratio:.2f}'})")
                within[p] += ratio is not None and ratio <= TOLERANCE
                judged[p] += ratio is not None
            print(f"| {row['case']} | {row['rate']} | {row['best']} | " + " | ".join(cells) + " |")
        print(f"\nof {len(rows)} groups, picks with a fixed row of their degree that is within 5% of the best: "
              + ", ".join(f"{p} {within[p]} of {judged[p]}" for p in PRICINGS) + "\n")


if __name__ == "__main__":
    main()
