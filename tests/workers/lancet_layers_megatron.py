"""Pool jobs for tests/test_lancet_layers_megatron.py: Lancet's batch partitions through Megatron-core's own
``TransformerLayer`` in its own ``TransformerBlock`` (the local GPT spec: Megatron's ``DotProductAttention``,
dropout on), stock and built while the plugin is enabled, on 4 ranks (2 nodes x 2, TP 1, EP 4) under the CPU shims,
fp64, with the same weights, tokens, masks and RNG state.

Shapes: L tokens per sample, B samples per rank, M model dim.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from moe_plugins.patches.megatron_cpu import megatron_on_cpu
from moe_plugins.tools.verify_megatron import MegatronVerifySpec, transformer_config
from tests.workers import megatron as jobs
from tests.workers.lancet_parts_megatron import _count_drops

RPN, L, B, M, H, E, LAYERS = 2, 6, 4, 8, 16, 4, 4


@contextmanager
def _memory_buffer() -> Iterator[None]:
    """Megatron's global memory buffer (DotProductAttention takes its score buffer there; initialize_model_parallel
    makes it in a Megatron job), made for the job and destroyed after (the pool's processes run later jobs)."""
    from megatron.core import parallel_state
    parallel_state._set_global_memory_buffer()
    try:
        yield
    finally:
        parallel_state.destroy_global_memory_buffer()


def _config(**overrides: Any):
    spec = MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RPN, mp=1, ep=4, esp=1, experts=E, k=2,
                              drop=True, capacity_factor=1.0, tokens=L * B, hidden=M, ffn=H, dtype="float64",
                              schedule="baseline")
    fields = dict(num_layers=LAYERS, num_attention_heads=2, hidden_dropout=0.1, attention_dropout=0.1)
    fields.update(overrides)
    return transformer_config(spec, **fields)


def _decoder(config: Any, pgc: Any):
    """Megatron's TransformerBlock of LAYERS local-spec layers, MoE on every other one (blocks 1 and 3), in fp64
    (Megatron's CPU norms are built in fp32 whatever params_dtype says)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    dense, moe = get_gpt_layer_local_spec(), get_gpt_layer_local_spec(num_experts=E)
    spec = TransformerBlockSubmodules(layer_specs=[moe if i % 2 else dense for i in range(LAYERS)],
                                      layer_norm=dense.submodules.input_layernorm)
    return TransformerBlock(config, spec, pg_collection=pgc).double()


class _Model(torch.nn.Module):
    """What GPTModel holds around its decoder, as far as the executor looks (one ModuleList of blocks)."""

    def __init__(self, decoder: Any):
        super().__init__()
        self.decoder = decoder

    def forward(self, x_LBM: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden_states=x_LBM, attention_mask=mask)


def _moe_layers(model: _Model) -> List[Any]:
    return [layer.mlp for layer in model.decoder.layers if layer.is_moe_layer]


def _seed(rank: int) -> None:
    """The same RNG state in both runs: the CPU generator (hidden dropout) and Megatron's tracker (attention
    dropout, forked from it under the shims)."""
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(123 + rank, tp_rank=0, ep_rank=rank, etp_rank=0)
    torch.manual_seed(7 + rank)


def _masks(gen: torch.Generator) -> torch.Tensor:
    """[B, 1, L, L] attention masks (True: masked): causal, and per sample some earlier keys masked too (never the
    diagonal), so that a partition's samples need their own rows."""
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    extra = (torch.rand(B, 1, L, L, generator=gen) < 0.3) & ~torch.eye(L, dtype=torch.bool)
    return causal | extra


