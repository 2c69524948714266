"""Waits on the thread that proves liveness beat its heartbeat (issue 34): the learner's wait
for the checkpoint writer, and a stage's backoff while only held records are left (a
dependency down; a Retry-After can say 60 s, the whole liveness window)."""

import threading
from types import SimpleNamespace

from steadyrl.bus.stage import Stage
from steadyrl.run import ckpt_writer


def test_the_wait_for_the_checkpoint_writer_beats(tmp_path, monkeypatch):
    """The write returns only after the waiting thread has beaten twice: wait() returns, so it
    beat while it waited (without the beats the write would never end: the test's guard)."""
    beats: list[int] = []
    beaten = threading.Event()

    def write(*a, **kw):
        assert beaten.wait(60), "wait() did not beat while the write was in flight"
        return tmp_path / "step_000001"

    monkeypatch.setattr(ckpt_writer, "snapshot", lambda *a: {})
    monkeypatch.setattr(ckpt_writer, "write", write)

    def beat():
        beats.append(1)
        if len(beats) >= 2:
            beaten.set()

    saver = ckpt_writer.AsyncCheckpointer(tmp_path, {}, verify=False, beat=beat)
    saver.save(1, None, None, None, {})
    saver.wait()
    assert len(beats) >= 2 and saver.last_seconds is not None


def test_a_stage_backoff_beats_and_a_stop_ends_it():
    """An hour's backoff: the heartbeat is called about every second, and the stop (set by the
    third beat) ends the wait."""
    stop = threading.Event()
    beats: list[int] = []

    def beat():
        beats.append(1)
        if len(beats) == 3:
            stop.set()

    stage = SimpleNamespace(_stop=stop, health=SimpleNamespace(beat=beat))
    Stage._backoff(stage, 3600)  # type: ignore[arg-type]
    assert len(beats) == 3 and stop.is_set()


def test_a_stage_backoff_waits_its_time_when_not_stopped():
    stage = SimpleNamespace(_stop=threading.Event(), health=SimpleNamespace(beat=lambda: None))
    stopped = threading.Event()
    t = threading.Thread(target=lambda: (Stage._backoff(stage, 0.05), stopped.set()))  # type: ignore[arg-type]
    t.start()
    t.join(30)
    assert stopped.is_set() and not stage._stop.is_set()
