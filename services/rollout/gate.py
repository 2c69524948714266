"""Rollout gate: the samples a rollout worker refuses to pass on, and why.

A sample fails when

    too_long             it has more tokens than its prompt's `max_new_tokens` (what the run
                         asked for: learner.max_new_tokens), or than `max_response_tokens` when set
    illegal_characters   its text holds NUL or another control character (C0 except tab,
                         newline and carriage return; DEL; C1)
    not_json             `response_schema` is set and the text is not JSON
    schema_mismatch      `response_schema` is set and the JSON does not validate against it

Failing samples leave their group (counted by reason in the group's `rejected` field and
in `steadyrl_rollout_samples_rejected_total{reason}`); a group left with no sample goes to
`rl.dlq` (reason `rejected`) with the reasons. The learner trains on what is left: GRPO
computes each group's advantages over its own samples, whatever their number.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from jsonschema import Draft202012Validator

from steadyrl.wire.contracts import RolloutGroup, Sample

ILLEGAL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class RolloutGate:
    """Checks samples against the limits above.

    Args:
        max_response_tokens: longest response allowed, tokens (a sample of exactly this
            many passes); None (the default): each group's own prompt's max_new_tokens, so
            the one length setting of a run is the learner's.
        response_schema: optional JSON Schema (draft 2020-12) every response must satisfy.

    Raises jsonschema.SchemaError for a schema that is not a valid JSON Schema.
    """

    def __init__(self, max_response_tokens: int | None = None, response_schema: dict[str, Any] | None = None):
        self.max_response_tokens = max_response_tokens
        self.validator: Draft202012Validator | None = None
        if response_schema is not None:
            Draft202012Validator.check_schema(response_schema)
            self.validator = Draft202012Validator(response_schema)

    def reason(self, text: str, n_tokens: int, asked: int | None = None) -> str | None:
        """Why this sample fails, or None when it passes. `asked`: the max_new_tokens its
        request asked for (the limit when max_response_tokens is None; no limit if both are)."""
        limit = self.max_response_tokens if self.max_response_tokens is not None else asked
        if limit is not None and n_tokens > limit:
            return "too_long"
        if ILLEGAL.search(text):
            return "illegal_characters"
        if self.validator is not None:
            try:
                value = json.loads(text)
            except ValueError:
                return "not_json"
            if next(self.validator.iter_errors(value), None) is not None:
                return "schema_mismatch"
        return None

    def apply(self, group: RolloutGroup) -> tuple[RolloutGroup, Counter[str]]:
        """The group without its failing samples (its `rejected` counts set), and the
        counts by reason. The returned group may have no samples left."""
        kept: list[Sample] = []
        why: Counter[str] = Counter()
        for s in group.samples:
            r = self.reason(s.text, len(s.token_ids), group.prompt.max_new_tokens)
            if r is None:
                kept.append(s)
            else:
                why[r] += 1
        if not why:
            return group, why
        return group.model_copy(update={"samples": kept, "rejected": dict(why)}), why
