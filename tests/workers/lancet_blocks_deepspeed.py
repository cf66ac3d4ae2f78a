"""Jobs for tests/test_lancet_blocks_deepspeed.py, run on pool ranks: the recipes' GPT-2-MoE (HF GPT-2 blocks with
DeepSpeed's MoE every other block) in fp64 under ZeRO-2 with dropout on, trained by stock DeepSpeed and by the
plugin with Lancet's batch partitions, from the same weights, batches and RNG state.

Shapes: B samples per rank, L tokens per sample.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Dict, Optional

import torch

from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
from tests.workers.deepspeed import count_zero_hooks, micro_steps

VOCAB, SEQ = 64, 8


def _model(bert: bool = False):
    from deepspeed.moe.layer import MoE

    from recipes import models
    size = models.ModelSize(layers=4, hidden=16, heads=2, ffn=24, seq_len=SEQ, experts=4, k=2, capacity_factor=1.0)

    def factory(hidden, expert):
        return MoE(hidden, expert, num_experts=size.experts, ep_size=4, k=size.k, capacity_factor=size.capacity_factor,
                   min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
    torch.manual_seed(0)
    if bert:
        return models.build_bert_moe(size, VOCAB, factory, dropout=0.1, attn_implementation="eager")
    return models.build_gpt2_moe(size, VOCAB, factory, dropout=0.1, attn_implementation="eager", use_cache=False)


def measure_profile(handle, profile_dir: str) -> None:
    """Collective: ``moe-plugins profile``'s measurement (the all-to-all on EP and the GEMM only, few sizes) for the
    layout the plugin will give the model's layers, cached in ``profile_dir`` for ``handle`` to read."""
    import torch.distributed as dist

    from moe_plugins.core.layout import ParallelLayout
    from tests.workers.profiles import measure_ep_profile
    world = dist.get_world_size()
    measure_ep_profile(ParallelLayout(world=world, ranks_per_node=handle.ranks_per_node or world, ep=world),
                       profile_dir)
    handle.profile_dir = profile_dir


def train(plugin: Optional[Dict[str, Any]], steps: int, gas: int = 1, micro_batch: int = 4,
          profile_dir: Optional[str] = None, stage: int = 2, bert: bool = False,
          dtype: torch.dtype = torch.float64) -> Dict[str, Any]:
    """A fresh ZeRO-``stage`` engine in ``dtype`` (the plugin enabled iff ``plugin`` is a section): per micro-step
    the loss and the ZeRO reduction hook's calls per parameter, the reduced gradients at each boundary, the
    executor's ranges, Lina's micro-ops submitted. ``profile_dir``: a cost profile is measured and cached there
    first (``"partitions": "auto"``)."""
    import deepspeed

    import moe_plugins
    from recipes.models import moe_aux_loss
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas,
              "steps_per_print": 10 ** 6, "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    if plugin is not None:
        config["moe_plugins"] = plugin
    out: Dict[str, Any] = {}
    init_deepspeed_comm()           # as the other DeepSpeed workers: no JIT build of DeepSpeed's unused shm op
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
        if profile_dir is not None:
            measure_profile(handle, profile_dir)
        model = _model(bert).to(dtype)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        calls: Dict[str, int] = {}
        stack.enter_context(count_zero_hooks(engine, calls))
        rank = torch.distributed.get_rank()

        def loss_of(micro: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(1000 * micro + rank)
            ids = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=gen)
            torch.manual_seed(77 + micro)                    # dropout's draws, the same in every run
            o = engine(input_ids=ids, labels=ids)
            return o.loss + 0.01 * moe_aux_loss(engine.module)

        out["losses"], out["grads"], out["hook_calls"] = micro_steps(engine, steps * gas, loss_of, False, calls)
        executors = [] if handle is None else handle.lancet.executors
        out["ranges"] = [e.ranges_run for e in executors]
        out["stock_calls"] = [e.stock_calls for e in executors]
        out["chosen"] = [sorted(set(e.chosen)) for e in executors]
        out["tuned"] = [e.parts.decisions() for e in executors if hasattr(e.parts, "decisions")]
        out["overlap_calls"] = 0 if handle is None else sum(o.calls for o in handle.lancet.overlaps)
        out["lina_submitted"] = 0 if handle is None else sum(s.submitted for s in handle.lina.engines)
        out["queue_empty"] = handle is None or handle.lancet.queue is None or handle.lancet.queue.empty()
        packers = [] if handle is None else [s.packer for s in handle.lina.engines if s.packer is not None]
        out["packing"] = [p.controller.packing for p in packers]
        out["local_experts"] = sorted({m.num_local_experts for m in model.modules() if hasattr(m, "deepspeed_moe")})
        out["dense"] = [] if handle is None else list(handle.lancet.dense)
        hecate = [] if handle is None else [s.schedule for s in handle.swapped_layers.values() if hasattr(s.schedule, "last")]
        out["hecate"] = [{"extra": s.last.extra_copies(), "overlap": s.overlap, "notes": s.notes(),
                          "regathers": s.regathers, "live_bytes": s.memory.live_bytes} for s in hecate]
        out["prefetch_hooks"] = 0 if handle is None else len(handle.hecate.handles)
        engine.destroy()
    out["restored"] = all("forward" not in vars(m) for m in model.modules())     # blocks and dense modules
    out["pre_hooks"] = {n: len(m._forward_pre_hooks) for n, m in model.named_modules()   # DeepSpeed's own, and
                        if m._forward_pre_hooks}                                            # none of Hecate's
    out["blocks"] = [type(b).__name__ for b in (model.bert.encoder.layer if bert else model.transformer.h)]
    return out


def refused(plugin: Dict[str, Any], micro_batch: int = 4, bert: bool = False, profile_dir: str = "",
            subclass: bool = False) -> str:
    """The error deepspeed.initialize raises for ``plugin`` (or "" when none), reading profiles in ``profile_dir``;
    ``subclass``: block 0's attention projection is a subclass of transformers' Conv1D."""
    import deepspeed

    import moe_plugins
    config = {"train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "moe_plugins": plugin}
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        stack.enter_context(moe_plugins.enable()).profile_dir = profile_dir or None
        model = _model(bert)
        if subclass:
            from transformers.pytorch_utils import Conv1D

            class ScaledConv1D(Conv1D):
                def forward(self, x):
                    return 2 * super().forward(x)
            attn = model.transformer.h[0].attn
            attn.c_proj = ScaledConv1D(*attn.c_proj.weight.shape[::-1])
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except ValueError as exc:
            return str(exc)
    return ""
