"""The rank side of the inference latency bench (``benchmarks/lina_infer.py``; issue #24).

One process per rank holds one :class:`~moe_plugins.recipes.infer_session.InferSession` per row, all on the
same checkpoint, text and knobs, and times them side by side:

- ``deepspeed``: stock DeepSpeed MoE layers (no ``moe_plugins`` section);
- ``ideal``: the stock layers with a perfectly balanced gate (round-robin routing), the bound of Lina §7.3; its
  output is not the model's;
- ``baseline``: the plugin's baseline schedule (``"schedule": "baseline"``);
- ``lina-infer``: baseline plus ``"lina": {"inference": {"table", "start_layer", "max_experts_per_device": 4,
  "estimation": true}}``: Lina's two-phase inference schedule on the layers from ``start_layer``;
- ``lina-infer-noest``: the same with ``"estimation": false`` (phase 2 only).

The plugin is enabled once with no config (``moe_plugins.enable(None, ledger=...)``), so each engine's own
ds_config section decides its layers; the stock engines are built first. ``warmup`` untimed rounds, then
``rounds`` timed rounds; round i serves batch i (the same held-out sequences) to every row, rows in an order
shuffled from (seed, round) like the other benches. Batch 0's output of every row is compared with
``deepspeed``'s (max |difference| over ranks): placement must move work, never results (``ideal`` differs by
construction).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

ROWS = ("deepspeed", "ideal", "baseline", "lina-infer", "lina-infer-noest")      # build order: stock first
LINA_ROWS = ("lina-infer", "lina-infer-noest")
REFERENCE = "deepspeed"


def row_problems(rows: List[str]) -> List[str]:
    problems = [f"row {r!r} is unknown; allowed: {', '.join(ROWS)}" for r in rows if r not in ROWS]
    problems += [f"row {r!r} is listed twice" for r in sorted(set(rows)) if rows.count(r) > 1]
    if REFERENCE not in rows:
        problems.append(f"rows must include {REFERENCE!r} (the reference of the targets and the output check)")
    return problems


def row_ds_config(row: str, batch_size: int, inference: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ds_config of a row; ``inference``: the lina rows' ``{"table", "start_layer"}``."""
    config: Dict[str, Any] = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
                              "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    if row in ("baseline",) + LINA_ROWS:
        config["moe_plugins"] = {"schedule": "baseline"}
    if row in LINA_ROWS:
        if not inference or not inference.get("table"):
            raise ValueError(f"row {row!r} needs the popularity table (inference.table)")
        config["moe_plugins"]["lina"] = {"inference": {
            "table": str(inference["table"]), "start_layer": int(inference["start_layer"]),
            "max_experts_per_device": int(inference.get("max_experts_per_device", 4)),
            "estimation": row == "lina-infer"}}
    return config


def _ordered(rows: List[str]) -> List[str]:
    return [r for r in ROWS if r in rows]


def rank_main(cfg: Dict[str, Any]) -> None:
    """Run the rows of ``cfg`` (written by the parent) on this rank; rank 0 writes ``cfg["result"]``."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import moe_plugins
    from moe_plugins.core.ledger import CommLedger
    from moe_plugins.recipes import data, models
    from moe_plugins.recipes.infer import batch_ids, held_out_blocks
    from moe_plugins.recipes.infer_session import InferSession, SessionSpec
    from moe_plugins.tools.bench.runner import round_order
    from moe_plugins.tools.bench.ranks import max_over_ranks

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=cfg.get("collective_timeout_s", 600)))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = _ordered(list(cfg["rows"]))
    size = models.SIZES[cfg["size"]]
    tokenizer = data.gpt2_tokenizer(Path(cfg["cache_dir"]))
    text_args = SimpleNamespace(chars=0, skip_chars=cfg["skip_chars"], data=None, hf_dataset=None)
    blocks = held_out_blocks(text_args, tokenizer, size.seq_len, cfg["rounds"] * world * cfg["batch_size"])
    ledger = CommLedger()
    plugin = moe_plugins.enable(None, ledger=ledger)
    sessions: Dict[str, Any] = {}
    try:
        for row in rows:
            spec = SessionSpec(ckpt_dir=cfg["ckpt_dir"], model="gpt2-moe", size=cfg["size"], ep=world,
                               capacity_factor=cfg.get("capacity_factor", 0.0), skew=cfg.get("skew", 0.0),
                               balanced=row == "ideal")
            ds_config = row_ds_config(row, cfg["batch_size"], cfg.get("inference"))
            sessions[row] = InferSession.open(spec, ds_config, len(tokenizer), plugin_on="moe_plugins" in ds_config,
                                              ledger=ledger, plugin=plugin)
        outputs = {}
        for w in range(cfg["warmup"]):
            for row in round_order(rows, cfg["seed"], -1 - w):
                sessions[row].run_batch(batch_ids(blocks, w % cfg["rounds"], rank, world, cfg["batch_size"]))
                if w == 0:
                    outputs[row] = sessions[row].last_output.detach().clone()
        for row in rows:
            sessions[row].reset()
        progress = cfg.get("progress")
        for i in range(cfg["rounds"]):
            for row in round_order(rows, cfg["seed"], i):
                sessions[row].run_batch(batch_ids(blocks, i, rank, world, cfg["batch_size"]))
            if rank == 0 and progress:
                with open(progress, "a") as f:
                    f.write(json.dumps({"round": i + 1, "rounds": cfg["rounds"]}) + "\n")
        summaries = {row: sessions[row].summary() for row in rows}
        diffs = {row: max_over_ranks(float((outputs[row] - outputs[REFERENCE]).abs().max())) for row in rows}
    finally:
        plugin.disable()
    if rank == 0:
        for row in rows:
            summaries[row]["output_max_abs_diff_vs_deepspeed"] = diffs[row]
        tmp = Path(cfg["result"] + ".tmp")
        tmp.write_text(json.dumps({"rows": summaries, "world": world, "pid": os.getpid()}))
        os.replace(tmp, cfg["result"])


