"""The DeepSpeed recipe as one rank of a plain 4-process job whose rank 3 stops itself (SIGSTOP) at the
``nth`` op of ``point`` (tests/workers/stall.py's points): ``python -m tests.workers.stall_recipe POINT NTH OUT
-- <recipe flags>``. The recipe's own ``--dist-timeout`` sets every collective's timeout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.workers.stall import arm


def main() -> None:
    point, nth, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    argv = sys.argv[sys.argv.index("--") + 1:]
    if int(os.environ["RANK"]) == 3:
        arm(point, nth, out)
    from moe_plugins.recipes.train_deepspeed import main as train
    train(argv)


if __name__ == "__main__":
    main()
