"""One model of the DeepSpeed recipe ready for timed inference: built by the training recipe's own code, its
weights loaded from a recipe checkpoint, and probes that measure each batch (:mod:`.infer` is the CLI; the
latency bench, ``benchmarks/lina_infer.py``, holds several sessions in one process, one per row).

Per batch and rank a :class:`BatchRecord` holds: the forward's wall time (after a barrier, so every rank starts
together), per MoE layer the layer's wall time (forward pre-hook to hook on DeepSpeed's ``MoE`` module), the
time its exchanges took and the gate's token counts per expert (``exp_counts``: the gate's choices before any
capacity drop). :meth:`InferSession.summary` reduces them over ranks (times: the slowest rank; counts: summed).

Exchange time of a layer, per batch, from the best source the layer has:

- a layer Lina's inference schedule runs: ``moe_plugins.lina.inference_stats`` (its ``exchange_ms``);
- another layer the plugin swapped: the plugin's ledger, the summed start-to-end time of the layer's
  ``all_to_all`` engine ops;
- a stock DeepSpeed layer: DeepSpeed's own ``MOELayer`` timers (``wall_clock_breakdown`` set on the MoE layers
  only), the time spent in its two ``_AllToAll`` calls.

Every source is wall time on the rank, waiting for the slowest peer included; the summary takes the slowest
rank's. Knobs (applied to the loaded weights, the same for every row of a bench):

- ``capacity_factor``: the gate's inference capacity factor; 0 (default) = dropless (``drop_tokens`` false:
  capacity = the largest count over the EP group, so every token is served and the exchange grows with the
  busiest expert; with drops DeepSpeed always sends E x C slots, whatever the routing);
- ``skew`` (synthetic second case): MoE layer j's gate logits gain ``skew`` on expert ``j mod E``, exactly:
  the bias of the LayerNorm feeding the layer is shifted by ``pinv(W_gate) @ b``, so every token's logits gain
  ``b`` (the experts see the shifted input too: a modified model, the same in every row);
- ``balanced`` (the ``ideal`` bound): a forward pre-hook on each gate replaces its input by one whose logits
  are ``8 * onehot(i mod E)`` for local token i: tokens go round-robin to the experts, every expert gets S / E.
  The output is not the model's; it is a bound only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moe_plugins.recipes import models, train_deepspeed

BALANCED_LOGIT = 8.0


@dataclass(frozen=True, kw_only=True)
class SessionSpec:
    ckpt_dir: str
    tag: Optional[str] = None
    model: str = "gpt2-moe"
    size: str = "tiny"
    ep: int = 1
    capacity_factor: float = 0.0
    skew: float = 0.0
    balanced: bool = False
    lm_head: bool = False


@dataclass
class BatchRecord:
    latency_s: float
    layer_ms: List[float]
    exchange_ms: List[float]                      # NaN: no source for that layer
    counts: List[List[int]]                       # per layer, tokens per expert (empty: not available)


def latency_stats(values_ms: Sequence[float]) -> Dict[str, Any]:
    """p50 / p95 / p99 (numpy's linear interpolation), mean and count of per-batch times."""
    a = np.asarray(values_ms, dtype=float)
    if a.size == 0:
        raise ValueError("latency_stats needs at least one batch")
    return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()), "n": int(a.size)}


def moe_wrappers(model: torch.nn.Module) -> List[tuple]:
    """(module name, ``deepspeed.moe.layer.MoE``) of every MoE layer, in layer order."""
    from deepspeed.moe.layer import MoE
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not found:
        raise ValueError("the model has no deepspeed.moe.layer.MoE layer")
    return found


def moe_input_norms(model: torch.nn.Module, model_name: str, size: models.ModelSize) -> List[torch.nn.LayerNorm]:
    """The LayerNorm whose output every MoE layer takes as input, in layer order."""
    idx = models.moe_layer_indices(size)
    if model_name == "gpt2-moe":
        return [model.transformer.h[i].ln_2 for i in idx]
    return [model.bert.encoder.layer[i].attention.output.LayerNorm for i in idx]


def _right_inverse(w_EM: torch.Tensor, what: str) -> torch.Tensor:
    """pinv(W) (M x E, fp64) with W @ pinv(W) = I_E checked (the gate's weight must have rank E)."""
    w = w_EM.detach().double()
    inv = torch.linalg.pinv(w)
    err = float((w @ inv - torch.eye(w.shape[0], dtype=w.dtype)).abs().max())
    if err > 1e-6:
        raise ValueError(f"{what}: the gate's weight has rank < {w.shape[0]} (|W pinv(W) - I| = {err:.1e}); "
                         f"its logits cannot be biased or set exactly")
    return inv


