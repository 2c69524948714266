"""Rule rewards with verl's signature, and lookup by name or dotted path.

`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`
(a dict carries the reward under "score" plus anything else worth logging).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

Scorer = Callable[..., "float | dict[str, Any]"]

_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUM + r")\s*\}")
_HASHES = re.compile(r"####\s*(" + _NUM + r")")
_ANY = re.compile(_NUM)


def _canon(text: str) -> Decimal | None:
    """'1,234.50' -> Decimal('1234.5'); None if not a number."""
    try:
        return Decimal(text.replace(",", "").replace(" ", "")).normalize()
    except (InvalidOperation, ValueError):
        return None


def extract_answer(solution: str) -> str | None:
    """The final answer: `\\boxed{x}` first, then `#### x`, else the last number in the text."""
    for pattern in (_BOXED, _HASHES):
        found: list[str] = pattern.findall(solution)
        if found:
            return found[-1]
    numbers: list[str] = _ANY.findall(solution)
    return numbers[-1] if numbers else None


def numeric_match(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """1.0 if the final number of `solution_str` equals `ground_truth` numerically, else 0.0.

    Tolerant of spaces, thousands commas and trailing zeros ("1,200.0" == "1200").
    Returns {"score": float, "pred": str | None}.
    """
    pred = extract_answer(solution_str)
    want = _canon(str(ground_truth))
    got = _canon(pred) if pred is not None else None
    return {"score": float(want is not None and got is not None and got == want), "pred": pred}


def tiny_copy(data_source: str, solution_str: str, ground_truth: str,
              extra_info: dict[str, Any] | None = None) -> float:
    """Share of the first 4 characters of `solution_str` equal to `ground_truth` (one char).

    The synthetic task a tiny random model learns by RL in about a minute on CPU.
    """
    head = solution_str[:4]
    return sum(c == ground_truth for c in head) / 4.0


def format_reward(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> float:
    """1.0 if the reply is only a number (optionally `\\boxed{}` or `#### n`), else 0.0."""
    s = solution_str.strip()
    return float(bool(re.fullmatch(r"(?:####\s*|\\boxed\{\s*)?(" + _NUM + r")\s*\}?\.?", s)))


def length_penalty(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None,
                   max_chars: int = 200) -> float:
    """-(excess characters beyond `max_chars`) / max_chars, capped at -1; 0 within the budget."""
    excess = max(0, len(solution_str) - max_chars)
    return -min(1.0, excess / max_chars)


def numeric_match_formatted(data_source: str, solution_str: str, ground_truth: str,
                            extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """numeric_match + 0.1 x format_reward + length_penalty: correct, short, number-only answers."""
    r = numeric_match(data_source, solution_str, ground_truth, extra_info)
    fmt = format_reward(data_source, solution_str, ground_truth)
    pen = length_penalty(data_source, solution_str, ground_truth)
    return {"score": r["score"] + 0.1 * fmt + pen, "correct": r["score"], "format": fmt,
            "length_penalty": pen, "pred": r["pred"]}


SCORERS: dict[str, Scorer] = {"numeric_match": numeric_match, "tiny_copy": tiny_copy,
                              "format": format_reward, "length_penalty": length_penalty,
                              "numeric_match_formatted": numeric_match_formatted}


def resolve_scorer(name: str) -> Scorer:
    """A scorer by registered name (`numeric_match`) or dotted path (`pkg.mod:func` or `pkg.mod.func`).

    Raises:
        ValueError: unknown name, or the path does not name a callable.
    """
    if name in SCORERS:
        return SCORERS[name]
    module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not module or not attr:
        raise ValueError(f"unknown scorer {name!r}: registered are {sorted(SCORERS)}, "
                         "or give a dotted path module:function")
    try:
        fn: Scorer = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scorer {name!r} not found: {e}") from None
    if not callable(fn):
        raise ValueError(f"scorer {name!r} is not callable")
    return fn


def score_value(result: float | dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Split a scorer's result into (reward, extra fields)."""
    if isinstance(result, dict):
        extra = {k: v for k, v in result.items() if k != "score"}
        return float(result["score"]), extra
    return float(result), {}
