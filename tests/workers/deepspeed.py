"""Jobs for tests/test_deepspeed_*.py, run on pool ranks: a small DeepSpeed MoE model trained through
``deepspeed.initialize`` with the plugin on and off, and checkpoints saved by one and loaded by the other.

Shapes: B batch, L sequence, M model dim, H FFN hidden, E experts.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Dict, Iterator, List, MutableMapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_plugins.core.patcher import Patch, Patcher
from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm, init_experts

M, H, E, B, L = 8, 16, 4, 2, 8


class TinyMoEModel(nn.Module):
    """Linear -> DeepSpeed MoE (residual) -> Linear head; loss = MSE + 0.01 * aux. DeepSpeed's default gate
    randomness stays on (RTS; top-2 sampling when k = 2): both runs are seeded identically."""

    def __init__(self, ep: int, k: int):
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.inp = nn.Linear(M, M)
        expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
        self.moe = MoE(hidden_size=M, expert=expert, num_experts=E, ep_size=ep, k=k, min_capacity=0)
        self.head = nn.Linear(M, 1)

    def forward(self, x_BLM: torch.Tensor, t_BL1: torch.Tensor) -> torch.Tensor:
        h_BLM = self.inp(x_BLM)
        m_BLM, aux, _ = self.moe(h_BLM)
        return F.mse_loss(self.head(torch.tanh(m_BLM + h_BLM)), t_BL1) + 0.01 * aux


# DeepSpeed's fp16 with a dynamic loss scale that moves within a short run: from 2^8, doubled after 4 clean steps,
# halved (and the step skipped) at an overflow
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 15, "loss_scale_window": 4, "hysteresis": 1}
HALF_DTYPES = {False: torch.float32, True: torch.bfloat16, "fp32-accum": torch.bfloat16, "bf16-fused": torch.bfloat16,
               "fp16": torch.float16, "fp16-fused": torch.float16, "offload": torch.float32,
               "bf16-offload": torch.bfloat16, "predivide": torch.float32}


def ds_config(stage: int, plugin: Optional[Dict[str, Any]], gas: int = 1, half: Any = False) -> Dict[str, Any]:
    """``half`` (a key of HALF_DTYPES): True for DeepSpeed's bf16; ``"fp32-accum"`` with fp32 gradient
    accumulation too (at ZeRO 1, DeepSpeed's BF16_Optimizer); ``"fp16"`` for its fp16 (:data:`FP16`); the
    ``-fused`` ones as fp16/bf16, built by :func:`make_engine` around DeepSpeed's fused-Adam optimizer;
    ``"predivide"``: fp32 with ``gradient_predivide_factor`` 3."""
    low = HALF_DTYPES[half]
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, **({"bf16": {"enabled": True}} if low == torch.bfloat16 else {}),
           **({"fp16": dict(FP16)} if low == torch.float16 else {}),
           **({"data_types": {"grad_accum_dtype": "fp32"}} if half == "fp32-accum" else {})}
    if half == "predivide":
        cfg["gradient_predivide_factor"] = 3.0
    if isinstance(half, str) and half.endswith("offload"):     # ZeRO-Offload, the torch Adam on the host
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if plugin is not None:
        cfg["moe_plugins"] = plugin
    return cfg


def batch(seed: int, step: int):
    gen = torch.Generator().manual_seed(seed * 7919 + step * 104729 + dist.get_rank())
    x = torch.randn(B, L, M, generator=gen)
    return x, torch.sin(x.sum(-1, keepdim=True))


def make_engine(stage: int, plugin: Optional[Dict[str, Any]], ep: int, k: int, seed: int,
                prepare: Optional[Callable[[nn.Module], None]] = None, gas: int = 1, half: Any = False):
    """A fresh engine; every global expert gets weights from (seed, id), wherever the layout places it.
    ``prepare(model)``: changes made to the model before ``deepspeed.initialize``; ``half``: DeepSpeed's bf16 or
    fp16 (:func:`ds_config`; the model 16-bit, fp32 masters in the optimizer) under :func:`cpu_half`."""
    import deepspeed
    torch.manual_seed(seed)
    model = TinyMoEModel(ep, k)
    esp = (plugin or {}).get("esp") or 1
    ep_rank = dist.get_rank() % (ep * esp) // esp        # stock: EP blocks of ranks; the plugin: ESP innermost
    init_experts(model.moe, seed, ep_rank=ep_rank, tp_rank=0, tp=1)
    if prepare is not None:
        prepare(model)
    with cpu_half(half):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(stage, plugin, gas, half))
    return engine


def cpu_half(half: Any) -> Patcher:
    """Test levers (a Patcher, undone on exit) for DeepSpeed's 16-bit optimizers on a CPU: with fp16, its
    accelerator's capability check answers yes (DeepSpeed refuses fp16 on a CPU without AVX512-FP16 at engine
    construction; torch runs fp16 on any CPU, and nothing else reads the check); with a ``-fused`` precision,
    torch's Adam counts as DeepSpeed's fused Adam (a CUDA kernel: it has no CPU build), so that the engine
    builds its ``FP16_Optimizer`` (the flat fp32 master per group it wraps a fused Adam in) around the same
    Adam update. Everything else is DeepSpeed's own path."""
    patches = []
    if HALF_DTYPES[half] == torch.float16:
        from deepspeed.accelerator import get_accelerator
        patches.append(Patch(get_accelerator(), "is_fp16_supported", lambda: True))
    if str(half).endswith("-fused"):
        import deepspeed.runtime.engine as ds_engine
        patches.append(Patch(ds_engine, "FusedAdam", torch.optim.Adam))
    return Patcher(patches)


