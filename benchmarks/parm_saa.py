"""Does SAA overlap? Parm's simultaneous all-to-all + all-gather against the same collectives in sequence.

    python benchmarks/parm_saa.py --rates 200mbit 1gbit --out benchmarks/results          # emulated cluster
    python benchmarks/parm_saa.py --mode loopback --fit --out benchmarks/results           # no namespaces

Two nodes of two ranks (network namespaces joined by a tbf-shaped link, moe_plugins/tools/bench/cluster.py),
layout mp=2 (inside a node), ep=2, esp=2, so the EP&ESP all-to-all crosses the link and the MP all-gather
stays on the node's loopback: the Parm paper's premise for SAA. For each size, in interleaved rounds (barrier,
time, max over ranks; medians reported):

- ``a2a``: the EP&ESP all-to-all alone (w: G x E_l x 1 x c x M, ``all_to_all_single``);
- ``ag``:  the MP all-gather of the combined buffer alone (E x c x M per rank);
- ``seq``: the two in sequence, with the ESP sum between them (what parm-s2 runs);
- ``seq_p2p``: the same with SAA's own transport (point-to-point all-to-all), not overlapped: the control;
- ``saa``: :func:`moe_plugins.parm.saa.saa_raw` (what parm-s2-saa runs).

It reports seq / saa (what parm-s2-saa gains over parm-s2), seq_p2p / saa, and the share of the all-gather
that the overlap hides: (seq_p2p - saa) / ag.
``--fit`` also fits alpha/beta (seconds, seconds per element) of every term Parm's planner uses, to refresh
the placeholders in moe_plugins/parm/cost.py. Timings on a shared 2-core machine are noisy: read the ratios,
which are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

# sizes: elements each rank passes to the all-to-all (fp32)
SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20)


def rank_main(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from moe_plugins.core import comm
    from moe_plugins.core.costmodel import fit_linear
    from moe_plugins.core.comm import Recorder
    from moe_plugins.core.groups import build_process_groups
    from moe_plugins.core.layout import ParallelLayout
    from moe_plugins.parm.saa import block_order, saa_raw
    from moe_plugins.tools.bench.ranks import slowest_seconds

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    world = dist.get_world_size()
    g = build_process_groups(ParallelLayout(world=world, ranks_per_node=cfg["ranks_per_node"], mp=cfg["mp"],
                                            ep=cfg["ep"], esp=cfg["esp"]))
    rec, esp, m = Recorder(None, "bench"), cfg["esp"], 256
    order = block_order(g.layout, g.mp, esp)

    results = []
    for z in cfg["sizes"]:
        e_l, gs = 2, g.ep_esp.size
        c = max(1, z // (gs * e_l * m))
        w = torch.randn(gs, e_l, 1, c, m)
        block = torch.randn(gs // esp * e_l, c, m)

        def a2a():
            out = torch.empty_like(w)
            dist.all_to_all_single(out, w, group=g.ep_esp.pg)

        def ag():
            comm.all_gather(block, g.mp, rec, dim=0)

        def seq():
            r = comm.all_to_all(w, g.ep_esp, rec)
            r = r.reshape(gs // esp, esp, e_l, 1, c, m).sum(1).reshape(gs // esp * e_l, 1, c, m)
            comm.all_gather(r, g.mp, rec, dim=1)

        def seq_p2p():
            saa_raw(w, ep_esp=g.ep_esp, mp=g.mp, esp=esp, order=order, rec=rec, phase="forward", overlap=False)

        def saa():
            saa_raw(w, ep_esp=g.ep_esp, mp=g.mp, esp=esp, order=order, rec=rec, phase="forward")

        fns = {"a2a": a2a, "ag": ag, "seq": seq, "seq_p2p": seq_p2p, "saa": saa}
        if cfg["fit"]:
            x = torch.randn(z)
            fns.update({"ag_esp": lambda: comm.all_gather(x, g.esp, rec),
                        "ar_esp": lambda: comm.all_reduce(x, g.esp, rec),
                        "a2a_ep": lambda: comm.all_to_all(x[: z - z % g.ep.size], g.ep, rec)})
        times = {k: [] for k in fns}
        for it in range(cfg["warmup"] + cfg["iters"]):
            names = list(fns)
            names = names[it % len(names):] + names[:it % len(names)]
            for name in names:
                t = slowest_seconds(fns[name])
                if it >= cfg["warmup"]:
                    times[name].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        numel = {"a2a": w.numel(), "ag": block.numel() * g.mp.size, "seq": w.numel(), "seq_p2p": w.numel(),
                 "saa": w.numel(),
                 "ag_esp": z * g.esp.size, "ar_esp": z, "a2a_ep": z - z % g.ep.size}
        results.append({"a2a_elements": w.numel(), "ag_elements": block.numel() * g.mp.size,
                        "median_s": med, "numel": {k: numel[k] for k in med}, "iters": cfg["iters"]})
    if dist.get_rank() == 0:
        fits = {}
        if cfg["fit"]:
            for k in results[0]["median_s"]:
                m_ = fit_linear([r["numel"][k] for r in results], [r["median_s"][k] for r in results], "element")
                fits[k] = {"alpha": m_.alpha, "beta": m_.beta, "r2": m_.r2, "alpha_clamped": m_.alpha_clamped}
        Path(cfg["result"]).write_text(json.dumps({"rows": results, "fits": fits}))
    dist.destroy_process_group()


def launch(cfg: dict, cluster, workdir: Path) -> dict:
    """Start the ranks (inside the nodes' namespaces when ``cluster`` is given) and wait for them."""
    from moe_plugins.tools.bench.launch import run_script_ranks
    return run_script_ranks(__file__, cfg, cluster, workdir)


def table(rate: str, data: dict) -> str:
    lines = [f"### link {rate}", "", "| all-to-all elems | all-gather elems | a2a ms | ag ms | seq ms | seq_p2p ms | "
             "saa ms | seq / saa | seq_p2p / saa | ag hidden |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        t = {k: v * 1e3 for k, v in r["median_s"].items()}
        lines.append(f"| {r['a2a_elements']} | {r['ag_elements']} | {t['a2a']:.2f} | {t['ag']:.2f} | "
                     f"{t['seq']:.2f} | {t['seq_p2p']:.2f} | {t['saa']:.2f} | {t['seq'] / t['saa']:.2f} | "
                     f"{t['seq_p2p'] / t['saa']:.2f} | {(t['seq_p2p'] - t['saa']) / t['ag']:+.0%} |")
    if data["fits"]:
        lines += ["", "alpha/beta fits (s, s/element, R^2): " + ", ".join(
            f"{k}: {v['alpha']:.3g} + {v['beta']:.3g} n ({v['r2']:.3f})" for k, v in data["fits"].items())]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rates", nargs="+", default=["1gbit"])
    p.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--fit", action="store_true", help="also fit the planner's alpha/beta terms")
    p.add_argument("--out", type=Path, default=None, help="write parm_saa.json / parm_saa.md here")
    p.add_argument("--timeout-s", type=float, default=1500.0)
    args = p.parse_args()
    if args.rank_config:
        from moe_plugins.tools.bench.outputs import run_rank_config
        return run_rank_config(args.rank_config, rank_main)
    from moe_plugins.tools.bench.launch import signals_raise
    with signals_raise():            # SIGTERM/SIGHUP unwind, so the ranks are stopped and the namespaces removed
        return run(args)


def run(args: argparse.Namespace) -> int:
    from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, netns_unavailable_reason, set_rate
    reason = None if args.mode == "loopback" else netns_unavailable_reason()
    if args.mode == "netns" and reason:
        raise SystemExit(f"parm_saa: the emulated cluster is unavailable: {reason}")
    use_netns = args.mode != "loopback" and reason is None
    out, md = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        base = {"world": 4, "ranks_per_node": 2, "mp": 2, "ep": 2, "esp": 2, "sizes": args.sizes,
                "iters": args.iters, "warmup": args.warmup, "fit": args.fit, "timeout_s": args.timeout_s,
                "result": str(Path(tmp) / "result.json")}
        if use_netns:
            with emulated_cluster(ClusterSpec(nodes=2)) as cluster:
                for rate in args.rates:
                    set_rate(cluster, rate)
                    out[rate] = launch(base, cluster, Path(tmp))
                    md.append(table(rate, out[rate]))
                    print(md[-1], flush=True)
        else:
            out["unshaped (loopback)"] = launch(base, None, Path(tmp))
            md.append(table("unshaped (loopback: " + (reason or "requested") + ")", out["unshaped (loopback)"]))
            print(md[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parm_saa.json").write_text(json.dumps({"command": " ".join(sys.argv), "results": out}, indent=1))
        (args.out / "parm_saa.md").write_text("# SAA against sequential all-to-all + all-gather\n\n"
                                              f"`{' '.join(sys.argv)}`\n\n" + "\n\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(main())     # not interpreter finalization: see moe_plugins.core.rank_exit