def _run(model: _Model, calls: int, rank: int) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    _seed(rank)
    out = []
    for _ in range(calls):
        x = torch.randn(L, B, M, generator=gen, dtype=torch.float64).requires_grad_(True)
        mask, g = _masks(gen), torch.randn(L, B, M, generator=gen, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        y = model(x, mask)
        y.backward(g)
        res = {"y": y.detach(), "x.grad": x.grad}
        res.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        out.append(res)
    return out


def equal_job(parts: Any = 2, calls: int = 3) -> Dict[str, Any]:
    """Stock Megatron and the plugin with ``"lancet": {"partitions": parts}`` on the same decoder weights: per call
    the largest difference over the output, the input gradient and every parameter gradient (by name), whether the
    same parameters got gradients, the routes each router call dropped in both runs, the executor's ranges and
    partition counts, and whether closing the plugin took the executor off."""
    from moe_plugins.patches import megatron as mp
    rank = dist.get_rank()
    out: Dict[str, Any] = {"dropped": {"stock": [], "ours": []}}
    with megatron_on_cpu(), _memory_buffer(), jobs._groups(_spec_for_groups()) as groups:
        config = _config()
        torch.manual_seed(0)
        stock = _Model(_decoder(config, groups.pg_collection))
        with torch.no_grad():
            for layer in _moe_layers(stock):
                layer.router.weight[0] += 1.0                  # lean to expert 0: capacity drops every call
        _count_drops(_moe_layers(stock), out["dropped"]["stock"])
        ref = _run(stock, calls, rank)
        with mp.enable({"ranks_per_node": RPN, "lancet": {"defer_wgrad": False, "partitions": parts}},
                       groups=groups) as handle:
            ours = _Model(_decoder(config, groups.pg_collection))   # its TransformerBlock installs the executor
            ours.load_state_dict(stock.state_dict())
            _count_drops(_moe_layers(ours), out["dropped"]["ours"])
            (executor,) = handle.lancet.partitions.executors
            got = _run(ours, calls, rank)
            out.update(ranges=executor.ranges_run, chosen=sorted(set(executor.chosen)),
                       stock_calls=executor.stock_calls, kinds=sorted({type(b).__name__ for b in executor.blocks}),
                       tuned=executor.parts.decisions() if hasattr(executor.parts, "decisions") else None)
        out["restored"] = all("forward" not in b.__dict__ for b in executor.blocks)
    out["err"] = [max(jobs._maxerr(a[n], b[n]) for n in a) for a, b in zip(ref, got)]
    out["same_names"] = all(sorted(a) == sorted(b) for a, b in zip(ref, got))
    out["nonzero"] = all(float(t.abs().max()) > 0 for r in got for t in r.values())
    return out


def _train(model: Any, steps: int, rank: int) -> Dict[str, Any]:
    """``steps`` steps through Megatron's DDP (``overlap_grad_reduce``): per step the loss, every ``main_grad`` after
    ``finish_grad_sync`` and the DDP hook's calls per parameter (on its gradient accumulator); an SGD update on
    ``main_grad`` after each."""
    from tests.workers.lina_megatron import _ddp
    ddp = _ddp(model.decoder.config, model, model.decoder.pg_collection, bucket_size=2000)
    calls: Dict[str, int] = {}
    for n, p in ddp.module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
    gen = torch.Generator().manual_seed(100 + rank)
    _seed(rank)
    out: Dict[str, Any] = {"losses": [], "grads": [], "hooks": []}
    for _ in range(steps):
        ddp.zero_grad_buffer()
        calls.clear()
        x, t = (torch.randn(L, B, M, generator=gen, dtype=torch.float64) for _ in range(2))
        loss = torch.nn.functional.mse_loss(ddp(x, _masks(gen)), t)
        loss.backward()
        ddp.finish_grad_sync()
        out["losses"].append(float(loss))
        out["hooks"].append(sorted(set(calls.values())))
        out["grads"].append({n: p.main_grad.clone() for n, p in ddp.module.named_parameters()})
        with torch.no_grad():
            for p in ddp.module.parameters():
                p.sub_(0.05 * p.main_grad)
    return out


def train_job(parts: int = 2, steps: int = 4) -> Dict[str, Any]:
    """Stock Megatron and the plugin with partitions (and the experts' dW deferred) from the same weights, each
    trained ``steps`` steps through Megatron's DDP (:func:`_train`): the largest loss and ``main_grad`` differences
    per step, and the hook counts of both runs."""
    from moe_plugins.patches import megatron as mp
    rank = dist.get_rank()
    with megatron_on_cpu(), _memory_buffer(), jobs._groups(_spec_for_groups()) as groups:
        config = _config()
        torch.manual_seed(0)
        stock = _Model(_decoder(config, groups.pg_collection))
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()}
        ref = _train(stock, steps, rank)
        with mp.enable({"ranks_per_node": RPN, "lancet": {"defer_wgrad": True, "partitions": parts}},
                       groups=groups) as handle:
            ours = _Model(_decoder(config, groups.pg_collection))
            ours.load_state_dict(state)
            executor = handle.lancet.partitions.wrap_model(ours, _moe_layers(ours), micro_batch=B)
            again = handle.lancet.partitions.executors == [executor]     # the block's own, returned again
            got = _train(ours, steps, rank)
            ranges = executor.ranges_run
    return {"loss_err": [abs(a - b) for a, b in zip(ref["losses"], got["losses"])],
            "grad_err": [max(jobs._maxerr(a[n], b[n]) for n in a) for a, b in zip(ref["grads"], got["grads"])],
            "hooks": (ref["hooks"], got["hooks"]), "ranges": ranges, "again": again}


