"""ScoringPool.call: a user's function (a tool, an environment's reset/step) with keyword
arguments in a worker process (issue 48, budgets). A call that raises, sleeps for ever, calls
os._exit or returns 10 MB costs that call: an outcome and a text, never the caller; the process
is replaced after a timeout or a crash and the next call runs."""

import os
import time

import pytest

from steadyrl.model.scorepool import Call, CallResult, ScoringPool

TOOLS = '''
import os, time

def add(a: int, b: int) -> int:
    return a + b

def pid() -> int:
    return os.getpid()

def boom(x: str) -> str:
    raise ValueError("no " + x)

def sleepy() -> str:
    time.sleep(10_000)

def die() -> str:
    os._exit(3)

def huge() -> str:
    return "x" * (10 * 2**20)

def records() -> list:
    return [{"n": i} for i in range(3)]

def hoard() -> str:
    keep = []
    while True:
        keep.append(bytearray(8 * 2**20))

def wrap(fn, **kwargs):
    return {"wrapped": fn(**kwargs)}
'''


@pytest.fixture
def pool(tmp_path, monkeypatch):
    (tmp_path / "t.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    with ScoringPool(1, item_timeout_s=5.0, memory_limit_mb=256) as p:
        yield p


def _one(pool, fn, timeout_s=2.0, max_chars=1000, **kwargs):
    [r] = pool.call([Call(f"t.py:{fn}", kwargs, timeout_s, max_chars, name=f"tool {fn}", **{})])
    return r


def _pid(pool):
    return int(_one(pool, "pid").text)


def test_a_call_gives_its_result_as_text_a_str_as_it_is_else_json(pool):
    assert _one(pool, "add", a=2, b=3) == CallResult("ok", "5")
    assert _one(pool, "records") == CallResult("ok", '[{"n": 0}, {"n": 1}, {"n": 2}]')
    [r] = pool.call([Call("t.py:add", {"a": 1, "b": 1}, 2.0, 100, via="t.py:wrap")])
    assert r == CallResult("ok", '{"wrapped": 2}')


def test_a_call_that_raises_is_its_error_and_the_process_goes_on(pool):
    first = _pid(pool)
    assert _one(pool, "boom", x="luck") == CallResult("error", "ValueError: no luck")
    assert _one(pool, "add", a=1).outcome == "error"   # bad arguments: a TypeError in the process
    assert _pid(pool) == first


def test_a_call_that_sleeps_for_ever_is_a_timeout_and_its_process_is_replaced(pool):
    first = _pid(pool)
    t0 = time.monotonic()
    r = _one(pool, "sleepy", timeout_s=0.5)
    assert r.outcome == "timeout" and "tool sleepy did not return within 0.5 s" in r.text
    assert time.monotonic() - t0 < 3
    assert pool.restarts["scorer_timeout"] == 1
    assert _pid(pool) != first and _one(pool, "add", a=2, b=2).text == "4"


def test_a_call_that_exits_its_process_is_a_crash_and_the_process_is_replaced(pool):
    first = _pid(pool)
    r = _one(pool, "die")
    assert r.outcome == "crash" and "exited with code 3" in r.text
    assert pool.restarts["scorer_crash"] == 1
    assert _pid(pool) != first and _one(pool, "add", a=2, b=2).text == "4"


def test_a_10_mb_result_is_cut_in_the_process_or_refused(pool):
    first = _pid(pool)
    r = _one(pool, "huge", max_chars=100)
    assert r.outcome == "cut" and r.text == "x" * 100 + f" [... {10 * 2**20 - 100} characters cut]"
    [r] = pool.call([Call("t.py:huge", {}, 2.0, 100, name="environment E", cut=False)])
    assert r == CallResult("too_large", f"environment E returned {10 * 2**20} characters, more than the 100 allowed")
    assert _pid(pool) == first   # cut in the process: the process lives on


def test_the_memory_limit_is_the_calls_error(pool):
    r = _one(pool, "hoard", timeout_s=4.0)
    assert r.outcome == "error" and r.text.startswith("MemoryError") and "memory_limit_mb 256" in r.text


def test_calls_run_in_parallel_each_within_its_own_timeout(tmp_path, monkeypatch):
    (tmp_path / "t.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    with ScoringPool(2, item_timeout_s=5.0) as pool:
        t0 = time.monotonic()
        out = pool.call([Call("t.py:sleepy", {}, 0.5, 100, name="tool sleepy"),
                         Call("t.py:add", {"a": 1, "b": 2}, 0.5, 100, name="tool add"),
                         Call("t.py:sleepy", {}, 0.5, 100, name="tool sleepy")])
        took = time.monotonic() - t0
    assert [r.outcome for r in out] == ["timeout", "ok", "timeout"] and out[1].text == "3"
    assert took < 4   # two processes: not one after another past the first's timeout only


def test_the_deadline_bounds_the_whole_call(pool):
    t0 = time.monotonic()
    out = pool.call([Call("t.py:sleepy", {}, 5.0, 100, name="tool sleepy"),
                     Call("t.py:add", {"a": 1, "b": 2}, 5.0, 100, name="tool add")], deadline=time.monotonic() + 0.5)
    assert [r.outcome for r in out] == ["timeout", "timeout"] and time.monotonic() - t0 < 3


def test_an_unknown_function_is_the_calls_error(pool):
    r = _one(pool, "nothing")
    assert r.outcome == "error" and "nothing" in r.text and os.getpid()
