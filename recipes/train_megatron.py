"""Train BERT-MoE or GPT-2-MoE with Megatron-core: its MoE layers, parallel state, DistributedDataParallel and
optimizer; ``--moe-plugins`` turns the plugin on.

    # GPU: one node of 8 GPUs (torchrun on every node for more)
    torchrun --nproc-per-node 8 -m moe_plugins.recipes.train_megatron --model gpt2-moe --size gpt2 \
        --tp 1 --ep 8 --moe-plugins '{"schedule": "baseline", "ranks_per_node": 8}' --steps 1000
    # CPU, 4 gloo ranks (development only: Megatron-core has no CPU path, --cpu-shims patches it)
    torchrun --standalone --nproc-per-node 4 -m moe_plugins.recipes.train_megatron --cpu-shims \
        --model gpt2-moe --size tiny --ep 2 --moe-plugins '{"schedule": "baseline"}' --steps 60

The MoE layers are Megatron-core ``MoELayer`` s (stock spec) or the plugin's layers (``--moe-plugins``: the
``moe_plugins`` section as JSON or a file, the schema of the DeepSpeed section) on the groups of
``parallel_state.initialize_model_parallel(--tp, --ep, --etp)``; the dense layers are HF modules replicated
over TP (see ``megatron_moe``). Checkpoints every ``--save-every`` steps (one file per rank: model, optimizer,
RNG, step); ``--resume`` continues from the latest one in ``--ckpt-dir`` with the same losses, because the
batch of a step is a pure function of (step, DP rank, seed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.groups import group_timeout
from moe_plugins.core.layout import layout_problems
from moe_plugins.core.plugin_config import PluginConfig
from moe_plugins.patches.megatron import FLAG, extra_args_provider, resolve_plugin
from moe_plugins.patches.megatron_compat import megatron_compat

from moe_plugins.recipes import data, models, report
from moe_plugins.recipes.megatron_moe import MegatronMoESettings, megatron_moe_factory, plugin_summary
from moe_plugins.recipes.train_deepspeed import add_dist_timeout, make_batch

DEFAULT_CLIP = 1.0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt2-moe", "bert-moe"], default="gpt2-moe")
    p.add_argument("--size", choices=sorted(models.SIZES), default="tiny")
    p.add_argument("--seq-len", type=int, default=None, help="override the size's sequence length")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per DP rank and step")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (MoE layers: sequence parallel)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree")
    p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel degree")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clip-grad", type=float, default=None,
                   help=f"gradient-norm clipping (default {DEFAULT_CLIP}; 0 with --cpu-shims, where Megatron's "
                        "clipping needs CUDA tensors)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron DDP reduces gradient buckets during backward (on whenever the plugin's lina "
                        "section is set: Lina reorders those reductions behind the all-to-alls)")
    data.add_corpus_args(p)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--out", default="runs/megatron-gpt2-moe", help="folder for steps.jsonl, report.json/.png")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/moe_plugins"))
    p.add_argument("--cpu-shims", action="store_true",
                   help="DEVELOPMENT ONLY: run Megatron-core on CPU with gloo through the test/bench shims of "
                        "moe_plugins.patches.megatron_cpu (never applied otherwise)")
    extra_args_provider(p)                                           # --moe-plugins <json or path>
    add_dist_timeout(p)
    return p.parse_args(argv)


# ---- checks at the boundary (pure) ---------------------------------------------------------------------------

def clip_grad(args: argparse.Namespace) -> float:
    """The clipping threshold: the flag, else 1.0 on GPU and 0 (off) with the CPU shims."""
    if args.clip_grad is not None:
        return args.clip_grad
    return 0.0 if args.cpu_shims else DEFAULT_CLIP


def run_problems(args: argparse.Namespace, size: models.ModelSize, *, world: int, ranks_per_node: int,
                 cuda: bool) -> List[str]:
    """Every reason this run cannot start, each naming the flag and its value (empty when fine)."""
    problems = []
    if not cuda and not args.cpu_shims:
        problems.append("no CUDA device: Megatron-core has no CPU path; pass --cpu-shims to run on CPU with gloo "
                        "(development only)")
    if args.cpu_shims and clip_grad(args) > 0:
        problems.append(f"--clip-grad ({args.clip_grad}) must be 0 with --cpu-shims: Megatron's gradient clipping "
                        "asserts CUDA tensors")
    problems += [f"--tp/--ep/--etp: {p}" for p in layout_problems(world, ranks_per_node, args.tp, args.ep, args.etp)]
    problems += size_problems(args, size)
    for flag in ("micro_batch_size", "steps", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"--{flag.replace('_', '-')} ({value}) must be >= 1")
    if args.save_every and not args.ckpt_dir:
        problems.append(f"--save-every ({args.save_every}) needs --ckpt-dir")
    if args.resume and not args.ckpt_dir:
        problems.append("--resume needs --ckpt-dir")
    return problems


def size_problems(args: argparse.Namespace, size: models.ModelSize) -> List[str]:
    """The model size against the parallel degrees (sequence parallelism splits the sequence over TP)."""
    checks = (("heads", size.heads, "--tp", args.tp), ("experts", size.experts, "--ep", args.ep),
              ("ffn", size.ffn, "--etp", args.etp), ("sequence length", size.seq_len, "--tp", args.tp))
    return [f"{what} of --size {args.size} ({value}) must be divisible by {flag} ({degree})"
            for what, value, flag, degree in checks if degree >= 1 and value % degree]


# ---- the model -----------------------------------------------------------------------------------------------

def wrap(config: Any, hf_model: torch.nn.Module) -> torch.nn.Module:
    """The HF model as the MegatronModule that DistributedDataParallel and the optimizer expect."""
    from megatron.core.transformer.module import MegatronModule

    class RecipeModel(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.hf = hf_model

        def forward(self, **batch):
            return self.hf(**batch)
    return RecipeModel()


def build_model(args, size: models.ModelSize, vocab_size: int, settings: MegatronMoESettings, pgc: Any,
                partitions: bool = False):
    """The HF model with Megatron MoE layers (same initial weights on every rank and in every run) and the list
    of those layers. ``partitions``: Lancet's batch partitions run the blocks (GPT-2 then builds no KV cache)."""
    moe_layers: list = []
    factory = megatron_moe_factory(size, settings, pgc, moe_layers)
    torch.manual_seed(args.seed)
    if args.model == "gpt2-moe":
        hf_model = models.build_gpt2_moe(size, vocab_size, factory, use_cache=False if partitions else None)
    else:
        hf_model = models.build_bert_moe(size, vocab_size, factory)
    return wrap(moe_layers[0].config, hf_model), moe_layers


