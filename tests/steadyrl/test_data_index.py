"""Datasets read a row at a time (issue 46): a JSONL file indexed by one streamed pass, a parquet
file by its row groups, the order drawn without the rows. The rows, their numbers and the
order are the same as when the whole file was read (a run saved before resumes unchanged)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steadyrl.model.data import (
    DatasetChanged,
    JsonlRows,
    ParquetRows,
    PromptRow,
    RowError,
    _from_verl,
    _jsonl_row,
    load_rows,
    open_rows,
    read_parquet,
    where,
)
from steadyrl.rl.loop import prompt_batches, prompt_order


def _verl(content: str | None, truth: str = "3") -> dict:
    return {"data_source": "mine", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}}


def _before(path: Path) -> list[tuple[str, int, object]]:
    """What read_jsonl(lenient=True) gave before rows were indexed (main at 56c1b73): the whole
    text, `splitlines()`, blank lines skipped; each row as (kind, line, value)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = _jsonl_row(line, "Reply with only the final number.", path, n)
            out.append(("row", n, (row.messages, row.ground_truth, row.data_source)))
        except RowError as e:
            out.append(("error", n, e.field))
    return out


def _now(rows) -> list[tuple[str, int, object]]:
    return [("row", r.row, (r.messages, r.ground_truth, r.data_source)) if isinstance(r, PromptRow)
            else ("error", r.row, r.field) for r in rows]


LINES = [
    json.dumps(_verl("1")),
    "",                                                   # blank
    "   \t ",                                             # blank (spaces)
    "\u00a0\u3000",                                      # blank as str.strip sees it (no-break, ideographic space)
    json.dumps(_verl("a\u2028b"), ensure_ascii=False),   # a raw U+2028 in a string: splitlines cuts there
    json.dumps(_verl("c\x85d"), ensure_ascii=False),     # NEL (U+0085), likewise
    json.dumps({"question": "2 + 2?", "answer": 4}),
    "not json",
    "[1, 2]",
    json.dumps(_verl("\u00e9t\u00e9"), ensure_ascii=False) + "\r",   # CRLF line ending
    json.dumps(_verl("x")) + "\r" + json.dumps(_verl("y")),          # a lone \r: two lines
    "\x1f",                                               # blank (unit separator is whitespace to str)
    json.dumps(_verl("last")),                            # no newline at the end
]


def test_a_jsonl_file_is_indexed_into_the_rows_and_numbers_the_whole_text_gave(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes("\n".join(LINES).encode())
    src = JsonlRows(path)
    assert _now(src) == _before(path)
    # line numbers as splitlines counts them: U+2028, U+0085 and a lone \r cut a line in two
    assert [r.row for r in src] == [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16]
    assert _now(load_rows(path, lenient=True)) == _before(path)
    rows = open_rows(path)
    assert len(rows) == 12 and _now(rows[::-1]) == _before(path)[::-1]   # read in any order
    assert [r.messages[0]["content"] for r in rows if isinstance(r, PromptRow)] == [
        "1", "2 + 2? Reply with only the final number.", "\u00e9t\u00e9", "x", "y", "last"]
    assert where(rows[-1], 11) == f"{path} row 16"


def test_a_line_that_is_not_utf8_is_that_rows_error_not_the_files(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(_verl("1")).encode() + b"\n" + b'{"question": "\xff", "answer": 1}\n'
                     + json.dumps(_verl("2")).encode() + b"\n")
    rows = open_rows(path)
    assert isinstance(rows[0], PromptRow) and isinstance(rows[2], PromptRow)
    assert isinstance(rows[1], RowError) and rows[1].field == "line" and "UTF-8" in rows[1].reason
    assert where(rows[1], 1) == f"{path} row 2"


def test_a_file_changed_under_the_run_stops_it_naming_the_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(_verl(str(i))) + "\n" for i in range(4)))
    rows = open_rows(path)
    assert rows[0].messages[0]["content"] == "0"
    os.utime(path, ns=(1, 1))   # a touch (or a checkout of the same bytes): nothing moved
    assert rows[1].messages[0]["content"] == "1"
    with open(path, "a") as f:
        f.write(json.dumps(_verl("9")) + "\n")
    with pytest.raises(DatasetChanged, match=rf"dataset {path} changed while the run was reading it"):
        rows[3]   # not a ConfigError: a restart (exit 1) indexes it anew


