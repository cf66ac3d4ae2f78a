"""``moe-plugins lina-profile``: Lina's popularity table (§5.2) from a checkpoint of the DeepSpeed recipe.

Loads a checkpoint that ``moe_plugins.recipes.train_deepspeed`` saved (``--ckpt-dir``, its ``latest`` tag or
``--tag``; any EP size: DeepSpeed keeps one file per global expert), runs the model over text held out from
training, records every MoE layer's top-1 expert per token (the gate's first choice, before capacity drops,
read by a forward pre-hook on DeepSpeed's ``TopKGate``; the recipe's code is not changed), builds the table
(``moe_plugins.lina.popularity``) from the first part of that text and writes it as JSON (``--out``). It then
prints the estimation accuracy on the rest (the paper's top-2 set test, per batch and layer) and the load
error (total-variation distance of the estimated and actual load shares), each beside the figure of the
layer's marginal distribution alone, and the busiest expert's share of tokens per layer.

Held-out text: the recipe trains on the first ``--max-chars`` characters of its corpus (default 600,000);
this reads the ``--chars`` characters after ``--skip-chars`` (set it to the training run's ``--max-chars``).

Limits: one process on the CPU (no process group; the model is rebuilt at EP 1 and every expert loaded);
checkpoints with tensor parallelism (mp_world_size > 1) or ZeRO stage 3 (no module weights) are refused.
"""

from __future__ import annotations

import argparse
import glob
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Sequence, Tuple

from moe_plugins.lina import popularity as pop

SHAKESPEARE_TRAIN_CHARS = 600_000      # the recipes' --max-chars default


def register(sub) -> None:
    p = sub.add_parser("lina-profile", help="Lina inference: expert-popularity table from a recipe checkpoint "
                       "(single process, CPU)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="the recipe's --ckpt-dir (DeepSpeed checkpoint folder)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the folder's `latest`)")
    p.add_argument("--model", choices=["gpt2-moe", "bert-moe"], default="gpt2-moe")
    p.add_argument("--size", default="tiny", help="the recipe's --size the checkpoint was trained with")
    p.add_argument("--out", required=True, help="where to write the table (JSON)")
    p.add_argument("--data", nargs="*", default=None, help="text files or folders (default: packaged Shakespeare)")
    p.add_argument("--skip-chars", type=int, default=SHAKESPEARE_TRAIN_CHARS,
                   help="corpus characters the training run read (its --max-chars); default %(default)s")
    p.add_argument("--chars", type=int, default=300_000, help="held-out characters to read (default %(default)s)")
    p.add_argument("--eval-fraction", type=float, default=0.25,
                   help="share of the held-out blocks kept out of the table to measure accuracy on")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch (accuracy is per batch)")
    p.add_argument("--path-length", type=int, default=pop.DEFAULT_PATH_LENGTH,
                   help="experts on the previous layers a path holds (default: the paper's %(default)s)")
    p.add_argument("--start-layer", type=int, default=None,
                   help="first MoE layer (0-based) to estimate (default: path length, at most the last layer; "
                        "0 schedules every layer, layer 0 from its profiled marginal)")
    p.add_argument("--top", type=int, default=pop.DEFAULT_TOP, help="size of the compared top set")
    p.add_argument("--keep", type=int, default=None,
                   help="each token's most probable experts to count (default: all)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="synthetic skew, as `moe_plugins.recipes.infer --skew`: MoE layer j's gate logits gain S "
                        "on expert j mod E (the LayerNorm before it shifted by pinv(W_gate) b)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/moe_plugins"), help="tokenizer cache")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    problems = _arg_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    import torch
    from moe_plugins.recipes import data, models
    size = models.SIZES.get(args.size)
    if size is None:
        raise ValueError(f"--size ({args.size!r}) must be one of {sorted(models.SIZES)}")
    ckpt = _checkpoint_folder(Path(args.ckpt_dir), args.tag)
    tokenizer = (data.gpt2_tokenizer if args.model == "gpt2-moe" else data.bert_tokenizer)(Path(args.cache_dir))
    model = load_model(args.model, args.size, len(tokenizer), ckpt)
    if args.skew:
        from moe_plugins.recipes.infer_session import apply_skew
        apply_skew(model, args.model, size, args.skew)
    gates = moe_gates(model)
    facts = pop.ModelFacts(num_layers=len(gates), num_experts=gates[0].wg.out_features, top_k=gates[0].k)
    start = args.start_layer if args.start_layer is not None else min(args.path_length, facts.num_layers - 1)

    text = data.read_corpus(data.corpus_files(args.data), args.skip_chars + args.chars)[args.skip_chars:]
    blocks_NS = data.TokenBlocks.from_text(text, tokenizer, size.seq_len).ids_NL
    n_eval = max(1, round(args.eval_fraction * blocks_NS.shape[0]))
    if blocks_NS.shape[0] - n_eval < 1:
        raise ValueError(f"the held-out text ({len(text)} characters) makes {blocks_NS.shape[0]} blocks of "
                         f"{size.seq_len} tokens: too few to profile and evaluate; raise --chars")
    with torch.no_grad():
        profile = record_routing(model, gates, blocks_NS[:-n_eval], args.batch_size)
        held = record_routing(model, gates, blocks_NS[-n_eval:], args.batch_size)
    table = pop.build_table([row for batch in profile for row in batch], facts, start_layer=start,
                            path_length=args.path_length)
    acc = pop.estimation_accuracy(table, held, top=args.top, keep=args.keep)
    marginal = pop.estimation_accuracy(table, held, top=args.top, keep=args.keep, min_count=table.tokens + 1)
    skew = busiest_share(held, facts)
    meta = {"checkpoint": str(ckpt), "model": args.model, "size": args.size,
            "text": {"data": args.data or "shakespeare", "skip_chars": args.skip_chars, "chars": len(text),
                     "profile_blocks": int(blocks_NS.shape[0] - n_eval), "eval_blocks": n_eval,
                     "seq_len": size.seq_len, "batch_size": args.batch_size},
            "accuracy": {"top": args.top, "keep": args.keep, "value": acc.value, "marginal_only": marginal.value,
                         "per_layer": [list(x) for x in acc.per_layer], "load_error": acc.mean_load_error,
                         "load_error_marginal_only": marginal.mean_load_error},
            "busiest_expert_share": skew, "synthetic_skew": args.skew}
    out = pop.save_table(table, args.out, meta)
    _report(args, facts, table, acc, marginal, skew, ckpt, out, n_eval, size.seq_len)
    return 0


