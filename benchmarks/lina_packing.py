"""Does Lina's expert packing pay on a compute-light MoE layer, and does ``"auto"`` pick it? On the core layer
(``--host core``, the default), through DeepSpeed (``--host deepspeed``) and through Megatron-core (``--host
megatron``: benchmarks/lina_packing_megatron.py says how).

    python benchmarks/lina_packing.py --rates 1gbit --out /tmp/lina_packing          # emulated cluster
    python benchmarks/lina_packing.py --mode loopback --out /tmp/lina_packing         # no namespaces
    python benchmarks/lina_packing.py --host deepspeed --rates 1gbit 200mbit --out /tmp/lpds
    python benchmarks/lina_packing.py --host megatron --rates 1gbit 200mbit --out /tmp/lpmc

Two nodes of two ranks (network namespaces joined by a tbf-shaped link, moe_plugins/tools/bench/cluster.py),
one core ``MoELayer`` (baseline schedule, E = 8 experts, fp32) with a small FFN (H = 32: little compute per
row) and many tokens (S per rank), unpacked layout ep = 4 (2 experts per device). A training step is
forward + backward + the synchronous gradient sums: expert weights over expert-DP (which packing grows: p
times more expert parameters per device, reduced over p replicas), the gate over DP. No optimizer.

Rows, in interleaved rounds on the same processes (the layer is regrouped between rows by
``PackingController.set_packing``; barrier, time ``--iters`` steps, max over ranks; medians reported):
``p=1``, ``p=2``, ``p=4`` (ep 4, 2, 1). Also: the regroup's own time, and what ``packing: "auto"`` decides
from p = 1 with checks after steps 2, 4, ... (``--auto-steps`` steps), with the agreed mean micro-op times
behind each decision. Timings on a shared 2-core machine are noisy: read the ratios of one run.

``--host deepspeed``: the model is Linear -> DeepSpeed ``MoE`` (the same E, M, H; top-2, capacity factor 1, no
RTS) -> Linear head, MSE loss, through ``deepspeed.initialize`` at ZeRO 0, fp32, torch's Adam; a step is
forward + ``engine.backward`` + ``engine.step``. Rows, one engine each in the same processes, built from the same
seed, interleaved the same way: ``deepspeed`` (stock), and the plugin with ``"lina": {"packing": p}`` for p = 1,
2, 4 (Lina's gradient micro-ops on in all three, so they differ only in the packing). Then a fresh engine with
``"packing": "auto"`` trains ``--auto-steps`` steps from p = 1 with the paper's schedule (checks after steps 10,
14, 18, ...).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path

PACKINGS = (1, 2, 4)


def rank_entry(cfg: dict) -> None:
    if cfg["host"] == "megatron":
        from lina_packing_megatron import rank_main_megatron       # this script's folder is on sys.path
        return rank_main_megatron(cfg)
    (rank_main_deepspeed if cfg["host"] == "deepspeed" else rank_main)(cfg)


def rank_main(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from moe_plugins.core.config import MoEConfig
    from moe_plugins.core.experts import init_full_weights
    from moe_plugins.core.groups import build_process_groups
    from moe_plugins.core.layer import MoELayer
    from moe_plugins.core.layout import ParallelLayout
    from moe_plugins.lina.packer import PackingController
    from moe_plugins.lina.packing import EXPERT_KEYS
    from moe_plugins.tools.bench.ranks import slowest_seconds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ParallelLayout(world=world, ranks_per_node=cfg["ranks_per_node"], ep=world)
    groups = build_process_groups(layout)
    m, h, e, s = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["tokens"]
    config = MoEConfig(hidden=m, ffn=h, num_experts=e, k=2, capacity_factor=1.0)

    def build():
        layer = MoELayer(config, groups, name="moe")
        g = torch.Generator().manual_seed(0)
        layer.load_full(torch.randn(e, m, generator=g) * 0.1, init_full_weights(e, m, h, g))
        return layer

    x = torch.randn(s, m, generator=torch.Generator().manual_seed(rank))

    def step(layer):
        for p in layer.parameters():
            p.grad = None
        layer(x).y.pow(2).mean().backward()
        g = layer.groups
        for name, p in layer.named_parameters():
            pg = g.expert_dp.pg if name in EXPERT_KEYS else g.dp.pg
            if pg is not None:
                dist.all_reduce(p.grad, group=pg)

    # "auto" from p = 1: its own layer, checks after steps 2, 4, ...
    auto_layer = build()
    auto = PackingController([auto_layer], groups, packing="auto", start=2, every=2)
    auto_packing = []
    for _ in range(cfg["auto_steps"]):
        step(auto_layer)
        auto.step_end()
        auto_packing.append(auto.packing)
    decisions = decisions_of(auto)
    auto.set_packing(1)
    auto.close()

    layer = build()
    ctl = PackingController([layer], groups, packing=1)
    times = {p: [] for p in PACKINGS}
    regroup = {p: [] for p in PACKINGS}
    for _ in range(cfg["warmup"]):
        for p in PACKINGS:
            ctl.set_packing(p)
            step(layer)
    for _ in range(cfg["rounds"]):
        for p in PACKINGS:
            regroup[p].append(slowest_seconds(lambda: ctl.set_packing(p)))
            times[p].append(slowest_seconds(lambda: [step(layer) for _ in range(cfg["iters"])]) / cfg["iters"])
    ctl.set_packing(1)
    ctl.close()
    if rank == 0:
        Path(cfg["result"]).write_text(json.dumps({
            "step_s": {p: statistics.median(v) for p, v in times.items()},
            "step_all_s": times, "regroup_s": {p: statistics.median(v) for p, v in regroup.items()},
            "auto_packing": auto_packing, "auto_decisions": decisions}))
    dist.destroy_process_group()


def rank_main_deepspeed(cfg: dict) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import moe_plugins
    from moe_plugins.tools.verify_deepspeed import deepspeed_groups, init_deepspeed_comm
    from moe_plugins.tools.bench.ranks import slowest_seconds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    init_deepspeed_comm()
    rank, world = dist.get_rank(), dist.get_world_size()
    m, h, e, s, batch = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["tokens"], 8

    class Net(nn.Module):
        def __init__(self):
            from deepspeed.moe.layer import MoE
            super().__init__()
            self.inp, self.head = nn.Linear(m, m), nn.Linear(m, 1)
            self.moe = MoE(hidden_size=m, expert=nn.Sequential(nn.Linear(m, h), nn.GELU(), nn.Linear(h, m)),
                           num_experts=e, ep_size=world, k=2, capacity_factor=1.0, min_capacity=0, use_rts=False,
                           top2_2nd_expert_sampling=False)

        def forward(self, x_BLM, t_BL1):
            h_BLM = self.inp(x_BLM)
            y_BLM, aux, _ = self.moe(h_BLM)
            return F.mse_loss(self.head(torch.tanh(y_BLM + h_BLM)), t_BL1) + 0.01 * aux

    def engine(packing):
        torch.manual_seed(0)
        model = Net()
        ds = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 0}}
        if packing is not None:
            ds["moe_plugins"] = {"ranks_per_node": cfg["ranks_per_node"],
                                 "lina": {"packing": packing, "micro_op_mb": 1}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, s // batch, m, generator=gen)
    target = torch.sin(x.sum(-1, keepdim=True))

    def step(eng):
        loss = eng(x, target)
        eng.backward(loss)
        eng.step()

    with deepspeed_groups(None), moe_plugins.enable() as handle:
        rows = {"deepspeed": engine(None)} | {f"p={p}": engine(p) for p in PACKINGS}
        times = {name: [] for name in rows}
        for _ in range(cfg["warmup"]):
            for eng in rows.values():
                step(eng)
        for _ in range(cfg["rounds"]):
            for name, eng in rows.items():
                times[name].append(slowest_seconds(lambda: [step(eng) for _ in range(cfg["iters"])]) / cfg["iters"])
        packed = {name: len(eng.module.moe.deepspeed_moe.experts.deepspeed_experts) for name, eng in rows.items()}
        for eng in rows.values():
            eng.destroy()
        auto = engine("auto")
        controller = next(st.packer.controller for st in handle.lina.engines if st.ds_engine is auto)
        result = host_result(times, packed, controller, lambda: step(auto), cfg["auto_steps"])
        auto.destroy()
    if rank == 0:
        Path(cfg["result"]).write_text(json.dumps(result))
    dist.destroy_process_group()


def decisions_of(controller) -> list:
    """A packing controller's ``"auto"`` decisions with the agreed mean micro-op times behind each."""
    return [{"step": st, "expert_ms": t.expert_mean_s * 1e3, "a2a_ms": t.a2a_mean_s * 1e3, "from": a, "to": b}
            for st, t, a, b in controller.decisions]