def train(engine, seed: int, steps: range, dtype: torch.dtype = torch.float32) -> List[float]:
    losses = []
    for step in steps:
        torch.manual_seed(seed * 31 + step)   # the gate's random draws, the same in both runs
        loss = engine(*(t.to(dtype) for t in batch(seed, step)))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_engine(stage: int, plugin: Optional[Dict[str, Any]], ep: int, k: int, seed: int, steps: int,
               half: Any = False) -> Dict[str, Any]:
    """Train a fresh engine (in ``half`` precision: :func:`ds_config`); the plugin is enabled (moe_plugins.enable(),
    the ds_config section decides) iff ``plugin`` is a section."""
    import moe_plugins
    init_deepspeed_comm()
    capture = _Capture()
    log = logging.getLogger("moe_plugins")
    log.addHandler(capture)
    log.setLevel(logging.INFO)
    try:
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            handle = stack.enter_context(moe_plugins.enable()) if plugin is not None else None
            engine = make_engine(stage, plugin, ep, k, seed, half=half)
            losses = train(engine, seed, range(steps), HALF_DTYPES[half])
            skipped, state = engine.skipped_steps, _state(engine)
            attrs = sorted({(n, p.allreduce, p.group_name) for n, p in engine.module.named_parameters()
                            if hasattr(p, "allreduce")})
            engine.destroy()
            built = handle.built_process_groups() if handle is not None else []
    finally:
        log.removeHandler(capture)
    live = set(map(id, dist.distributed_c10d._world.pg_map))          # after disable
    return {"losses": losses, "expert_attrs": attrs, "log": capture.lines, "groups_built": len(built),
            "groups_left": sum(id(pg) in live for pg in built), "skipped": skipped, "state": state}


def train_on_and_off(stage: int, plugin: Dict[str, Any], ep: int, k: int, seed: int, steps: int,
                     half: Any = False) -> Dict[str, Any]:
    off = run_engine(stage, None, ep, k, seed, steps, half)
    on = run_engine(stage, plugin, ep, k, seed, steps, half)
    return {"off": off, "on": on}


CACHE_ENV = "MOE_PLUGINS_CACHE"          # read by the DeepSpeed adapter once, at enable (the boundary)


