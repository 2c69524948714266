"""A full disk never ends the run (issue 34, point 1): each writer keeps the last good copy, retries
until space returns, and reports it; nothing half-written is left; temporaries of dead processes go.

ENOSPC is simulated by an `os.fsync` that refuses (where a delayed-allocation filesystem reports
it), and once for real on a full tmpfs of the test's own (skipped where mounting is refused)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from prometheus_client import REGISTRY

from steadyrl.config import ConfigError
from steadyrl.files import append_lines, write_atomic
from steadyrl.run import diskspace, policy_files
from steadyrl.run.rollout_cache import RolloutCache, rows_of
from tests.steadyrl.test_rollout_cache import _scored
from tests.tmpfs import fill, small_fs

REAL_FSYNC = os.fsync


def refuse_fsync(monkeypatch, times: int = 1) -> list[int]:
    """The next `times` fsyncs raise ENOSPC (after the data went to the page cache); returns the
    count of refusals so far (a one-item list)."""
    left = [times]

    def fsync(fd):
        if left[0] > 0:
            left[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        REAL_FSYNC(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return left


@pytest.fixture
def no_sleep(monkeypatch) -> list[float]:
    """retry's waits recorded instead of slept (with the readiness seen during each)."""
    waits: list[float] = []
    monkeypatch.setattr(diskspace, "_sleeper", lambda beat, stop: waits.append)
    return waits


def _count(writer: str) -> float:
    return REGISTRY.get_sample_value("steadyrl_disk_full_writes_total", {"writer": writer}) or 0.0


def test_retry_waits_with_growing_backoff_reports_and_goes_on_when_space_returns(no_sleep):
    seen: list[tuple[bool, str]] = []
    calls = [0]

    def write():
        calls[0] += 1
        if calls[0] <= 3:
            seen.append(diskspace.readiness())
            raise OSError(errno.ENOSPC, "No space left on device")
        return "written"

    before = _count("t-retry")
    assert diskspace.retry(write, "t-retry", "/x/state.json") == "written"
    assert calls[0] == 4 and _count("t-retry") - before == 3
    assert no_sleep == sorted(no_sleep) and no_sleep[0] >= 0.5 and no_sleep[-1] > no_sleep[0]
    # not ready while it waited (after the first refusal), naming the writer and the path; ready after
    assert not seen[1][0] and "t-retry" in seen[1][1] and "/x/state.json" in seen[1][1]
    assert diskspace.readiness()[0]
    assert REGISTRY.get_sample_value("steadyrl_disk_full_waiting", {"writer": "t-retry"}) == 0


def test_retry_raises_other_errors_at_once_and_stops_when_told(no_sleep):
    def denied():
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        diskspace.retry(denied, "t-other", "/x")
    assert no_sleep == []

    stop = threading.Event()
    stop.set()

    def full():
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(OSError) as e:
        diskspace.retry(full, "t-stop", "/x", stop=stop)
    assert e.value.errno == errno.EDQUOT and diskspace.readiness()[0]


def test_write_atomic_on_a_refusal_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("old")
    refuse_fsync(monkeypatch)
    with pytest.raises(OSError):
        write_atomic(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_atomic(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_append_lines_is_all_or_nothing_so_a_retry_never_follows_half_a_line(tmp_path, monkeypatch, no_sleep):
    path = tmp_path / "consumed.jsonl"
    append_lines(path, ['{"step": 1}'])
    refuse_fsync(monkeypatch, times=2)   # the data reached the file; the fsync refused
    diskspace.retry(lambda: append_lines(path, ['{"step": 2, "a": 1}', '{"step": 2, "a": 2}']), "t-audit", path)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1}, {"step": 2, "a": 1}, {"step": 2, "a": 2}]
    assert len(no_sleep) == 2


def test_append_audit_retries_until_the_disk_takes_the_lines(tmp_path, monkeypatch, no_sleep):
    from steadyrl.services.learner.parts import append_audit
    from steadyrl.services.learner.state import Ready

    batch = [Ready(group=_scored(i), topic="rl.scored", partition=0, offset=i) for i in range(3)]
    refuse_fsync(monkeypatch)
    append_audit(tmp_path, 7, batch)
    rows = [json.loads(x) for x in (tmp_path / "consumed.jsonl").read_text().splitlines()]
    assert [(r["step"], r["offset"]) for r in rows] == [(7, 0), (7, 1), (7, 2)] and len(no_sleep) == 1


