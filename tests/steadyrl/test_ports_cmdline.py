"""One reading of a process's command line (steadyrl.local.ports.cmdline), used both to tell a
running broker (`LocalBroker.pid`: the whole line must hold `kafka.Kafka`) and to name who holds
a port (`holders`: shortened for the message)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from steadyrl.local import ports


def test_cmdline_is_whole_and_empty_for_a_gone_process():
    long_arg = "x" * 500 + "-kafka.Kafka-tail"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", long_arg])
    try:
        deadline = time.monotonic() + 10
        while not (line := ports.cmdline(proc.pid)).endswith(long_arg) and time.monotonic() < deadline:
            time.sleep(0.05)   # until the child has exec'd (before, /proc shows the parent's line)
        assert line.endswith(long_arg) and len(line) > 500   # never shortened: a marker at the end is seen
    finally:
        proc.kill()
        proc.wait()
    assert ports.cmdline(proc.pid) == ""


def test_a_holder_shows_a_long_line_shortened_and_an_unreadable_one_as_a_question_mark():
    line = ports.cmdline(os.getpid())
    assert ports._short("") == "?"
    assert ports._short("a" * 100 + "b" * 200) == "a" * 60 + " ... " + "b" * 140
    assert ports._short(line[:150]) == line[:150]