def host_result(times: dict, local: dict, controller, step, steps: int) -> dict:
    """A host run's result: the rows' median step times and experts per rank, then ``steps`` timed steps of the
    ``"auto"`` model (``step()``; ``controller``: its packing controller): its packing after each, and its
    decisions."""
    from moe_plugins.tools.bench.ranks import slowest_seconds
    auto_packing, auto_steps = [], []
    for _ in range(steps):
        auto_steps.append(slowest_seconds(step))
        auto_packing.append(controller.packing)
    return {"step_s": {n: statistics.median(v) for n, v in times.items()}, "step_all_s": times,
            "local_experts": local, "auto_packing": auto_packing, "auto_step_s": auto_steps,
            "auto_decisions": decisions_of(controller)}


def launch(cfg: dict, cluster, workdir: Path) -> dict:
    """Start the ranks (inside the nodes' namespaces when ``cluster`` is given) and wait for them."""
    from moe_plugins.tools.bench.launch import run_script_ranks
    return run_script_ranks(__file__, cfg, cluster, workdir)


def table(rate: str, data: dict) -> str:
    step = {int(p): v * 1e3 for p, v in data["step_s"].items()}
    best = min(step, key=step.get)
    lines = [f"### link {rate}", "", "| packing | ep | step ms (median) | vs p=1 | regroup to it, ms |",
             "|---|---|---|---|---|"]
    for p, ms in step.items():
        lines.append(f"| p={p} | {4 // p} | {ms:.1f} | {step[1] / ms:.2f}x | {data['regroup_s'][str(p)] * 1e3:.1f} |")
    lines += ["", f"fastest: p={best}; auto, per step: {data['auto_packing']}"]
    for d in data["auto_decisions"]:
        lines.append(f"- auto at step {d['step']}: expert micro-op {d['expert_ms']:.2f} ms, all-to-all micro-op "
                     f"{d['a2a_ms']:.2f} ms (means over ranks): p {d['from']} -> {d['to']}")
    return "\n".join(lines)