def apply_skew(model: torch.nn.Module, model_name: str, size: models.ModelSize, skew: float) -> List[int]:
    """Bias MoE layer j's gate logits by ``skew`` on expert j mod E (module docstring). Returns those experts."""
    favoured = []
    for j, (norm, (name, moe)) in enumerate(zip(moe_input_norms(model, model_name, size), moe_wrappers(model))):
        w_EM = moe.deepspeed_moe.gate.wg.weight
        b_E = torch.zeros(w_EM.shape[0], dtype=torch.float64)
        b_E[j % w_EM.shape[0]] = skew
        with torch.no_grad():
            norm.bias.add_((_right_inverse(w_EM, name) @ b_E).to(norm.bias.dtype))
        favoured.append(j % w_EM.shape[0])
    return favoured


def balance_gates(model: torch.nn.Module) -> List[Any]:
    """Round-robin gates (module docstring); returns the hook handles."""
    handles = []
    for name, moe in moe_wrappers(model):
        gate = moe.deepspeed_moe.gate
        rows_EM = _right_inverse(gate.wg.weight, name).t().contiguous()      # row e: input with logits onehot(e)

        def hook(module, args, rows_EM=rows_EM):
            x_SM = args[0]
            pick = torch.arange(x_SM.shape[0]) % rows_EM.shape[0]
            return (BALANCED_LOGIT * rows_EM[pick]).to(x_SM.dtype), *args[1:]
        handles.append(gate.register_forward_pre_hook(hook))
    return handles


def load_weights(engine: Any, ckpt_dir: str, tag: Optional[str]) -> str:
    """The checkpoint's module weights (dense from mp_rank_00, every expert this rank holds from its per-global-
    expert file: any saved world or EP), no optimizer state. Returns the tag loaded."""
    from moe_plugins.patches.deepspeed_reshard import latest_tag, read_saved_layout
    if not Path(ckpt_dir).is_dir():
        raise ValueError(f"--ckpt-dir ({ckpt_dir!r}) is not a folder")
    tag = tag or latest_tag(ckpt_dir)
    saved = read_saved_layout(ckpt_dir, tag)
    built = tuple(m.num_experts for _, m in moe_wrappers(engine.module))
    if saved.num_experts and saved.num_experts != built:
        raise ValueError(f"checkpoint {ckpt_dir}/{tag} has {list(saved.num_experts)} experts per MoE layer; the "
                         f"model built here has {list(built)} (check --model / --size)")
    try:
        path, _ = engine.load_checkpoint(ckpt_dir, tag=tag, load_optimizer_states=False,
                                         load_lr_scheduler_states=False, load_module_only=True)
    except RuntimeError as exc:                     # shapes or keys: another --model / --size
        raise ValueError(f"checkpoint {ckpt_dir}/{tag} does not fit the model built here: {exc}") from exc
    if path is None:
        raise ValueError(f"DeepSpeed found no checkpoint {tag!r} in {ckpt_dir}")
    return tag


def lina_inference_on(ds_config: Mapping[str, Any], plugin_on: bool) -> bool:
    section = (ds_config.get("moe_plugins") or {}) if plugin_on else {}
    return bool(section.get("enabled", True)) and (section.get("lina") or {}).get("inference") is not None


def _lina_api():
    try:
        from moe_plugins.lina import inference_stats, reset_inference_stats
    except ImportError as exc:
        raise ValueError("the ds_config turns Lina's inference schedule on (moe_plugins.lina.inference), but this "
                         "moe_plugins has no inference layer (moe_plugins.lina.inference_stats)") from exc
    return inference_stats, reset_inference_stats