def _arg_problems(args: argparse.Namespace) -> List[str]:
    checks = [("--skip-chars", args.skip_chars, 0), ("--chars", args.chars, 1), ("--batch-size", args.batch_size, 1),
              ("--path-length", args.path_length, 1), ("--top", args.top, 1)]
    problems = [f"{flag} ({value}) must be >= {low}" for flag, value, low in checks if value < low]
    if args.start_layer is not None and args.start_layer < 0:
        problems.append(f"--start-layer ({args.start_layer}) must be >= 0 (a MoE layer index)")
    if args.keep is not None and args.keep < 1:
        problems.append(f"--keep ({args.keep}) must be >= 1")
    if args.skew != args.skew or args.skew in (float("inf"), float("-inf")):
        problems.append(f"--skew ({args.skew}) must be a finite number of logits")
    if not 0 < args.eval_fraction < 1:
        problems.append(f"--eval-fraction ({args.eval_fraction}) must be in (0, 1)")
    return problems


def _checkpoint_folder(root: Path, tag: Any) -> Path:
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ValueError(f"--ckpt-dir {str(root)!r} has no `latest` file; is it a DeepSpeed checkpoint "
                             f"folder? (or pass --tag)")
        tag = latest.read_text().strip()
    folder = root / tag
    if not (folder / "mp_rank_00_model_states.pt").is_file():
        raise ValueError(f"checkpoint {str(folder)!r} has no mp_rank_00_model_states.pt")
    return folder


def load_model(model_name: str, size_name: str, vocab_size: int, folder: Path):
    """The recipe's model at EP 1 with the checkpoint's weights: the dense ones from ``mp_rank_00``, every
    expert from its per-global-expert file (DeepSpeed names them by global id, whatever EP saved them)."""
    import torch
    from moe_plugins.recipes import models, train_deepspeed
    size = models.SIZES[size_name]
    states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    if states.get("mp_world_size", 1) != 1:
        raise ValueError(f"{folder}: saved with mp_world_size {states['mp_world_size']}; lina-profile reads "
                         f"checkpoints without tensor parallelism only")
    module = states.get("module")
    if not module:
        raise ValueError(f"{folder}: no module weights in mp_rank_00_model_states.pt (ZeRO stage 3 checkpoints "
                         f"are not supported; convert with zero_to_fp32.py)")
    state = dict(module)
    for path in sorted(glob.glob(str(folder / "layer_*_expert_*_mp_rank_00_model_states.pt"))):
        state.update(torch.load(path, map_location="cpu", weights_only=False))
    model = train_deepspeed.build_model(SimpleNamespace(ep=1, model=model_name, seed=0), size, vocab_size)
    saved_experts = list(states.get("num_experts") or [])
    built = [g.wg.out_features for g in moe_gates(model)]
    if saved_experts and saved_experts != built:
        raise ValueError(f"{folder}: experts per MoE layer {saved_experts}, but --model {model_name} --size "
                         f"{size_name} builds {built}")
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:                      # shape mismatches: another --size
        raise ValueError(f"{folder} does not fit --model {model_name} --size {size_name}: {exc}") from exc
    missing = [k for k in missing if k not in set(states.get("shared_params") or [])]
    if missing or unexpected:
        raise ValueError(f"{folder} does not fit --model {model_name} --size {size_name}: missing {missing[:5]} "
                         f"({len(missing)}), unexpected {list(unexpected)[:5]} ({len(unexpected)})")
    return model.eval()


