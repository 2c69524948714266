"""`steadyrl up` survives a failed write of its own output (issue 46): steadyrl.output.LossyWriter
drops and counts a line it cannot write (a full volume, a closed pipe), never raises, and says
what was lost once it can write again; the Supervisor keeps reading a child's output meanwhile."""

import io
import os
import subprocess
import sys
import time
from pathlib import Path

from steadyrl.output import LossyWriter
from tests.tmpfs import fill, small_fs


def test_a_closed_pipe_drops_and_counts_lines_and_never_raises():
    r, w = os.pipe()
    os.close(r)                                   # the reader is gone: EPIPE (SIGPIPE is ignored by Python)
    with os.fdopen(w, "w") as stream:
        out = LossyWriter(stream)
        for i in range(5):
            print(f"line {i}", file=out, flush=True)
        out.write("two\nlines\n")
        assert out.dropped == 7 and out.losses == 1


def test_a_full_volume_drops_lines_and_says_so_once_space_returns(tmp_path):
    with small_fs(tmp_path / "fs", "1m") as fs:
        log = fs / "run.log"
        with open(log, "w") as stream:
            out = LossyWriter(stream, note="; see the logs")
            out.write("before\n")
            ballast = fill(fs)
            for i in range(20):                   # 20 KiB: past the page the file holds already
                out.write(f"full {i} " + "x" * 1024 + "\n")
            assert out.dropped >= 10, out.dropped
            dropped = out.dropped
            ballast.unlink()
            out.write("after\n")
            assert out.dropped == dropped
        text = log.read_text()
    assert text.startswith("before\n") and text.endswith("after\n"), text[-500:]
    report = [line for line in text.splitlines() if "could not be written" in line]
    assert len(report) == 1 and report[0].startswith(f"up | {dropped} lines of output could not be written (No space "
                                                     f"left on device) from "), report
    assert report[0].endswith(": dropped; see the logs"), report


def test_a_file_of_its_own_is_opened_again_after_a_failure(tmp_path):
    path = tmp_path / "logs" / "x.log"            # its folder does not exist yet: the first writes fail
    out = LossyWriter(path, prefix="steadyrl up | ")
    out.write_bytes(b"lost\n")
    assert out.dropped == 1
    path.parent.mkdir()
    out.write_bytes(b"kept\n")
    out.close()
    lines = path.read_text().splitlines()
    assert lines[0].startswith("steadyrl up | 1 line of output could not be written (No such file or directory)")
    assert lines[1:] == ["kept"]


def test_print_under_guard_stdio_survives_a_closed_stdout():
    code = ("import sys\nfrom steadyrl.output import guard_stdio\n"
            "with guard_stdio() as (out, err):\n"
            "    for i in range(1000): print('x' * 100, flush=True)\n"
            "    print('to stderr', file=sys.stderr, flush=True)\n"
            "open(sys.argv[1], 'w').write(f'{out.dropped} {err.dropped}')\n")
    report = Path(os.environ.get("TMPDIR", "/tmp")) / f"guard-{os.getpid()}.txt"
    r, w = os.pipe()
    os.close(r)
    try:
        done = subprocess.run([sys.executable, "-c", code, str(report)], stdout=w, stderr=w, timeout=60)
    finally:
        os.close(w)
    try:
        assert done.returncode == 0
        assert report.read_text() == "1000 1"
    finally:
        report.unlink(missing_ok=True)


def test_the_supervisor_keeps_reading_a_child_whose_lines_cannot_be_shown(tmp_path):
    """Regression: a pump thread died at the first failed write, the child's pipe filled and the
    child blocked for good on its next line."""
    from steadyrl.local.supervisor import Child, Supervisor

    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w") as closed:
        child = Child("reward-0", [sys.executable, "-c", "for i in range(20000): print('y' * 40, flush=True)"], 1)
        sup = Supervisor([child], out=closed, log_dir=tmp_path / "logs")
        sup._start(child)
        t0 = time.monotonic()
        assert child.proc.wait(60) == 0             # 800 KB through a 64 KiB pipe: read all along
        for t in child.threads:
            t.join(10)
        assert sup.out.dropped == 20000, sup.out.dropped
    assert len((tmp_path / "logs" / "reward-0.log").read_text().splitlines()) == 20000
    assert time.monotonic() - t0 < 60
    assert isinstance(sup.out, io.TextIOBase)
