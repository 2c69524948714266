"""`python tests/integration/fake_clock.py SHIFT_S -m MODULE ARGS...`: runs `python -m MODULE
ARGS...` with this process's wall clock (time.time, time.time_ns) SHIFT_S seconds off, the way
a node whose clock is wrong would run it; the machine's clock and other processes are untouched.
The monotonic clock is left alone (intervals and timeouts stay right)."""

import os
import runpy
import sys
import time

if __name__ == "__main__":
    shift = float(sys.argv[1])
    real, real_ns = time.time, time.time_ns
    time.time = lambda: real() + shift
    time.time_ns = lambda: real_ns() + int(shift * 1e9)
    if sys.argv[2] != "-m":
        raise SystemExit("usage: fake_clock.py SHIFT_S -m MODULE ARGS...")
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    sys.path[0] = os.getcwd()   # as `python -m` has it (not this file's folder)
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
