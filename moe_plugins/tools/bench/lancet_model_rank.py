"""The rank side of Lancet's model-level bench (``benchmarks/lancet_model.py``; rows and cases in
:mod:`.lancet_model`).

One process per rank. The plugin is enabled once (``moe_plugins.enable(ledger=...)``: each engine's ds_config
section decides its layers, none: stock), then one DeepSpeed engine per row is built over its own copy of the
recipes' GPT-2-MoE (``recipes.models.build_gpt2_moe``, DeepSpeed's ``MoE`` with EP = world, top-k gates without
random token selection or second-expert sampling, dropout 0, ``use_cache`` off), every copy from the same seed,
its local experts re-drawn from (seed, layer, global expert id), so that every row trains the same weights.
ZeRO stage ``zero`` (0, 1 or 2), fp32, Adam (torch's). With a ``partitions=auto`` row, the cost profile of the layout
(the all-to-all on EP and the experts' GEMM, ``moe_plugins.tools.profiler``) is measured first, on this link,
and cached for the plugin to read.

Round i (warm-up rounds first, then the timed ones) feeds batch i (token ids drawn from (seed, i, rank)) to every
row, in a seeded random order per round. A step is ``engine(ids, labels=ids)`` + 0.01 x the MoE aux loss,
``engine.backward(loss)``, ``engine.step()``: forward, backward and the optimizer step, from a barrier, timed
on this rank. Per step and rank: the time, the loss, the exchange figures of :mod:`.lancet_model_meter`, the
plugin ledger's all-to-all bytes, the node NIC's transmitted bytes. Rank 0 gathers everything; it and the
Lancet facts (the partition counts the executors ran, how often a queue ran dW behind an exchange) are the
result.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.bench.lancet_model import AUTO, ModelCase, ModelRow, parse_row
from moe_plugins.tools.bench.lancet_model_meter import ExchangeMeter
from moe_plugins.tools.bench.traffic import nic_tx_bytes

AUX_COEF = 0.01


def round_order(labels: List[str], seed: int, round_index: int) -> List[str]:
    """The rows' order in one round: shuffled from (seed, round) (pure; the same on every rank)."""
    order = list(labels)
    random.Random(seed * 7919 + round_index).shuffle(order)
    return order


