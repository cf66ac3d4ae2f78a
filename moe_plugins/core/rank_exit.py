"""Ending a rank's process so that a finished job never exits with SIGABRT.

The race (CPython 3.11/3.12 with torch's gloo backend; found from a core of the abort, whose crashing thread reads
``ProcessGroupGloo::runLoop -> ~AsyncAlltoallWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire ->
take_gil -> PyThread_exit_thread -> pthread_exit -> std::terminate``): a gloo worker thread drops a finished
collective's work *after* waking the caller. When the caller has already dropped the Python object of a tensor
that work holds, that drop is the tensor's last reference and takes the GIL. If the main thread has begun
interpreter finalization by then, CPython ends the worker with ``pthread_exit``, whose forced unwind crosses a
``noexcept`` destructor: ``std::terminate``, "terminate called without an active exception", and the rank exits
-6 after finishing its work (torchrun then stops the other ranks and the job fails).

A process that ran gloo collectives therefore ends with :func:`exit_rank`: it flushes what Python would flush
(logging handlers, stdout, stderr) and leaves with ``os._exit``, so no finalization runs and the race cannot
happen (multiprocessing ends its children the same way). Call it only where the process is done: the
``__main__`` guard of a rank's script, after ``destroy_process_group()``. An exception escaping the script's
``main`` still takes Python's normal path (traceback, exit code 1).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Optional, Union


def exit_code(code: Union[int, str, None]) -> int:
    """The process exit status ``sys.exit(code)`` would give (None: 0; a message: 1, printed by :func:`exit_rank`)."""
    if code is None:
        return 0
    if not isinstance(code, int):
        return 1
    return int(code) & 0xFF


def exit_rank(code: Union[int, str, None] = 0) -> NoReturn:
    """Flush logging, stdout and stderr, then end the process at once with ``code`` as ``sys.exit`` reads it."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    os._exit(exit_code(code))


def _flush(stream: Optional[object]) -> None:
    flush = getattr(stream, "flush", None)
    if flush is None:
        return
    try:
        flush()
    except (OSError, ValueError):     # a closed or broken stream: nothing more can be written to it
        pass
