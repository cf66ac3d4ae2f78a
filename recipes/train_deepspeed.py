"""Train BERT-MoE or GPT-2-MoE with DeepSpeed; the ds_config's ``moe_plugins`` section turns the plugin on.

    torchrun --standalone --nproc-per-node 4 -m moe_plugins.recipes.train_deepspeed \
        --model gpt2-moe --size tiny --ds-config recipes/configs/gpt2_moe_tiny.json --steps 60

Checkpoints every ``--save-every`` steps (DeepSpeed's own format, per-expert files included) and resumes from
the latest one in ``--ckpt-dir``: the batch of a step is a pure function of (step, rank, seed) and the RNG state
travels in the checkpoint, so a resumed run reproduces the losses of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_plugins.core.groups import group_timeout
from moe_plugins.lancet.config import partitioned
from moe_plugins.recipes import data, models, report

AUX_COEF = 0.01


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt2-moe", "bert-moe"], default="gpt2-moe")
    p.add_argument("--size", choices=sorted(models.SIZES), default="tiny")
    p.add_argument("--ds-config", required=True, help="DeepSpeed JSON config (may hold a moe_plugins section)")
    p.add_argument("--no-plugins", action="store_true", help="ignore the moe_plugins section (stock DeepSpeed)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree of the MoE layers")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    data.add_corpus_args(p)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--out", default="runs/gpt2-moe", help="folder for report.json and report.png")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/moe_plugins"))
    p.add_argument("--rss-every", type=int, default=0, metavar="N",
                   help="every N steps, each rank logs its RSS after the optimizer step to OUT/rss-rankR.jsonl")
    add_dist_timeout(p)
    return p.parse_args(argv)


def add_dist_timeout(p: argparse.ArgumentParser) -> None:
    """``--dist-timeout``: how long any collective waits for a peer (the process group's timeout; the plugin's
    groups and communication threads take the same)."""
    p.add_argument("--dist-timeout", type=_seconds, default=1800.0, metavar="SECONDS",
                   help="seconds a collective waits for a stopped or dead peer before this rank fails "
                        "(default 1800, torch's)")


def init_deepspeed_dist(timeout_s: float) -> None:
    """DeepSpeed's communication backend, every collective waiting up to ``timeout_s``: NCCL on GPUs; gloo on CPU,
    without building DeepSpeed's shm all-reduce op, which nothing here uses (patches/deepspeed_host.py)."""
    import deepspeed
    if torch.cuda.is_available():
        deepspeed.init_distributed(dist_backend="nccl", timeout=timedelta(seconds=timeout_s))
    else:
        from moe_plugins.patches.deepspeed_host import init_deepspeed_comm
        init_deepspeed_comm(timeout=timedelta(seconds=timeout_s))


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--dist-timeout ({text!r}) must be a number of seconds > 0")
    return value


def lancet_partitions(ds_config: Dict[str, Any]) -> bool:
    """Whether the ds_config's ``moe_plugins`` section asks for Lancet's batch partitions (n > 1 or "auto"), which
    run GPT-2 forwards that build no KV cache."""
    section = ds_config.get("moe_plugins")
    lancet = section.get("lancet") if isinstance(section, dict) else None
    return isinstance(lancet, dict) and partitioned(lancet)


def build_model(args, size: models.ModelSize, vocab_size: int, use_cache: Optional[bool] = None):
    from deepspeed.moe.layer import MoE

    def factory(hidden, expert):
        return MoE(hidden, expert, num_experts=size.experts, ep_size=args.ep, k=size.k,
                   capacity_factor=size.capacity_factor, min_capacity=0, use_rts=False,
                   top2_2nd_expert_sampling=False)
    torch.manual_seed(args.seed)                  # same initial weights on every rank and in every run
    if args.model == "gpt2-moe":
        return models.build_gpt2_moe(size, vocab_size, factory, use_cache=use_cache)
    return models.build_bert_moe(size, vocab_size, factory)


