"""Prompt datasets: verl's parquet format, JSONL, and the tiny synthetic copy task.

verl parquet columns: `data_source`, `prompt` (chat list of {role, content}), `ability`,
`reward_model` {style, ground_truth}, `extra_info` {split, index, ...}.
JSONL: either those fields, or `question` + `answer` (the question becomes one user turn).
Several files are one dataset, their rows concatenated in the order given (`load_rows`). Each row
knows where it came from (`source`, and `row`: its number in that file counting from 1, a
JSONL's line number), so a bad row is named as a user finds it (`where`).

A dataset is read two ways: `load_rows` reads every row into a list (the CLI's evaluation,
tests, small sets), `open_rows` indexes the files and reads a row when it is asked for
(`Rows`): the learner's way, for datasets of any size. The index is what grows with the
file: for a JSONL file, the byte offset and line number of each row (16 bytes a row: 16 MB for
1 000 000 rows), made by one streamed pass over its lines; for parquet, the rows of each row
group (from the file's footer; a read decodes its row group, the last two kept, at most
`ROW_GROUP_CACHE_BYTES` beyond the one in use). Both ways give the same rows, numbered the same.

The default data set ships with the package (`data/arithmetic/` in the checkout, DATA_DIR
wherever steadyrl is installed): a relative path under `data/` that names no file in the
working folder is read from there (`dataset_path`), so the defaults work from any folder.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import random
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar, overload

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


def encode_prompt(tokenizer: Any, row: PromptRow) -> list[int]:
    """Token ids of `row`'s chat with the assistant turn opened: the prompt the actor generates
    from and the learner scores (both call this)."""
    ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


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


_R = TypeVar("_R", PromptRow, RowError)


def _at(row: _R, source: str | Path, n: int) -> _R:
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


def _jsonl_row(text: str, instruction: str, source: str | Path, n: int) -> PromptRow:
    """The row of one JSONL line's text (line `n` of `source`, from 1). Raises RowError naming
    the bad field."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError("line", f"not JSON: {e}") from None
    if not isinstance(rec, dict):
        raise RowError("line", f"expected a JSON object, got {type(rec).__name__}")
    if "prompt" in rec:
        return _at(_from_verl(rec), source, n)
    for key in ("question", "answer"):
        if key not in rec:
            raise RowError(key, "missing (a record needs `prompt` or `question` and `answer`)")
    if not isinstance(rec["question"], str):
        raise RowError("question", f"expected text, got {type(rec['question']).__name__}")
    q = f"{rec['question']} {instruction}".strip()
    return PromptRow(messages=[{"role": "user", "content": q}], ground_truth=str(rec["answer"]),
                     data_source=rec.get("data_source") or rec.get("module") or "jsonl", source=str(source), row=n)


@overload
def read_jsonl(path: str | Path, instruction: str = INSTRUCTION,
               lenient: Literal[False] = False) -> list[PromptRow]: ...
@overload
def read_jsonl(path: str | Path, instruction: str = INSTRUCTION, *, lenient: bool) -> list[PromptRow | RowError]: ...
def read_jsonl(path: str | Path, instruction: str = INSTRUCTION,
               lenient: bool = False) -> list[PromptRow] | list[PromptRow | RowError]:
    """Rows of a JSONL file with verl fields, or `question` and `answer` (blank lines skipped;
    a row's index counts the others). Lines are as Python's `str.splitlines` cuts the text
    (a raw U+2028 in a string ends a line: JsonlRows).

    `instruction` is appended to a bare question (e.g. "Reply with only the final number.").
    Raises ValueError naming the line of a malformed record; with `lenient`, such a record is
    a RowError in the list instead (at its index).
    """
    src = JsonlRows(path, instruction=instruction)
    try:
        rows: list[PromptRow | RowError] = []
        for row in src:
            if isinstance(row, RowError) and not lenient:
                raise ValueError(f"{path}:{row.row}: not a verl record nor question/answer: {row}")
            rows.append(row)
        return rows
    finally:
        src.close()


