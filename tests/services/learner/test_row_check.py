"""Rows checked when the run reaches them, once per file (issue 46, services/learner/rows.py):
a few rows at start, the rest as the feeder takes them, the results cached per file so a
restart checks none again; exit 2 at start for data with no usable row, quickly."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from steadyrl.config import ConfigError
from steadyrl.local.limits import GenerationLimits
from steadyrl.model.data import load_rows, open_rows
from steadyrl.model.models import load_policy
from steadyrl.rl.loop import prompt_order
from steadyrl.services.learner import rows as rows_mod
from steadyrl.services.learner.config import LearnerSection
from steadyrl.services.learner.feeder import Feeder
from steadyrl.services.learner.rows import GOOD, PROBE_ROWS, UNKNOWN, check_rows, start_check, train_check
from steadyrl.services.learner.state import RunState
from tests.services.learner.conftest import FakeOutbox

GOOD_ROW = json.dumps({"data_source": "tiny_copy", "prompt": [{"role": "user", "content": "3"}],
                       "reward_model": {"ground_truth": "3"}})
BAD_ROW = json.dumps({"data_source": "tiny_copy", "prompt": [{"role": "tool", "content": "3"}],
                      "reward_model": {"ground_truth": "3"}})


@pytest.fixture(scope="module")
def tok():
    return load_policy("tiny")[1]


def _file(tmp_path, kinds: str, name: str = "d.jsonl"):
    """A JSONL file with a good row for each 'g' of `kinds` and a bad one (role tool) for each 'b'."""
    path = tmp_path / name
    path.write_text("".join((GOOD_ROW if k == "g" else BAD_ROW) + "\n" for k in kinds))
    return path


def _lc(path, **kw) -> LearnerSection:
    return LearnerSection(model="tiny", data=str(path), eval_data=None, max_new_tokens=4, **kw)


def _counted(monkeypatch) -> list[int]:
    """The indexes rows.py checks (its _why), in order."""
    seen: list[int] = []
    real = rows_mod._why

    def why(lc, row, index, *a):
        seen.append(index)
        return real(lc, row, index, *a)

    monkeypatch.setattr(rows_mod, "_why", why)
    return seen


def test_only_the_rows_reached_are_checked_and_a_restart_checks_none_again(tmp_path, tok, monkeypatch):
    path = _file(tmp_path, "gb" * 500)
    lc = _lc(path, prompts_per_step=4, max_staleness=1)
    seen = _counted(monkeypatch)
    cache = tmp_path / "cache"
    check = train_check(lc, open_rows(path), tok, 128, GenerationLimits(), cache)
    start_check(lc, check, (i for _, i in prompt_order(1000, 4, lc.seed)), tmp_path)
    assert check.good == 8 and 8 <= len(seen) < 40   # (max_staleness + 1) x B good rows found: about 16 met
    assert not check.known and check.status.count(UNKNOWN) == 1000 - len(seen)
    first = list(seen)
    # a restart: nothing checked again, and the bad ones are known with their reasons
    seen.clear()
    again = train_check(lc, open_rows(path), tok, 128, GenerationLimits(), cache)
    start_check(lc, again, (i for _, i in prompt_order(1000, 4, lc.seed)), tmp_path)
    assert seen == [] and (again.good, again.bad) == (check.good, check.bad)
    assert [b.index for b in again.known_bad()] == [i for i in first if i % 2]
    assert all(b.field == "prompt[0].role" and b.where == f"{path} row {b.index + 1}" for b in again.known_bad())
    # the same file under other limits is another check
    other = train_check(lc, open_rows(path), tok, 64, GenerationLimits(), cache)
    assert other.good == other.bad == 0
    # the file changed (its mtime): checked again
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert train_check(lc, open_rows(path), tok, 128, GenerationLimits(), cache).good == 0


def test_a_file_with_no_usable_row_exits_2_after_a_thousand_rows_not_the_whole_file(tmp_path, tok, monkeypatch):
    n = 20_000
    path = _file(tmp_path, "b" * n)
    lc = _lc(path)
    seen = _counted(monkeypatch)
    t0 = time.monotonic()
    check = train_check(lc, open_rows(path), tok, 128, GenerationLimits(), tmp_path / "cache")
    with pytest.raises(ConfigError) as e:
        start_check(lc, check, (i for _, i in prompt_order(n, 8, 0)), tmp_path / "state")
    assert e.value.code == 2 and len(seen) == PROBE_ROWS and time.monotonic() - t0 < 30
    said = e.value.message
    assert said.startswith(f"learner.data {path}: none of the first {PROBE_ROWS} rows the run takes is usable "
                           f"({PROBE_ROWS} bad, first: {path} row "), said
    assert "prompt[0].role" in said and f"all in {tmp_path / 'state' / 'bad_rows.jsonl'})" in said
    report = (tmp_path / "state" / "bad_rows.jsonl").read_text().splitlines()
    assert len(report) == PROBE_ROWS and json.loads(report[0])["where"].startswith(f"{path} row ")


def test_a_small_file_is_checked_whole_and_too_few_good_rows_exit_2_as_before(tmp_path, tok):
    path = _file(tmp_path, "gbgbbbgb")
    lc = _lc(path, prompts_per_step=4)
    check = train_check(lc, open_rows(path), tok, 128, GenerationLimits())
    with pytest.raises(ConfigError) as e:
        start_check(lc, check, (i for _, i in prompt_order(8, 4, 0)), tmp_path)
    assert check.known and re.match(rf"learner\.data {path}: 3 usable rows of 8 < learner\.prompts_per_step 4 "
                                    rf"\(5 bad, first: {path} row \d: prompt\[0\]\.role: ", e.value.message)


def test_the_feeder_publishes_what_the_whole_check_at_start_published(tmp_path, tok):
    """The rows met lazily are left out exactly as the start-time check of every row left them
    out: the same prompts in the same order, the bad ones recorded as the feeder meets them."""
    kinds = "".join("b" if i % 5 in (1, 3) else "g" for i in range(120))
    path = _file(tmp_path, kinds)
    lc = _lc(path, prompts_per_step=4, steps=40, max_staleness=3)
    whole = load_rows(path, lenient=True)
    skip = frozenset(b.index for b in check_rows(lc, whole, tok, 128, GenerationLimits()))

    def published(feeder, st):
        out = []
        for _ in range(12):   # train the oldest 4, top up
            feeder.top_up()
            for pid in sorted(st.in_flight, key=lambda p: st.in_flight[p].seq)[:4]:
                del st.in_flight[pid]
            out.append(len(feeder.outbox.sent))
        return [k for _, k, _ in feeder.outbox.sent], st.feeder_position

    before = published(Feeder(lc, whole, st := RunState(run_id="r"), FakeOutbox(), skip=skip), st)
    check = train_check(lc, open_rows(path), tok, 128, GenerationLimits())
    found = []
    check.on_bad = found.append
    check.report_to(tmp_path / "bad_rows.jsonl")
    now = published(Feeder(lc, check.rows, st := RunState(run_id="r"), FakeOutbox(), check=check), st)
    assert now == before and len(now[0]) == 16 + 11 * 4   # (max_staleness + 1) x B, then B a step
    assert {b.index for b in found} == {i for i in skip if check.status[i] != UNKNOWN} and found
    assert all(check.status[i] == GOOD for i in range(120) if i not in skip and check.status[i] != UNKNOWN)
    lines = [json.loads(x) for x in (tmp_path / "bad_rows.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == [b.index for b in found]
    assert lines[0]["where"] == f"{path} row {lines[0]['index'] + 1}"


def test_a_resumed_feeder_goes_on_from_its_position_in_the_order(tmp_path, tok):
    path = _file(tmp_path, "g" * 50)
    lc = _lc(path, prompts_per_step=4, steps=100, max_staleness=0)
    rows = open_rows(path)
    st = RunState(run_id="r")
    first = Feeder(lc, rows, st, FakeOutbox(), check=train_check(lc, rows, tok, 128, GenerationLimits()))
    pulled = [first._pull() for _ in range(130)]   # past two epochs of 48
    st2 = RunState(run_id="r", feeder_position=57)
    resumed = Feeder(lc, rows, st2, FakeOutbox(), check=train_check(lc, rows, tok, 128, GenerationLimits()))
    assert [resumed._pull() for _ in range(73)] == pulled[57:]


def test_the_order_of_a_run_saved_by_main_before_is_the_order_now(tmp_path, tok):
    """tests/fixtures/run-4bba081 (main at 4bba081, the whole dataset loaded): its 64 prompts (48
    trained, 16 in flight) are the first 64 this feeder takes, and its state resumes from there
    to the prompts prompt_batches gives next."""
    from steadyrl.rl.loop import prompt_batches
    from steadyrl.services.learner.config import load_dataset, open_dataset
    from tests.services.learner.test_resume_old_run import FIXTURE, RUN

    run = FIXTURE / "learner" / RUN
    saved = json.loads((run / "state.json").read_text())
    trained = [json.loads(x)["prompt_id"] for x in (run / "consumed.jsonl").read_text().splitlines()]
    old = set(trained) | set(saved["in_flight"])
    lc = LearnerSection(model="tiny", data="tiny_copy:256", eval_data=None, max_new_tokens=4, steps=200,
                        prompt_gate={"cooldown_s": 0})
    rows = open_dataset(lc.data)
    check = train_check(lc, rows, tok, 128, GenerationLimits())
    fresh = Feeder(lc, rows, RunState(run_id=RUN), FakeOutbox(), check=check)
    new = [f"{RUN}/e{e}-i{i}" for e, i in (fresh._pull() for _ in range(64))]
    assert len(old) == 64 and set(new) == old
    st = RunState(run_id=RUN, feeder_position=saved["feeder_position"])
    resumed = Feeder(lc, rows, st, FakeOutbox(), check=check)
    batches = prompt_batches(load_dataset(lc.data), 8, 0)
    want = [(e, i) for _ in range(40) for e, i, _ in next(batches)][64:]
    assert [resumed._pull() for _ in range(len(want))] == want   # into epoch 1


def test_cached_results_unused_for_30_days_are_pruned_and_those_in_use_kept(tmp_path, tok):
    from steadyrl.services.learner.rows import prune_cache

    path = _file(tmp_path, "gggb")
    lc = _lc(path, prompts_per_step=2)
    cache = tmp_path / "cache"
    check = train_check(lc, open_rows(path), tok, 128, GenerationLimits(), cache)
    assert [check.ok(i) for i in range(4)] == [True, True, True, False]
    check.save()
    assert check.known and {p.suffix for p in cache.iterdir()} == {".good", ".jsonl"}
    gone = cache / "0123.good"   # a file since changed: its entry no longer used
    gone.write_bytes(b"\1")
    month = time.time() - 31 * 86400
    for p in cache.iterdir():
        os.utime(p, (month, month))
    train_check(lc, open_rows(path), tok, 128, GenerationLimits(), cache)   # in use: marked so
    assert prune_cache(cache) == 1 and not gone.exists() and len(list(cache.iterdir())) == 2
    assert train_check(lc, open_rows(path), tok, 128, GenerationLimits(), cache).known
