"""Which rows of a dataset the learner can serve: each row checked once, the first time the
run reaches it, with the result kept per file.

Every row is checked the way it will be used: its prompt record is built and encoded as the
feeder will publish it (a NaN in `extra_info`, a role `tool`, a `null` content or a prompt
given as a string fails here), its size is checked against rl.prompts' largest record, and
its chat is tokenized with the model's template and checked against the actor's limits
(`GenerationLimits`: `max_prompt_tokens`) and the model's context (prompt + max_new_tokens).
An evaluation row (learner.eval_data, eval_splits) is checked for what the evaluation does
with it (`eval_why`): a row that is not a prompt, a chat the template refuses or that
tokenizes to nothing, prompt + eval_max_new_tokens past the model's context.
A bad row is left out of the run: never published (never evaluated), so it costs nothing
later. The bad rows are written to `<run>/bad_rows.jsonl` (`bad_eval_rows.jsonl` with the
split for the evaluation's; index, field, reason, and where: the file and the row number in
it, counting from 1), the first few logged, and counted (`bad_rows`, `bad_eval_rows`).

When, for a dataset of any size (`RowCheck`):

- at start, the files are indexed (steadyrl.model.data.Rows: one streamed pass over a JSONL file,
  the footer of a parquet one; ~1.5 s a million JSONL rows) and the rows are checked in the
  order the run takes them (steadyrl.rl.loop.prompt_order) until the first
  (max_staleness + 1) x prompts_per_step prompts are found good: a few rows, not the file.
  The learner stops at start with exit 2 (`ConfigError`) naming the file and the first
  reasons when none of the first PROBE_ROWS rows checked is good, or when every row is
  checked and fewer than prompts_per_step are good (a small dataset is met whole at start).
  Rows are checked until the first step's prompts are found: a file whose good rows are rare
  takes as long as finding them (the heartbeat beating);
- the rest as the feeder reaches them (~0.05 ms a row with the tiny model's tokenizer, up to
  ~0.5 ms with a real one): a bad row is skipped then, recorded and counted as above;
- the evaluation's rows (those `eval_limit` / `eval_splits_limit` pick) at start, all: exit 2
  naming the file when none of a split's is left; the others are evaluated.

The heartbeat (the service's Health.beat) beats all along, so /livez holds at any size.
Memory: one byte a row for the results beside the index (steadyrl.model.data.Rows); bad rows are
written out, not held. The results are cached per file in `<state_dir>/data-check/`, keyed
by the file's size, mtime and the sha256 of its first and last MiB (steadyrl.model.data.file_identity)
and by what the check depends on (tokenizer, limits, settings, CHECK_VERSION): a restart, or
the next run on the same file, checks no row twice. The cache is written every SAVE_EVERY_S
while rows are checked and when the learner stops; entries unused for CACHE_KEEP_DAYS are
deleted at start (prune_cache). It is only a cache: a lost one costs checking again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from steadyrl.bus.topics import load_catalogue
from steadyrl.config import ConfigError
from steadyrl.files import replacing
from steadyrl.local.limits import GenerationLimits
from steadyrl.model.data import Beat, MemoryRows, PromptRow, RowError, Rows, encode_prompt, where
from steadyrl.rl.loop import prompt_seed
from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt

from .config import LearnerSection, data_label, open_dataset, spread

log = logging.getLogger("steadyrl.learner")

#: bytes a published record may exceed the checked one by (its run id, epoch, attempt seed)
RECORD_MARGIN = 1024
#: bad rows named in the log (all of them are in bad_rows.jsonl)
LOGGED = 5


@dataclass(frozen=True)
class BadRow:
    """A dataset row the run leaves out: its index (in the whole dataset, from 0), the field at
    fault and why; `where` names it as a user finds it (`file row N`, N from 1)."""

    index: int
    field: str
    reason: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.where or f'row {self.index + 1}'}: {self.field}: {self.reason}"


def prompt_tokens(tokenizer: Any, row: PromptRow, index: int) -> int | BadRow:
    """The number of tokens of row `index`'s chat as the actor encodes it, or why it has none
    (the template refuses it, or it tokenizes to nothing): training and evaluation rows alike."""
    try:
        n = len(encode_prompt(tokenizer, row))
    except Exception as e:  # noqa: BLE001 - a template that refuses the chat (e.g. roles out of order)
        return BadRow(index, "prompt", f"the model's chat template refused it: {type(e).__name__}: {e}")
    return n if n else BadRow(index, "prompt", "the chat tokenizes to no tokens")


def prompt_record(lc: LearnerSection, row: PromptRow, pid: str, epoch: int, index: int, attempt: int,
                  run_id: str, min_policy_version: int) -> Prompt:
    """The rl.prompts record of dataset row `row` (attempt n > 0: seed + 7919 n, a new sample).
    Raises pydantic.ValidationError when the row cannot be one (a role or content the chat
    contract does not take)."""
    return Prompt(prompt_id=pid, epoch=epoch, index=index, messages=row.messages,
                  n_samples=lc.group_size, data_source=row.data_source, ground_truth=row.ground_truth,
                  extra_info=row.extra_info, run_id=run_id, temperature=lc.train.temperature,
                  top_p=lc.top_p, max_new_tokens=lc.max_new_tokens,
                  seed=prompt_seed(lc.seed, epoch, index) + 7919 * attempt,
                  min_policy_version=min_policy_version, attempt=attempt)


def _field(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location in the dataset's terms: ("messages", 0, "role") -> prompt[0].role."""
    out = ""
    for part in loc:
        part = "prompt" if part == "messages" else part
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check_row(lc: LearnerSection, row: PromptRow | RowError, index: int, tokenizer: Any, context: int | None,
              limits: GenerationLimits, max_record_bytes: int) -> BadRow | None:
    """Why row `index` cannot be served (the first reason, and where the row is), or None when
    it can."""
    bad = _why(lc, row, index, tokenizer, context, limits, max_record_bytes)
    return None if bad is None else replace(bad, where=where(row, index))