def table_host(rate: str, data: dict, stock: str = "deepspeed") -> str:
    """The table of a host run (``stock``: the host's own row)."""
    step = {n: v * 1e3 for n, v in data["step_s"].items()}
    lines = [f"### link {rate}", "", f"| row | ep | experts per rank | step ms (median) | vs p=1 | vs {stock} |",
             "|---|---|---|---|---|---|"]
    for name, ms in step.items():
        local = data["local_experts"][name]
        lines.append(f"| {name} | {8 // local} | {local} | {ms:.1f} | {step['p=1'] / ms:.2f}x | "
                     f"{step[stock] / ms:.2f}x |")
    plugin = {n: v for n, v in step.items() if n != stock}
    last = data["auto_packing"][-1]
    auto_tail = [t * 1e3 for t, p in zip(data["auto_step_s"], data["auto_packing"]) if p == last][1:]
    lines += ["", f"fastest packing: {min(plugin, key=plugin.get)}; auto, packing after each step: "
              f"{data['auto_packing']}"]
    for d in data["auto_decisions"]:
        lines.append(f"- auto at step {d['step']}: expert micro-op {d['expert_ms']:.2f} ms, all-to-all micro-op "
                     f"{d['a2a_ms']:.2f} ms (means over ranks): p {d['from']} -> {d['to']}")
    if auto_tail:
        lines.append(f"- auto's steps at its final packing (p={last}, after the first): median "
                     f"{statistics.median(auto_tail):.1f} ms over {len(auto_tail)}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rates", nargs="+", default=["1gbit"])
    p.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=None, help="default 1 (core), 2 (hosts)")
    p.add_argument("--auto-steps", type=int, default=None, help="default 6 (core), 22 (hosts)")
    p.add_argument("--host", choices=("core", "deepspeed", "megatron"), default="core")
    p.add_argument("--out", type=Path, default=None, help="write lina_packing[_<host>].json / .md here")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args()
    host = args.host != "core"
    args.warmup = args.warmup if args.warmup is not None else 2 if host else 1
    args.auto_steps = args.auto_steps if args.auto_steps is not None else 22 if host else 6
    if args.rank_config:
        from moe_plugins.tools.bench.outputs import run_rank_config
        return run_rank_config(args.rank_config, rank_entry)
    from moe_plugins.tools.bench.launch import signals_raise
    with signals_raise():            # SIGTERM/SIGHUP unwind, so the ranks are stopped and the namespaces removed
        return run(args)


def run(args: argparse.Namespace) -> int:
    from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, netns_unavailable_reason, set_rate
    reason = None if args.mode == "loopback" else netns_unavailable_reason()
    if args.mode == "netns" and reason:
        raise SystemExit(f"lina_packing: the emulated cluster is unavailable: {reason}")
    out, md = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        base = {"world": 4, "ranks_per_node": 2, "experts": 8, "tokens": args.tokens, "hidden": args.hidden,
                "ffn": args.ffn, "iters": args.iters, "rounds": args.rounds, "warmup": args.warmup,
                "auto_steps": args.auto_steps, "timeout_s": args.timeout_s, "result": str(Path(tmp) / "result.json"),
                "host": args.host}
        table_of = table if args.host == "core" else functools.partial(table_host, stock=args.host)
        if args.mode != "loopback" and reason is None:
            with emulated_cluster(ClusterSpec(nodes=2)) as cluster:
                for rate in args.rates:
                    set_rate(cluster, rate)
                    out[rate] = launch(base, cluster, Path(tmp))
                    md.append(table_of(rate, out[rate]))
                    print(md[-1], flush=True)
        else:
            out["unshaped (loopback)"] = launch(base, None, Path(tmp))
            md.append(table_of("unshaped (loopback: " + (reason or "requested") + ")", out["unshaped (loopback)"]))
            print(md[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "lina_packing" if args.host == "core" else f"lina_packing_{args.host}"
        (args.out / f"{stem}.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                          "runs": out}, indent=1, default=str))
        (args.out / f"{stem}.md").write_text("\n\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(main())     # not interpreter finalization: see moe_plugins.core.rank_exit
