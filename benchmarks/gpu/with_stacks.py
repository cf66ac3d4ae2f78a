"""Run a script with every thread's Python stack dumped to stderr after AFTER_S seconds (then exit 3): where a
hang is, on a machine without py-spy. ``torchrun ... benchmarks/gpu/with_stacks.py SCRIPT ARGS``."""
import faulthandler
import os
import runpy
import sys

faulthandler.dump_traceback_later(float(os.environ.get("AFTER_S", 45)), exit=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