@contextmanager
def cache_dir_env(cache_dir: str) -> Iterator[None]:
    """``$MOE_PLUGINS_CACHE`` set to ``cache_dir`` inside the block, as it was after (only that variable)."""
    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = cache_dir
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = saved


def train_with_cache(cache_dir: str, *args: Any) -> Dict[str, Any]:
    """:func:`train_on_and_off` with ``$MOE_PLUGINS_CACHE`` set to ``cache_dir``."""
    with cache_dir_env(cache_dir):
        return train_on_and_off(*args)


def _state(engine) -> Dict[str, torch.Tensor]:
    """The module's state_dict with local expert ids turned into global ones (the layouts place experts
    differently), as DeepSpeed's expert checkpoint files name them."""
    from deepspeed.utils import groups
    moe = engine.module.moe
    first = moe.num_local_experts * groups._get_expert_parallel_rank(moe.expert_group_name)
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    out = {}
    for n, t in engine.module.state_dict().items():
        if n.startswith(prefix):
            local, rest = n[len(prefix):].split(".", 1)
            n = f"{prefix}{first + int(local)}.{rest}"
        out[n] = t.detach().clone()
    return out


def checkpoint_round_trip(save_plugin: Optional[Dict[str, Any]], load_plugin: Optional[Dict[str, Any]],
                          stage: int, ep: int, k: int, path: str) -> Dict[str, Any]:
    """Train 3 steps under ``save_plugin`` and save; go on 2 steps. A fresh engine (another seed) under
    ``load_plugin`` loads the checkpoint and runs the same 2 steps."""
    import moe_plugins
    init_deepspeed_comm()
    seed = 5
    results: Dict[str, Any] = {}
    for role, plugin, init_seed in (("saver", save_plugin, seed), ("loader", load_plugin, seed + 100)):
        with ExitStack() as stack:
            stack.enter_context(deepspeed_groups(None))
            if plugin is not None:
                stack.enter_context(moe_plugins.enable())
            engine = make_engine(stage, plugin, ep, k, init_seed)
            initial = _state(engine)
            if role == "saver":
                train(engine, seed, range(3))
                engine.save_checkpoint(path, tag="t3")
            else:
                engine.load_checkpoint(path, tag="t3")
            state = _state(engine)
            results[role] = {"keys": list(engine.module.state_dict()), "initial": initial, "state": state,
                             "after": train(engine, seed, range(3, 5))}
            engine.destroy()
    dist.barrier()
    results["files"] = sorted(os.listdir(os.path.join(path, "t3")))
    return results


def engine_sections() -> Dict[str, Any]:
    """With ``moe_plugins.enable()`` and no config, each engine's ds_config decides: a bad section fails
    ``deepspeed.initialize`` with every problem listed before any layer is swapped; no section, or
    ``enabled: false``, keeps DeepSpeed's stock layers (logged)."""
    import moe_plugins
    init_deepspeed_comm()
    out: Dict[str, Any] = {}
    capture = _Capture()
    log = logging.getLogger("moe_plugins")
    log.addHandler(capture)
    log.setLevel(logging.INFO)
    try:
        for name, section in (("bad", {"schedule": "warp", "pipeline_degree": -1, "fsdp": True}),
                              ("absent", None), ("disabled", {"enabled": False})):
            with deepspeed_groups(None), moe_plugins.enable() as plugin:
                try:
                    engine = make_engine(0, section, 2, 1, 0)
                except ValueError as exc:
                    out[name] = {"error": str(exc), "swaps": list(plugin.swaps)}
                    continue
                out[name] = {"losses": train(engine, 0, range(2)), "swaps": list(plugin.swaps)}
                engine.destroy()
    finally:
        log.removeHandler(capture)
    out["log"] = capture.lines
    return out


