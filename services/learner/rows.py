"""Which rows of the dataset the learner can serve, decided once at start.

Every row is checked the way it will be used: its prompt record is built and encoded as the
feeder will publish it (a NaN in `extra_info`, a role `tool`, a `null` content or a prompt
given as a string fails here), its size is checked against rl.prompts' largest record, and
its chat is tokenized with the model's template and checked against the actor's limits
(`GenerationLimits`: `max_prompt_tokens`) and the model's context (prompt + max_new_tokens).
A bad row is left out of the run: never published, so it costs nothing later. The bad rows
are written to `<run>/bad_rows.jsonl` (index, field, reason, and where: the file and the row
number in it, counting from 1), the first few logged, and counted; when fewer good rows are left
than one step needs, the learner stops with exit 2 (`ConfigError`) naming the file and the first
reasons.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from steadyrl import codec
from steadyrl.config import ConfigError
from steadyrl.contracts import Prompt
from steadyrl.data import PromptRow, RowError, where
from steadyrl.limits import GenerationLimits
from steadyrl.rl.loop import encode_prompt, prompt_seed
from steadyrl.services.learner.config import LearnerSection, data_label
from steadyrl.topics import load_catalogue

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
    try:
        n = len(encode_prompt(tokenizer, row))
    except Exception as e:  # noqa: BLE001 - a template that refuses the chat (e.g. roles out of order)
        return BadRow(index, "prompt", f"the model's chat template refused it: {type(e).__name__}: {e}")
    if n == 0:
        return BadRow(index, "prompt", "the chat tokenizes to no tokens")
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


def report(lc: LearnerSection, rows: Sequence[PromptRow | RowError], bad: list[BadRow], run_dir: Path) -> None:
    """Write the run's bad_rows.jsonl and log the first few (nothing when every row is good)."""
    if bad:
        path = write_report(bad, run_dir)
        log.warning("dataset rows left out: the actor or the prompt contract cannot take them",
                    extra={"data": data_label(lc.data), "bad": len(bad), "rows": len(rows), "report": str(path),
                           "first": [str(b) for b in bad[:LOGGED]]})