def plugin_model_hooks(module, moe_layers, micro_batch: int) -> None:
    """With Lancet's ``dense_wgrad``: the HF model's dense Linear / Conv1D layers defer their dW too (its
    attention and MLPs are not Megatron's parallel linears, which the enabled plugin wraps when they are built).
    With Lancet's ``partitions``: the HF blocks run partition by partition after each gate (``micro_batch``
    samples per rank). With Hecate's ``prefetch``: the HF blocks holding MoE layers issue their early gather."""
    from moe_plugins.patches.megatron import active
    handle = active()
    if handle is not None and handle.lancet is not None and handle.lancet.partitions is not None:
        handle.lancet.partitions.wrap_model(module, moe_layers, micro_batch=micro_batch)
    if handle is not None and handle.lancet is not None and handle.lancet.dense is not None:
        handle.lancet.dense.wrap_model(module, moe_layers)
    if handle is not None and handle.early is not None:      # Hecate's early gather: when each HF block starts
        handle.early.wrap_model(module)


def make_optimizer(args, model, pgc: Any):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, params_dtype=torch.float32,
                             clip_grad=clip_grad(args))
    return get_megatron_optimizer(config, [model], use_gloo_process_groups=False, pg_collection=pgc)


# ---- checkpoints: one file per rank, `latest` written by rank 0 once every rank has saved ----------------------

CKPT_META = ("model", "size", "world", "tp", "ep", "etp")


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, meta: Dict[str, Any]) -> None:
    rank = dist.get_rank()
    folder = ckpt_dir / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": torch.get_rng_state(), "meta": {k: meta[k] for k in CKPT_META}}
    tmp = folder / f".rank{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / f"rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (ckpt_dir / ".latest.tmp").write_text(f"step{step}\n")
        os.replace(ckpt_dir / ".latest.tmp", ckpt_dir / "latest")


def load_checkpoint(ckpt_dir: Path, model, optimizer, meta: Dict[str, Any]) -> int:
    """Restore the latest checkpoint; returns its step (0, and a message, when there is none)."""
    latest = ckpt_dir / "latest"
    if not latest.exists():
        if dist.get_rank() == 0:
            print(f"--resume: no checkpoint in {ckpt_dir}; starting at step 0")
        return 0
    path = ckpt_dir / latest.read_text().strip() / f"rank{dist.get_rank():05d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = state["meta"]
    differ = [f"{k} ({saved[k]!r} in the checkpoint, {meta[k]!r} now)" for k in CKPT_META if saved[k] != meta[k]]
    if differ:
        raise ValueError(f"checkpoint {path} was saved by another run: " + "; ".join(differ))
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


