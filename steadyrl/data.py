"""Prompt datasets: verl's parquet format, JSONL, and the tiny synthetic copy task.

verl parquet columns: `data_source`, `prompt` (chat list of {role, content}), `ability`,
`reward_model` {style, ground_truth}, `extra_info` {split, index, ...}.
JSONL: either those fields, or `question` + `answer` (the question becomes one user turn).
Several files are one dataset, their rows concatenated in the order given (`load_rows`). Each row
knows where it came from (`source`, and `row`: its number in that file counting from 1, a
JSONL's line number), so a bad row is named as a user finds it (`where`).

The default data set ships with the package (`data/arithmetic/` in the checkout, DATA_DIR
wherever steadyrl is installed): a relative path under `data/` that names no file in the
working folder is read from there (`dataset_path`), so the defaults work from any folder.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from steadyrl.assets import asset_dir

DATA_DIR = asset_dir("data")
ARITHMETIC = DATA_DIR / "arithmetic"


def dataset_path(path: str | Path) -> Path:
    """The file a dataset path names: `path` itself, except a relative `data/...` path with no
    such file under the working folder, which is the shipped copy (DATA_DIR / ...) when that
    exists. Nothing is checked beyond that: the caller reports a missing file."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not p.parts or p.parts[0] != "data":
        return p
    shipped = DATA_DIR.joinpath(*p.parts[1:])
    return shipped if shipped.is_file() else p


@dataclass
class PromptRow:
    """One dataset row, in verl's terms."""

    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str = ""
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    #: the file it was read from ("" when made in code) and its row there, counting from 1 (a
    #: JSONL's line number); not part of the row's value
    source: str = field(default="", compare=False, repr=False)
    row: int = field(default=0, compare=False, repr=False)


