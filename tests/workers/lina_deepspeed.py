"""Jobs for tests/test_lina_deepspeed.py, run on pool ranks: a small DeepSpeed MoE model (two MoE layers,
tied input/output embeddings) trained through ``deepspeed.initialize`` with the plugin on, once with its
``lina`` section and once without (the same schedule), and the reduced gradients compared step by step.

Shapes: B batch, L sequence, V vocabulary, M model dim, H FFN hidden, E experts.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_plugins.core.ledger import CommLedger
from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm, init_experts
from tests.workers.deepspeed import cpu_half, reduced_grads

V, M, H, E, B, L = 24, 8, 16, 4, 2, 8


class TiedMoEModel(nn.Module):
    """Embedding -> MoE -> Linear -> MoE -> logits through the embedding's own weight (a parameter used twice);
    loss = cross-entropy + 0.01 * aux. DeepSpeed's gate randomness stays on; both runs are seeded alike."""

    def __init__(self, eps: Tuple[int, int]):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.emb = nn.Embedding(V, M)
        self.mid = nn.Linear(M, M)
        expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
        self.moes = nn.ModuleList(MoE(hidden_size=M, expert=expert, num_experts=E, ep_size=ep, k=2, min_capacity=0)
                                  for ep in eps)

    def forward(self, x_BL: torch.Tensor, t_BL: torch.Tensor) -> torch.Tensor:
        h_BLM = self.emb(x_BL)
        m_BLM, aux0, _ = self.moes[0](h_BLM)
        h_BLM = torch.tanh(self.mid(h_BLM + m_BLM))
        m_BLM, aux1, _ = self.moes[1](h_BLM)
        logits_BLV = (h_BLM + m_BLM) @ self.emb.weight.t()
        return F.cross_entropy(logits_BLV.reshape(-1, V), t_BL.reshape(-1)) + 0.01 * (aux0 + aux1)


def ds_config(stage: int, gas: int, lina: Optional[Dict[str, Any]], zero: Optional[Dict[str, Any]] = None,
              extra: Optional[Dict[str, Any]] = None, pipeline_degree: int = 1) -> Dict[str, Any]:
    section: Dict[str, Any] = {"schedule": "baseline", "pipeline_degree": pipeline_degree}
    if lina is not None:
        section["lina"] = lina
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage, **(zero or {})}, "moe_plugins": section}
    cfg.update(extra or {})
    return cfg


def batch(step: int):
    gen = torch.Generator().manual_seed(step * 104729 + dist.get_rank())
    return torch.randint(0, V, (B, L), generator=gen), torch.randint(0, V, (B, L), generator=gen)


def make_engine(cfg: Dict[str, Any], eps: Tuple[int, int] = (2, 2), seed: int = 0):
    """A fresh fp32 engine (DeepSpeed on CPU reduces fp32 and bf16 gradients only: ZeRO 0 refuses fp64 ones,
    ZeRO 1/2 bucket them in fp32); every global expert gets weights from (seed, id)."""
    import deepspeed
    torch.manual_seed(seed)
    model = TiedMoEModel(eps)
    for moe in model.moes:
        init_experts(moe, seed, ep_rank=dist.get_rank() % moe.ep_size, tp_rank=0, tp=1)
    with cpu_half("fp16" if cfg.get("fp16", {}).get("enabled") else False):      # DeepSpeed's fp16 on a CPU
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(engine, gas: int, steps: int) -> Dict[str, Any]:
    losses, grads = [], []
    for step in range(steps):
        for micro in range(gas):
            torch.manual_seed(step * 31 + micro)            # the gates' random draws, the same in both runs
            loss = engine(*batch(step * gas + micro))
            boundary = engine.is_gradient_accumulation_boundary()
            engine.backward(loss)
            if boundary:
                grads.append(reduced_grads(engine))
            engine.step()
            losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads}