# ---- the run -------------------------------------------------------------------------------------------------

def _init_distributed(cpu_shims: bool, timeout_s: float) -> bool:
    """Join the job torchrun started (gloo with the CPU shims, NCCL on GPUs); False when already joined."""
    if dist.is_initialized():
        return False
    if not cpu_shims:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if cpu_shims else "nccl", timeout=timedelta(seconds=timeout_s))
    return True


def _mean_over(t: torch.Tensor, group: Any) -> float:
    t = t.detach().float().clone()
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


def _shims(cpu_shims: bool):
    """The CPU shims (model, optimizer), or null contexts: only the explicit flag imports them."""
    if not cpu_shims:
        return contextlib.nullcontext(), contextlib.nullcontext
    from moe_plugins.patches.megatron_cpu import megatron_on_cpu, megatron_optimizer_on_cpu
    return megatron_on_cpu(), megatron_optimizer_on_cpu


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    plugin = resolve_plugin(args.moe_plugins, FLAG) if args.moe_plugins is not None else None
    size = models.SIZES[args.size]
    size = replace(size, seq_len=args.seq_len or size.seq_len)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rpn = (plugin.ranks_per_node if plugin else None) or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    problems = run_problems(args, size, world=world, ranks_per_node=rpn, cuda=torch.cuda.is_available())
    if problems:
        raise ValueError("train_megatron: " + "; ".join(problems))
    model_shims, optimizer_shims = _shims(args.cpu_shims)
    owns_dist = _init_distributed(args.cpu_shims, args.dist_timeout)
    try:
        with model_shims, megatron_compat(), group_timeout(timedelta(seconds=args.dist_timeout)):
            return _train(args, size, plugin, rpn, optimizer_shims)
    finally:
        if owns_dist:
            dist.destroy_process_group()


def load_text(args, size: models.ModelSize):
    """The tokenizer and the corpus cut into blocks of the size's sequence length."""
    cache = Path(args.cache_dir)
    tokenizer = data.gpt2_tokenizer(cache) if args.model == "gpt2-moe" else data.bert_tokenizer(cache)
    max_chars = args.max_chars or None
    text = (data.hf_dataset_text(args.hf_dataset, max_chars=max_chars) if args.hf_dataset
            else data.read_corpus(data.corpus_files(args.data), max_chars))
    return tokenizer, data.TokenBlocks.from_text(text, tokenizer, size.seq_len)


