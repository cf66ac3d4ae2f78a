"""One rank of a 4-rank gloo job in which rank ``--victim`` stops itself (SIGSTOP, a stuck host) at a chosen
point; the others must fail with a CommError that says where they were, within about the process group's
timeout, and exit non-zero. Run by tests/test_reliability.py as four plain processes (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment), not on the test pool: a stopped pool worker would stop the pool.

Points (``--point``): ``forward`` / ``backward`` (an MoE all-to-all of the baseline schedule in that phase),
``pipemoe`` (an op of a PipeMoE chunk on the engine's pipeline lane, degree 2), ``saa`` (Parm's SAA of
parm-s2-saa, MP 2 x EP 2 x ESP 2: its fused EP&ESP group spans the world), ``lina`` (a micro-op of Lina's gradient reduction on the background lane), ``regather`` (Hecate's
re-materialisation: the copies' early re-gather, a ``spag`` in backward on the pipeline lane), ``partitions``
(Lancet's batch partitions: an exchange of one partition, issued on the pipeline lane in forward or by autograd in
backward, 2 partitions of samples of 4 tokens). The victim
stops at the ``--nth`` matching op, counted from the start, after writing the time to ``--out``/stopped.
Every rank writes ``--out``/rank<r>.json when its step loop ends, normally or not.

Shapes: S tokens per rank, M hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_plugins.core.engine import CommEngine, build_engine
from moe_plugins.core.groups import process_groups
from moe_plugins.core.layer import MoELayer
from moe_plugins.lina.reducer import GradReducer
from moe_plugins.pipemoe.runner import build_executor
from moe_plugins.plugins import default_registry
from moe_plugins.tools.verify import VerifySpec, make_problem

POINTS = ("forward", "backward", "pipemoe", "saa", "lina", "regather", "partitions")


def spec_of(point: str) -> VerifySpec:
    if point == "saa":
        return VerifySpec(world=4, ranks_per_node=2, mp=2, ep=2, esp=2, k=2, tokens=16, schedule="parm-s2-saa")
    if point == "regather":
        return VerifySpec(world=4, ranks_per_node=2, ep=4, k=2, tokens=16, schedule="hecate", exchange="ragged",
                          drop=False)
    return VerifySpec(world=4, ranks_per_node=2, ep=4, k=2, tokens=16, schedule="baseline",
                      pipeline_degree=2 if point == "pipemoe" else 1)


def stop_here(out: Path) -> None:
    (out / "stopped").write_text(str(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def arm(point: str, nth: int, out: Path) -> None:
    """Make this rank stop at the ``nth`` op of ``point`` (test code: wraps the engine's op and SAA)."""
    seen = [0]

    def hit() -> bool:
        seen[0] += 1
        return seen[0] == nth

    if point == "saa":
        from moe_plugins.parm import saa
        inner = saa._saa_raw

        def _saa_raw(*args, **kwargs):
            if hit():
                stop_here(out)
            return inner(*args, **kwargs)
        saa._saa_raw = _saa_raw
        return
    op_of = CommEngine._op

    def _op(self, job, name, op, group, on, x, reduce, layer, phase, ledger, priority, lane, *rest):
        wanted = {"forward": op == "all_to_all" and phase == "forward" and lane == "main",
                  "backward": op == "all_to_all" and phase == "backward" and lane == "main",
                  "pipemoe": lane == "pipeline", "lina": lane == "background",
                  "regather": name == "spag" and phase == "backward" and lane == "pipeline",
                  "partitions": op == "all_to_all" and lane == "pipeline"}[point]
        if wanted and hit():
            stop_here(out)
        return op_of(self, job, name, op, group, on, x, reduce, layer, phase, ledger, priority, lane, *rest)
    CommEngine._op = _op


def steps(point: str, n: int) -> int:
    spec = spec_of(point)
    dp = spec.layout().coords(dist.get_rank())["dp"]
    prob = make_problem(spec)
    done = 0
    with process_groups(spec.layout()) as groups:
        engine = build_engine(groups, pipeline=point in ("pipemoe", "regather", "partitions"),
                              background=point == "lina")
        schedule = spec.schedule
        if point == "regather":
            from moe_plugins.hecate.config import HecateConfig
            from moe_plugins.hecate.schedule import HecateSchedule
            schedule = HecateSchedule.configured(HecateConfig(rematerialize=True))
        try:
            layer = MoELayer(spec.moe_config(), groups, registry=default_registry(), schedule=schedule,
                             dtype=torch.float64, engine=engine,
                             executor=build_executor(spec.pipeline_degree, None, engine))
            layer.load_full(prob.wg_EM, prob.full)
            dense = torch.nn.Linear(spec.hidden, spec.hidden, dtype=torch.float64)
            reducer = GradReducer(engine, micro_op_bytes=64, priority=True) if point == "lina" else None
            for _ in range(n):
                x = prob.x_DSM[dp].clone().requires_grad_(True)
                y, aux = _moe(layer, torch.tanh(dense(x)), point)
                dense.zero_grad(set_to_none=True)
                (y * prob.g_DSM[dp]).sum().add(aux).backward()
                if reducer is not None:
                    pending = [reducer.submit(p.grad.view(-1), groups.dp) for p in dense.parameters()]
                    for handle in pending:
                        handle.wait()
                done += 1
        finally:
            engine.close()
    return done


def _moe(layer: MoELayer, h_SM: torch.Tensor, point: str):
    """The layer's output and aux loss: called whole, or (``partitions``) as 2 partitions of samples of 4 tokens."""
    if point != "partitions":
        o = layer(h_SM)
        return o.y, o.aux_loss
    from moe_plugins.lancet.partition import layer_start
    call = layer_start(layer, h_SM.view(-1, 4, h_SM.shape[-1]), 2, rows_per_sample=4)
    return torch.cat([call.output(p) for p in range(len(call))]).view(h_SM.shape), call.aux_loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--point", choices=POINTS, required=True)
    p.add_argument("--nth", type=int, required=True)
    p.add_argument("--victim", type=int, default=3)
    p.add_argument("--timeout", type=float, required=True, help="the process group's timeout (seconds)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    if rank == args.victim:
        arm(args.point, args.nth, args.out)
    record = {"rank": rank, "error": None, "steps": 0}
    try:
        record["steps"] = steps(args.point, args.steps)
    except Exception as exc:          # reported, then re-raised: the process exits non-zero with the traceback
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        raise
    finally:
        record["end"] = time.time()
        (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(0)     # not interpreter finalization: see moe_plugins.core.rank_exit
