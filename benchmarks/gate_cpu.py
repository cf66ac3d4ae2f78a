"""DeepSpeed's top-1 / top-2 gate against the exact fast gate (moe_plugins/core/fastgate.py) on CPU.

    python benchmarks/gate_cpu.py --out benchmarks/results            # about 2 minutes on 2 cores

For S in {2048, 8192}, E in {8, 16, 64}, k in {1, 2} (DeepSpeed's defaults: capacity_factor 1, min_capacity 4,
drop_tokens, use_rts for k = 1, second-expert sampling for k = 2), four rows, each one forward call of the gate on
fp32 logits that require grad (the autograd graph is recorded, as in training), from the same seed in a round:

- ``ds-dense``: ``top1gating`` / ``top2gating`` as TopKGate returns them by default (combine weights and dispatch
  mask, both (S, E, C));
- ``fast-dense``: ``top1_routing`` / ``top2_routing`` then ``dense_format``: the same four outputs;
- ``ds-routing``: the gate with ``sparse_routes=True`` then ``routing_from_gate``: the plugin's path before;
- ``fast-routing``: ``top1_routing`` / ``top2_routing``: the Routing the plugin's DeepSpeed path now uses.

Rows run interleaved (round-robin, order rotated each round; the dense rows only in the first 5 rounds, 3 at
S = 8192) on one thread (``--threads``); medians are reported, and ratios are DeepSpeed's median over the fast
one's. Peak memory: one extra call per row under torch.profiler
with ``profile_memory``, its allocations and frees (torch.profiler._memory_profiler's timeline, a private API)
summed in time order: the most bytes the call held at once beyond what existed before it, outputs included.
Timings on a shared 2-core machine are noisy: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List

import torch

SHAPES = [(s, e, k) for s in (2048, 8192) for e in (8, 16, 64) for k in (1, 2)]
ROWS = ("ds-dense", "fast-dense", "ds-routing", "fast-routing")


def row_fns(num_tokens: int, num_experts: int, k: int) -> Dict[str, Callable[[torch.Tensor], object]]:
    from deepspeed.moe import sharded_moe as sm

    from moe_plugins.core.fastgate import dense_format, top1_routing, top2_routing
    from moe_plugins.patches.deepspeed_layer import _rts_uniform, routing_from_gate

    def ds(logits, sparse):
        if k == 1:
            return sm.top1gating(logits, 1.0, 4, None, None, True, True, None, sparse)
        return sm.top2gating(logits, 1.0, 4, True, None, True, sparse)

    def fast(logits):                           # with the samplers the plugin's DeepSpeed path passes
        if k == 1:
            return top1_routing(logits, 1.0, 4, uniform=partial(_rts_uniform, sm))
        return top2_routing(logits, 1.0, 4, gumbel=sm.gumbel_rsample)

    return {"ds-dense": lambda lg: ds(lg, False), "fast-dense": lambda lg: dense_format(fast(lg), num_experts),
            "ds-routing": lambda lg: routing_from_gate(ds(lg, True)), "fast-routing": fast}


def peak_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler._memory_profiler import Action
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        out = fn()
    del out
    live = peak = 0
    for _, action, _, size in sorted(prof._memory_profile().timeline, key=lambda r: r[0]):
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def measure(num_tokens: int, num_experts: int, k: int, rounds: int, budget_s: float) -> dict:
    fns = row_fns(num_tokens, num_experts, k)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(0))
    w = (torch.randn(num_experts, 32, generator=torch.Generator().manual_seed(1)) * 0.3).requires_grad_()

    def call(row: str, seed: int) -> float:
        logits = x @ w.t()                      # fresh per call: top2gating adds its noise in place
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = fns[row](logits)
        dt = time.perf_counter() - t0
        del out
        return dt

    times: Dict[str, List[float]] = {r: [] for r in ROWS}
    dense_rounds = 5 if num_tokens <= 2048 else 3          # a dense call at S = 8192 takes up to seconds
    for r in ROWS:
        if num_tokens <= 2048 or not r.endswith("dense"):
            call(r, 0)                          # warm-up (not the seconds-long dense calls)
    start = None
    for i in range(rounds):
        rows = [r for r in ROWS if not r.endswith("dense") or i < dense_rounds]
        rows = rows[i % len(rows):] + rows[:i % len(rows)]
        for r in rows:
            times[r].append(call(r, i))
        if i + 1 == dense_rounds:
            start = time.perf_counter()       # the budget bounds the routing rows' extra rounds
        if start is not None and i >= 10 and time.perf_counter() - start > budget_s:
            break
    peaks = {}
    for r in ROWS:
        logits = x @ w.t()
        torch.manual_seed(0)
        peaks[r] = peak_bytes(lambda: fns[r](logits))
    med = {r: statistics.median(v) * 1e3 for r, v in times.items()}
    return {"S": num_tokens, "E": num_experts, "k": k, "rounds": {r: len(v) for r, v in times.items()},
            "median_ms": med, "peak_bytes": peaks, "times_ms": {r: [t * 1e3 for t in v] for r, v in times.items()}}


def fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def report(results: List[dict], header: List[str]) -> str:
    lines = ["# DeepSpeed's gate against the exact fast gate, CPU (benchmarks/gate_cpu.py)", ""] + header + [""]
    lines += ["| S | E | k | rounds (dense / routing) | ds-dense ms | fast-dense ms | ratio | ds-routing ms "
              "| fast-routing ms | ratio | ds-dense / fast-routing |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median_ms"]
        lines.append(f"| {r['S']} | {r['E']} | {r['k']} | {r['rounds']['ds-dense']} / {r['rounds']['ds-routing']} "
                     f"| {m['ds-dense']:.2f} | {m['fast-dense']:.2f} | {m['ds-dense'] / m['fast-dense']:.2f}x | {m['ds-routing']:.2f} | {m['fast-routing']:.2f} "
                     f"| {m['ds-routing'] / m['fast-routing']:.2f}x | {m['ds-dense'] / m['fast-routing']:.1f}x |")
    lines += ["", "Peak memory of one call (allocations held at once, outputs included):", "",
              "| S | E | k | ds-dense | fast-dense | ds-routing | fast-routing | ds-routing / fast-routing |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["peak_bytes"]
        lines.append(f"| {r['S']} | {r['E']} | {r['k']} | " + " | ".join(fmt_bytes(p[x]) for x in ROWS)
                     + f" | {p['ds-routing'] / max(p['fast-routing'], 1):.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--stem", default="gate-cpu")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--budget-s", type=float, default=4.0,
                        help="after the dense rows' rounds, stop a shape's routing rounds after this long")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import deepspeed
    load_before = os.getloadavg()[0]
    t0 = time.time()
    results = []
    for s, e, k in SHAPES:
        results.append(measure(s, e, k, args.rounds, args.budget_s))
        m = results[-1]["median_ms"]
        print(f"S={s} E={e} k={k}: " + ", ".join(f"{r} {m[r]:.2f} ms" for r in ROWS), flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    header = [f"- one run, git {commit} (+ working tree), torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
              f"{args.threads} thread(s), load average {load_before:.2f} before / {os.getloadavg()[0]:.2f} after, "
              f"{time.time() - t0:.0f} s wall",
              f"- reproduce: `python benchmarks/gate_cpu.py --out {args.out}`",
              "- one forward gate call on fp32 logits that require grad; capacity_factor 1, min_capacity 4, drop_tokens; "
              "k = 1 with RTS, k = 2 with second-expert sampling (DeepSpeed's defaults); rows interleaved, medians; "
              "ratio = DeepSpeed / fast (> 1: the fast gate is faster)"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.md").write_text(report(results, header))
    (out / f"{args.stem}.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
    print(f"wrote {out / args.stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