@dataclass
class InferSession:
    engine: Any
    spec: SessionSpec
    names: List[str]
    moes: List[Any]
    ledger: Any = None
    lina: bool = False
    plugin_layers: List[str] = field(default_factory=list)
    records: List[BatchRecord] = field(default_factory=list)
    last_output: Optional[torch.Tensor] = None
    tag: Optional[str] = None                     # the checkpoint tag loaded
    _t0: Dict[int, float] = field(default_factory=dict)
    _layer_s: Dict[int, float] = field(default_factory=dict)
    _a2a_seen: List[float] = field(default_factory=list)

    @classmethod
    def open(cls, spec: SessionSpec, ds_config: Dict[str, Any], vocab_size: int, *, plugin_on: bool,
             ledger: Any = None, plugin: Any = None) -> "InferSession":
        """Build the recipe's engine for ``ds_config`` (the plugin, if enabled, swaps its layers), load the
        checkpoint, apply the knobs, switch to eval mode and attach the probes."""
        size = models.SIZES[spec.size]

        def adjust(model):                         # before deepspeed.initialize: the plugin reads these facts
            for _, moe in moe_wrappers(model):
                gate = moe.deepspeed_moe.gate
                gate.drop_tokens = spec.capacity_factor > 0
                if spec.capacity_factor > 0:
                    gate.eval_capacity_factor = spec.capacity_factor
        swaps_before = len(plugin.swaps) if plugin is not None else 0
        args = SimpleNamespace(model=spec.model, ep=spec.ep, seed=0, lr=0.0)
        engine = train_deepspeed.build_engine(args, size, vocab_size, ds_config, adjust)
        tag = load_weights(engine, spec.ckpt_dir, spec.tag)
        if spec.skew:
            apply_skew(engine.module, spec.model, size, spec.skew)
        if spec.balanced:
            balance_gates(engine.module)
        engine.eval()
        named = moe_wrappers(engine.module)
        session = cls(engine=engine, spec=spec, names=[n for n, _ in named], moes=[m for _, m in named],
                      ledger=ledger, lina=lina_inference_on(ds_config, plugin_on),
                      plugin_layers=[s["layer"] for s in (plugin.swaps[swaps_before:] if plugin else [])], tag=tag)
        session._attach()
        return session

    def _attach(self) -> None:
        for i, moe in enumerate(self.moes):
            moe.register_forward_pre_hook(lambda m, a, i=i: self._t0.__setitem__(i, time.perf_counter()))
            moe.register_forward_hook(lambda m, a, o, i=i: self._layer_s.__setitem__(
                i, time.perf_counter() - self._t0[i]))
            if self.names[i] not in self.plugin_layers:
                moe.deepspeed_moe.wall_clock_breakdown = True       # DeepSpeed's own a2a timers, MoE layer only
        self._a2a_seen = [self._stock_a2a_ms(i) for i in range(len(self.moes))]
        if self.lina:
            _lina_api()[1](self.engine.module)

    def _stock_a2a_ms(self, i: int) -> float:
        layer = self.moes[i].deepspeed_moe
        return float(getattr(layer, "time_falltoall", 0.0)) + float(getattr(layer, "time_salltoall", 0.0))

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """The trunk's last hidden states (with ``lm_head``: the logits)."""
        model = self.engine.module
        ids = ids_BS.to(self.engine.device)
        with torch.no_grad():
            extra = {"use_cache": False} if self.spec.model == "gpt2-moe" else {}
            out = (model if self.spec.lm_head else model.base_model)(input_ids=ids, **extra)
        return out.logits if self.spec.lm_head else out.last_hidden_state

    def reset(self) -> None:
        """Forget what the warm-up batches left (records, Lina's counters)."""
        self.records.clear()
        self._a2a_seen = [self._stock_a2a_ms(i) for i in range(len(self.moes))]
        if self.lina:
            _lina_api()[1](self.engine.module)

    def run_batch(self, ids_BS: torch.Tensor) -> BatchRecord:
        """One timed batch (collective: every rank calls it with its own ids)."""
        if self.ledger is not None:
            self.ledger.clear()
        dist.barrier()
        t0 = time.perf_counter()
        self.last_output = self.forward(ids_BS)
        latency = time.perf_counter() - t0
        exchange = []
        for i, name in enumerate(self.names):
            if name in self.plugin_layers:
                ops = [r for r in (self.ledger.records if self.ledger is not None else []) if r.layer == name
                       and r.op == "all_to_all" and r.end_ns > 0]
                exchange.append(sum(r.end_ns - r.start_ns for r in ops) / 1e6 if ops else float("nan"))
            else:
                now = self._stock_a2a_ms(i)
                exchange.append(now - self._a2a_seen[i])
                self._a2a_seen[i] = now
        counts = []
        for moe in self.moes:
            c = getattr(moe.deepspeed_moe, "exp_counts", None)
            counts.append([int(v) for v in c.tolist()] if isinstance(c, torch.Tensor) else [])
        rec = BatchRecord(latency_s=latency, layer_ms=[self._layer_s.get(i, float("nan")) * 1e3
                                                       for i in range(len(self.moes))],
                          exchange_ms=exchange, counts=counts)
        self.records.append(rec)
        return rec

    def summary(self) -> Dict[str, Any]:
        """Over ranks (collective): per-batch latency and per-layer times of the slowest rank, counts summed;
        percentiles, skew, and Lina's own figures (exchange times, estimation accuracy, phase-2 re-plans)."""
        n, L = len(self.records), len(self.moes)
        lat = _reduce([[r.latency_s * 1e3] for r in self.records], dist.ReduceOp.MAX)[:, 0]
        layer = _reduce([r.layer_ms for r in self.records], dist.ReduceOp.MAX)
        exchange = _reduce([r.exchange_ms for r in self.records], dist.ReduceOp.MAX)
        lina = self._lina_stats(n) if self.lina else {}
        for i, name in enumerate(self.names):
            if name in lina.get("by_layer", {}):
                exchange[:, i] = _reduce([[v] for v in lina["by_layer"][name]["exchange_ms"]], dist.ReduceOp.MAX)[:, 0]
        sources = ["lina inference_stats" if name in lina.get("by_layer", {}) else
                   "plugin ledger (all_to_all ops)" if name in self.plugin_layers else
                   "DeepSpeed MOELayer all-to-all timers" for name in self.names]
        have_counts = all(len(c) > 0 for r in self.records for c in r.counts)
        counts = (_reduce([[v for c in r.counts for v in c] for r in self.records], dist.ReduceOp.SUM)
                  .reshape(n, L, -1) if have_counts else None)
        layers = []
        for i, name in enumerate(self.names):
            ex = exchange[:, i]
            row = {"layer": name, "exchange_source": sources[i],
                   "exchange_p95_ms": None if np.isnan(ex).any() else float(np.percentile(ex, 95)),
                   "exchange_p50_ms": None if np.isnan(ex).any() else float(np.percentile(ex, 50)),
                   "layer_p95_ms": float(np.percentile(layer[:, i], 95)),
                   "layer_p50_ms": float(np.percentile(layer[:, i], 50))}
            if counts is not None:
                total = counts[:, i].sum(axis=0)
                row["tokens_per_expert"] = [int(v) for v in total]
                row["busiest_share"] = float(total.max() / max(1, total.sum()))
                row["busiest_share_batch_mean"] = float((counts[:, i].max(axis=1)
                                                         / np.maximum(1, counts[:, i].sum(axis=1))).mean())
            layers.append(row)
        shares = [r["busiest_share"] for r in layers if "busiest_share" in r]
        out = {**latency_stats(lat), "latency_ms": [float(v) for v in lat], "layers": layers,
               "skew": {"busiest_share": max(shares) if shares else None,
                        "busiest_share_batch_mean": max((r["busiest_share_batch_mean"] for r in layers), default=None)
                        if shares else None,
                        "even_share": 1.0 / counts.shape[2] if counts is not None else None},
               "lina": {k: v for k, v in lina.items() if k != "by_layer"} or None}
        return out

    def _lina_stats(self, n: int) -> Dict[str, Any]:
        stats = _lina_api()[0](self.engine.module)
        by_layer, problems = {}, []
        for s in stats:
            ex = list(s.get("exchange_ms") or [])
            if len(ex) != n:
                problems.append(f"layer {s.get('layer')!r}: {len(ex)} exchange times for {n} batches")
            by_layer[str(s["layer"])] = s
        if problems:
            raise ValueError("Lina's inference_stats do not match the timed batches: " + "; ".join(problems))
        accurate = sum(int(s["estimate_accurate"]) for s in stats)
        total = sum(int(s["estimate_total"]) for s in stats)
        replans = sum(int(s["phase2_replans"]) for s in stats)
        batches = sum(int(s["batches"]) for s in stats)
        return {"by_layer": by_layer, "estimate_accurate": accurate, "estimate_total": total,
                "accuracy": accurate / total if total else None, "phase2_replans": replans,
                "layer_batches": batches, "phase2_rate": replans / batches if batches else None,
                "per_layer": [{k: v for k, v in s.items() if k != "exchange_ms"} for s in stats]}


def _reduce(rows: Sequence[Sequence[float]], op: Any) -> np.ndarray:
    """A (batches x k) table reduced over every rank with ``op`` (NaN stays NaN under MAX: any rank's NaN)."""
    t = torch.tensor(rows, dtype=torch.float64)
    if op == dist.ReduceOp.MAX:
        nan = torch.isnan(t)
        t = torch.where(nan, torch.full_like(t, float("inf")), t)
        dist.all_reduce(t, op=op)
        t = torch.where(torch.isinf(t), torch.full_like(t, float("nan")), t)
    else:
        dist.all_reduce(t, op=op)
    return t.numpy()