def _tensors(v: float) -> dict:
    return {"w": torch.full((4, 4), v), "b": torch.zeros(4)}


def test_a_policy_version_the_disk_refuses_leaves_the_previous_one_and_no_temporary(tmp_path, monkeypatch):
    rel = policy_files.version_dir("r20261204T000000-0001", 1)
    policy_files.write_version(tmp_path, policy_files.version_dir("r20261204T000000-0001", 0), _tensors(0.0))
    refuse_fsync(monkeypatch)
    with pytest.raises(OSError):
        policy_files.write_version(tmp_path, rel, _tensors(1.0))
    run = tmp_path / rel.parent
    assert sorted(p.name for p in run.iterdir()) == ["v000000"]
    digest = policy_files.write_version(tmp_path, rel, _tensors(1.0))
    assert torch.equal(policy_files.read_version(tmp_path, str(rel), digest)["w"], torch.ones(4, 4))


def test_the_policy_store_retries_a_full_disk_and_announces_only_the_written_version(tmp_path, monkeypatch,
                                                                                     no_sleep):
    from steadyrl.model.models import load_policy
    from steadyrl.services.learner.policy_store import PolicyStore
    from steadyrl.services.learner.state import RunState
    from tests.services.learner.conftest import FakeOutbox

    model, _ = load_policy("tiny", seed=0)
    outbox = FakeOutbox()
    store = PolicyStore(tmp_path, outbox, keep=2)   # type: ignore[arg-type]
    st = RunState(run_id="r20261204T000000-0001", step=3)
    before = _count("policy")
    refuse_fsync(monkeypatch, times=2)
    store.publish(model, st)
    assert _count("policy") - before == 2 and len(no_sleep) == 2
    [(_, record)] = outbox.on("rl.policy")
    assert record.version == 3 and record.sha256 == st.policy_sha256
    assert policy_files.read_version(tmp_path, st.policy_uri, st.policy_sha256)
    assert not [p for p in (tmp_path / st.run_id).iterdir() if ".tmp-" in p.name]


