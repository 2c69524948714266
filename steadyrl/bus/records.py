"""What flows through a stage (steadyrl/bus/stage.py): where an input came from (`Meta`), what a
handler returns (`Output`, `RetryLater`, or a `codec.Rejected`), what a batch's transaction
will produce (`Pending`) and which partitions it holds (`Transformed`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from steadyrl.wire import codec
from steadyrl.wire.contracts import Contract, DLQReason

#: Bytes the broker adds to a record when it checks max.message.bytes (the record batch
#: header, 61 bytes, and the varints of one record): an output is refused when its value,
#: key and headers plus this exceed its topic's limit.
RECORD_FRAMING_BYTES = 256
#: Longest error text kept in a DLQ record (a handler's message can be anything).
DLQ_ERROR_CHARS = 4000

_NON_FINITE = re.compile(r"non-finite|not finite|finite number|\bnan\b|\binf(inity)?\b", re.IGNORECASE)


def refusal_reason(detail: str) -> DLQReason:
    """The DLQ reason of a refusal by its message: `non_finite` when it names a non-finite
    value (NaN, Infinity), else `handler_error`."""
    return DLQReason.non_finite if _NON_FINITE.search(detail) else DLQReason.handler_error


def record_bytes(value: bytes, key: str | bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Bytes of a record's value, key and headers (what its topic's limit is checked against,
    with RECORD_FRAMING_BYTES)."""
    k = key.encode() if isinstance(key, str) else (key or b"")
    return len(value) + len(k) + sum(len(n.encode()) + len(v or b"") for n, v in headers)


class RetryLater(Exception):
    """A record that cannot be done now: returned by a batch handler as one record's result
    (that record is held), or raised by a handler (every record of the call is held). Tried
    again with the next batch, or after `backoff_s` when nothing else moved.

    Args:
        message: why; a record whose budget runs out goes to rl.dlq with it.
        backoff_s: wait before the next try when only held records are left (seconds).
        counts: the dependency answered and failed or refused this record (a 5xx, 503
            "behind"): the try counts against the record's budget (module doc). False: it
            did not answer, or is down for everything: held without limit.
        own: the handler just saw the dependency serve other work, so the failure is this
            record's own: tried alone from the next try; needs no other record done to be
            dropped once its budget is spent. Implies counts.
    """

    def __init__(self, message: str, backoff_s: float = 1.0, *, counts: bool = False, own: bool = False):
        super().__init__(message)
        self.backoff_s = backoff_s
        self.own = own
        self.counts = counts or own


@dataclass(frozen=True)
class Meta:
    """Where an input record came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int


@dataclass
class Output:
    """One record to produce: `topic` is the catalogue name (e.g. "rl.scored")."""

    topic: str
    key: str | bytes | None
    value: Contract


#: A handler turns one accepted input into zero or more outputs. It must be a pure
#: function of its input (it may run again for the same record after a crash).
Handler = Callable[[Contract, Meta], list[Output]]
#: A batch handler does the same for every accepted record of a batch at once (one
#: result list per record, in order, or a RetryLater to hold that record, or a
#: codec.Rejected to send it to rl.dlq with its reason); the rollout worker uses it to send
#: one request and to refuse groups its gate emptied, the reward worker to hold groups it
#: cannot score yet.
BatchHandler = Callable[[list[tuple[Contract, Meta]]], "list[list[Output] | RetryLater | codec.Rejected]"]


@dataclass(frozen=True)
class Pending:
    """One record to produce in a batch's transaction, with the input record it came from."""

    source: tuple[str, int]   # (topic, partition) of the input record
    offset: int               # the input record's offset
    topic: str                # full output topic name (prefix included)
    key: str | bytes | None
    value: bytes              # an output, or the DLQRecord of a refused input, encoded
    headers: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class Held:
    """A partition's first record the batch handler held (its result was a RetryLater)."""

    offset: int
    why: RetryLater


@dataclass
class Transformed:
    """A batch's transform: records to produce, and the held partitions by (topic, partition)."""

    pending: list[Pending] = field(default_factory=list)
    held: dict[tuple[str, int], Held] = field(default_factory=dict)

    def hold(self, tp: tuple[str, int], offset: int, why: RetryLater) -> None:
        """Hold partition `tp` from `offset` on (its lowest held offset counts)."""
        if tp not in self.held or offset < self.held[tp].offset:
            self.held[tp] = Held(offset, why)

    def is_held(self, tp: tuple[str, int], offset: int) -> bool:
        """True for a record at or after its partition's first held record."""
        return tp in self.held and offset >= self.held[tp].offset