def _why(lc: LearnerSection, row: PromptRow | RowError, index: int, tokenizer: Any, context: int | None,
         limits: GenerationLimits, max_record_bytes: int) -> BadRow | None:
    """check_row's reason, without where."""
    if isinstance(row, RowError):
        return BadRow(index, row.field, row.reason)
    tool = next((i for i, m in enumerate(row.messages) if isinstance(m, dict) and m.get("role") == "tool"), None)
    if tool is not None:   # prompt 1.4 takes it for an episode's turns only: its tool call's result (docs/agents.md)
        return BadRow(index, f"prompt[{tool}].role", "'tool' is an episode's tool result, not a dataset row's")
    try:
        record = prompt_record(lc, row, f"r00000000T000000-0000/e0-i{index}", 0, index, 0,
                               "r00000000T000000-0000", 0)
    except ValidationError as e:
        err = e.errors()[0]
        return BadRow(index, _field(err["loc"]), err["msg"])
    try:
        value, _ = codec.encode(record)
    except ValueError as e:
        where = str(e).split(": cannot encode a non-finite number: ")[-1].split(" ")[0]
        return BadRow(index, where if "non-finite" in str(e) else "prompt", str(e))
    # the check's record carries placeholder ids and epoch 0: a real one is a few bytes longer
    if len(value) > max_record_bytes - RECORD_MARGIN:
        return BadRow(index, "prompt", f"the prompt record is {len(value)} bytes > rl.prompts' largest record "
                                       f"{max_record_bytes} less {RECORD_MARGIN} for its ids")
    n = prompt_tokens(tokenizer, row, index)
    if isinstance(n, BadRow):
        return n
    if n > limits.max_prompt_tokens:
        return BadRow(index, "prompt", f"{n} tokens > actor.max_prompt_tokens {limits.max_prompt_tokens}")
    if context is not None and n + lc.max_new_tokens > context:
        return BadRow(index, "prompt", f"{n} tokens + learner.max_new_tokens {lc.max_new_tokens} = "
                                       f"{n + lc.max_new_tokens} > the model's context {context}")
    return None


