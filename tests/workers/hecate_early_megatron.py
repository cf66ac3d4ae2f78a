"""Pool jobs for Hecate's early gather on Megatron-core (tests/test_hecate_megatron.py): Megatron's own
``TransformerLayer`` (``get_gpt_layer_local_spec``'s, without its attention: :func:`_block`) stock and built while the plugin
is enabled with ``"hecate": {"prefetch": true}``, on 4 ranks (2 nodes x 2, TP 1, EP 4) under the CPU shims, fp64.

Every expert gets its own weights (:func:`~tests.workers.ckpt_reshard_megatron.redraw`) and the gate leans to
experts 0 and 1 (the tokens carry a constant direction, which their router rows gain), so that from the second call
on the gather copies experts.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config
from tests.megatron_shims_extra import cuda_factories_on_cpu
from tests.workers import megatron as jobs
from tests.workers.ckpt_reshard_megatron import redraw

RPN, S, M, H, E, HOT = 2, 8, 8, 16, 4, (0, 1)


def _direction() -> torch.Tensor:
    u = torch.randn(M, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    return u / u.norm()


def _block(config: Any, groups: Any):
    """Megatron's TransformerLayer of the GPT local spec without its attention (Megatron's own IdentityOp: its core
    attention would need Megatron's RNG tracker seeded, its memory buffer and an explicit mask on CPU, as in
    tests/workers/lancet_layers_megatron.py; the gather concerns the MoE part): norm, MoE MLP, residuals."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer
    submodules = replace(get_gpt_layer_local_spec(num_experts=E).submodules, self_attention=IdentityOp,
                         self_attn_bda=IdentityFuncOp)
    block = TransformerLayer(config, submodules=submodules, layer_number=1, pg_collection=groups.pg_collection)
    block.mlp.set_layer_number(1)
    return block.double()               # Megatron's CPU norms are built in fp32 whatever params_dtype says


def _grads(block: Any) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}


def _spec() -> MegatronVerifySpec:
    return MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RPN, mp=1, ep=4, esp=1, experts=E, k=2,
                              drop=False, tokens=S, hidden=M, ffn=H, dtype="float64", schedule="hecate",
                              exchange="ragged")


def _stock(config: Any, groups: Any, count: int) -> List[Any]:
    """``count`` stock blocks, each with its own experts (seed 1 + i) and a gate leaning to the HOT experts."""
    blocks = [_block(config, groups) for _ in range(count)]
    for i, block in enumerate(blocks):
        redraw(block.mlp, groups.pg_collection, seed=1 + i)
        with torch.no_grad():
            block.mlp.router.weight[list(HOT)] += 3.0 * _direction()
    return blocks


def _calls(stock: List[Any], ours: List[Any], calls: int) -> Iterator[Tuple[float, bool]]:
    """Per call, the same tokens and output gradient through both stacks of blocks: the largest output /
    input-gradient / parameter-gradient difference, and whether the same parameters got gradients."""
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    for _ in range(calls):
        x = torch.randn(S, 1, M, generator=gen, dtype=torch.float64) + 2.0 * _direction()
        g = torch.randn_like(x)
        res = []
        for blocks in (stock, ours):
            for block in blocks:
                block.zero_grad(set_to_none=True)
            y = xi = x.clone().requires_grad_(True)
            for block in blocks:
                y, _ = block(y, attention_mask=None)
            y.backward(g)
            res.append((y.detach(), xi.grad, [_grads(b) for b in blocks]))
        (ys, gxs, gws), (yp, gxp, gwp) = res
        err = max(jobs._maxerr(ys, yp), jobs._maxerr(gxs, gxp),
                  max(jobs._maxerr(a[n], b[n]) for a, b in zip(gws, gwp) for n in a))
        yield err, [sorted(a) for a in gws] == [sorted(b) for b in gwp]


def blocks_job(calls: int = 4) -> Dict[str, Any]:
    """``calls`` forward/backward calls of the stock block and of the plugin's (same weights, same tokens): the
    largest output / input-gradient / parameter-gradient difference per call, the copies beyond the homes per
    call, the layer's notes, whether the block's pre-hook issued the gathers, and whether disable() took it off."""
    from moe_plugins.patches import megatron as mp
    out: Dict[str, Any] = {"err": [], "extra": []}
    with megatron_on_cpu(), cuda_factories_on_cpu(), jobs._groups(_spec()) as groups:
        config = transformer_config(_spec(), num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0)
        stock = _stock(config, groups, 1)
        with mp.enable({"ranks_per_node": RPN, "hecate": {"enabled": True, "prefetch": True}},
                       groups=groups) as handle:
            ours = _block(config, groups)
            ours.load_state_dict(stock[0].state_dict())
            for err, same in _calls(stock, [ours], calls):
                out["err"].append(err)
                out["extra"].append(ours.mlp.token_dispatcher.schedule.last.extra_copies())
                out["same_grads"] = same
            schedule = ours.mlp.token_dispatcher.schedule
            out.update(notes=schedule.notes(), hooked=ours.mlp in handle.early.hooked,
                       measured=len(schedule._state.meter.history), pre_hooks=len(ours._forward_pre_hooks))
        out["pre_hooks_after"] = len(ours._forward_pre_hooks)
    return out


def remat_blocks_job(calls: int = 3) -> Dict[str, Any]:
    """Two stock blocks and two built while the plugin is enabled with ``"rematerialize": true``, run in sequence
    for ``calls`` forward/backward calls: the largest difference per call, and per plugin layer its re-gathers by
    what started them and its copy bytes alive after the calls."""
    from moe_plugins.patches import megatron as mp
    out: Dict[str, Any] = {"err": []}
    with megatron_on_cpu(), cuda_factories_on_cpu(), jobs._groups(_spec()) as groups:
        config = transformer_config(_spec(), num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0)
        stock = _stock(config, groups, 2)
        with mp.enable({"ranks_per_node": RPN, "hecate": {"enabled": True, "rematerialize": True}}, groups=groups):
            ours = [_block(config, groups), _block(config, groups)]
            for mine, theirs in zip(ours, stock):
                mine.load_state_dict(theirs.state_dict())
            out["err"] = [err for err, same in _calls(stock, ours, calls) if same]
            schedules = [b.mlp.token_dispatcher.schedule for b in ours]
            out.update(regathers=[s.regathers for s in schedules], live=[s.memory.live_bytes for s in schedules],
                       extra=[s.last.extra_copies() for s in schedules], calls=calls)
    return out
