"""Encode contracts into Kafka records and decode them back, refusing what does not fit.

A record is accepted only if: its value is bytes of at most `max_bytes`, it carries a
`schema` header `name/vMAJOR.MINOR` whose name is the expected contract's and whose major
equals ours, it is UTF-8 JSON (parsed by pydantic's parser, which refuses a lone surrogate
escape, nesting past 200 and integers past 4300 digits), it has no NaN or Infinity literal
anywhere (Python's json and pydantic's parser both take them) and no number that
overflows to Infinity, and it validates against the model (whose floats are finite and
token ids in range: steadyrl/wire/contracts.py) with nothing nested deeper than MAX_DEPTH.
Anything else raises `Rejected` with a `DLQReason` and a message naming what was expected
and what came; `dlq_record()` turns that into the `DLQRecord` a stage produces to `rl.dlq`.

Decoding never raises anything else, whatever the value and headers are (any bytes, any
header list, a value or header of another type): every failure of the parser or the model,
RecursionError, MemoryError and ValueError included, becomes `Rejected`
(`tests/steadyrl/test_codec_fuzz.py`). Only a programming error of the caller (`expected`
not a contract, `max_bytes` not an int) raises TypeError.

Encoding refuses a contract holding a NaN or Infinity (a writer's bug: pydantic would write
it as `null`) with a ValueError naming the field.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, from_json

from steadyrl.wire.contracts import INT64_MAX, Contract, DLQReason, DLQRecord

C = TypeVar("C", bound=Contract)

SCHEMA_HEADER = "schema"
# Matched with fullmatch (a "$" would let "\n" follow); ASCII digits only (\d would take
# "١"), and a major/minor of at most 9 digits.
_HEADER_RE = re.compile(r"(?P<name>[a-z0-9_]+)/v(?P<major>[0-9]{1,9})\.(?P<minor>[0-9]{1,9})")

#: Bytes of the original payload kept in a DLQ record (base64 grows it by 4/3).
DLQ_PAYLOAD_LIMIT = 512 * 1024

#: Deepest nesting (models, lists, dicts) a decoded record may have. The contracts' own fields
#: nest at most 6 deep (quarantined_group > scored_group > rollout_group > samples > sample >
#: logprobs); the rest is for free-form extra_info and reward_extra. Pydantic's serializer
#: stops at ~254 levels, so a deep free-form field made the stage fail to encode its output.
MAX_DEPTH = 64

#: Longest `Rejected.detail` (and header kept): a DLQ record must fit rl.dlq's 1 MiB.
DETAIL_LIMIT = 4096
_HEADER_KEPT = 256


class Rejected(Exception):
    """A record that cannot be accepted.

    Attributes:
        reason: the DLQReason.
        detail: what was expected and what came (at most DETAIL_LIMIT characters, valid UTF-8).
        schema_header: the header seen, if any (at most 256 characters, valid UTF-8).
    """

    def __init__(self, reason: DLQReason, detail: str, schema_header: str | None = None):
        detail = _clean(str(detail), DETAIL_LIMIT)
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.schema_header = _clean(schema_header, _HEADER_KEPT) if schema_header is not None else None


def _clean(text: str, limit: int) -> str:
    """`text` shortened to `limit` characters, lone surrogates escaped (\\udc80) so that
    it encodes as UTF-8."""
    if len(text) > limit:
        text = text[:limit - 25] + f"... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(obj: Any, limit: int = 80) -> str:
    """repr of `obj`, at most `limit` characters."""
    r = repr(obj)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _non_finite_literal(value: bytes) -> str | None:
    """Where the first NaN/Infinity/-Infinity literal of `value` is (pydantic's parser's
    position), or None when it has none (or is not JSON at all: the caller's parse says why)."""
    try:
        from_json(value, allow_inf_nan=False)
        return None
    except ValueError as strict:
        try:
            from_json(value)  # parses with them: the strict failure was such a literal
        except ValueError:
            return None
        return str(strict).replace("expected value", "").replace("invalid number", "").strip()


def _path(parts: list[int | str]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


def _scan(root: Any, max_depth: int | None) -> str | None:
    """"non_finite" if a float in `root` (a model, and everything it holds) is NaN or
    Infinity, "deep" if something is nested deeper than `max_depth` (models, lists, dicts),
    else None. No paths are kept: `_locate` finds the culprit once there is one."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, float):
            if not math.isfinite(o):
                return "non_finite"
            continue
        if max_depth is not None and d > max_depth:
            return "deep"
        if isinstance(o, BaseModel):
            values: Any = o.__dict__.values()
        elif isinstance(o, list):
            try:  # fast path: numbers only, and their sum is finite, so each one is
                if math.isfinite(sum(o)):
                    continue
            except (TypeError, OverflowError, ValueError):
                pass
            values = o
        elif isinstance(o, dict):
            values = o.values()
        else:
            continue
        stack.extend((v, d + 1) for v in values if isinstance(v, _WALKED))
    return None


def _locate(root: Any, problem: str, max_depth: int | None) -> str:
    """The path (`samples[0].logprobs[3] = nan`) of the first `problem` _scan reported."""
    stack: list[tuple[Any, int, tuple[int | str, ...]]] = [(root, 1, ())]
    while stack:
        o, d, path = stack.pop()
        if isinstance(o, float):
            if problem == "non_finite" and not math.isfinite(o):
                return f"{_path(list(path))} = {o!r}"
            continue
        if problem == "deep" and max_depth is not None and d > max_depth:
            return _path(list(path))
        items: Any
        if isinstance(o, BaseModel):
            items = o.__dict__.items()
        elif isinstance(o, list):
            items = enumerate(o)
        elif isinstance(o, dict):
            items = o.items()
        else:
            continue
        stack.extend((v, d + 1, path + (k,)) for k, v in reversed(list(items)) if isinstance(v, _WALKED))
    return "<somewhere>"


_WALKED = (float, BaseModel, list, dict)


def encode(msg: Contract) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Serialize a contract: `(value bytes, headers)` with the `schema` header set.

    Raises:
        ValueError: the contract holds NaN or Infinity (named with its field, e.g.
            `samples[0].logprobs[3] = nan`): JSON has no such number and pydantic would
            write `null`. Also what pydantic cannot serialize (a lone surrogate in a str,
            nesting past its limit).
    """
    if _scan(msg, None) is not None:
        raise ValueError(f"{msg.schema_header()}: cannot encode a non-finite number: "
                         f"{_locate(msg, 'non_finite', None)} (contracts carry finite numbers only)")
    try:
        value = msg.model_dump_json().encode()
    except PydanticSerializationError as e:
        raise ValueError(f"{msg.schema_header()}: cannot encode: {e}") from e
    return value, [(SCHEMA_HEADER, msg.schema_header().encode())]


def header_value(headers: Any, name: str = SCHEMA_HEADER) -> str | None:
    """The last value of header `name` as text, or None. Never raises: undecodable bytes are
    replaced, a str value is taken as it is (lone surrogates escaped), and anything that is
    not a list of (name, bytes | str | None) pairs counts as no header."""
    try:
        for item in reversed(list(headers or [])):
            if not (isinstance(item, (tuple, list)) and len(item) == 2) or item[0] != name:
                continue
            v = item[1]
            if isinstance(v, (bytes, bytearray, memoryview)):
                return bytes(v).decode("utf-8", errors="replace")
            if isinstance(v, str):
                return v.encode("utf-8", "backslashreplace").decode("utf-8")
            return None
    except Exception:  # noqa: BLE001 - a headers object whose iteration raises: no header
        return None
    return None


def _validation_detail(expected: type[Contract], e: ValidationError) -> tuple[DLQReason, str]:
    errors = e.errors(include_url=False, include_input=False)
    types = {err.get("type") for err in errors}
    if "json_invalid" in types:  # pydantic's parser: syntax, nesting past 200, a lone surrogate, a huge number
        msg = next(err.get("msg", "?") for err in errors if err.get("type") == "json_invalid")
        return DLQReason.undecodable, f"value is not UTF-8 JSON: {msg}"
    reason = DLQReason.non_finite if "finite_number" in types else DLQReason.validation_failed
    parts = []
    for err in errors[:5]:
        loc = ".".join(_clean(str(p), 64) for p in err.get("loc", ())) or "<root>"
        parts.append(f"{loc}: {err.get('msg', '?')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return reason, f"{expected.schema_header()}: {'; '.join(parts)}{more}"


def decode(value: Any, headers: Any, expected: type[C], max_bytes: int | None = None) -> C:
    """Decode and validate one record value as `expected`.

    Raises:
        Rejected: oversize, missing/malformed header, another contract, another major
            version, undecodable bytes (not UTF-8 JSON, NaN literals aside; too deep; a lone
            surrogate; a number the parser refuses), a non-finite number, or failed
            validation. Nothing else for any `value` and `headers`.
        TypeError: `expected` is not a contract or `max_bytes` not an int (the caller's bug).
    """
    if not (isinstance(expected, type) and issubclass(expected, Contract)):
        raise TypeError(f"expected must be a Contract subclass, got {expected!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)):
        raise TypeError(f"max_bytes must be an int or None, got {type(max_bytes).__name__}")
    header = header_value(headers)
    try:
        return _decode(value, header, expected, max_bytes)
    except Rejected:
        raise
    except Exception as e:  # noqa: BLE001 - the promise: a record never raises anything else
        raise Rejected(DLQReason.undecodable, f"{expected.schema_header()}: {type(e).__name__}: {e}",
                       header) from None


def _decode(value: Any, header: str | None, expected: type[C], max_bytes: int | None) -> C:
    if value is not None and not isinstance(value, bytes):
        if not isinstance(value, (bytearray, memoryview)):
            raise Rejected(DLQReason.undecodable, f"value must be bytes, got {type(value).__name__}", header)
        value = bytes(value)
    size = len(value or b"")
    if max_bytes is not None and size > max_bytes:
        raise Rejected(DLQReason.oversize, f"value is {size} bytes, limit is {max_bytes}", header)
    if header is None:
        raise Rejected(DLQReason.missing_schema_header,
                       f"expected header schema={expected.schema_header()}, got none")
    m = _HEADER_RE.fullmatch(header)
    if m is None:
        raise Rejected(DLQReason.missing_schema_header,
                       f"malformed schema header {_short(header)}, expected like {expected.schema_header()!r}",
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
        text = value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Rejected(DLQReason.undecodable, f"value is not UTF-8 JSON: {e}", header) from None
    if "NaN" in text or "Infinity" in text:  # in a string, or a literal, which pydantic's parser takes
        where = _non_finite_literal(value)
        if where is not None:
            raise Rejected(DLQReason.non_finite, f"{expected.schema_header()}: NaN or Infinity literal ({where}), "
                                                 f"expected a finite number", header)
    try:
        msg = expected.model_validate_json(value)
    except ValidationError as e:
        reason, detail = _validation_detail(expected, e)
        raise Rejected(reason, detail, header) from None
    except Exception as e:  # noqa: BLE001 - a validator raising something pydantic does not wrap
        raise Rejected(DLQReason.validation_failed, f"{expected.schema_header()}: {type(e).__name__}: {e}",
                       header) from None
    # What the types cannot say: no float of a free-form field (extra_info, reward_extra) is
    # Infinity (a literal such as 1e999 overflows), nothing is nested deeper than MAX_DEPTH.
    problem = _scan(msg, MAX_DEPTH)
    if problem == "non_finite":
        raise Rejected(DLQReason.non_finite, f"{expected.schema_header()}: {_locate(msg, problem, MAX_DEPTH)}, "
                                             f"expected a finite number", header)
    if problem == "deep":
        raise Rejected(DLQReason.undecodable, f"{expected.schema_header()}: nested deeper than {MAX_DEPTH} levels "
                                              f"at {_locate(msg, problem, MAX_DEPTH)}", header)
    return msg


def held_prompt(value: bytes | None) -> dict[str, Any] | None:
    """The prompt (as parsed JSON) a raw record value holds: a Prompt's value itself, a rollout
    group's `prompt`, a scored group's `group.prompt`; None when the value is not JSON of one of
    these shapes. Never raises: a refused record is read as far as it can be (any bytes)."""
    try:
        obj = from_json(value or b"")
    except Exception:  # noqa: BLE001 - any bytes: not JSON, too deep, too large
        return None
    for path in ((), ("prompt",), ("group", "prompt")):
        at: Any = obj
        for name in path:
            at = at.get(name) if isinstance(at, dict) else None
        if isinstance(at, dict) and "prompt_id" in at and "messages" in at:
            return at
    return None


def held_attempt(value: bytes | None) -> int | None:
    """The `attempt` of the prompt a raw record value holds (`held_prompt`), or None: not
    readable, or a prompt of before prompt 1.3. A bool or a number out of int64 is None."""
    p = held_prompt(value)
    a = p.get("attempt") if p is not None else None
    return a if type(a) is int and 0 <= a <= INT64_MAX else None


def dlq_record(rej: Rejected, *, stage: str, topic: str, partition: int, offset: int,
               key: bytes | None, value: bytes | None) -> DLQRecord:
    """The DLQ record for a rejected input; payloads above DLQ_PAYLOAD_LIMIT are truncated.
    `attempt` is the attempt of the prompt the input holds (`held_attempt`), read from the
    whole value, truncated or not."""
    payload = value or b""
    kept = payload[:DLQ_PAYLOAD_LIMIT]
    return DLQRecord(attempt=held_attempt(payload),
        reason=rej.reason, error=rej.detail, stage=stage, topic=topic, partition=partition,
        offset=offset, key_b64=base64.b64encode(key).decode() if key is not None else None,
        schema_seen=rej.schema_header, payload_b64=base64.b64encode(kept).decode(),
        payload_size=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_truncated=len(kept) < len(payload),
    )