def check_rows(lc: LearnerSection, rows: Sequence[PromptRow | RowError], tokenizer: Any, context: int | None,
               limits: GenerationLimits) -> list[BadRow]:
    """Every row of `rows` that cannot be served (see the module doc), in index order."""
    t0 = time.monotonic()
    max_bytes = load_catalogue()["rl.prompts"].max_message_bytes
    bad = [b for i, row in enumerate(rows)
           if (b := check_row(lc, row, i, tokenizer, context, limits, max_bytes)) is not None]
    log.info("dataset checked", extra={"data": data_label(lc.data), "rows": len(rows), "bad": len(bad),
                                       "seconds": round(time.monotonic() - t0, 2)})
    return bad


def write_report(bad: list[BadRow], folder: Path) -> Path:
    """`<folder>/bad_rows.jsonl`: one line per bad row (index, field, reason, where)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad_rows.jsonl"
    path.write_text("".join(json.dumps(asdict(b)) + "\n" for b in bad))
    return path


def refuse_too_few(lc: LearnerSection, rows: Sequence[PromptRow | RowError], bad: list[BadRow], folder: Path) -> None:
    """Raise ConfigError (exit 2) when the good rows are fewer than one step's prompts, with
    the report written to `<folder>/bad_rows.jsonl` and named."""
    good = len(rows) - len(bad)
    if good >= lc.prompts_per_step:
        return
    where = ""
    if bad:
        first = "; ".join(str(b) for b in bad[:3])
        where = f" ({len(bad)} bad, first: {first}; all in {write_report(bad, folder)})"
    raise ConfigError(f"learner.data {data_label(lc.data)}: {good} usable rows of {len(rows)} < "
                      f"learner.prompts_per_step {lc.prompts_per_step}{where}")


# ---- checking a dataset of any size, a row when the run reaches it -------------------------

#: Bump when a check's rules change: results cached by an earlier version are not reused.
CHECK_VERSION = 1
#: At start, rows checked in the run's order with none of them good: the learner stops (exit 2).
PROBE_ROWS = 1000
#: Seconds between two writes of a file's cached results while rows are checked.
SAVE_EVERY_S = 30.0
#: Rows checked between two heartbeats.
BEAT_EVERY = 64
UNKNOWN, GOOD, BAD = 0, 1, 2
#: Why one row (at its index) cannot be used, or None: check_row, eval_why.
Why = Callable[[PromptRow | RowError, int], BadRow | None]


def tokenizer_identity(tokenizer: Any) -> list[Any] | None:
    """What a check's result depends on of the tokenizer: its vocabulary size, chat template and
    special tokens (None: no tokenizer)."""
    if tokenizer is None:
        return None
    return [len(tokenizer), getattr(tokenizer, "chat_template", None), getattr(tokenizer, "bos_token", None),
            getattr(tokenizer, "eos_token", None), getattr(tokenizer, "pad_token", None)]


def _where(rows: Rows, index: int) -> str:
    """Row `index` as a user finds it (steadyrl.model.data.where), without reading it."""
    s, j = rows.locate(index)
    src = rows.sources[s]
    return f"{src.label} row {src.line(j)}" if src.label else f"row {index + 1}"


class _Cache:
    """One file's cached results under one check: `<key>.good` (a byte a row, GOOD where the row
    was found good) and `<key>.bad.jsonl` (a line a bad row: row in the file from 0, field,
    reason), key = sha256 of the file's identity, the check's settings and CHECK_VERSION."""

    def __init__(self, folder: Path, identity: dict[str, Any], settings: dict[str, Any]):
        what = {"version": CHECK_VERSION, "file": identity, "check": settings}
        key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:40]
        self.good, self.bad = folder / f"{key}.good", folder / f"{key}.bad.jsonl"

    def touch(self) -> None:
        """Mark the entry used now (prune_cache keeps it)."""
        for path in (self.good, self.bad):
            with contextlib.suppress(OSError):
                os.utime(path)

    def bad_lines(self) -> Iterator[tuple[int, str, str]]:
        """(row, field, reason) of each bad row recorded, once each in the order found; a torn
        or foreign line is passed over."""
        seen: set[int] = set()
        try:
            with open(self.bad, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        row, field, reason = int(rec["row"]), str(rec["field"]), str(rec["reason"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    if row not in seen:
                        seen.add(row)
                        yield row, field, reason
        except FileNotFoundError:
            return


class RowCheck:
    """The rows of `rows` checked once each, when first asked about (`ok`), by `why`; results
    per file cached under `cache_dir` (see the module doc; None: not cached). `settings` is what
    the result depends on besides the row (a tokenizer's identity, limits): the cache's key.
    `beat` is called every BEAT_EVERY rows checked. A bad row found is recorded: the first
    LOGGED in `first`, every one in the cache, in the report file once `report_to` named it,
    and passed to `on_bad`. `good`, `bad`: rows known good, bad; `checked`: rows this object
    checked (not known from the cache)."""

    def __init__(self, rows: Sequence[PromptRow | RowError], why: Why, settings: dict[str, Any],
                 cache_dir: Path | None = None, beat: Beat | None = None):
        self.rows = rows if isinstance(rows, Rows) else Rows([MemoryRows(rows)])
        self.why, self.beat = why, beat
        self.status = bytearray(len(self.rows))
        self.first: list[BadRow] = []
        self.on_bad: Callable[[BadRow], None] | None = None
        self._report: Path | None = None
        self._held: list[BadRow] = []       # bad rows of sources without a cache (rows made in code)
        self._caches: list[_Cache | None] = []
        self.checked, self._dirty, self._saved_t = 0, False, time.monotonic()
        self._cache_error = False
        for s, src in enumerate(self.rows.sources):
            cache = None
            if cache_dir is not None and (identity := src.identity()) is not None:
                cache = _Cache(cache_dir, identity, settings)
                self._load(cache, self.rows.starts[s], len(src))
            self._caches.append(cache)
        self.good, self.bad = self.status.count(GOOD), self.status.count(BAD)

    def _load(self, cache: _Cache, start: int, n: int) -> None:
        cache.touch()
        try:
            good = cache.good.read_bytes()
        except OSError:
            good = b""
        if len(good) == n:  # another length: not this file's (a torn write): checked again
            self.status[start:start + n] = good.replace(bytes([BAD]), bytes([UNKNOWN]))
        for row, field, reason in cache.bad_lines():
            if row < n:
                self.status[start + row] = BAD
                if len(self.first) < LOGGED:
                    self.first.append(BadRow(start + row, field, reason, _where(self.rows, start + row)))

    @property
    def known(self) -> bool:
        """Every row checked."""
        return self.good + self.bad == len(self.status)

    def ok(self, index: int) -> bool:
        """Whether row `index` can be used (checked now when it was not before)."""
        state = self.status[index]
        if state == UNKNOWN:
            self._check(index)
            state = self.status[index]
        return state == GOOD

    def why_bad(self, index: int) -> BadRow | None:
        """Why row `index` cannot be used (checked again: the reason is not held), or None."""
        if self.ok(index):
            return None
        bad = self.why(self.rows[index], index)
        return None if bad is None else replace(bad, where=_where(self.rows, index))

    def _check(self, index: int) -> None:
        bad = self.why(self.rows[index], index)
        self.checked += 1
        self._dirty = True
        if bad is None:
            self.status[index] = GOOD
            self.good += 1
        else:
            self.status[index] = BAD
            self.bad += 1
            self._record(replace(bad, where=_where(self.rows, index)))
        if not self.checked % BEAT_EVERY:
            if self.beat is not None:
                self.beat()
            if time.monotonic() - self._saved_t > SAVE_EVERY_S:
                self.save()

    def _record(self, bad: BadRow) -> None:
        if len(self.first) < LOGGED:
            self.first.append(bad)
        s, j = self.rows.locate(bad.index)
        cache = self._caches[s]
        if cache is None:
            self._held.append(bad)
        else:
            self._append(cache.bad, {"row": j, "field": bad.field, "reason": bad.reason})
        if self._report is not None:
            self._append(self._report, asdict(bad))
        if self.on_bad is not None:
            self.on_bad(bad)

    def _append(self, path: Path, rec: dict[str, Any]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:  # a full disk costs the record (the row is still left out), never the run
            self._warn(path, e)

    def _warn(self, path: Path, e: OSError) -> None:
        if not self._cache_error:
            self._cache_error = True
            log.warning("dataset check: a file could not be written (the rows are still checked)",
                        extra={"path": str(path), "error": str(e)})

    def known_bad(self) -> Iterator[BadRow]:
        """Every bad row found so far (this process's and the cache's), file by file."""
        for s, cache in enumerate(self._caches):
            start = self.rows.starts[s]
            if cache is None:
                yield from (b for b in self._held if self.rows.locate(b.index)[0] == s)
                continue
            for row, field, reason in cache.bad_lines():
                if row < len(self.rows.sources[s]) and self.status[start + row] == BAD:
                    yield BadRow(start + row, field, reason, _where(self.rows, start + row))

    def report_to(self, path: Path) -> Path:
        """Write every bad row found so far to `path` (JSON lines: index, field, reason, where)
        and append each one found later. Returns `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for bad in self.known_bad():
                f.write(json.dumps(asdict(bad)) + "\n")
        self._report = path
        return path

    def save(self) -> None:
        """Write each file's results to its cache (when rows were checked since the last write)."""
        self._saved_t = time.monotonic()
        if not self._dirty:
            return
        self._dirty = False
        for s, cache in enumerate(self._caches):
            if cache is None:
                continue
            start = self.rows.starts[s]
            try:
                cache.good.parent.mkdir(parents=True, exist_ok=True)
                with replacing(cache.good) as tmp:
                    tmp.write_bytes(self.status[start:start + len(self.rows.sources[s])])
            except OSError as e:
                self._warn(cache.good, e)


#: Days a cached check result is kept unused (prune_cache).
CACHE_KEEP_DAYS = 30


def prune_cache(folder: Path, keep_days: float = CACHE_KEEP_DAYS) -> int:
    """Delete the cached check results under `folder` not used for `keep_days` (those of files
    since changed or gone); returns how many files. Never raises (a cache)."""
    cutoff, n = time.time() - keep_days * 86400, 0
    try:
        for path in folder.iterdir():
            with contextlib.suppress(OSError):
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    n += 1
    except OSError:
        pass
    return n


def train_check(lc: LearnerSection, rows: Sequence[PromptRow | RowError], tokenizer: Any, context: int | None,
                limits: GenerationLimits, cache_dir: Path | None = None, beat: Beat | None = None) -> RowCheck:
    """The RowCheck of the training rows: check_row against the actor's limits, the model's
    context and rl.prompts' largest record."""
    max_bytes = load_catalogue()["rl.prompts"].max_message_bytes
    settings = {"kind": "train", "model": lc.model, "tokenizer": tokenizer_identity(tokenizer), "context": context,
                "max_prompt_tokens": limits.max_prompt_tokens, "max_record_bytes": max_bytes,
                "record": [lc.group_size, lc.train.temperature, lc.top_p, lc.max_new_tokens]}
    return RowCheck(rows, lambda row, i: _why(lc, row, i, tokenizer, context, limits, max_bytes), settings,
                    cache_dir, beat)


def start_check(lc: LearnerSection, check: RowCheck, order: Iterator[int], folder: Path) -> None:
    """Check rows in the run's `order` (dataset indexes) until the first (max_staleness + 1) x
    prompts_per_step of them are found good (a row met again in a later epoch counts again).
    Raises ConfigError (exit 2) naming the file and the first reasons, with every bad row found
    written to `<folder>/bad_rows.jsonl`, when none of the first PROBE_ROWS rows met is good, or
    when every row is known and fewer than prompts_per_step are good."""
    t0, want, found, checked = time.monotonic(), (lc.max_staleness + 1) * lc.prompts_per_step, 0, check.checked
    n = len(check.status)
    for met, index in enumerate(order, 1):
        if check.ok(index):
            found += 1
            if found >= want:
                break
        if check.good == 0 and met >= PROBE_ROWS:
            raise ConfigError(f"learner.data {data_label(lc.data)}: none of the first {met} rows the run takes is "
                              f"usable{_first(check, folder)}")
        if check.known:
            break
    if check.known and check.good < lc.prompts_per_step:
        raise ConfigError(f"learner.data {data_label(lc.data)}: {check.good} usable rows of {n} < "
                          f"learner.prompts_per_step {lc.prompts_per_step}{_first(check, folder)}")
    check.save()
    log.info("dataset checked at start", extra={"data": data_label(lc.data), "rows": n, "good": check.good,
                                                "bad": check.bad, "unchecked": n - check.good - check.bad,
                                                "checked_now": check.checked - checked,
                                                "seconds": round(time.monotonic() - t0, 2)})


def _first(check: RowCheck, folder: Path) -> str:
    """' (N bad, first: ...; all in <folder>/bad_rows.jsonl)', the report written; '' when none is bad."""
    if not check.bad:
        return ""
    first = "; ".join(str(b) for b in check.first[:3])
    return f" ({check.bad} bad, first: {first}; all in {check.report_to(folder / 'bad_rows.jsonl')})"


def eval_why(lc: LearnerSection, tokenizer: Any, context: int | None) -> Why:
    """Why an evaluation row cannot be evaluated (see the module doc), or None. With no
    `tokenizer`, only a row that is not a prompt."""

    def why(row: PromptRow | RowError, index: int) -> BadRow | None:
        if isinstance(row, RowError):
            return BadRow(index, row.field, row.reason)
        if tokenizer is None:
            return None
        n = prompt_tokens(tokenizer, row, index)
        if isinstance(n, BadRow):
            return n
        m = lc.eval_max_new_tokens
        if context is not None and n + m > context:
            return BadRow(index, "prompt", f"{n} tokens + learner.eval_max_new_tokens {m} = {n + m} > the model's "
                                           f"context {context}")
        return None

    return why


@dataclass
class EvalSplit:
    """One evaluation's rows: `split` ("test" for eval_data, else the harder split's name),
    `setting` (the config key, for messages), the dataset `rows`, the indexes `picked` (limit
    rows spread evenly) and of those the `good` ones (evaluated, in this order) and the `bad`."""

    split: str
    setting: str
    spec: str | list[str]
    rows: Rows
    picked: list[int]
    good: list[int]
    bad: list[BadRow]

    def prompt_rows(self) -> list[PromptRow]:
        """The good rows, read."""
        out = []
        for i in self.good:
            row = self.rows[i]
            assert isinstance(row, PromptRow), f"row {i} was checked good"
            out.append(row)
        return out


def eval_split(lc: LearnerSection, split: str, setting: str, spec: str | list[str], limit: int, tokenizer: Any,
               context: int | None, cache_dir: Path | None = None, beat: Beat | None = None) -> EvalSplit:
    """The rows of one evaluation, checked (eval_why; results cached as RowCheck's). Raises
    ConfigError (exit 2) naming the setting, the file and the first reasons when none is good."""
    rows = open_dataset(spec, beat)
    settings = {"kind": "eval", "model": lc.model, "tokenizer": tokenizer_identity(tokenizer), "context": context,
                "max_new_tokens": lc.eval_max_new_tokens}
    check = RowCheck(rows, eval_why(lc, tokenizer, context), settings, cache_dir, beat)
    picked = spread(range(len(rows)), limit)
    good, bad = [], []
    for i in picked:
        if check.ok(i):
            good.append(i)
        elif (b := check.why_bad(i)) is not None:
            bad.append(b)
    check.save()
    rows.close()
    if not good:
        first = "; ".join(str(b) for b in bad[:3])
        raise ConfigError(f"{setting} {data_label(spec)}: none of its {len(picked)} rows to evaluate is usable"
                          + (f" ({len(bad)} bad, first: {first})" if bad else ""))
    return EvalSplit(split, setting, spec, rows, list(picked), good, bad)


def eval_splits(lc: LearnerSection, tokenizer: Any, context: int | None, cache_dir: Path | None = None,
                beat: Beat | None = None) -> dict[str, EvalSplit]:
    """Every evaluation of the run, checked: "test" (eval_data, eval_limit rows) and each harder
    split (eval_splits_limit rows each); {} when eval_data is None. Raises as eval_split."""
    if lc.eval_data is None:
        return {}
    out = {"test": eval_split(lc, "test", "learner.eval_data", lc.eval_data, lc.eval_limit, tokenizer, context,
                              cache_dir, beat)}
    for name, spec in lc.harder_splits.items():
        out[name] = eval_split(lc, name, f"learner.eval_splits.{name}", spec, lc.eval_splits_limit, tokenizer,
                               context, cache_dir, beat)
    return out
