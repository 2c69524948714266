"""Rule rewards with verl's signature, and lookup by name, dotted path or file.

`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`
(a dict carries the reward under "score" plus anything else worth logging).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import numbers
import os
import re
import sys
import traceback
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


#: Where the modules a saved config may name (`steadyrl.rewards:numeric_match`, a run's
#: reward_server.scorers written before the package had sub-packages) live now. Spelled with
#: "steadyrl." + name: these are the old paths, kept as they were.
MOVED_MODULES = {"steadyrl." + old: "steadyrl.model." + old
                 for old in ("rewards", "scorers", "similarity", "scorepool", "data", "models")}
MOVED_MODULES["steadyrl." + "generation"] = "steadyrl.rl.generation"


def resolve_scorer(name: str) -> Scorer:
    """A scorer by registered name (`numeric_match`), dotted path (`pkg.mod:func` or
    `pkg.mod.func`; a steadyrl module that moved is also found by its old path, MOVED_MODULES)
    or file (`my_reward.py:compute_score`, verl's `custom_reward_function` path and name;
    relative to the working folder).

    A dotted path is imported as it is, else from the working folder: `steadyrl score` and the
    services find `my_reward:compute_score` beside the user as `python -m` would, without
    PYTHONPATH. A file is loaded as module `steadyrl_reward_<stem>_<8 hex of its path>`, once
    per process.

    Raises:
        ValueError: unknown name, no such module, file or function, not a callable, or a module
            that raises (or exits) as it is imported.
    """
    if name in SCORERS:
        return SCORERS[name]
    module, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    module = MOVED_MODULES.get(module, module)
    if not module or not attr:
        raise ValueError(f"unknown scorer {name!r}: registered are {sorted(SCORERS)}, "
                         "or give module:function or file.py:function")
    try:
        owner = _from_file(module) if module.endswith(".py") else _import(module)
    except (ImportError, AttributeError, OSError) as e:
        raise ValueError(f"scorer {name!r} not found: {type(e).__name__}: {e}") from None
    except SyntaxError as e:
        raise ValueError(f"scorer {name!r} cannot be loaded: SyntaxError: {e}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module raised (or exited) on import
        raise ValueError(f"scorer {name!r} cannot be loaded: importing it raised {type(e).__name__}: {e}") from None
    if not hasattr(owner, attr):   # said by the name the user gave, not the module's internal one
        defined = _functions(owner)
        raise ValueError(f"scorer {name!r} not found: {module} has no function {attr}; "
                         + (f"it defines: {', '.join(defined)}" if defined else "it defines no function"))
    fn: Scorer = getattr(owner, attr)
    if not callable(fn):
        raise ValueError(f"scorer {name!r} is not callable")
    return fn


def _functions(module: Any, most: int = 12) -> list[str]:
    """The public functions `module` defines itself (not those it imports), sorted; at most
    `most`, then `...`."""
    names = sorted(k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
                   and getattr(v, "__module__", None) == module.__name__ and not isinstance(v, type))
    return names[:most] + (["..."] if len(names) > most else [])


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != module.split(".")[0] or cwd in sys.path:
            raise
        sys.path.append(cwd)   # after the installed packages: a local file never shadows them
        return importlib.import_module(module)


def _from_file(path: str) -> Any:
    file = os.path.abspath(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no file {file} (relative paths are from the working folder, {os.getcwd()})")
    stem = re.sub(r"\W", "_", os.path.basename(file)[:-3])
    mod_name = f"steadyrl_reward_{stem}_{hashlib.sha256(file.encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file} as Python")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod   # before running it: dataclasses and pickling look it up there
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return mod


#: Characters of an exception's message kept in an item's error.
ERROR_MESSAGE_CHARS = 200


def raised(spec: str, e: BaseException) -> str:
    """An item's error for scorer `spec` raising `e`: the scorer, the exception's type and message
    (cut at ERROR_MESSAGE_CHARS) and the innermost line of its traceback:

        scorer my_reward.py:compute_score raised ValueError: could not convert string to float: 'abc'
        (at my_reward.py:3 in compute_score: return float(solution_str))
    """
    msg = str(e)
    msg = msg if len(msg) <= ERROR_MESSAGE_CHARS else msg[:ERROR_MESSAGE_CHARS] + "..."
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        f = frames[-1]
        where = f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name}" + (f": {f.line})" if f.line else ")")
    return f"scorer {spec} raised {type(e).__name__}: {msg}{where}"


class NotAReward(ValueError):
    """A scorer returned something that is not a reward (`score_value`). `kind` is `non_finite`
    (NaN or infinity in the reward or an extra) or `scorer_error` (not a number, a dict without
    "score", an extra JSON has no form for)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _numpy_plain(value: Any) -> Any:
    """A numpy scalar or array as the Python value it holds (`.tolist()`); anything else as is.
    Duck-typed on the module: this file never imports numpy."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    return value


def _plain(value: Any) -> Any:
    """`value` with numpy scalars and arrays replaced by Python numbers and lists, in dicts,
    lists and tuples at any depth."""
    value = _numpy_plain(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _reward(value: Any, what: str) -> float:
    value = _numpy_plain(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise NotAReward("scorer_error", f"{what} {_cut(repr(value))} ({type(value).__name__}), not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise NotAReward("non_finite", f"{what} {reward!r}, not a finite number")
    return reward


def score_value(result: Any) -> tuple[float, dict[str, Any]]:
    """Split a scorer's return value into (reward, extra fields): the one rule for what a reward is.

    Taken: a real number (int, float, numpy's float64, float32, int64, ... and 0-d arrays), or a
    dict whose "score" is one; the dict's other keys are the extras, JSON values (numpy scalars
    and arrays become numbers and lists). Refused (NotAReward, its `kind`): NaN or infinity in
    the reward or anywhere in the extras (`non_finite`); a str ("0.7"), a bool (True, numpy's
    bool_), None, a dict without "score", an extra JSON has no form for, such as a set
    (`scorer_error`).
    """
    if not isinstance(result, dict):
        return _reward(result, "returned"), {}
    if "score" not in result:
        keys = ", ".join(repr(k) for k in list(result)[:5])
        raise NotAReward("scorer_error", f"returned a dict without \"score\" (keys: {keys})")
    reward = _reward(result["score"], 'returned "score"')
    extra = {str(k): _plain(v) for k, v in result.items() if k != "score"}
    try:
        json.dumps(extra, allow_nan=False)
    except ValueError:
        raise NotAReward("non_finite", "returned extras holding NaN or infinity: "
                                       f"{_cut(repr(extra))}") from None
    except TypeError as e:
        raise NotAReward("scorer_error", f"returned extras that are not JSON ({e})") from None
    return reward, extra


def _cut(text: str, most: int = ERROR_MESSAGE_CHARS) -> str:
    return text if len(text) <= most else text[:most] + "..."