def test_a_parquet_file_renamed_over_the_path_leaves_the_open_one_read(tmp_path):
    """Regression (review of issue 46): a file replaced by rename (rsync, cp through a temp
    file) stopped the run though the open ParquetFile still reads the indexed one."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([_verl(str(i)) for i in range(10)]), path, row_group_size=4)
    src = ParquetRows(path)
    pq.write_table(pa.Table.from_pylist([_verl("x") for _ in range(30)]), tmp_path / "new.parquet")
    os.replace(tmp_path / "new.parquet", path)
    assert src.read(9).messages[0]["content"] == "9"


def test_parquet_rows_are_read_by_row_group_as_the_whole_file_gave_them(tmp_path):
    path = tmp_path / "d.parquet"
    recs = [_verl(str(i), truth=str(i)) if i % 7 else _verl(None) for i in range(50)]   # every 7th: no content
    pq.write_table(pa.Table.from_pylist(recs), path, row_group_size=8)   # 7 row groups
    src = ParquetRows(path)
    assert len(src) == 50 and src.starts == [0, 8, 16, 24, 32, 40, 48, 50]
    whole = read_parquet(path, lenient=True)
    order = list(range(50))
    random.Random(0).shuffle(order)
    for i in order:   # random access, as the feeder reads
        a, b = src.read(i), whole[i]
        assert type(a) is type(b) and (a.row, a.source) == (b.row, b.source) == (i + 1, str(path))
        assert (a.messages, a.ground_truth) == (b.messages, b.ground_truth) if isinstance(a, PromptRow) \
            else a.field == b.field
    assert len(src._groups) <= 2   # the last two row groups kept


def test_rows_of_several_files_are_located_and_named_by_their_file(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    a.write_text(json.dumps(_verl("1")) + "\n\n" + json.dumps({"answer": "4"}) + "\n")
    pq.write_table(pa.Table.from_pylist([_verl("5"), _verl("6")]), b)
    rows = open_rows([a, b])
    assert len(rows) == 4 and [rows.locate(i) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [where(r, i) for i, r in enumerate(rows)] == [f"{a} row 1", f"{a} row 3", f"{b} row 1", f"{b} row 2"]
    assert _now(rows) == _now(load_rows([a, b], lenient=True))
    with pytest.raises(IndexError):
        rows.locate(4)


@pytest.mark.parametrize(("n", "batch", "seed"), [(10, 3, 0), (64, 4, 7), (9, 9, 2**40), (101, 8, 1)])
def test_prompt_order_is_prompt_batches_order_from_any_position(n, batch, seed):
    rows = [PromptRow(messages=[{"role": "user", "content": str(i)}], ground_truth="") for i in range(n)]
    batches = prompt_batches(rows, batch, seed)
    want = [(e, i) for _ in range(4 * (n // batch) + 3) for e, i, _ in next(batches)]
    assert list(zip(range(len(want)), prompt_order(n, batch, seed), strict=False)) == list(enumerate(want))
    for start in (0, 1, n // batch * batch - 1, n // batch * batch, 2 * (n // batch * batch) + 1):
        got = prompt_order(n, batch, seed, start)
        assert [next(got) for _ in range(len(want) - start)] == want[start:], start


def test_prompt_order_is_empty_when_no_epoch_holds_a_batch():
    assert list(prompt_order(3, 4, 0)) == []


def test_from_verl_and_the_index_agree_on_a_row_with_every_field(tmp_path):
    rec = {**_verl("q"), "ability": "math", "extra_info": {"split": "train", "index": 3}, "data_source": "gsm8k"}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    [row] = open_rows(path)
    assert row == _from_verl(rec) and os.fspath(row.source) == str(path)
