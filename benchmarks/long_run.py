"""Long run (issue #28 item 6): the demo's tiny GPT-2-MoE (DeepSpeed recipe, 4 CPU gloo ranks) for 2,000 steps,
stock, with the plugin at baseline r = 1, and with PipeMoE ``"auto"``; every worker's RSS sampled once a second
from outside, and every 10 steps by the worker itself at a fixed point of its step (the recipe's ``--rss-every``).

    python benchmarks/long_run.py --steps 2000 --out benchmarks/results      # writes long-run.{json,md,png}

    python benchmarks/long_run.py --from-json benchmarks/results/long-run.json   # re-summarize stored runs

Checks, reported (not asserted): RSS growth per rank between step 200 and the last step (target < 2%; judged on
the fixed-phase samples, median of steps 200-400 against the last 200 steps); the
plugin-r=1 losses against stock's at every 100th step (target within 1e-5 relative); ``auto``'s largest
relative difference (its chunked GEMMs round differently), with the curves overlaid. ``auto`` reads the cost
profile cached for the layout (``moe-plugins profile`` is run first into a temporary cache).

Every worker (stock's too) runs with glibc's mmap threshold fixed at its default, ``MALLOC_MMAP_THRESHOLD_=131072``
(:data:`MALLOC_ENV`). Left dynamic, glibc raises the threshold to the size of each large block freed, so the model's
tensors move from mmap into the heap, whose free space is returned in ~12-13 MiB steps (1.8% of a worker) at
moments unrelated to growth: two runs without the setting measured those steps, not leaks (docs/reliability.md).
Fixed, a tensor's pages go back to the system when it is freed, and RSS follows the live memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import psutil

ROOT = Path(__file__).resolve().parents[1]
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1}}
RUNS = {"stock": None, "baseline-r1": {"schedule": "baseline", "pipeline_degree": 1},
        "auto": {"schedule": "baseline", "pipeline_degree": "auto"}}


def run(name: str, section: Any, steps: int, work: Path, cache: Path) -> Dict[str, Any]:
    """One torchrun of the recipe; RSS of every worker once a second, keyed by the step rank 0 last logged."""
    config = dict(BASE, **({"moe_plugins": section} if section else {}))
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    out = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
           "moe_plugins.recipes.train_deepspeed", "--ds-config", str(path), "--steps", str(steps),
           "--out", str(out), "--max-chars", "300000", "--rss-every", str(RSS_EVERY)] + ([] if section else ["--no-plugins"])
    env = dict(os.environ, MOE_PLUGINS_CACHE=str(cache), OMP_NUM_THREADS="1", **MALLOC_ENV)
    started = time.time()
    with open(work / f"{name}.log", "w") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        samples: List[Dict[str, Any]] = []
        while agent.poll() is None:
            time.sleep(1.0)
            steps_file = out / "steps.jsonl"
            step = len(steps_file.read_text().splitlines()) if steps_file.exists() else 0
            try:
                workers = sorted(psutil.Process(agent.pid).children(), key=lambda p: p.pid)
                rss = [p.memory_info().rss / 2 ** 20 for p in workers]
            except psutil.Error:
                continue
            if len(rss) == 4:
                samples.append({"step": step, "rss_mb": rss})
    if agent.returncode != 0:
        raise RuntimeError(f"{name} failed: see {work / (name + '.log')}")
    losses = [json.loads(line)["loss"] for line in (out / "steps.jsonl").read_text().splitlines()]
    plugin = json.loads((out / "report.json").read_text()).get("plugin")       # each layer's schedule and degree
    fixed = [[json.loads(line) for line in (out / f"rss-rank{r}.jsonl").read_text().splitlines()] for r in range(4)]
    return {"losses": losses, "rss": samples, "rss_fixed": [[[s["step"], s["rss_mb"]] for s in rank] for rank in fixed],
            "seconds": time.time() - started, "plugin": plugin, "malloc_env": MALLOC_ENV}


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}    # glibc's default, not raised: see the module docstring
RSS_EVERY = 10      # steps between a worker's own RSS samples (after its optimizer step: one phase of the step)


START = 200         # warm-up steps: RSS growth is measured from here
WINDOW = 200        # steps per RSS window: a step's RSS swings by ~110 MiB (~14%) between forward and backward


def growth(samples: List[Dict[str, Any]], start_step: int, steps: int) -> List[float]:
    """Per rank: RSS at the last sample taken while training (before the last step's line: not in teardown)
    over RSS at the first sample at or after ``start_step``, minus 1. Two point samples: this measures where
    in its step each sample fell as much as growth (see ``window_growth``)."""
    training = [s for s in samples if s["step"] < steps]
    first = next(s for s in training if s["step"] >= start_step)
    return [b / a - 1.0 for a, b in zip(first["rss_mb"], training[-1]["rss_mb"])]


def window_growth(samples: List[Dict[str, Any]], start_step: int, steps: int, stat: str) -> List[float]:
    """Per rank: ``stat`` ("median" or "peak") of the RSS samples in the last ``WINDOW`` training steps over the
    same statistic in the ``WINDOW`` steps from ``start_step``, minus 1; samples reading 0 (a worker being
    reaped) are skipped. Phase-independent: every window holds samples from every part of a step."""
    def stat_of(lo: int, hi: int, rank: int) -> float:
        values = [s["rss_mb"][rank] for s in samples if lo <= s["step"] < hi and s["rss_mb"][rank] > 0]
        return statistics.median(values) if stat == "median" else max(values)
    ranks = range(len(samples[0]["rss_mb"]))
    return [stat_of(steps - WINDOW, steps, r) / stat_of(start_step, start_step + WINDOW, r) - 1.0 for r in ranks]


def fixed_growth(fixed: List[List[List[float]]], start_step: int, steps: int) -> List[float]:
    """Per rank: median of the fixed-phase samples of the last ``WINDOW`` steps over the median of those of the
    ``WINDOW`` steps from ``start_step``, minus 1."""
    def median(rank: List[List[float]], lo: int, hi: int) -> float:
        return statistics.median(mb for step, mb in rank if lo <= step < hi)
    return [median(rank, steps - WINDOW, steps) / median(rank, start_step, start_step + WINDOW) - 1.0
            for rank in fixed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--from-json", type=Path, help="re-summarize the runs stored in this long-run.json")
    args = p.parse_args()
    if args.from_json:
        results = json.loads(args.from_json.read_text())["runs"]
        args.steps = len(results["stock"]["losses"])
        write(results, args.steps, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        subprocess.run([sys.executable, "-m", "moe_plugins.tools.cli", "profile", "--world", "4",
                        "--ranks-per-node", "4", "--ep", "2", "--cache-dir", str(cache), "--no-plot",
                        "--no-progress"], cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        results = {name: run(name, section, args.steps, work, cache) for name, section in RUNS.items()}
    write(results, args.steps, args.out)


def write(results: Dict[str, Dict[str, Any]], steps: int, out: Path) -> None:
    report = summarize(results, steps)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long-run.json").write_text(json.dumps({"report": report, "runs": results}, indent=1))
    (out / "long-run.md").write_text(markdown(report))
    plot(results, out / "long-run.png")
    print(markdown(report))


def summarize(results: Dict[str, Dict[str, Any]], steps: int) -> Dict[str, Any]:
    stock = results["stock"]["losses"]
    every = list(range(0, steps, 100)) + [steps - 1]
    rel = {name: max(abs(r["losses"][i] - stock[i]) / abs(stock[i]) for i in every)
           for name, r in results.items() if name != "stock"}
    rss = {name: growth(r["rss"], START, steps) for name, r in results.items()}
    median = {name: window_growth(r["rss"], START, steps, "median") for name, r in results.items()}
    peak = {name: window_growth(r["rss"], START, steps, "peak") for name, r in results.items()}
    fixed = {name: fixed_growth(r["rss_fixed"], START, steps) for name, r in results.items() if "rss_fixed" in r}
    return {"steps": steps, "checked_steps": every, "max_rel_loss_diff_vs_stock": rel,
            "rss_growth_200_to_end": rss, "rss_median_growth": median, "rss_peak_growth": peak,
            "rss_fixed_phase_growth": fixed, "seconds": {n: r["seconds"] for n, r in results.items()},
            "final_rss_mb": {n: [s for s in r["rss"] if s["step"] < steps][-1]["rss_mb"] for n, r in results.items()},
            "plugin": {n: r["plugin"] for n, r in results.items()},
            "malloc_env": results["stock"].get("malloc_env", {})}


def markdown(report: Dict[str, Any]) -> str:
    end = report["steps"]
    lines = [f"# Long run: {end} steps, tiny GPT-2-MoE, DeepSpeed recipe, 4 CPU gloo ranks", "",
             f"RSS growth per rank, steps {START}-{START + WINDOW} against steps {end - WINDOW}-{end}: the median of "
             f"each worker's own samples at one point of its step (after the optimizer step, every {RSS_EVERY} "
             "steps: the target's measure); median and peak of the once-a-second outside samples in each window; "
             f"and the two outside point samples (first at step {START}, last in training; these depend on where in "
             "its step each sample fell).", "",
             "Allocator: " + (", ".join(f"`{k}={v}`" for k, v in report["malloc_env"].items()) or "glibc's defaults")
             + " in every worker.", "",
             "| run | wall s | RSS growth, fixed phase | RSS growth, window median | RSS growth, window peak "
             "| RSS growth, point samples | final RSS MB | max rel. loss diff vs stock (every 100th step) |",
             "|---|---|---|---|---|---|---|---|"]
    def pct(key: str, name: str) -> str:
        return ", ".join(f"{100 * x:+.2f}%" for x in report.get(key, {}).get(name, [])) or "-"
    for name in RUNS:
        final = ", ".join(f"{x:.0f}" for x in report["final_rss_mb"][name])
        diff = report["max_rel_loss_diff_vs_stock"].get(name)
        lines.append(f"| {name} | {report['seconds'][name]:.0f} | {pct('rss_fixed_phase_growth', name)} | "
                     f"{pct('rss_median_growth', name)} | "
                     f"{pct('rss_peak_growth', name)} | {pct('rss_growth_200_to_end', name)} | {final} | "
                     f"{'-' if diff is None else f'{diff:.2e}'} |")
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, Dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_rss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        ax_loss.plot(r["losses"], label=name, lw=0.8)
        colour = ax_loss.lines[-1].get_color()
        for rank, samples in enumerate(r["rss_fixed"]):
            ax_rss.plot([s for s, _ in samples], [mb for _, mb in samples], lw=0.7, color=colour,
                        label=f"{name} (4 ranks)" if rank == 0 else None)
    ax_loss.set(xlabel="step", ylabel="loss", title="losses (overlaid)")
    ax_rss.set(xlabel="step", ylabel="RSS (MiB)", title="RSS per rank after its optimizer step, every 10 steps")
    ax_loss.legend()
    ax_rss.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(0)     # not interpreter finalization: see moe_plugins.core.rank_exit
