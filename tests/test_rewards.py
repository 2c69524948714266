import pytest

from steadyrl.rewards import extract_answer, numeric_match, resolve_scorer, score_value


@pytest.mark.parametrize("solution,truth,score", [
    ("The answer is 42", "42", 1.0),
    ("#### 1,200.0", "1200", 1.0),
    ("so \\boxed{ 7 } and then 9", "7", 1.0),
    ("3.50", "3.5", 1.0),
    ("-4", "-4", 1.0),
    ("41", "42", 0.0),
    ("no number here", "42", 0.0),
    ("12 then 13", "12", 0.0),  # the final number counts
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
    with pytest.raises(ValueError, match="not found"):
        resolve_scorer("tests.helpers:missing")


def test_score_value():
    assert score_value(0.5) == (0.5, {})
    assert score_value({"score": 1, "pred": "3"}) == (1.0, {"pred": "3"})