def run(cfg: Dict[str, Any], gas: int, steps: int) -> Dict[str, Any]:
    import moe_plugins
    ledger = CommLedger()
    with ExitStack() as stack:
        stack.enter_context(deepspeed_groups(None))
        plugin = stack.enter_context(moe_plugins.enable(ledger=ledger))
        engine = make_engine(cfg)
        out = train(engine, gas, steps)
        out["skipped"] = engine.skipped_steps
        out["offload"] = bool(engine.zero_cpu_offload())
        out["lina"] = [{"mode": s.mode, "submitted": s.submitted, "skipped": s.skipped, "passed": s.passed,
                        "dense": len(s.dense), "scaling": (s.scaling.before, s.scaling.after)}
                       for s in plugin.lina.engines]
        out["read"] = (engine._config.prescale_gradients, engine.gradient_predivide_factor())
        optimizer = engine.optimizer
        engine.destroy()
        out["left_after_destroy"] = len(plugin.lina.engines)
        out["left_patched"] = sorted(set(vars(engine)) & {"_reduce_non_expert_gradients", "_configure_zero_optimizer",
                                                           "destroy"}) + \
            sorted(set(vars(optimizer)) & {"average_tensor", "reduce_ready_partitions_and_remove_grads"})
    out["records"] = [asdict(r) for r in ledger.records]
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, infinities included, NaNs at the same places (an overflowed fp16 step's gradients hold both;
    a NaN's sign bit is no value: on one such step stock's came out negative, Lina's positive)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.masked_fill(a.isnan(), 0).view(ints), b.masked_fill(b.isnan(), 0).view(ints))


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """0 for :func:`same_bits`, else the largest difference relative to ``a``'s largest magnitude (inf where
    that is not a number)."""
    if same_bits(a, b):
        return 0.0
    diff = float((a - b).abs().max() / a.abs().max().clamp(min=1e-30))
    return diff if diff == diff else float("inf")


def compare(stage: int, gas: int, steps: int, lina: Dict[str, Any],
            zero: Optional[Dict[str, Any]] = None, pipeline_degree: int = 1,
            extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Stock (the plugin's section without ``lina``) and Lina on this rank: per optimizer step the largest
    difference of the reduced gradients, relative to each tensor's largest magnitude; whether all were bitwise
    equal; the losses, Lina's counters and the Lina run's ledger (every collective with its issue/start/end)."""
    init_deepspeed_comm()
    stock = run(ds_config(stage, gas, None, zero, extra, pipeline_degree=pipeline_degree), gas, steps)
    on = run(ds_config(stage, gas, lina, zero, extra, pipeline_degree=pipeline_degree), gas, steps)
    diffs, bitwise = [], True
    for a_step, b_step in zip(stock["grads"], on["grads"]):
        if len(a_step) != len(b_step) or not any(bool((t != 0).any()) for t in a_step):
            raise ValueError(f"{len(a_step)} stock gradients against {len(b_step)} with Lina (or all zero)")
        diffs.append(max(_difference(a, b) for a, b in zip(a_step, b_step)))
        bitwise &= all(same_bits(a, b) for a, b in zip(a_step, b_step))
    return {"diffs": diffs, "bitwise": bitwise, "steps": (len(stock["grads"]), len(on["grads"])),
            "stock_losses": stock["losses"], "lina_losses": on["losses"], "lina": on["lina"],
            "stock_lina": stock["lina"], "records": on["records"], "grads": on["grads"][:1],
            "offload": (stock["offload"], on["offload"]), "read": (stock["read"], on["read"]),
            "left": (on["left_after_destroy"], on["left_patched"]), "skipped": (stock["skipped"], on["skipped"]),
            "finite": [tuple(all(bool(t.isfinite().all()) for t in step) for step in pair)
                       for pair in zip(stock["grads"], on["grads"])]}


def bad_inputs() -> Dict[str, str]:
    """Errors raised through ``deepspeed.initialize``: settings Lina cannot reproduce (every one listed), and
    two MoE layouts in one model. Returns each message, and whether DeepSpeed's ZeRO optimizer and engine
    classes are their own afterwards."""
    import moe_plugins
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    init_deepspeed_comm()
    before = (dict(vars(DeepSpeedEngine)), dict(vars(DeepSpeedZeroOptimizer)))
    out: Dict[str, Any] = {}
    cases = {"settings": (ds_config(2, 1, {"packing": 2}, {"contiguous_gradients": False},
                                    {"prescale_gradients": True, "communication_data_type": "fp16"}), (2, 2)),
             "layouts": (ds_config(1, 1, {"micro_op_mb": 0.001}), (1, 2)),
             "auto_without_profile": (ds_config(1, 1, {"micro_op_mb": "auto"}), (2, 2))}
    for name, (cfg, eps) in cases.items():
        with deepspeed_groups(None), moe_plugins.enable() as plugin:
            try:
                make_engine(cfg, eps)
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
            out[name + "_lina_engines"] = len(plugin.lina.engines)
    out["classes_untouched"] = before == (dict(vars(DeepSpeedEngine)), dict(vars(DeepSpeedZeroOptimizer)))
    return out


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def checkpoint_round_trip(save: Optional[Dict[str, Any]], load: Optional[Dict[str, Any]], stage: int,
                          path: str) -> Dict[str, Any]:
    """tests/workers/deepspeed.py's round trip (save after 3 steps, load into a fresh engine, 2 more steps
    each), with the plugin's log lines: the Lina side logs that Lina reduces its gradients."""
    from tests.workers import deepspeed as ds_jobs
    capture, log = _Lines(), logging.getLogger("moe_plugins")
    log.addHandler(capture)
    log.setLevel(logging.INFO)
    try:
        out = ds_jobs.checkpoint_round_trip(save, load, stage, 2, 1, path)
    finally:
        log.removeHandler(capture)
    out["lina_log"] = [line for line in capture.lines if "Lina reduces" in line]
    return out
