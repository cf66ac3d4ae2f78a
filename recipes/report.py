"""Per-step progress (a bar plus one line per step) and the run report: report.json and report.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List


class RunLog:
    """Collects (step, loss, seconds); only rank 0 prints and writes."""

    def __init__(self, *, rank: int, total: int, start: int, meta: Dict[str, Any], out: Path):
        self.rank, self.meta = rank, meta
        self.steps: List[Dict[str, float]] = []
        self.bar = None
        self.jsonl = None
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(out / "steps.jsonl", "a", encoding="utf-8")   # survives a kill: one line per step
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
            layers = meta.get("plugin")
            if layers is None:
                self.bar.write("moe_plugins: off (stock layers)")
            for rec in layers or []:
                self.bar.write(f"moe_plugins: {rec['layer']}: schedule {rec['schedule']}, pipeline degree "
                               f"{rec['pipeline_degree']}, mp={rec['mp']} ep={rec['ep']} esp={rec['esp']} "
                               f"E={rec['num_experts']} k={rec['k']}" + (
                                   f", Lina packing {rec['lina_packing']} ({rec['experts_per_rank']} experts per "
                                   "rank)" if "lina_packing" in rec else ""))

    def step(self, step: int, loss: float, seconds: float) -> None:
        self.steps.append({"step": step, "loss": loss, "time_s": seconds})
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(self.steps[-1]) + "\n")
            self.jsonl.flush()
        if self.bar is not None:
            self.bar.write(f"step {step:4d} | loss {loss:8.4f} | {seconds * 1000:7.1f} ms")
            self.bar.set_postfix(loss=f"{loss:.3f}")
            self.bar.update(1)

    def finish(self, out: Path) -> Dict[str, Any]:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        out.mkdir(parents=True, exist_ok=True)
        losses = [s["loss"] for s in self.steps]
        n = min(10, len(losses) // 2)
        summary = {"first10_mean": sum(losses[:n]) / n, "last10_mean": sum(losses[-n:]) / n} if n else {}
        result = {**self.meta, "steps": self.steps, "summary": summary}
        (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
        _plot(self.steps, out / "report.png")
        if summary:
            print(f"loss: first-10 mean {summary['first10_mean']:.4f} -> last-10 mean {summary['last10_mean']:.4f}"
                  f"; report in {out}/report.json and report.png")
        return result


class RssLog:
    """Every ``every`` steps, this rank's resident set size at the same point of its step (after the optimizer
    step), one JSON line in ``out/rss-rank{rank}.jsonl``: a step's RSS swings by ~14% between forward and
    backward, so samples taken at random points measure the phase as much as the growth."""

    def __init__(self, *, rank: int, every: int, out: Path):
        self.every, self.file = every, None
        if every > 0:
            import psutil
            out.mkdir(parents=True, exist_ok=True)
            self.process = psutil.Process()
            self.file = open(out / f"rss-rank{rank}.jsonl", "a", encoding="utf-8")

    def step(self, step: int) -> None:
        if self.file is not None and step % self.every == 0:
            self.file.write(json.dumps({"step": step, "rss_mb": self.process.memory_info().rss / 2 ** 20}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _plot(steps: List[Dict[str, float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    xs = [s["step"] for s in steps]
    a.plot(xs, [s["loss"] for s in steps])
    a.set_xlabel("step"), a.set_ylabel("loss"), a.set_title("training loss")
    b.plot(xs, [s["time_s"] * 1000 for s in steps])
    b.set_xlabel("step"), b.set_ylabel("ms"), b.set_title("step time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