def build_engine(args, size: models.ModelSize, vocab_size: int, ds_config: Dict[str, Any],
                 adjust: Optional[Callable[[torch.nn.Module], None]] = None) -> Any:
    """The recipe's model (``build_model``; ``adjust`` may change it before DeepSpeed sees it) under
    ``deepspeed.initialize`` with the recipe's optimizer (AdamW, MoE parameter groups split as DeepSpeed needs)."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    model = build_model(args, size, vocab_size, use_cache=False if lancet_partitions(ds_config) else None)
    if adjust is not None:
        adjust(model)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "parameters"})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def make_batch(args, blocks, tokenizer, step, batch_size, rank, world):
    ids = blocks.batches(step, batch_size, rank, world, args.seed)
    if args.model == "gpt2-moe":
        return {"input_ids": ids, "labels": ids}
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    inputs, labels = data.mask_tokens(ids, tokenizer, 0.15, gen)
    return {"input_ids": inputs, "labels": labels}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    with group_timeout(timedelta(seconds=args.dist_timeout)):    # DeepSpeed's own groups wait as long too
        return _main(args)


def _main(args: argparse.Namespace) -> Dict[str, Any]:
    ds_config = json.loads(Path(args.ds_config).read_text())
    plugin = None
    if "moe_plugins" in ds_config and not args.no_plugins:
        import moe_plugins
        plugin = moe_plugins.enable(ds_config)          # validates the section before patching anything
    if args.no_plugins:
        ds_config.pop("moe_plugins", None)
    init_deepspeed_dist(args.dist_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    size = models.SIZES[args.size]
    cache = Path(args.cache_dir)
    tokenizer = data.gpt2_tokenizer(cache) if args.model == "gpt2-moe" else data.bert_tokenizer(cache)
    max_chars = args.max_chars or None
    text = (data.hf_dataset_text(args.hf_dataset, max_chars=max_chars) if args.hf_dataset
            else data.read_corpus(data.corpus_files(args.data), max_chars))
    blocks = data.TokenBlocks.from_text(text, tokenizer, size.seq_len)
    engine = build_engine(args, size, len(tokenizer), ds_config)
    start = _resume(engine, args.ckpt_dir)
    batch_size = engine.train_micro_batch_size_per_gpu()
    log = report.RunLog(rank=rank, total=args.steps, start=start, out=Path(args.out), meta={
        "model": args.model, "size": models.describe(size), "world": world, "ep": args.ep,
        "ds_config": ds_config, "plugin": _plugin_summary(plugin)})
    rss = report.RssLog(rank=rank, every=args.rss_every, out=Path(args.out))
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        batch = make_batch(args, blocks, tokenizer, step, batch_size, rank, world)
        out, loss = forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        log.step(step, _mean_over_ranks(out.loss.detach()), time.perf_counter() - t0)
        rss.step(step)
        if args.ckpt_dir and args.save_every and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.ckpt_dir, tag=f"step{step + 1}",
                                   client_state={"step": step + 1, "rng": torch.get_rng_state()})
    result = log.finish(Path(args.out)) if rank == 0 else {}
    rss.close()
    if plugin is not None:
        plugin.disable()
    return result


def forward_loss(engine: Any, batch: Dict[str, torch.Tensor]) -> Tuple[Any, torch.Tensor]:
    """The model's output and the training loss (LM loss + aux loss) of a batch made on the CPU, moved to the
    engine's device first (DeepSpeed does not move inputs: on GPU the embedding would get CPU indices)."""
    out = engine(**{name: t.to(engine.device) for name, t in batch.items()})
    return out, out.loss + AUX_COEF * models.moe_aux_loss(engine.module)


def _resume(engine, ckpt_dir: Optional[str]) -> int:
    """Resume from ``ckpt_dir``'s latest tag, at the saved sizes or another world / ``--ep`` (ZeRO stage 0 fp32
    reshards per global expert; what cannot reshard is refused with both sizes named, before loading)."""
    if not ckpt_dir or not (Path(ckpt_dir) / "latest").exists():
        return 0
    from moe_plugins.patches import deepspeed_reshard
    _, client = deepspeed_reshard.load_checkpoint(engine, ckpt_dir)
    torch.set_rng_state(client["rng"])
    return int(client["step"])


def _mean_over_ranks(t: torch.Tensor) -> float:
    t = t.float().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _plugin_summary(plugin) -> Any:
    """One record per swapped MoE layer: its schedule, pipeline degree and layout (None when off), and Lina's
    expert packing where one is set (``lina_packing``: as configured; ``experts_per_rank`` now)."""
    if plugin is None:
        return None
    packers = [s.packer for s in plugin.lina.engines if s.packer is not None and s.packer.controller is not None]
    if not packers:
        return list(plugin.swaps)
    ctl = packers[0].controller                      # the recipe builds one engine
    return [dict(rec, lina_packing=packers[0].lina.packing, experts_per_rank=rec["num_experts"] // rec["ep"]
                 * ctl.packing) for rec in plugin.swaps]


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()      # NCCL wants it before exit; gloo frees its groups
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(0)     # not interpreter finalization: see moe_plugins.core.rank_exit