class RowError(ValueError):
    """One dataset row that is not a prompt: `field` names the part (e.g. `prompt[1].content`),
    the message says why; `source` and `row` say where it is, as PromptRow's do."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason
        self.source, self.row = "", 0


def where(row: PromptRow | RowError, index: int) -> str:
    """A row's place as a user finds it: `file row N` (N from 1, a JSONL's line), or `row N`
    (index + 1) for a row made in code."""
    if row.source:
        return f"{row.source} row {row.row}"
    return f"row {index + 1}"


def _at(row: PromptRow | RowError, source: str | Path, n: int) -> PromptRow | RowError:
    row.source, row.row = str(source), n
    return row


def _messages(prompt: Any) -> list[dict[str, str]]:
    """verl's `prompt` column as chat messages. Raises RowError naming the first bad part: not a
    list (a bare string included), an entry that is not a {role, content} mapping, or a role or
    content that is not text."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__") or isinstance(prompt, dict):
        raise RowError("prompt", f"expected a list of {{role, content}} messages, got {type(prompt).__name__}")
    messages = []
    for j, m in enumerate(list(prompt)):
        if not isinstance(m, dict):
            raise RowError(f"prompt[{j}]", f"expected a {{role, content}} mapping, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise RowError(f"prompt[{j}].{key}", f"expected text, got {type(m.get(key)).__name__}")
        messages.append({"role": m["role"], "content": m["content"]})
    if not messages:
        raise RowError("prompt", "no messages")
    return messages


def _from_verl(rec: dict[str, Any]) -> PromptRow:
    """A verl record as a row. Raises RowError naming the bad field."""
    messages = _messages(rec["prompt"])
    rm = rec.get("reward_model") or {}
    if not isinstance(rm, dict):
        raise RowError("reward_model", f"expected a mapping, got {type(rm).__name__}")
    extra = rec.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise RowError("extra_info", f"expected a mapping, got {type(extra).__name__}")
    return PromptRow(messages=messages, ground_truth=str(rm.get("ground_truth", "")),
                     data_source=rec.get("data_source", "") or "", ability=rec.get("ability", "") or "",
                     extra_info=dict(extra))


@overload
def read_parquet(path: str | Path, lenient: Literal[False] = False) -> list[PromptRow]: ...
@overload
def read_parquet(path: str | Path, lenient: bool) -> list[PromptRow | RowError]: ...
def read_parquet(path: str | Path, lenient: bool = False) -> list[PromptRow] | list[PromptRow | RowError]:
    """Rows of a verl-format parquet file. Raises KeyError naming a missing column, and
    ValueError naming the first row that is not a prompt (its number, from 1, and field); with
    `lenient`, such a row is a RowError in the list instead (at its index)."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # lazy: heavy (pyarrow), parquet only; it has no stubs

    table = pq.read_table(path)
    for col in ("prompt", "reward_model"):
        if col not in table.column_names:
            raise KeyError(f"{path}: verl parquet needs column {col!r}, has {table.column_names}")
    rows: list[PromptRow | RowError] = []
    for n, rec in enumerate(table.to_pylist(), 1):
        try:
            rows.append(_at(_from_verl(rec), path, n))
        except RowError as e:
            if not lenient:
                raise ValueError(f"{path} row {n}: {e}") from None
            rows.append(_at(e, path, n))
    return rows


INSTRUCTION = "Reply with only the final number."


@overload
def read_jsonl(path: str | Path, instruction: str = INSTRUCTION,
               lenient: Literal[False] = False) -> list[PromptRow]: ...
@overload
def read_jsonl(path: str | Path, instruction: str = INSTRUCTION, *, lenient: bool) -> list[PromptRow | RowError]: ...
def read_jsonl(path: str | Path, instruction: str = INSTRUCTION,
               lenient: bool = False) -> list[PromptRow] | list[PromptRow | RowError]:
    """Rows of a JSONL file with verl fields, or `question` and `answer` (blank lines skipped;
    a row's index counts the others).

    `instruction` is appended to a bare question (e.g. "Reply with only the final number.").
    Raises ValueError naming the line of a malformed record; with `lenient`, such a record is
    a RowError in the list instead (at its index).
    """
    rows: list[PromptRow | RowError] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RowError("line", f"not JSON: {e}") from None
            if not isinstance(rec, dict):
                raise RowError("line", f"expected a JSON object, got {type(rec).__name__}")
            if "prompt" in rec:
                rows.append(_at(_from_verl(rec), path, n))
            else:
                for key in ("question", "answer"):
                    if key not in rec:
                        raise RowError(key, "missing (a record needs `prompt` or `question` and `answer`)")
                if not isinstance(rec["question"], str):
                    raise RowError("question", f"expected text, got {type(rec['question']).__name__}")
                q = f"{rec['question']} {instruction}".strip()
                rows.append(PromptRow(messages=[{"role": "user", "content": q}], ground_truth=str(rec["answer"]),
                                      data_source=rec.get("data_source") or rec.get("module") or "jsonl",
                                      source=str(path), row=n))
        except RowError as e:
            if not lenient:
                raise ValueError(f"{path}:{n}: not a verl record nor question/answer: {e}") from None
            rows.append(_at(e, path, n))
    return rows


#: One dataset file, or several read as one (their rows concatenated in the order given).
Paths = str | Path | Sequence[str | Path]


def paths_of(paths: Paths) -> list[str | Path]:
    """`paths` as a list of files (one path: a list of one)."""
    return [paths] if isinstance(paths, (str, Path)) else list(paths)


@overload
def load_rows(path: Paths, lenient: Literal[False] = False) -> list[PromptRow]: ...
@overload
def load_rows(path: Paths, lenient: bool) -> list[PromptRow | RowError]: ...
def load_rows(path: Paths, lenient: bool = False) -> list[PromptRow] | list[PromptRow | RowError]:
    """By extension: .parquet or .jsonl (see read_parquet, read_jsonl: `lenient` keeps a bad
    row as a RowError at its index instead of raising); `path` as `dataset_path` resolves it.
    Several paths: their rows concatenated in the order given, each row knowing its file."""
    if not isinstance(path, (str, Path)):
        rows: list[PromptRow | RowError] = []
        for one in path:
            rows.extend(load_rows(one, lenient=True) if lenient else load_rows(one))
        return rows
    p = dataset_path(path)
    if p.suffix == ".parquet":
        return read_parquet(p, lenient)
    if p.suffix in (".jsonl", ".json"):
        return read_jsonl(p, lenient=lenient)
    raise ValueError(f"{p}: expected a .parquet (verl) or .jsonl file")


def tiny_copy_rows(n: int, seed: int = 0) -> list[PromptRow]:
    """The synthetic task: the prompt is one digit; the reward is the share of the first
    four response characters that repeat it (scorer `tiny_copy`)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        d = str(rng.randrange(10))
        rows.append(PromptRow(messages=[{"role": "user", "content": d}], ground_truth=d,
                              data_source="tiny_copy", extra_info={"index": i}))
    return rows
