"""Prompt datasets: verl's parquet format, JSONL, and the tiny synthetic copy task.

verl parquet columns: `data_source`, `prompt` (chat list of {role, content}), `ability`,
`reward_model` {style, ground_truth}, `extra_info` {split, index, ...}.
JSONL: either those fields, or `question` + `answer` (the question becomes one user turn).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadyrl.broker import PROJECT_ROOT

DATA_DIR = PROJECT_ROOT / "data"
ARITHMETIC = DATA_DIR / "arithmetic"


@dataclass
class PromptRow:
    """One dataset row, in verl's terms."""

    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str = ""
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)


def _from_verl(rec: dict[str, Any]) -> PromptRow:
    prompt = rec["prompt"]
    messages = [{"role": m["role"], "content": m["content"]} for m in list(prompt)]
    rm = rec.get("reward_model") or {}
    return PromptRow(messages=messages, ground_truth=str(rm.get("ground_truth", "")),
                     data_source=rec.get("data_source", "") or "", ability=rec.get("ability", "") or "",
                     extra_info=dict(rec.get("extra_info") or {}))


def read_parquet(path: str | Path) -> list[PromptRow]:
    """Rows of a verl-format parquet file. Raises KeyError naming a missing column."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for col in ("prompt", "reward_model"):
        if col not in table.column_names:
            raise KeyError(f"{path}: verl parquet needs column {col!r}, has {table.column_names}")
    return [_from_verl(r) for r in table.to_pylist()]


INSTRUCTION = "Reply with only the final number."


def read_jsonl(path: str | Path, instruction: str = INSTRUCTION) -> list[PromptRow]:
    """Rows of a JSONL file with verl fields, or `question` and `answer`.

    `instruction` is appended to a bare question (e.g. "Reply with only the final number.").
    Raises ValueError naming the line of a malformed record.
    """
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if "prompt" in rec:
                rows.append(_from_verl(rec))
            else:
                q = f"{rec['question']} {instruction}".strip()
                rows.append(PromptRow(messages=[{"role": "user", "content": q}], ground_truth=str(rec["answer"]),
                                      data_source=rec.get("data_source") or rec.get("module") or "jsonl"))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a verl record nor question/answer: {e}") from None
    return rows


def load_rows(path: str | Path) -> list[PromptRow]:
    """By extension: .parquet or .jsonl."""
    p = Path(path)
    if p.suffix == ".parquet":
        return read_parquet(p)
    if p.suffix in (".jsonl", ".json"):
        return read_jsonl(p)
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
