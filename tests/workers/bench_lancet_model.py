"""Pool jobs for tests/test_bench_lancet_model.py (run on the gloo ranks of the ``world`` fixture)."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict

import torch
import torch.distributed as dist

from moe_plugins.core.ops import Handle
from moe_plugins.tools.bench.lancet_model_meter import ExchangeMeter

SLEEP_S = 0.2


def _finish_later(handle: Handle, seconds: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), handle._finish(1)), daemon=True)
    t.start()
    return t


def meter_job() -> Dict[str, Any]:
    """The meter on 2 ranks, each its own node: an even inline call, an uneven one (rank r sends [1, 3] rows), a
    call on another thread, a wait on an exchange handle and one on an all-reduce handle, each finished
    ``SLEEP_S`` later by another thread; a call after stop(). Returns each step's figures."""
    rank = dist.get_rank()
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 10 * rank
    original, original_wait = dist.all_to_all_single, Handle.wait
    out: Dict[str, Any] = {}
    meter = ExchangeMeter(lambda r: r)
    with meter.installed():
        out["patched"] = dist.all_to_all_single is not original and Handle.wait is not original_wait
        meter.start()
        dist.all_to_all_single(torch.empty_like(x), x)
        out["even"] = meter.stop().to_dict()
        meter.start()
        recv = [1, 1] if rank == 0 else [3, 3]
        dist.all_to_all_single(x.new_empty(sum(recv), 2), x, output_split_sizes=recv, input_split_sizes=[1, 3])
        out["uneven"] = meter.stop().to_dict()
        meter.start()
        side = threading.Thread(target=lambda: dist.all_to_all_single(torch.empty_like(x), x))
        side.start()
        side.join()
        out["side_thread"] = meter.stop().to_dict()
        meter.start()
        exchange, reduce = Handle("all_to_all@ep (urgent, layer 'test', forward)"), Handle("all_reduce@dp (test)")
        _finish_later(exchange, SLEEP_S)
        exchange.wait()
        _finish_later(reduce, SLEEP_S)
        reduce.wait()
        waits = meter.stop()
        out["waits"] = waits.to_dict()
        dist.all_to_all_single(torch.empty_like(x), x)          # meter off: not counted in the step just read
        out["after_stop"] = waits.to_dict()
    out["restored"] = dist.all_to_all_single is original and Handle.wait is original_wait
    return out