def _train(args, size: models.ModelSize, plugin, rpn: int, optimizer_shims) -> Dict[str, Any]:
    """Megatron's parallel state for the duration of the run (torn down after, also on error)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if args.cpu_shims:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rpn))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep,
                                             expert_tensor_parallel_size=args.etp,
                                             distributed_timeout_minutes=args.dist_timeout / 60,
                                             create_gloo_process_groups=False)
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        from moe_plugins.hecate.config import lane_on, reshard_interval
        if plugin is None or not plugin.enabled or (plugin.lina is None and plugin.lancet is None
                                                    and not reshard_interval(plugin) and not lane_on(plugin)):
            from moe_plugins.patches.megatron_engines import LayoutEngines
            with LayoutEngines() as engines:               # pipelined layers' lanes, freed when training ends
                settings = MegatronMoESettings(tp=args.tp, ep=args.ep, etp=args.etp, plugin=plugin,
                                               ranks_per_node=rpn, seed=args.seed, engines=engines)
                return _run(args, size, settings, pgc, optimizer_shims, plugin)
        # Lina patches Megatron's DDP, Lancet its linear layers and blocks and shares one dW queue, Hecate's
        # re-sharding the optimizer's step and its early gather hooks the blocks: build the model (Megatron's own
        # spec, replaced by the plugin's) and train inside enable(), which closes their engines when training ends
        from moe_plugins.patches.megatron import enable
        settings = MegatronMoESettings(tp=args.tp, ep=args.ep, etp=args.etp, plugin=None, ranks_per_node=rpn,
                                       seed=args.seed)
        with enable(plugin, ranks_per_node=rpn) as handle:
            return _run(args, size, settings, pgc, optimizer_shims, plugin, handle)
    finally:
        parallel_state.destroy_model_parallel()


def _run(args, size: models.ModelSize, settings: MegatronMoESettings, pgc: Any, optimizer_shims,
         plugin: Optional[PluginConfig], handle: Any = None) -> Dict[str, Any]:
    """``handle``: the enabled plugin, if any (with Hecate's re-sharding or Lina's packing, checkpoints are written
    and read with the experts on their stock owners)."""
    resharding = handle.hecate if handle is not None else None
    packing = handle.lina.packing if handle is not None and handle.lina is not None else None
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    device = torch.device("cpu") if args.cpu_shims else torch.device("cuda", torch.cuda.current_device())
    tokenizer, blocks = load_text(args, size)
    partitions = handle is not None and handle.lancet is not None and handle.lancet.partitions is not None
    module, moe_layers = build_model(args, size, len(tokenizer), settings, pgc, partitions)
    plugin_model_hooks(module, moe_layers, args.micro_batch_size)
    module.to(device)
    overlap = args.overlap_grad_reduce or (plugin is not None and plugin.enabled and plugin.lina is not None)
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=overlap), module,
                                    pg_collection=pgc)
    with optimizer_shims():
        optimizer = make_optimizer(args, model, pgc)
    meta = {"model": args.model, "size": models.describe(size), "world": dist.get_world_size(), "tp": args.tp,
            "ep": args.ep, "etp": args.etp, "host": "megatron-core", "clip_grad": clip_grad(args),
            "moe_plugins": plugin.to_dict() if plugin else None, "plugin": plugin_summary(moe_layers)}
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir else None
    if args.resume and resharding is not None:
        resharding.to_stock()          # the files hold every expert on its stock owner
    with packing.stock_homes() if packing is not None and args.resume else contextlib.nullcontext():
        start = load_checkpoint(ckpt, model, optimizer, meta) if args.resume else 0
    log = report.RunLog(rank=dist.get_rank(), total=args.steps, start=start, out=Path(args.out), meta=meta)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        batch = make_batch(args, blocks, tokenizer, step, args.micro_batch_size, pgc.dp.rank(), pgc.dp.size())
        loss = train_step(model, optimizer, {k: v.to(device) for k, v in batch.items()}, pgc, optimizer_shims)
        log.step(step, _mean_over(loss, pgc.dp), time.perf_counter() - t0)
        if ckpt is not None and args.save_every and (step + 1) % args.save_every == 0:
            stock = resharding or packing
            with stock.stock_homes() if stock is not None else contextlib.nullcontext():
                save_checkpoint(ckpt, step + 1, model, optimizer, meta)
    if partitions:                     # Lancet's batch partitions: the ranges run and the partition counts chosen
        executors = handle.lancet.partitions.executors
        log.meta["lancet_partitions"] = {"ranges": sum(e.ranges_run for e in executors),
                                         "chosen": sorted({k for e in executors for k in e.chosen})}
    if handle is not None and handle.early is not None:        # the MoE layers whose block issues the early gather
        log.meta["hecate_early_blocks"] = len(handle.early.hooked)
        schedules = [getattr(getattr(m, "token_dispatcher", None), "schedule", None) for m in model.modules()]
        log.meta["hecate_regathers"] = [s.regathers for s in schedules if hasattr(s, "regathers")]   # rematerialize
    if packing is not None:            # Lina's packing: where it ended and the decisions of "auto"
        log.meta["lina_packing"] = [{"packing": p.controller.packing, "regroups": p.regroups,
                                     "decisions": [[s, a, b] for s, _, a, b in p.controller.decisions]}
                                    for p in packing.packers]
    if resharding is not None:         # where Hecate's re-sharding left each layer's experts, and how often it ran
        layers = [s for r in resharding.resharders for s, _ in r.layers]
        log.meta["hecate_reshard"] = {"homes": [list(s.homes) for s in layers], "reshards": sum(
            r.rounds for r in resharding.resharders), "window_load": [list(s.window_load()) for s in layers],
            "copied": [list(s.overlappable(s.window_load())) for s in layers]}
    return log.finish(Path(args.out)) if dist.get_rank() == 0 else {}


def train_step(model, optimizer, batch: Dict[str, torch.Tensor], pgc: Any, optimizer_shims) -> torch.Tensor:
    """One step through Megatron's DDP and optimizer; returns this rank's LM loss. Megatron's aux loss joins the
    gradients through its router (``MoEAuxLossAutoScaler``)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    finalize_model_grads([model], pg_collection=pgc)
    with optimizer_shims():
        ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("Megatron's optimizer skipped a step (non-finite gradients)")
    clear_aux_losses_tracker()
    return loss.detach()


if __name__ == "__main__":
    main()
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(0)     # not interpreter finalization: see moe_plugins.core.rank_exit