#: The heartbeat a long read calls now and then (a service's Health.beat).
Beat = Callable[[], None]
#: Line breaks other than \n (and a \r\n's \r) that str.splitlines also cuts at: a line
#: holding one is cut as `read_text().splitlines()` cut it (rows and line numbers unchanged)
_OTHER_BREAKS = re.compile(rb"[\r\x0b\x0c\x1c\x1d\x1e]|\xc2\x85|\xe2\x80[\xa8\xa9]")
#: what bytes.strip must take off besides ASCII space and tab to match str.strip on the others
_ASCII_SPACE = b" \t\x1f"
#: lines between two heartbeats while a file is indexed
_BEAT_LINES = 1 << 15


def _pieces(raw: bytes) -> list[str]:
    """The lines `read_text().splitlines()` makes of one \n-ended line `raw` (universal newlines:
    \r\n and \r are \n); bytes that are not UTF-8 kept as surrogates (`_strict` refuses them)."""
    text = raw.decode("utf-8", "surrogateescape").replace("\r\n", "\n").replace("\r", "\n")
    return text.splitlines()


def _strict(text: str) -> str:
    """`text` (from `_pieces`) when it was UTF-8 throughout. Raises RowError otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError("line", "not UTF-8 text") from None
    return text


def file_identity(path: str | Path) -> dict[str, Any]:
    """What a file's cached results are keyed by: its size, mtime (ns) and the sha256 of its
    first and last MiB (a file rewritten in place keeping its size, its mtime and both ends is
    not told apart; `touch` it). Raises OSError if it cannot be read."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(st.st_size - (1 << 20))
        h.update(f.read(1 << 20))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ends_sha256": h.hexdigest()}


