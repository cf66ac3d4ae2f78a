"""Pool jobs for tests/test_lancet_blocks.py: a tiny HF GPT-2 (fp64, dropout on, eager attention) whose blocks 1
and 3 hold the core MoE layer (EP over every rank), run stock and with Lancet's block executor
(moe_plugins/lancet/blocks.py) cut into batch partitions, from the same weights, tokens and RNG state.

Shapes: B samples, L tokens per sample, M model dim.
"""

from __future__ import annotations

from typing import Any, Dict, List

AUX_COEF = 0.01


def _model(parts_moe: List[int], groups, engine, dropout: float, attn: str):
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    from moe_plugins.core.config import MoEConfig
    from moe_plugins.core.experts import init_full_weights
    from moe_plugins.core.layer import MoELayer

    class CoreMoE(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer, self.last_aux = layer, None

        def forward(self, h_BLM):
            o = self.layer(h_BLM)
            self.last_aux = o.aux_loss
            return o.y

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=4, n_head=2, n_inner=12, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation=attn)
    model = GPT2LMHeadModel(cfg).double()
    config = MoEConfig(hidden=8, ffn=12, num_experts=8, k=2, capacity_factor=1.0, min_capacity=0, drop_tokens=True,
                       activation="gelu")
    gen = torch.Generator().manual_seed(1)
    for i in parts_moe:
        layer = MoELayer(config, groups, dtype=torch.float64, engine=engine, name=f"moe{i}")
        wg = torch.randn(8, 8, generator=gen, dtype=torch.float64)
        wg[0] += 3.0                                      # skewed towards expert 0: drops
        layer.load_full(wg, init_full_weights(8, 8, 12, gen, torch.float64))
        model.transformer.h[i].mlp = CoreMoE(layer)
    return model


def _step(model, ids, seed: int):
    import torch
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    aux = sum(model.transformer.h[i].mlp.last_aux for i in (1, 3))
    (out.loss + AUX_COEF * aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(out.loss.detach()), float(aux.detach()), grads


def stock_and_partitioned(jobs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per job (parts, dropout, batch): this rank's loss, aux loss and every parameter's gradient, stock and with
    the block executor; how many ranges it ran; whether the blocks were restored after ``remove``."""
    import torch

    from moe_plugins.core.engine import build_engine
    from moe_plugins.core.groups import process_groups
    from moe_plugins.core.layout import ParallelLayout
    from moe_plugins.lancet.blocks import BlockExecutor
    from moe_plugins.lancet.partition import layer_start

    out = []
    for job in jobs:
        world = torch.distributed.get_world_size()
        with process_groups(ParallelLayout(world=world, ranks_per_node=2, ep=world)) as groups:
            engine = build_engine(groups, pipeline=True, timeout_s=60)
            try:
                model = _model([1, 3], groups, engine, job["dropout"], "eager")
                model.train()
                gen = torch.Generator().manual_seed(100 + groups.global_rank)
                ids = torch.randint(0, 32, (job["batch"], 8), generator=gen)
                stock = _step(model, ids, seed=5)

                def start_moe(block, h_BLM, parts):
                    call = layer_start(block.mlp.layer, h_BLM, parts, rows_per_sample=h_BLM.shape[1])
                    block.mlp.last_aux = call.aux_loss
                    return call

                parts = job["parts"]
                if parts == "auto":      # the planner's model: exchanges like the compute behind them: k > 1 wins
                    from moe_plugins.lancet.auto import AutoPartitions, StackFacts
                    from moe_plugins.lancet.plan import LancetCosts
                    facts = StackFacts(M=8, H=12, heads=2, E=8, k=2, f=1.0, P=world, layers=4, moe_every=2,
                                       element_bytes=8)
                    parts = AutoPartitions(facts, LancetCosts(alpha_a=1e-5, beta_a=1e-6, alpha_c=1e-6, beta_c=1e-7),
                                           "test costs")
                executor = BlockExecutor(model.transformer.h, [1, 3], start_moe, parts).install()
                try:
                    parted = _step(model, ids, seed=5)
                    again = _step(model, ids, seed=6)        # another dropout draw: the executor must follow it
                finally:
                    executor.remove()
                other = _step(model, ids, seed=6)
                planned = list(parts.choose(job["batch"], 8)) if job["parts"] == "auto" else [parts] * 2
                out.append({"stock": stock, "parted": parted, "again": again, "other": other,
                            "ranges": executor.ranges_run, "chosen": executor.chosen, "planned": planned,
                            "restored": all("forward" not in vars(b) for b in model.transformer.h)})
            finally:
                engine.close()
    return out
