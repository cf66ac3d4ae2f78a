"""``exit_rank`` (the end of every rank script): flushes what was written, exits with ``sys.exit``'s status, and
skips interpreter finalization, where gloo's worker threads abort the process (see ``moe_plugins.core.rank_exit``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_plugins.core.rank_exit import exit_code

SCRIPT = """
import atexit, logging, sys
from moe_plugins.core.rank_exit import exit_rank
atexit.register(lambda: print("finalized", flush=True))    # runs only on Python's normal exit path
logging.basicConfig(stream=sys.stderr, format="%(message)s")
print("buffered", end="")                                   # no newline: still in the buffer of a pipe
logging.getLogger("rank").warning("logged")
exit_rank({code})
"""


@pytest.mark.parametrize("code, status", [(0, 0), (3, 3), (None, 0), ("a message", 1)])
def test_exit_rank_flushes_and_exits_without_finalizing(code, status):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(code=repr(code))], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == status
    assert out.stdout == "buffered"                  # flushed; the atexit handler never ran
    assert out.stderr.splitlines()[0] == "logged"
    assert ("a message" in out.stderr) == isinstance(code, str)


def test_exit_code_reads_like_sys_exit():
    assert [exit_code(c) for c in (None, 0, 2, 256 + 7, "x", True)] == [0, 0, 2, 7, 1, 1]
    assert exit_code(False) == 0