class RowSource:
    """One dataset file (or rows made in code), read a row at a time: `len()`, `read(i)` (row i
    of this source, from 0: a PromptRow, or a RowError saying why it is not one, both knowing
    where they are), `line(i)` (its number in the file, from 1), `label` (the file as given;
    "" for rows made in code) and `identity()` (file_identity, None for rows made in code)."""

    label = ""

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, i: int) -> PromptRow | RowError:
        raise NotImplementedError

    def line(self, i: int) -> int:
        return i + 1

    def identity(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        """Release the open file, if any (a later read opens it again)."""


class MemoryRows(RowSource):
    """Rows held in a list (tiny_copy:N, rows made in code)."""

    def __init__(self, rows: Sequence[PromptRow | RowError]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def read(self, i: int) -> PromptRow | RowError:
        return self.rows[i]


class DatasetChanged(RuntimeError):
    """A dataset file's size changed under the run since it was indexed: its rows are no longer
    where the index says. Not a ConfigError: a restart (exit 1; `up` restarts the learner)
    indexes it anew."""


def _changed(label: str, then: tuple[int, int], now: os.stat_result) -> DatasetChanged:
    """The error of a dataset file whose size changed since it was indexed (a `touch`, a
    checkout of the same bytes or a file renamed over the path change nothing: the size is
    what moves the rows, and the open file is still the indexed one)."""
    return DatasetChanged(f"dataset {label} changed while the run was reading it ({then[0]} bytes when indexed, "
                          f"{now.st_size} now): the learner restarts to read it anew (a dataset file must not change "
                          f"under a run)")


class JsonlRows(RowSource):
    """A JSONL file, indexed by one streamed pass (`beat` called every 32 768 lines): per row,
    the byte offset of its line and its line number (array('q'), 16 bytes a row). A row is read
    from the file when asked for (one seek, one line). The rows and their numbers are
    read_text().splitlines()'s, blank lines skipped: a line holding another line break
    (\x85, U+2028, U+2029, \x0b, \x0c, \x1c-\x1e, a lone \r) is cut there too, as before.
    A line that is not UTF-8 is a RowError (field `line`). Reads check the open file's size:
    DatasetChanged naming the file when it changed since the index was made."""

    def __init__(self, path: str | Path, instruction: str = INSTRUCTION, beat: Beat | None = None):
        self.path, self.label, self.instruction = Path(path), str(path), instruction
        self.offsets, self.lines = array("q"), array("q")
        self.piece: dict[int, int] = {}  # row -> which of its line's pieces (a line cut by another break)
        self._lock = threading.Lock()
        # kept open for the reads: a file renamed over this path later is not this one
        self._f: BinaryIO | None = open(self.path, "rb")  # noqa: SIM115  close() closes it
        try:
            st = os.fstat(self._f.fileno())
            self._stat = (st.st_size, st.st_mtime_ns)
            self._index(self._f, beat)
        except BaseException:
            self.close()
            raise

    def _index(self, f: BinaryIO, beat: Beat | None) -> None:
        offsets, lines, pos, line = self.offsets, self.lines, 0, 0
        for n, raw in enumerate(f, 1):
            if beat is not None and not n % _BEAT_LINES:
                beat()
            content = raw[:-1] if raw.endswith(b"\n") else raw
            if content.endswith(b"\r"):
                content = content[:-1]
            if _OTHER_BREAKS.search(content):
                for k, piece in enumerate(_pieces(raw)):
                    line += 1
                    if piece.strip():
                        self.piece[len(offsets)] = k
                        offsets.append(pos)
                        lines.append(line)
            else:
                line += 1
                bare = content.strip(_ASCII_SPACE)
                # blank as str.strip sees it: a line of only non-ASCII spaces (U+00A0, U+3000...) too
                if bare and (bare[0] < 0x80 or bare.decode("utf-8", "surrogateescape").strip()):
                    offsets.append(pos)
                    lines.append(line)
            pos += len(raw)

    def __len__(self) -> int:
        return len(self.offsets)

    def line(self, i: int) -> int:
        return int(self.lines[i])

    def identity(self) -> dict[str, Any]:
        return file_identity(self.path)

    def _raw(self, i: int) -> bytes:
        with self._lock:
            if self._f is None:
                self._f = open(self.path, "rb")  # noqa: SIM115  kept open between reads; close() closes it
            st = os.fstat(self._f.fileno())
            if st.st_size != self._stat[0]:
                raise _changed(self.label, self._stat, st)
            self._f.seek(self.offsets[i])
            return self._f.readline()

    def text(self, i: int) -> str:
        """Row i's line as text. Raises RowError when it is not UTF-8."""
        raw = self._raw(i)
        k = self.piece.get(i)
        if k is not None:
            return _strict(_pieces(raw)[k])
        content = raw[:-1] if raw.endswith(b"\n") else raw
        try:
            return (content[:-1] if content.endswith(b"\r") else content).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError("line", f"not UTF-8 text: {e}") from None

    def read(self, i: int) -> PromptRow | RowError:
        n = self.lines[i]
        try:
            return _jsonl_row(self.text(i), self.instruction, self.label, n)
        except RowError as e:
            return _at(e, self.label, n)

    def __iter__(self) -> Iterator[PromptRow | RowError]:
        return (self.read(i) for i in range(len(self)))

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


#: Decoded row groups a ParquetRows keeps besides the one in use, in bytes (Arrow's).
ROW_GROUP_CACHE_BYTES = 256 << 20
#: The parquet columns a row is made of (_from_verl); others are never read.
_VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


class ParquetRows(RowSource):
    """A verl parquet file: its row groups' sizes from the footer; a row is read by decoding its
    row group (only the columns a row is made of), the last two kept within
    ROW_GROUP_CACHE_BYTES. Raises KeyError naming a missing column (as read_parquet)."""

    def __init__(self, path: str | Path):
        import pyarrow.parquet as pq  # lazy: heavy (pyarrow), parquet only

        self.path, self.label = Path(path), str(path)
        self._file = pq.ParquetFile(self.path)
        names = self._file.schema_arrow.names
        for col in ("prompt", "reward_model"):
            if col not in names:
                raise KeyError(f"{path}: verl parquet needs column {col!r}, has {names}")
        self.columns = [c for c in _VERL_COLUMNS if c in names]
        meta = self._file.metadata
        self.starts: list[int] = list(itertools.accumulate(
            (int(meta.row_group(g).num_rows) for g in range(meta.num_row_groups)), initial=0))
        self._groups: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()
        st = os.stat(self.path)
        self._stat = (st.st_size, st.st_ino)

    def __len__(self) -> int:
        return self.starts[-1]

    def identity(self) -> dict[str, Any]:
        return file_identity(self.path)

    def _group(self, g: int) -> Any:
        with self._lock:
            if g in self._groups:
                self._groups.move_to_end(g)
                return self._groups[g]
            st = os.stat(self.path)   # a file renamed over the path is not read (the open one is)
            if st.st_ino == self._stat[1] and st.st_size != self._stat[0]:
                raise _changed(self.label, self._stat, st)
            table = self._file.read_row_group(g, columns=self.columns)
            self._groups[g] = table
            while len(self._groups) > 2 or (len(self._groups) > 1 and sum(
                    t.nbytes for t in self._groups.values()) > ROW_GROUP_CACHE_BYTES + table.nbytes):
                self._groups.popitem(last=False)
            return table

    def read(self, i: int) -> PromptRow | RowError:
        g = bisect.bisect_right(self.starts, i) - 1
        rec = self._group(g).slice(i - self.starts[g], 1).to_pylist()[0]
        try:
            return _at(_from_verl(rec), self.label, i + 1)
        except RowError as e:
            return _at(e, self.label, i + 1)

    def close(self) -> None:
        with self._lock:
            self._groups.clear()


def open_source(path: str | Path, beat: Beat | None = None) -> RowSource:
    """The RowSource of one file, by extension (as load_rows: `path` as dataset_path resolves
    it, which is also the label its rows are named by). Raises ValueError for another extension, KeyError for a parquet
    file without verl's columns, OSError when it cannot be read."""
    p = dataset_path(path)
    src: RowSource
    if p.suffix == ".parquet":
        src = ParquetRows(p)
    elif p.suffix in (".jsonl", ".json"):
        src = JsonlRows(p, beat=beat)
    else:
        raise ValueError(f"{p}: expected a .parquet (verl) or .jsonl file")
    return src


class Rows(Sequence[PromptRow | RowError]):
    """A dataset read a row at a time: its sources' rows concatenated in order. `rows[i]` reads
    row i (the last ROW_CACHE read are kept), a PromptRow or a RowError, as load_rows(lenient=True)
    would have it at index i; `locate(i)` says which source and which of its rows."""

    ROW_CACHE = 4096

    def __init__(self, sources: Sequence[RowSource]):
        self.sources = list(sources)
        self.starts = list(itertools.accumulate((len(s) for s in self.sources), initial=0))
        self._cache: OrderedDict[int, PromptRow | RowError] = OrderedDict()

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(source number, row in that source) of dataset row i (0 <= i < len)."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - self.starts[s]

    @overload
    def __getitem__(self, i: int) -> PromptRow | RowError: ...
    @overload
    def __getitem__(self, i: slice) -> list[PromptRow | RowError]: ...
    def __getitem__(self, i: int | slice) -> PromptRow | RowError | list[PromptRow | RowError]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        row = self._cache.get(i)
        if row is not None:
            self._cache.move_to_end(i)
            return row
        s, j = self.locate(i)
        row = self.sources[s].read(j)
        self._cache[i] = row
        if len(self._cache) > self.ROW_CACHE:
            self._cache.popitem(last=False)
        return row

    def close(self) -> None:
        for s in self.sources:
            s.close()


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


def open_rows(path: Paths, beat: Beat | None = None) -> Rows:
    """The dataset of `path` (one file or several, as load_rows), indexed, each row read when
    asked for (Rows); `beat` is called as a JSONL file is indexed. Raises as open_source."""
    return Rows([open_source(p, beat) for p in paths_of(path)])


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