def test_a_checkpoint_the_disk_refuses_is_retried_and_latest_stays_the_last_good_one(tmp_path, monkeypatch,
                                                                                       no_sleep):
    from steadyrl.run import checkpoint as ck
    from steadyrl.run import ckpt_writer
    from tests.steadyrl.test_checkpoint import CONFIG, _trained

    model, tr = _trained()
    saver = ckpt_writer.AsyncCheckpointer(tmp_path, CONFIG, keep=3)
    saver.save(1, model, tr.opt, tr.sched, {"global_step": 1})
    saver.wait()
    seen: list[str] = []
    real = ck.write

    def write(root, step, *a, **kw):
        seen.append((root / "LATEST").read_text().strip())   # what a reader finds while the disk refuses
        return real(root, step, *a, **kw)

    monkeypatch.setattr(ckpt_writer, "write", write)
    refuse_fsync(monkeypatch, times=2)
    saver.save(2, model, tr.opt, tr.sched, {"global_step": 2})
    saver.wait()   # no error: the refusals were retried
    assert seen == ["step_000001"] * 3 and len(no_sleep) == 2
    assert (tmp_path / "LATEST").read_text().strip() == "step_000002"
    assert ck.list_checkpoints(tmp_path) == ["step_000001", "step_000002"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    ck.verify(tmp_path / "step_000002")


def test_a_cache_part_the_disk_refuses_keeps_its_rows_and_is_written_once(tmp_path, monkeypatch, no_sleep):
    import pyarrow.dataset as ds

    cache = RolloutCache(tmp_path)
    cache.append(rows_of(_scored(1), 1))
    refuse_fsync(monkeypatch)
    cache.close()
    assert len(no_sleep) == 1 and not list(tmp_path.rglob("*.tmp"))
    assert ds.dataset(tmp_path, format="ipc").to_table().column("step").to_pylist() == [1, 1]


def test_the_cache_keeps_to_its_total_cap_and_retention_oldest_first(tmp_path):
    cache = RolloutCache(tmp_path, max_file_bytes=1)   # each append closes a part
    for i in range(1, 4):
        cache.append(rows_of(_scored(i), i))
    size = max(p.stat().st_size for p in cache.parts())
    names = [p.name for p in cache.parts()]
    assert names == ["part-000001.arrow", "part-000002.arrow", "part-000003.arrow"]
    capped = RolloutCache(tmp_path, max_file_bytes=1, max_total_bytes=2 * size)
    capped.append(rows_of(_scored(4), 4))   # a fourth part: the two oldest go
    assert [p.name for p in capped.parts()] == ["part-000003.arrow", "part-000004.arrow"]
    os.utime(capped.parts()[0], (1, 1))   # part 3 written in 1970
    kept = RolloutCache(tmp_path, max_file_bytes=1, retention_s=3600)
    kept.append(rows_of(_scored(5), 5))
    assert [p.name for p in kept.parts()] == ["part-000004.arrow", "part-000005.arrow"]


def test_temporaries_of_dead_processes_and_this_pid_go_those_of_live_ones_stay(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {f"step_000005.tmp-{dead_pid}": True, f".v000007.tmp-{dead_pid}": True,
                 f".v000007.old-{dead_pid}": True, f".state.json.tmp-{dead_pid}": True,
                 f".state.json.tmp-{os.getpid()}": True, f"step_000010.tmp-{live.pid}": False,
                 f".v000008.tmp-{live.pid}": False, "v000007": False, "step_000005": False, "notes.tmp-x": False}
        for name in names:
            (tmp_path / name).mkdir() if "step_" in name or "v0" in name else (tmp_path / name).write_text("x")
        gone = diskspace.clean_temporaries(tmp_path)
        assert sorted(p.name for p in gone) == sorted(n for n, go in names.items() if go)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, go in names.items() if not go)
    finally:
        live.kill()
        live.wait()


def test_a_run_the_volume_cannot_hold_is_refused_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(diskspace, "usage", lambda path: (10 << 20, 100 << 20))
    need = [("learner.state_dir", tmp_path / "learner", 8 << 20, 0),
            ("learner.policy_root", tmp_path / "policies", 4 << 20, 0)]   # the same volume: 12 MiB
    with pytest.raises(ConfigError) as e:
        diskspace.refuse_small(need)
    assert e.value.code == 2 and str(tmp_path / "learner") in e.value.message and "12.0 MiB" in e.value.message
    diskspace.refuse_small([(s, p, n, 3 << 20) for s, p, n, _ in need[:1]] + need[1:])   # a resume holds 3 MiB


def test_a_real_full_filesystem_refuses_the_write_and_leaves_the_old_bytes(tmp_path):
    with small_fs(tmp_path / "fs", "1m") as fs:
        path = fs / "state.json"
        write_atomic(path, "old")
        append_lines(fs / "consumed.jsonl", ['{"step": 1}'])
        ballast = fill(fs)
        with pytest.raises(OSError) as e:
            write_atomic(path, "x" * 100_000)
        assert diskspace.is_no_space(e.value)
        with pytest.raises(OSError):
            append_lines(fs / "consumed.jsonl", ['{"step": 2}' * 10_000])
        with pytest.raises(OSError):
            policy_files.write_version(fs, policy_files.version_dir("r20261204T000000-0001", 1),
                                       {"w": torch.ones(1 << 16)})
        assert path.read_text() == "old" and (fs / "consumed.jsonl").read_text() == '{"step": 1}\n'
        assert sorted(p.name for p in fs.iterdir()) == ["ballast", "consumed.jsonl", "r20261204T000000-0001",
                                                        "state.json"]
        assert list((fs / "r20261204T000000-0001").iterdir()) == []
        free, size = diskspace.usage(fs)
        assert size == 1 << 20 and free < 64 << 10
        ballast.unlink()
        write_atomic(path, "new")
        assert path.read_text() == "new"
