"""Encode contracts into Kafka records and decode them back, refusing what does not fit.

A record is accepted only if: its value is at most `max_bytes`, it is UTF-8 JSON, it carries a
`schema` header `name/vMAJOR.MINOR` whose name is the expected contract's and whose major
equals ours, and it validates against the model. Anything else raises `Rejected` with a
`DLQReason` and a message naming what was expected and what came; `dlq_record()` turns that
into the `DLQRecord` a stage produces to `rl.dlq`. Decoding never raises anything else.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import TypeVar

from pydantic import ValidationError

from steadyrl.contracts import Contract, DLQReason, DLQRecord

C = TypeVar("C", bound=Contract)

SCHEMA_HEADER = "schema"
_HEADER_RE = re.compile(r"^(?P<name>[a-z0-9_]+)/v(?P<major>\d+)\.(?P<minor>\d+)$")

#: Bytes of the original payload kept in a DLQ record (base64 grows it by 4/3).
DLQ_PAYLOAD_LIMIT = 512 * 1024


class Rejected(Exception):
    """A record that cannot be accepted.

    Attributes:
        reason: the DLQReason.
        detail: what was expected and what came.
        schema_header: the header seen, if any.
    """

    def __init__(self, reason: DLQReason, detail: str, schema_header: str | None = None):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.schema_header = schema_header


def encode(msg: Contract) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Serialize a contract: `(value bytes, headers)` with the `schema` header set."""
    value = msg.model_dump_json().encode()
    return value, [(SCHEMA_HEADER, msg.schema_header().encode())]


def header_value(headers: list[tuple[str, bytes]] | None, name: str = SCHEMA_HEADER) -> str | None:
    """The last value of header `name` as text, or None (undecodable bytes are replaced)."""
    for k, v in reversed(headers or []):
        if k == name:
            return v.decode("utf-8", errors="replace") if v is not None else None
    return None


def decode(value: bytes | None, headers: list[tuple[str, bytes]] | None, expected: type[C],
           max_bytes: int | None = None) -> C:
    """Decode and validate one record value as `expected`.

    Raises:
        Rejected: oversize, missing/malformed header, another contract, another major
            version, undecodable bytes or failed validation.
    """
    header = header_value(headers)
    size = len(value or b"")
    if max_bytes is not None and size > max_bytes:
        raise Rejected(DLQReason.oversize, f"value is {size} bytes, limit is {max_bytes}", header)
    if header is None:
        raise Rejected(DLQReason.missing_schema_header,
                       f"expected header schema={expected.schema_header()}, got none")
    m = _HEADER_RE.match(header)
    if m is None:
        raise Rejected(DLQReason.missing_schema_header,
                       f"malformed schema header {header!r}, expected like {expected.schema_header()!r}",
                       header)
    if m["name"] != expected.SCHEMA_NAME:
        raise Rejected(DLQReason.wrong_schema,
                       f"expected {expected.schema_header()}, got {header}", header)
    if int(m["major"]) != expected.major():
        raise Rejected(DLQReason.major_version_mismatch,
                       f"expected {expected.SCHEMA_NAME} v{expected.major()}.x, got {header}", header)
    if value is None:
        raise Rejected(DLQReason.undecodable, "value is empty (null)", header)
    try:
        obj = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Rejected(DLQReason.undecodable, f"value is not UTF-8 JSON: {e}", header) from None
    try:
        return expected.model_validate(obj)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                         for err in e.errors()[:5])
        raise Rejected(DLQReason.validation_failed, f"{expected.schema_header()}: {errs}", header) from None


def dlq_record(rej: Rejected, *, stage: str, topic: str, partition: int, offset: int,
               key: bytes | None, value: bytes | None) -> DLQRecord:
    """The DLQ record for a rejected input; payloads above DLQ_PAYLOAD_LIMIT are truncated."""
    payload = value or b""
    kept = payload[:DLQ_PAYLOAD_LIMIT]
    return DLQRecord(
        reason=rej.reason, error=rej.detail, stage=stage, topic=topic, partition=partition,
        offset=offset, key_b64=base64.b64encode(key).decode() if key is not None else None,
        schema_seen=rej.schema_header, payload_b64=base64.b64encode(kept).decode(),
        payload_size=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_truncated=len(kept) < len(payload),
    )
