"""Run inside a fresh venv that has only `pip install ".[deepspeed]"`: moe_plugins.enable() and
deepspeed.initialize on a one-rank gloo model with a deepspeed.moe layer, one training step. Prints a JSON line."""

import faulthandler
import json
import os

import torch
import torch.distributed as dist

from moe_plugins.core.rank_exit import exit_rank

faulthandler.enable()      # an abort (SIGABRT) prints every thread's Python stack to stderr
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)

import deepspeed  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402

import moe_plugins  # noqa: E402
from moe_plugins.patches import deepspeed as adapter  # noqa: E402
from moe_plugins.patches.deepspeed_host import init_deepspeed_comm  # noqa: E402

init_deepspeed_comm()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.moe = MoE(hidden_size=8, expert=expert, num_experts=2, ep_size=1, k=1)

    def forward(self, x):
        y, aux, _ = self.moe(x)
        return y.pow(2).mean() + 0.01 * aux


# torch's Adam: DeepSpeed's own CPU Adam is a C++ op compiled on first use (about 50 s), not what this checks
config = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 0}, "moe_plugins": {"schedule": "baseline", "pipeline_degree": 1}}
torch.manual_seed(0)
with moe_plugins.enable():
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(4, 6, 8))
    engine.backward(loss)
    engine.step()
    swaps = len(adapter.active().swaps)
print(json.dumps({"loss": float(loss.detach()), "swapped_layers": swaps, "active_after": adapter.active() is not None}))
# The abort at exit ("terminate called without an active exception") that this file once saw is gloo's
# worker dropping a finished work during interpreter finalization: exit_rank ends without finalizing.
dist.destroy_process_group()
exit_rank(0)
