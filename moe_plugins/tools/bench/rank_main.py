"""Entry point of one benchmark rank: ``python -m moe_plugins.tools.bench.rank_main JOB.pkl``.

Reads the pickled :class:`~moe_plugins.tools.bench.runner.RankJob` (or the step bench's
:class:`~moe_plugins.tools.bench.lina_step.StepJob`, or a job with a ``run_rank()`` method such as
:class:`~moe_plugins.tools.bench.lancet_step.TimelineJob`), joins the gloo group from the torchrun-style
variables set by :mod:`.launch`, runs the plan, and on rank 0 writes ``result.json`` next to the job file
(atomically). Exit code 0 on success, 1 on an error (traceback on stderr).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    job_path = Path(args[0])
    import torch
    import torch.distributed as dist

    from moe_plugins.tools.bench.lina_step import StepJob, run_step_plan
    from moe_plugins.tools.bench.runner import run_plan
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=timedelta(seconds=job.plan.collective_timeout_s))
    try:
        run_rank = getattr(job, "run_rank", None)        # a job that runs itself (lancet_step.TimelineJob)
        records = (run_rank() if callable(run_rank) else run_step_plan(job) if isinstance(job, StepJob)
                   else run_plan(job))
        if records is not None:
            tmp = job_path.with_name("result.json.tmp")
            tmp.write_text(json.dumps(records))
            os.replace(tmp, job_path.with_name("result.json"))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    try:
        code = main()
    except Exception:  # the parent reads the log tail and reports it
        traceback.print_exc()
        code = 1
    exit_rank(code)     # not interpreter finalization: see moe_plugins.core.rank_exit