def moe_gates(model) -> List[Any]:
    """DeepSpeed's gates in layer order."""
    from deepspeed.moe.sharded_moe import TopKGate
    gates = [m for m in model.modules() if isinstance(m, TopKGate)]
    if not gates:
        raise ValueError("the model has no deepspeed.moe gate (TopKGate)")
    return gates


def record_routing(model, gates: Sequence[Any], blocks_NS, batch_size: int) -> List[List[Tuple[int, ...]]]:
    """Per batch of ``batch_size`` blocks, one routing record per token: its top-1 expert at every MoE layer.
    The pre-hook takes the gate's own choice: argmax of softmax(fp32 logits), as DeepSpeed's top-k gatings."""
    import torch
    chosen: List[List[Any]] = [[] for _ in gates]

    def hook_for(i: int):
        def hook(gate, inputs):
            x_SM = inputs[0]
            logits_SE = torch.nn.functional.linear(x_SM.float(), gate.wg.weight.float())
            chosen[i].append(torch.argmax(torch.softmax(logits_SE, dim=1), dim=1))
        return hook

    handles = [g.register_forward_pre_hook(hook_for(i)) for i, g in enumerate(gates)]
    batches = []
    try:
        for start in range(0, blocks_NS.shape[0], batch_size):
            ids_BS = blocks_NS[start:start + batch_size]
            for c in chosen:
                c.clear()
            model.base_model(input_ids=ids_BS)       # the MoE layers only need the trunk, not the LM head
            if any(len(c) != 1 for c in chosen):
                raise ValueError(f"expected each MoE gate to run once per forward, got {[len(c) for c in chosen]}")
            e_SL = torch.stack([c[0] for c in chosen], dim=1)
            batches.append([tuple(row) for row in e_SL.tolist()])
    finally:
        for h in handles:
            h.remove()
    return batches


def busiest_share(batches: Sequence[Sequence[Sequence[int]]], facts: pop.ModelFacts) -> List[float]:
    """Per MoE layer, the busiest expert's share of all tokens (1 / E when perfectly even)."""
    rows = [row for batch in batches for row in batch]
    return [max(pop.actual_counts(rows, layer, facts.num_experts)) / max(1, len(rows))
            for layer in range(facts.num_layers)]


def _report(args, facts, table, acc, marginal, skew, ckpt: Path, out: Path, n_eval: int, seq_len: int) -> None:
    print(f"lina-profile: {args.model} --size {args.size} from {ckpt} (one process, CPU, EP 1): "
          f"{facts.num_layers} MoE layers x {facts.num_experts} experts, top-{facts.top_k} gate")
    print(f"table: {table.tokens} tokens of held-out text, start_layer {table.start_layer}, path_length "
          f"{table.path_length} -> {out}")
    rows = zip(acc.per_layer, marginal.per_layer, acc.load_error, marginal.load_error)
    for (layer, hit, n), (_, m_hit, _), err, m_err in rows:
        print(f"  layer {layer}: {len(table.counts(layer).paths)} paths; accuracy {hit}/{n} (marginal only "
              f"{m_hit}/{n}); load error {err:.3f} (marginal only {m_err:.3f}); busiest expert {skew[layer]:.1%}")
    keep = "all experts" if args.keep is None else f"top-{args.keep} per token"
    print(f"estimation accuracy (top-{args.top} set equal, {acc.total} batch-layers of {args.batch_size} x "
          f"{seq_len} tokens from {n_eval} held-out blocks, {keep}): {acc.value:.1%} "
          f"(marginal only {marginal.value:.1%})")