def _gpt(config: Any, pgc: Any, vocab: int):
    """Megatron's GPTModel with the local spec, every layer MoE, learned positions, in fp64."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return GPTModel(config, get_gpt_layer_local_spec(num_experts=E), vocab_size=vocab, max_sequence_length=L,
                    pg_collection=pgc).double()


def gpt_job(parts: int = 2, calls: int = 2, vocab: int = 64) -> Dict[str, Any]:
    """Megatron's GPTModel built stock and while the plugin is enabled with ``"lancet": {"partitions": parts}``
    (nothing else: its decoder installs the executor), the same weights, tokens and RNG: per call the largest
    difference of the per-token losses and of every parameter gradient, and the executor's ranges."""
    from moe_plugins.patches import megatron as mp
    rank = dist.get_rank()
    with megatron_on_cpu(), _memory_buffer(), jobs._groups(_spec_for_groups()) as groups:
        config = _config(num_layers=2)
        torch.manual_seed(0)
        stock = _gpt(config, groups.pg_collection, vocab)
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in stock.state_dict().items()}
        runs = []
        with ExitStack() as stack:
            for name in ("stock", "ours"):
                if name == "ours":
                    handle = stack.enter_context(mp.enable({"ranks_per_node": RPN, "lancet": {"partitions": parts}},
                                                           groups=groups))
                    model = _gpt(config, groups.pg_collection, vocab)
                    model.load_state_dict(state)
                else:
                    model = stock
                gen = torch.Generator().manual_seed(100 + rank)
                _seed(rank)
                per_call = []
                for _ in range(calls):
                    ids = torch.randint(0, vocab, (B, L), generator=gen)
                    positions = torch.arange(L).expand(B, L)
                    model.zero_grad(set_to_none=True)
                    logits_BLV = model(ids, positions, _masks(gen))   # the loss here: Megatron's needs its TP state
                    loss_BL = torch.nn.functional.cross_entropy(logits_BLV.transpose(1, 2), ids, reduction="none")
                    loss_BL.sum().backward()
                    res = {"loss": loss_BL.detach()}
                    res.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
                    per_call.append(res)
                runs.append(per_call)
            executors = handle.lancet.partitions.executors
            ranges = [e.ranges_run for e in executors]
    ref, got = runs
    return {"err": [max(jobs._maxerr(a[n], b[n]) for n in a) for a, b in zip(ref, got)],
            "same_names": all(sorted(a) == sorted(b) for a, b in zip(ref, got)), "ranges": ranges}


def _spec_for_groups() -> MegatronVerifySpec:
    return MegatronVerifySpec(world=dist.get_world_size(), ranks_per_node=RPN, mp=1, ep=4, esp=1, experts=E, k=2,
                              tokens=L * B, hidden=M, ffn=H, dtype="float64", schedule="baseline")


def refused_job(overrides: Optional[Dict[str, Any]] = None) -> str:
    """The error of building, while the plugin is enabled with partitions, a decoder with config ``overrides``
    (its TransformerBlock installs the executor; "" when none), and whether nothing was installed then."""
    from moe_plugins.patches import megatron as mp
    with megatron_on_cpu(), jobs._groups(_spec_for_groups()) as groups:
        with mp.enable({"ranks_per_node": RPN, "lancet": {"defer_wgrad": False, "partitions": 2}},
                       groups=groups) as handle:
            try:
                _decoder(_config(**(overrides or {})), groups.pg_collection)
            except ValueError as exc:
                return str(exc) if not handle.lancet.partitions.executors else "installed: " + str(exc)
    return ""