def zero0_masters(opt: Any) -> Dict[int, Dict[str, torch.Tensor]]:
    """DeepSpeed's 16-bit optimizers at ZeRO 0, read from their own layouts (not through the plugin's readers):
    per model parameter (by id) its fp32 master (``"fp32"``) and the master's optimizer state tensors shaped like
    it (Adam's moments). ``FP16_UnfusedOptimizer`` keeps a master per parameter; ``FP16_Optimizer`` one flat
    master per group, unflattened by torch's ``_unflatten_dense_tensors`` as DeepSpeed made its parameters views
    of the flat 16-bit buffer. Empty for any other optimizer."""
    from torch._utils import _unflatten_dense_tensors

    def shaped(main: torch.Tensor) -> Dict[str, torch.Tensor]:
        state = opt.optimizer.state.get(main, {})
        return {"fp32": main.detach(),
                **{k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == main.shape}}
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    if hasattr(opt, "fp32_groups_flat"):
        for params, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            pieces = {k: _unflatten_dense_tensors(v, params) for k, v in shaped(flat).items()}
            out.update({id(p): {k: rows[j] for k, rows in pieces.items()} for j, p in enumerate(params)})
    elif hasattr(opt, "fp16_groups") and isinstance(getattr(opt, "fp32_groups", None), list):
        out.update({id(p): shaped(main) for low, high in zip(opt.fp16_groups, opt.fp32_groups)
                    for p, main in zip(low, high)})
    return out


def reduced_grads(engine) -> List[torch.Tensor]:
    """The gradients DeepSpeed hands to the optimizer: ZeRO 0 the parameters' (all-reduced), ZeRO 1/2 this
    rank's partition (``averaged_gradients``; with ZeRO-Offload the host fp32 partitions' ``grad``)."""
    if engine.zero_optimization_stage() == 0:
        return [p.grad.detach().clone() for p in engine.module.parameters() if p.grad is not None]
    if engine.zero_cpu_offload():
        return [flat.grad.detach().clone() for flat in engine.optimizer.single_partition_of_fp32_groups
                if flat.grad is not None]
    out = []
    for i in sorted(engine.optimizer.averaged_gradients):
        g = engine.optimizer.averaged_gradients[i]
        out += [t.detach().reshape(-1).clone() for t in (g if isinstance(g, (list, tuple)) else [g])]
    return out


def count_zero_hooks(engine, calls: MutableMapping[str, int]) -> Patcher:
    """A Patcher (enter it) that counts into ``calls``, per parameter name, each call of ZeRO 1/2's
    per-parameter reduction hook (``process_gradients``, what its post-accumulate-grad hook calls)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    original = engine.optimizer.process_gradients

    def counted(param, i):
        calls[names[id(param)]] = calls.get(names[id(param)], 0) + 1
        return original(param, i)

    return Patcher([Patch(engine.optimizer, "process_gradients", counted)])


def micro_steps(engine, micros: int, loss_of: Callable[[int], torch.Tensor], torch_style: bool,
                calls: Dict[str, int]) -> Tuple[List[float], List[List[torch.Tensor]], List[Dict[str, int]]]:
    """``micros`` micro-steps (``loss_of(micro)`` each): ``loss.backward()`` (scaled by the accumulation) when
    ``torch_style``, else ``engine.backward``, then ``engine.step()``. Returns the losses, the reduced gradients
    at each accumulation boundary (:func:`reduced_grads`) and ``calls`` (cleared per micro-step) as counted."""
    gas = engine.gradient_accumulation_steps()
    losses, grads, hook_calls = [], [], []
    for micro in range(micros):
        calls.clear()
        loss = loss_of(micro)
        boundary = engine.is_gradient_accumulation_boundary()
        if torch_style:
            (loss / gas).backward()
        else:
            engine.backward(loss)
        if boundary:
            grads.append(reduced_grads(engine))
        hook_calls.append(dict(sorted(calls.items())))
        engine.step()
        losses.append(float(loss.detach()))
    return losses, grads, hook_calls
