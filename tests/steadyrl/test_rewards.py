import sys

import pytest

from steadyrl.model.rewards import extract_answer, numeric_match, resolve_scorer, score_value


@pytest.mark.parametrize("solution,truth,score", [
    ("The answer is 42", "42", 1.0),
    ("#### 1,200.0", "1200", 1.0),
    ("so \\boxed{ 7 } and then 9", "7", 1.0),
    ("3.50", "3.5", 1.0),
    ("-4", "-4", 1.0),
    ("41", "42", 0.0),
    ("no number here", "42", 0.0),
    ("12 then 13", "12", 0.0),  # the final number counts
    ("-0.5", "-.5", 1.0),
    ("The answer is -3.", "-3", 1.0),
    ("1 234", "1234", 0.0),  # a space is not a thousands separator: two numbers, the last is 234
    ("12,5", "12.5", 0.0),  # a decimal comma is not accepted
    ("+7", "7", 1.0),
    ("#### -1,000,000", "-1000000", 1.0),
    ("\\boxed{3} but wait, 4", "3", 1.0),  # boxed wins over later numbers
    ("", "0", 0.0),
    ("5.0000", "5", 1.0),
    ("2/3", "0.6667", 0.0),
])
def test_numeric_match(solution, truth, score):
    assert numeric_match("arith", solution, truth)["score"] == score


def test_extract_answer_prefers_boxed_then_hashes():
    assert extract_answer("1 #### 2 \\boxed{3} 4") == "3"
    assert extract_answer("1 #### 2 4") == "2"


def test_resolve_by_name_and_dotted_path():
    assert resolve_scorer("numeric_match") is numeric_match
    assert resolve_scorer("tests.helpers:slow_numeric").__name__ == "slow_numeric"
    assert resolve_scorer("tests.helpers.slow_numeric").__name__ == "slow_numeric"
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        resolve_scorer("nope")
    with pytest.raises(ValueError, match="not found: tests.helpers has no function missing; it defines: "):
        resolve_scorer("tests.helpers:missing")


def test_a_scorer_named_by_its_module_s_old_path_still_resolves():
    """A run's saved config written before steadyrl/ had sub-packages names e.g.
    `steadyrl.rewards:numeric_match`: it resolves to the same function (issue 47)."""
    old = "steadyrl." + "rewards"   # spelled apart: the path of before, not a module of today
    assert resolve_scorer(f"{old}:numeric_match") is numeric_match
    assert resolve_scorer(f"{old}.numeric_match") is numeric_match
    assert resolve_scorer("steadyrl." + "scorers:raised") is resolve_scorer("steadyrl.model.rewards:raised")
    # every module that moved, including the one that went to rl/, not model/
    from steadyrl.model.rewards import MOVED_MODULES
    from steadyrl.rl.generation import engine_seed
    assert MOVED_MODULES["steadyrl." + "generation"] == "steadyrl.rl.generation"
    assert resolve_scorer("steadyrl." + "generation:engine_seed") is engine_seed


def test_score_value():
    assert score_value(0.5) == (0.5, {})
    assert score_value({"score": 1, "pred": "3"}) == (1.0, {"pred": "3"})


def test_format_and_length_rewards():
    from steadyrl.model.rewards import format_reward, length_penalty, numeric_match_formatted, tiny_copy

    assert format_reward("", " 42 ", "") == 1.0 and format_reward("", "the answer is 4", "") == 0.0
    assert format_reward("", "\\boxed{3}", "") == 1.0 and format_reward("", "#### 1,200", "") == 1.0
    assert length_penalty("", "x" * 200, "") == 0.0 and length_penalty("", "x" * 300, "") == -0.5
    assert length_penalty("", "x" * 1000, "") == -1.0
    r = numeric_match_formatted("", "42", "42")
    assert r["score"] == pytest.approx(1.1) and r["correct"] == 1.0
    assert tiny_copy("", "7737", "7") == 0.75 and tiny_copy("", "7", "7") == 0.25


VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "source": data_source}
'''


def test_a_reward_file_given_by_path_loads_as_verl_names_it(tmp_path, monkeypatch):
    """Issue 38: `my_reward.py:compute_score` gave "No module named '/x/my_reward'"."""
    (tmp_path / "my_reward.py").write_text(VERL_REWARD)
    fn = resolve_scorer(f"{tmp_path}/my_reward.py:compute_score")
    assert score_value(fn("gsm8k", " 4 ", "4", None)) == (1.0, {"source": "gsm8k"})
    monkeypatch.chdir(tmp_path)
    assert resolve_scorer("my_reward.py:compute_score") is fn          # relative: the same file, loaded once
    with pytest.raises(ValueError, match=r"no file .*nope\.py \(relative paths are from the working folder"):
        resolve_scorer("nope.py:compute_score")
    (tmp_path / "two.py").write_text(VERL_REWARD + "from os.path import join\nLIMIT = 3\n"
                                      "def _helper(): pass\nclass Parsed: pass\ndef compute_bonus(): pass\n")
    with pytest.raises(ValueError) as e:   # the walk-through's typo: AttributeError naming the internal module
        resolve_scorer("two.py:compute_scor")
    assert str(e.value) == ("scorer 'two.py:compute_scor' not found: two.py has no function compute_scor; it "
                            "defines: compute_bonus, compute_score")
    (tmp_path / "none.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="none.py has no function f; it defines no function$"):
        resolve_scorer("none.py:f")
    (tmp_path / "broken.py").write_text("def compute_score(:\n")
    with pytest.raises(ValueError, match="'broken.py:compute_score' cannot be loaded: SyntaxError"):
        resolve_scorer("broken.py:compute_score")


def test_a_module_beside_the_user_imports_without_pythonpath(tmp_path, monkeypatch):
    """`steadyrl score --scorer my_reward2:compute_score` needed PYTHONPATH=. (issue 38)."""
    (tmp_path / "my_reward2.py").write_text(VERL_REWARD)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    fn = resolve_scorer("my_reward2:compute_score")
    assert score_value(fn("x", "1", "1"))[0] == 1.0
    assert sys.path[-1] == str(tmp_path)                              # after the installed packages
    with pytest.raises(ValueError, match="No module named 'not_here'"):
        resolve_scorer("not_here:compute_score")
    monkeypatch.delitem(sys.modules, "my_reward2")


@pytest.mark.parametrize("body", ["raise RuntimeError('no GPU here')\n", "import sys\nsys.exit('bye')\n"])
def test_a_reward_file_that_raises_as_it_is_imported_is_a_value_error(tmp_path, body):
    """Regression (review of issue 46): a RuntimeError at import escaped resolve_scorer, so the
    reward server exited 1 (restarted for ever) instead of 2 naming the scorer."""
    from steadyrl.model.rewards import resolve_scorer

    (tmp_path / "bad_import.py").write_text(body)
    with pytest.raises(ValueError, match=r"bad_import.py:fn' cannot be loaded: importing it raised"):
        resolve_scorer(f"{tmp_path}/bad_import.py:fn")
