"""The DeepSpeed recipe moves each batch (made on the CPU) to the engine's device (issue #27: on GPU, GPT-2's
embedding got CPU indices). On a CPU machine the engine's device is played by PyTorch's ``meta`` device, with
the recipe's GPT-2-MoE model on it; the engine stand-in records where its inputs were, and refuses inputs on
another device as CUDA does ("Expected all tensors to be on the same device": meta itself does not check)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_plugins.recipes import models
from moe_plugins.recipes.train_deepspeed import forward_loss

SIZE = models.SIZES["tiny"]


class DenseMoE(nn.Module):
    """The MoE contract the recipe's blocks expect ``(out, aux, counts)``, with one dense expert: the
    device path is under test, not the routing."""

    def __init__(self, expert: nn.Module):
        super().__init__()
        self.expert = expert

    def forward(self, x):
        return self.expert(x), x.float().pow(2).mean(), None



class _Engine:
    """What the recipe uses of DeepSpeed's engine: ``device``, ``module`` and calling it."""

    def __init__(self, device: str):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.module = models.build_gpt2_moe(SIZE, 64, lambda hidden, expert: DenseMoE(expert)).to(self.device)

    def __call__(self, **batch):
        wrong = {name: str(t.device) for name, t in batch.items() if t.device != self.device}
        if wrong:
            raise RuntimeError(f"Expected all tensors to be on the same device ({self.device}), got {wrong}")
        return self.module(**batch)


def _batch() -> dict:
    ids = torch.randint(0, 64, (2, 8))
    return {"input_ids": ids, "labels": ids}


def test_the_batch_reaches_the_engines_device():
    out, loss = forward_loss(_Engine("meta"), _batch())
    assert out.logits.device.type == "meta" and loss.device.type == "meta" and loss.shape == ()


def test_the_recipe_step_is_the_one_that_moves_it():
    """The recipe's loop calls forward_loss with the batch make_batch built, on the CPU."""
    import inspect

    from moe_plugins.recipes import train_deepspeed
    loop = inspect.getsource(train_deepspeed._main)
    assert "forward_loss(engine, batch)" in loop and "engine(**batch)" not in loop


def test_on_the_cpu_the_loss_is_the_lm_loss_plus_the_aux_loss():
    engine = _Engine("cpu")
    batch = _batch()
    out, loss = forward_loss(engine, batch)
    aux = models.moe_aux_loss(engine.module)
    assert float(aux) > 0 and torch.equal(loss, out.loss + 0.01 * aux)


def test_the_recipe_builds_gpt2_without_a_cache_only_for_lancet_partitions():
    from moe_plugins.recipes.train_deepspeed import lancet_partitions
    assert lancet_partitions({"moe_plugins": {"lancet": {"partitions": 2}}})
    assert lancet_partitions({"moe_plugins": {"lancet": {"partitions": "auto"}}})
    assert not lancet_partitions({"moe_plugins": {"lancet": {"partitions": 1}}})
    assert not lancet_partitions({"moe_plugins": {"lancet": {"defer_wgrad": True}}})
    assert not lancet_partitions({"moe_plugins": {"schedule": "baseline"}}) and not lancet_partitions({})
