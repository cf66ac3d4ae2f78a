"""Benchmark/test-only shims that let Megatron-core's stock ``MoELayer`` run on CPU with gloo (0.16.1, 0.19.2).

Megatron-core has no CPU path: its MoE code calls torch.cuda stream, event and device functions that fail
on a CPU build. These shims are small, explicit and undo themselves; nothing in the user path imports this
module (only :mod:`moe_plugins.tools.bench.stock_megatron` and the tests do). Each is active only inside
:func:`megatron_on_cpu`, which restores every original in ``finally``. Enter it around construction and
around every forward/backward of a Megatron layer.

The shims (each found by running the stock layer on CPU; docs/megatron.md, "CPU"; 0.19.2 still needs 1-3,
5 and 6: the same torch.cuda calls, ``maybe_move_tensor_to_cpu`` and the list all_gather are unchanged there):

1. RNG: ``torch.cuda.get_rng_state``/``set_rng_state``/``manual_seed`` and the RNG tracker's own
   ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state`` route to the CPU generator, so that
   the tracker's states (``model_parallel_cuda_manual_seed``) and its ``fork()`` (around expert init, and
   around the attention dropout of Megatron's ``DotProductAttention``) swap the CPU generator's state as they
   swap the CUDA one's on a GPU.
2. Streams: ``torch.cuda.Stream``/``Event``/``current_stream``/``stream`` become no-op CPU stand-ins, and
   ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (a class attribute) holds a stand-in stream.
3. Device: ``torch.cuda.current_device()`` returns ``"cpu"`` (router, ``tensor_parallel.mappings``).
4. ``moe_utils.te_general_gemm = None``: the name exists only when Transformer Engine imports (an upstream
   bug in core 0.16, fixed in 0.17): applied only where the name is missing (0.16.1), not on 0.19.2.
5. ``maybe_move_tensor_to_cpu`` also converts CPU tensors when ``as_numpy=True`` (the all-to-all splits must
   be lists, not tensors), in both ``moe_utils`` and ``token_dispatcher``.
6. ``mappings._gather_along_first_dim`` with uneven ``output_split_sizes`` pads to the largest split and
   uses ``all_gather_into_tensor`` (gloo's list all_gather rejects uneven sizes), then trims.

For Megatron's optimizer, :func:`megatron_optimizer_on_cpu` (separate: it costs a Python call per torch call, so
enter it around the optimizer's construction and ``step`` only): ``megatron.core.optimizer`` creates bookkeeping
tensors with a literal ``device='cuda'`` (``FP32Optimizer._scale``, ``MixedPrecisionOptimizer.found_inf``, the
grad norm in ``clip_grads.py``); a ``TorchFunctionMode`` rewrites a CUDA ``device=`` argument of any torch call
to CPU while it is active, and ``Tensor.type()`` names a CPU tensor's type as its CUDA one (``torch.cuda.BFloat16Tensor``:
``Float16OptimizerWithFloat16Params`` accepts only those). Gradient clipping is not relied on here
(``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` gradients, which passes inside this shim; its
CPU path is untested): the tests and CPU recipes use ``clip_grad=0`` and compare the norm it would scale by.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple


import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from moe_plugins.core.patcher import Patch, Patcher



class _CpuStream:
    """Stand-in for torch.cuda.Stream: work on CPU is already ordered, so every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Optional["_CpuEvent"] = None) -> "_CpuEvent":
        return event or _CpuEvent()

    def __eq__(self, other: object) -> bool:      # one CPU "stream": all stand-ins are the same stream
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _gather_along_first_dim(input_: torch.Tensor, group: dist.ProcessGroup,
                            output_split_sizes: Optional[Sequence[int]] = None,
                            use_global_buffer: bool = False) -> torch.Tensor:
    """Megatron's gather along dim 0, with uneven splits done as pad + all_gather_into_tensor + trim."""
    world = group.size()
    if world == 1:
        return input_
    sizes = [input_.shape[0]] * world if output_split_sizes is None else [int(s) for s in output_split_sizes]
    longest = max(sizes)
    padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
    padded[:input_.shape[0]] = input_
    out = input_.new_empty((world * longest,) + tuple(input_.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([out[i * longest:i * longest + s] for i, s in enumerate(sizes)], dim=0)


def _patches() -> List[Tuple[Any, str, Any]]:
    """(object, attribute, replacement) for every shim this Megatron needs; imports Megatron lazily."""
    from megatron.core.tensor_parallel import mappings, random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    cuda = torch.cuda
    te_gemm = [] if "te_general_gemm" in vars(moe_utils) else [(moe_utils, "te_general_gemm", None)]   # 4
    return te_gemm + [
        (cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),          # 1
        (cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        (cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()),
        (random, "_set_cuda_rng_state", lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)),
        (cuda, "Stream", _CpuStream),                                                   # 2
        (cuda, "Event", _CpuEvent),
        (cuda, "current_stream", lambda device=None: _CpuStream()),
        (cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _CpuStream()),
        (cuda, "current_device", lambda: "cpu"),                                        # 3
        (moe_utils, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu),             # 5
        (token_dispatcher, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu),
        (mappings, "_gather_along_first_dim", _gather_along_first_dim),                 # 6
    ]


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Apply the shims (:func:`_patches`); restore every original (or remove what did not exist) on exit."""
    with Patcher([Patch(obj, name, replacement) for obj, name, replacement in _patches()]):
        yield


class _CudaDeviceToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:      # the type's name, as on CUDA
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_optimizer_on_cpu() -> Iterator[None]:
    """Inside: ``torch.tensor(..., device='cuda')`` and friends make CPU tensors (Megatron's optimizer)."""
    with _CudaDeviceToCpu():
        yield