def batch_ids(case: ModelCase, seed: int, round_index: int, rank: int) -> torch.Tensor:
    """Round ``round_index``'s token ids of ``rank``: B x L from (seed, round, rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round_index * 1009 + rank)
    return torch.randint(0, case.vocab, (case.batch, case.seq_len), generator=gen)


def build_model(case: ModelCase, seed: int) -> torch.nn.Module:
    """The recipes' GPT-2-MoE of ``case`` with DeepSpeed's MoE layers (EP = world), the same on every row."""
    from deepspeed.moe.layer import MoE

    from moe_plugins.recipes import models
    size = models.ModelSize(layers=case.layers, hidden=case.hidden, heads=case.heads, ffn=case.ffn,
                            seq_len=case.seq_len, experts=case.experts, k=case.k,
                            capacity_factor=case.capacity_factor, moe_every=case.moe_every)
    world = dist.get_world_size()

    def factory(hidden: int, expert: torch.nn.Module) -> torch.nn.Module:
        return MoE(hidden, expert, num_experts=case.experts, ep_size=world, k=case.k,
                   capacity_factor=case.capacity_factor, eval_capacity_factor=case.capacity_factor, min_capacity=0,
                   use_rts=False, top2_2nd_expert_sampling=False, drop_tokens=bool(case.drop))
    torch.manual_seed(seed)
    model = models.build_gpt2_moe(size, case.vocab, factory, dropout=0.0, use_cache=False)
    local = case.experts // world
    with torch.no_grad():
        for layer in models.moe_layer_indices(size):
            experts = model.transformer.h[layer].mlp.moe.deepspeed_moe.experts.deepspeed_experts
            for j, expert in enumerate(experts):          # DeepSpeed copies one module: draw each expert its own
                gen = torch.Generator().manual_seed(seed * 100_003 + layer * 1_000 + dist.get_rank() * local + j)
                for name, p in expert.named_parameters():
                    drawn = torch.randn(p.shape, generator=gen) * 0.02
                    p.copy_(torch.zeros_like(p) if name.endswith("bias") else drawn)
            if case.skew:
                skew_gate(model.transformer.h[layer], case.skew, case.k, seed * 7 + layer)
            if case.grade:
                grade_gate(model.transformer.h[layer], case.grade, seed * 7 + layer)
    return model


def grade_gate(block: torch.nn.Module, grade: float, seed: int) -> None:
    """Bias the MoE block's gate towards the lower experts, graded: its ``ln_2`` bias shifted by a unit vector d
    (seeded) and grade (1 - e / (E - 1)) d added to expert e's gate row, so expert e's logit gains about that much
    (times 1 + N(0, 1): inputs N(0, I) + d). Under expert parallelism the hottest experts then share the first
    ranks' node (the measured shares are the report's)."""
    wg = block.mlp.moe.deepspeed_moe.gate.wg.weight
    gen = torch.Generator().manual_seed(seed)
    d_M = torch.randn(wg.shape[1], generator=gen)
    d_M /= d_M.norm()
    num = wg.shape[0]
    with torch.no_grad():
        block.ln_2.bias += d_M
        for e in range(num):
            wg[e] += grade * (1 - e / max(num - 1, 1)) * d_M


def expected_hot_share(w_EM: torch.Tensor, d_M: torch.Tensor, gamma: float, k: int, samples: int = 8192,
                       seed: int = 0) -> float:
    """The share of top-``k`` routes that a gate ``w_EM`` with ``gamma`` d added to expert 0's row sends to
    expert 0, for inputs N(0, I) + d (a LayerNorm's output with its bias shifted by the unit vector d)."""
    gen = torch.Generator().manual_seed(seed)
    x_NM = torch.randn(samples, w_EM.shape[1], generator=gen) + d_M
    w = w_EM.clone()
    w[0] += gamma * d_M
    top_NK = (x_NM @ w.t()).topk(k, dim=1).indices
    return float((top_NK == 0).sum()) / (samples * k)


def skew_gate(block: torch.nn.Module, share: float, k: int, seed: int) -> float:
    """Bias the MoE block's gate towards expert 0: its ``ln_2`` bias shifted by a unit vector d (seeded) and
    gamma d added to the gate's expert-0 row, gamma bisected so that :func:`expected_hot_share` is ``share``
    (the shares measured in the run are the report's, ``BuiltRow.hot_share``). Returns gamma."""
    wg = block.mlp.moe.deepspeed_moe.gate.wg.weight
    gen = torch.Generator().manual_seed(seed)
    d_M = torch.randn(wg.shape[1], generator=gen)
    d_M /= d_M.norm()
    low, high = 0.0, 64.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_hot_share(wg.detach(), d_M, mid, k) < share else (low, mid)
    gamma = (low + high) / 2
    with torch.no_grad():
        block.ln_2.bias += d_M
        wg[0] += gamma * d_M
    return gamma


def ds_config(row: ModelRow, case: ModelCase, zero: int, lr: float) -> Dict[str, Any]:
    config: Dict[str, Any] = {"train_micro_batch_size_per_gpu": case.batch, "gradient_accumulation_steps": 1,
                              "steps_per_print": 10 ** 9, "zero_optimization": {"stage": zero},
                              "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}}}
    section = row.section()
    if section is not None:
        config["moe_plugins"] = section
    return config


def measure_profile(plugin: Any, case: ModelCase, profile_dir: str, ranks_per_node: int) -> Dict[str, Any]:
    """Collective: the all-to-all on EP (sizes around one partition's exchange up to the padded one) and the
    experts' GEMM (E_l, M, H) of the layout the plugin gives the layers, cached in ``profile_dir`` for the plugin
    (``"partitions": "auto"`` reads it). Returns what was measured."""
    from moe_plugins.core.costmodel import cache_path
    from moe_plugins.core.layout import ParallelLayout
    from moe_plugins.tools.profiler import ProfileSpec, profile_rank
    world = dist.get_world_size()
    layout = ParallelLayout(world=world, ranks_per_node=ranks_per_node, ep=world)
    top = max(2 ** 13, 1 << (case.exchange_bytes() - 1).bit_length())
    sizes = tuple(s for s in (top // 64, top // 16, top // 4, top) if s >= 1024)
    c = case.capacity()
    rows = tuple(sorted({max(1, c // 8), max(2, c // 2), max(3, c), 2 * c}))
    spec = ProfileSpec(layout=layout, sizes_bytes=sizes, gemm_rows=rows,
                       gemm_shape=(case.experts // world, case.hidden, case.ffn), ops=("gemm", "all_to_all"),
                       groups=("ep",), warmup=1, repeats=3)
    t0 = time.monotonic()
    profile = profile_rank(spec, source="benchmarks/lancet_model.py", progress=False)
    if profile is not None:
        profile.save(cache_path(profile_dir, profile.key))
    dist.barrier()
    plugin.profile_dir = profile_dir
    return {"sizes_bytes": list(sizes), "gemm_rows": list(rows), "gemm_shape": list(spec.gemm_shape),
            "seconds": round(time.monotonic() - t0, 2)}


class BuiltRow:
    """A row's engine and its step; ``executors`` / ``overlaps``: the Lancet objects its engine added."""

    def __init__(self, row: ModelRow, engine: Any, executors: List[Any], overlaps: List[Any],
                 schedules: List[Any] = ()):
        self.row, self.engine, self.executors, self.overlaps = row, engine, executors, overlaps
        self.schedules = list(schedules)         # its swapped layers' schedules (Hecate's notes)

    def step(self, ids: torch.Tensor) -> float:
        from moe_plugins.recipes.models import moe_aux_loss
        out = self.engine(input_ids=ids, labels=ids)
        loss = out.loss + AUX_COEF * moe_aux_loss(self.engine.module)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def hot_share(self) -> Optional[float]:
        """Expert 0's share of this rank's routes in the last step (the gates' counts before drops), over the
        MoE layers."""
        counts = [m.exp_counts for m in self.engine.module.modules() if type(m).__name__ == "MOELayer"
                  and isinstance(getattr(m, "exp_counts", None), torch.Tensor)]
        total = sum(float(c.sum()) for c in counts)
        return sum(float(c[0]) for c in counts) / total if total else None

    def copy_peak(self, start_ns: int, end_ns: int) -> Optional[int]:
        """Hecate's expert copies: the most bytes alive at once on this rank between the stamps (None: no Hecate
        layer)."""
        from moe_plugins.hecate.memory import live_peak
        ledgers = [s.memory for s in self.schedules if hasattr(s, "memory")]
        return live_peak(ledgers, start_ns, end_ns) if ledgers else None

    def lancet_facts(self) -> Dict[str, Any]:
        tuned = [d for e in self.executors if hasattr(e.parts, "decisions") for d, _ in e.parts.decisions().values()]
        return {"chosen_partitions": sorted({k for e in self.executors for k in e.chosen}), "tuned_partitions": tuned,
                "ranges_run": sum(e.ranges_run for e in self.executors),
                "dw_behind_exchange_calls": sum(o.calls for o in self.overlaps),
                "schedule_notes": [n for s in self.schedules for n in s.notes()],
                "regathers": dict(sum((Counter(getattr(s, "regathers", {})) for s in self.schedules), Counter()))}


def build_row(row: ModelRow, case: ModelCase, plugin: Any, stack: ExitStack, seed: int, zero: int,
              lr: float) -> BuiltRow:
    import deepspeed
    ex0, ov0 = len(plugin.lancet.executors), len(plugin.lancet.overlaps)
    model = build_model(case, seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(row, case, zero, lr))
    stack.callback(engine.destroy)
    swapped = [plugin.swapped_layers.get(m) for m in model.modules()]
    return BuiltRow(row, engine, plugin.lancet.executors[ex0:], plugin.lancet.overlaps[ov0:],
                    [s.schedule for s in swapped if s is not None])


def _ledger_step(ledger: CommLedger) -> Dict[str, int]:
    a2a = [r for r in ledger.records if r.op == "all_to_all"]
    return {"ledger_a2a": len(a2a), "ledger_inter_node_bytes": sum(r.inter_node_bytes for r in a2a)}


def run_rounds(rows: List[BuiltRow], case: ModelCase, cfg: Dict[str, Any], meter: ExchangeMeter,
               ledger: CommLedger, ifname: Optional[str], progress: Callable[[int], None]) -> Dict[str, List[dict]]:
    """Every round's step of every row on this rank (see the module docstring)."""
    rank, out = dist.get_rank(), {r.row.label: [] for r in rows}
    by_label = {r.row.label: r for r in rows}
    for i in range(cfg["warmup"] + cfg["iters"]):
        ids = batch_ids(case, cfg["seed"], i, rank)
        for label in round_order(list(by_label), cfg["seed"], i):
            dist.barrier()
            ledger.clear()
            meter.start()
            tx0 = nic_tx_bytes(ifname)
            t0, ns0 = time.perf_counter(), time.perf_counter_ns()
            loss = by_label[label].step(ids)
            elapsed, ns1 = time.perf_counter() - t0, time.perf_counter_ns()
            share = by_label[label].hot_share()
            tx1 = nic_tx_bytes(ifname)
            figures = meter.stop().to_dict()
            out[label].append({"round": i, "timed": i >= cfg["warmup"], "step_s": elapsed, "loss": loss,
                               "hot_share": share, "copy_peak_bytes": by_label[label].copy_peak(ns0, ns1),
                               "nic_tx_bytes": None if tx0 is None or tx1 is None else tx1 - tx0,
                               **figures, **_ledger_step(ledger)})
        progress(i + 1)
    ledger.clear()
    return out


def rank_main(cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Run ``cfg``'s case and rows on this rank (joining the gloo group from the environment when none is up);
    rank 0 returns the result (and writes it to ``cfg["result"]`` when given), the others None."""
    import moe_plugins
    from moe_plugins.patches.deepspeed_host import init_deepspeed_comm
    from moe_plugins.tools.verify_deepspeed import deepspeed_groups
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://",
                                timeout=timedelta(seconds=cfg.get("collective_timeout_s", 300)))
    torch.set_num_threads(1)
    init_deepspeed_comm()
    case = ModelCase(**cfg["case"])
    rows = [parse_row(label) for label in cfg["rows"]]
    rpn = int(cfg["ranks_per_node"])
    ifname = cfg.get("ifname")
    ledger = CommLedger()
    t0 = time.monotonic()
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        plugin = stack.enter_context(moe_plugins.enable(ledger=ledger))
        plugin.ranks_per_node = rpn
        profile = None
        if any(r.partitions == AUTO for r in rows):
            profile = measure_profile(plugin, case, cfg["profile_dir"], rpn)
        built = [build_row(r, case, plugin, stack, cfg["seed"], cfg["zero"], cfg["lr"]) for r in rows]
        setup_s = time.monotonic() - t0
        meter = stack.enter_context(ExchangeMeter(lambda r: r // rpn).installed())
        steps = run_rounds(built, case, cfg, meter, ledger, ifname, _progress(cfg))
        facts = {b.row.label: b.lancet_facts() for b in built}
        swaps = list(plugin.swaps)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"steps": steps, "facts": facts})
    if dist.get_rank() != 0:
        return None
    result = {"case": cfg["case"], "rows": list(cfg["rows"]), "world": dist.get_world_size(), "ranks_per_node": rpn,
              "warmup": cfg["warmup"], "iters": cfg["iters"], "zero": cfg["zero"], "lr": cfg["lr"],
              "seed": cfg["seed"], "profile": profile, "setup_s": round(setup_s, 2), "swaps": swaps,
              "steps_per_rank": [g["steps"] for g in gathered], "facts_per_rank": [g["facts"] for g in gathered]}
    if cfg.get("result"):
        tmp = Path(cfg["result"] + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, cfg["result"])
    return result


def _progress(cfg: Dict[str, Any]) -> Callable[[int], None]:
    path = cfg.get("progress")

    def emit(done: int) -> None:
        if path and dist.get_rank() == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"round": done, "rounds": cfg["warmup"] + cfg["iters"]}) + "\n")
    return emit
