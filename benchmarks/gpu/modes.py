"""What the GPU layer scripts (layer_modes.py, layer_pair.py) share: the plugin sections they run, by name
("stock": none), and the engine of one ``deepspeed.moe`` layer."""

import deepspeed
import torch
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

MODES = {
    "stock": None,
    "r1": {"schedule": "baseline", "pipeline_degree": 1},
    "r4": {"schedule": "baseline", "pipeline_degree": 4},
    "parm-auto": {"schedule": "parm-auto", "pipeline_degree": 1},
    "pipe-auto": {"schedule": "baseline", "pipeline_degree": "auto"},
    "lancet": {"schedule": "baseline", "lancet": {"defer_wgrad": True}},
    "hecate": {"schedule": "hecate"},
    "lina": {"schedule": "baseline", "lina": {"priority": True, "micro_op_mb": 4}},
}


class OneMoE(torch.nn.Module):
    """One ``deepspeed.moe`` layer: E experts M -> H -> M (GELU), top-k, capacity factor 1, no RTS, EP 1.
    forward -> (y, aux loss)."""

    def __init__(self, M: int, H: int, E: int, K: int):
        super().__init__()
        expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.GELU(), torch.nn.Linear(H, M))
        self.moe = MoE(M, expert, num_experts=E, ep_size=1, k=K, capacity_factor=1.0, min_capacity=0,
                       use_rts=False, top2_2nd_expert_sampling=False)

    def forward(self, x_BSM):
        y_BSM, aux, _ = self.moe(x_BSM)
        return y_BSM, aux


def build_engine(shape, ds_config: dict, section):
    """A DeepSpeed engine (AdamW) of a fresh, seeded :class:`OneMoE` of ``shape`` (M, H, E, K); ``section``: the
    ds_config's ``moe_plugins`` section, or None for none."""
    torch.manual_seed(0)
    net = OneMoE(*shape)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p"})
    if section is not None:
        ds_config = dict(ds_config, moe_plugins=section)
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(groups, lr=1e-4), config=ds_config)
    return engine
