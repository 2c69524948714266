"""Property-based fuzzing of `codec.decode` for every contract it decodes.

Each contract gets EXAMPLES cases, reproducible (derandomize): a valid record of it, then at
most one mutation - one field broken (wrong type, NaN, Infinity, huge ints and floats,
negative ids, odd unicode: lone surrogates, NUL, RTL), a field missing or extra, nesting
too deep, a raw literal the JSON encoder cannot write (NaN, 1e999, a 5000-digit integer),
truncated or garbled bytes, a duplicated key, a value of another type or contract - under
random headers (missing, garbage, another contract, another major, pairs of the wrong shape).

Hypothesis draws one integer per case; it picks the valid record (one of POOL built once
per contract from seeds by the plain functions below, edge values favoured), the mutation,
the header and, as a seed, every detail (where, what). Drawing every field and choice
through hypothesis cost ~25 ms a case (~30 min for all); each further draw costs ~0.5 ms.

Properties: decode raises nothing but `Rejected`; a rejection has a reason and a detail, and
its DLQ record encodes within rl.dlq's limit; whatever is accepted encodes again (finite
numbers, nothing a stage cannot write out); an unmutated record under its own header (any
minor) decodes to itself.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import re
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadyrl.wire import codec
from steadyrl.wire.contracts import (
    ALL_CONTRACTS,
    INT64_MAX,
    LOGPROB_MAX,
    LOGPROB_MIN,
    TOKEN_ID_MAX,
    Contract,
    DLQReason,
    DLQRecord,
    EpisodeState,
    PolicyUpdate,
    Prompt,
    QuarantineAction,
    QuarantineDecision,
    QuarantinedGroup,
    RewardSource,
    RolloutGroup,
    ScoredGroup,
)

log = logging.getLogger(__name__)

EXAMPLES = 10_000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# ---------------------------------------------------------------- valid records from a seed

ODD = ["\x00", "\u202e", "\u200f", "\ufeff", "\U0010ffff", "e\u0301", "NaN", "Infinity", '"', "\\", "\n", "\x7f",
       "\u2028", "\U0001f4a5", "\u0661", " ", "null", "ün"]
INT64_EDGES = [0, 1, -1, INT64_MAX, -INT64_MAX - 1, 2**31 - 1, 2**32, 1_796_114_973_339]


def _text(r: random.Random, lo: int = 0, hi: int = 8) -> str:
    if r.random() < 0.3:
        s = "".join(r.choice(ODD) for _ in range(r.randint(lo, max(lo, 3))))
    else:  # any code point but a surrogate (a valid record has none)
        s = "".join(chr(r.choice([r.randint(0x20, 0x7e), r.randint(0, 0xd7ff), r.randint(0xe000, 0x10ffff)]))
                    for _ in range(r.randint(lo, hi)))
    return s if len(s) >= lo else s + "x" * (lo - len(s))


def _int(r: random.Random, lo: int, hi: int) -> int:
    edges = [e for e in INT64_EDGES + [lo, hi] if lo <= e <= hi]
    return r.choice(edges) if r.random() < 0.3 else r.randint(lo, min(hi, lo + r.choice([10, 10**6, 2**63])))


def _float(r: random.Random, lo: float | None = None, hi: float | None = None) -> float:
    if lo is not None and hi is not None:
        return r.choice([lo, hi, r.uniform(lo, hi)])
    return r.choice([0.0, -0.0, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 1e-300,
                     r.uniform(-20, 0), r.gauss(0, 1e6)])


def _logprob(r: random.Random) -> float:
    return r.choice([LOGPROB_MIN, LOGPROB_MAX, 0.0, -0.0, -5e-324, 1e-300, r.uniform(-20, 0),
                     r.uniform(LOGPROB_MIN, LOGPROB_MAX)])


def _json(r: random.Random, depth: int = 0) -> Any:
    k = r.randint(0, 7 if depth < 3 else 4)
    if k == 0:
        return None
    if k == 1:
        return r.random() < 0.5
    if k == 2:
        return r.choice([0, -1, 2**70, -(2**70), r.randint(-1000, 1000)])
    if k == 3:
        return _float(r)
    if k == 4:
        return _text(r)
    if k in (5, 6):
        return [_json(r, depth + 1) for _ in range(r.randint(0, 3))]
    return {_text(r): _json(r, depth + 1) for _ in range(r.randint(0, 3))}


def _tokens(r: random.Random, n: int) -> list[int]:
    return [r.choice([0, TOKEN_ID_MAX, r.randint(0, 50_000)]) for _ in range(n)]


def _hex64(r: random.Random) -> str:
    return r.randbytes(32).hex()


def _b64(r: random.Random) -> str:
    return base64.b64encode(r.randbytes(r.randint(0, 12))).decode()


def prompt(r: random.Random) -> Prompt:
    return Prompt(
        prompt_id=_text(r, 1), epoch=_int(r, 0, INT64_MAX), index=_int(r, 0, INT64_MAX),
        messages=[{"role": r.choice(["system", "user", "assistant"]), "content": _text(r)}
                  for _ in range(r.randint(1, 2))],
        n_samples=_int(r, 1, 1024), data_source=_text(r), ground_truth=r.choice([None, _text(r)]),
        extra_info={_text(r): _json(r, 1) for _ in range(r.randint(0, 2))},
        created_ms=_int(r, -INT64_MAX - 1, INT64_MAX),
        run_id=_text(r, 0, 8), temperature=_float(r, 0.0, 10.0), top_p=r.choice([1.0, 5e-324, r.uniform(0.01, 1)]),
        max_new_tokens=_int(r, 1, 32768), seed=r.choice([None, 0, 2**80, r.randint(0, 2**63)]),
        min_policy_version=_int(r, 0, INT64_MAX))


def rollout_group(r: random.Random) -> RolloutGroup:
    samples = []
    for _ in range(r.randint(1, 3)):
        n = r.randint(0, 4)
        samples.append({"text": _text(r), "token_ids": _tokens(r, n), "logprobs": [_logprob(r) for _ in range(n)],
                        "finish_reason": r.choice(["stop", "length", "error"])})
    return RolloutGroup(prompt=prompt(r), prompt_token_ids=_tokens(r, r.randint(0, 4)), samples=samples,
                        policy_version=_int(r, 0, INT64_MAX), actor=_text(r),
                        generated_ms=_int(r, -INT64_MAX - 1, INT64_MAX),
                        rejected={_text(r): _int(r, 0, INT64_MAX) for _ in range(r.randint(0, 2))})


def scored_group(r: random.Random) -> ScoredGroup:
    g = rollout_group(r)
    n = len(g.samples)
    return ScoredGroup(group=g, rewards=[_float(r) for _ in range(n)], reward_source=r.choice(list(RewardSource)),
                       scorer=_text(r), cache_similarity=r.choice([None, 0.0, 1.0, r.random()]),
                       reward_extra=[{_text(r): _json(r, 2) for _ in range(r.randint(0, 2))} for _ in range(n)],
                       scored_ms=_int(r, -INT64_MAX - 1, INT64_MAX))


def policy_update(r: random.Random) -> PolicyUpdate:
    parts = ["r", "/", ".", "v000001", "é", " ", "\u202e", "..", "\x80"]
    uri = "".join(r.choice(parts) for _ in range(r.randint(1, 6)))
    return PolicyUpdate(version=_int(r, 0, INT64_MAX), step=_int(r, 0, INT64_MAX), uri=uri, sha256=_hex64(r),
                        created_ms=_int(r, -INT64_MAX - 1, INT64_MAX), run_id=_text(r, 0, 8),
                        high_water=_int(r, 0, INT64_MAX))


def dlq_record(r: random.Random) -> DLQRecord:
    return DLQRecord(reason=r.choice(list(DLQReason)), error=_text(r), stage=_text(r), topic=_text(r),
                     partition=_int(r, -INT64_MAX - 1, INT64_MAX), offset=_int(r, -INT64_MAX - 1, INT64_MAX),
                     key_b64=r.choice([None, _b64(r)]), schema_seen=r.choice([None, _text(r)]), payload_b64=_b64(r),
                     payload_size=_int(r, 0, INT64_MAX), payload_sha256=_hex64(r),
                     payload_truncated=r.random() < 0.5, rejected_ms=_int(r, -INT64_MAX - 1, INT64_MAX))


def quarantined_group(r: random.Random) -> QuarantinedGroup:
    count = _int(r, 1, 64)
    return QuarantinedGroup(batch_id=_text(r, 1), run_id=_text(r, 0, 8), step=_int(r, 1, INT64_MAX),
                            index=r.randint(0, count - 1), count=count,
                            rules=[_text(r) for _ in range(r.randint(1, 2))],
                            var_ratio=r.choice([None, _float(r)]), extreme_share=r.choice([None, _float(r)]),
                            ks_pvalue=r.choice([None, _float(r)]), group=scored_group(r),
                            quarantined_ms=_int(r, -INT64_MAX - 1, INT64_MAX))


def quarantine_decision(r: random.Random) -> QuarantineDecision:
    return QuarantineDecision(batch_id=_text(r, 1), action=r.choice(list(QuarantineAction)), by=_text(r),
                              note=_text(r), decided_ms=_int(r, -INT64_MAX - 1, INT64_MAX))


def episode_state(r: random.Random) -> EpisodeState:
    episodes = []
    for _ in range(r.randint(1, 3)):
        n = r.randint(0, 4)
        episodes.append({
            "messages": [{"role": r.choice(["system", "user", "assistant", "tool"]), "content": _text(r)}
                         for _ in range(r.randint(1, 3))],
            "prompt_ids": _tokens(r, r.randint(1, 4)), "token_ids": _tokens(r, n),
            "logprobs": [_logprob(r) for _ in range(n)], "loss_mask": [r.randint(0, 1) for _ in range(n)],
            "turn_versions": [_int(r, 0, INT64_MAX) for _ in range(r.randint(0, 2))], "text": _text(r),
            "finish_reason": r.choice(["stop", "length", "error"]), "done": r.random() < 0.5,
            "reward": r.choice([None, _float(r)]), "env_state": r.choice([None, _json(r, 1)])})
    return EpisodeState(prompt=prompt(r), turn=_int(r, 0, INT64_MAX), episodes=episodes, engine=_text(r, 0, 8),
                        actor=_text(r), started_ms=_int(r, -INT64_MAX - 1, INT64_MAX))


VALID = {Prompt: prompt, RolloutGroup: rollout_group, ScoredGroup: scored_group, PolicyUpdate: policy_update,
         DLQRecord: dlq_record, QuarantinedGroup: quarantined_group, QuarantineDecision: quarantine_decision,
         EpisodeState: episode_state}

# ---------------------------------------------------------------- mutations

# Raw JSON tokens json.dumps cannot write (or would not): put in place of a marker string.
RAW = {
    "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e999": "1e999", "-1e999": "-1e999",
    "1e309": "1e309", "bigfrac": "1" + "0" * 400 + ".5", "int4300": "9" * 4300, "int5000": "9" * 5000,
    "1e-400": "1e-400", "-0": "-0", "lone_hi": '"\\ud800"', "lone_lo": '"x\\udfff"', "pair": '"\\ud83d\\ude00"',
    "nul": '"\\u0000"', "deep63": "[" * 63 + "]" * 63, "deep64": "[" * 64 + "]" * 64, "deep65": "[" * 65 + "]" * 65,
    "deep199": "[" * 199 + "]" * 199, "deep201": "[" * 201 + "]" * 201, "deep300": "[" * 300 + "]" * 300,
    "deep3000": "[" * 3000 + "]" * 3000,
    "deepobj100": '{"a":' * 100 + "1" + "}" * 100, "deepobj1000": '{"a":' * 1000 + "1" + "}" * 1000,
    "nan_in_list": "[1, NaN]", "trailing": "1 2", "bare": "nan", "hexint": "0x10", "plus": "+1", "dot": ".5",
}
RAW_NAMES = sorted(RAW)
POISON: list[Any] = [
    float("nan"), float("inf"), float("-inf"), -1, -(2**31), 2**31, 2**31 - 1, 2**63, 2**63 - 1, -(2**63) - 1, 2**64,
    10**40, -(10**40), 10**400, 1e308, -1e308, 5e-324, 0.5, -0.0, True, False, None, "", "x" * 5000, "\ud800",
    "\udfff", "a\udc80b", "\x00", "\u202e", "NaN", "nan", "inf", "-Infinity", "1e999", "9" * 50, "-1", "1.5", [], {},
    [None], {"": None}, [[[]]], [float("nan")], {"a": float("inf")}, [-1], [2**40], {"\ud800": 1},
] + [f"\x00RAW:{k}\x00" for k in RAW_NAMES]
OTHER_VALUES = [codec.encode(m)[0] for m in (
    Prompt(prompt_id="p", epoch=0, index=0, messages=[{"role": "user", "content": "x"}], n_samples=1),
    PolicyUpdate(version=1, step=1, uri="r/v000001", sha256="0" * 64),
    QuarantineDecision(batch_id="b", action="drop"),
)] + [b"", b"null", b"[]", b"{}", b"0", b'"x"', b"\xef\xbb\xbf{}", b'{"a":1,}', b"\xff\xfe{\x00}\x00", b"NaN"]


def _paths(obj, here=()):
    """Every (container path, key) of a JSON tree."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield here, k
            yield from _paths(v, here + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield here, i
            yield from _paths(v, here + (i,))


def _at(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _dumps(obj, ascii_only: bool) -> bytes:
    s = json.dumps(obj, ensure_ascii=ascii_only, allow_nan=True)
    if "\\u0000RAW:" in s or "\x00RAW:" in s:
        for k, raw in RAW.items():
            s = s.replace(json.dumps(f"\x00RAW:{k}\x00", ensure_ascii=ascii_only), raw)
    return s.encode("utf-8", "surrogatepass")  # a lone surrogate, unescaped: invalid UTF-8


OPS = ["none", "none", "none", "field", "field", "field", "field", "delete", "extra", "raw", "raw", "type", "other"]
RAW_KINDS = ["truncate", "insert", "flip", "number", "wrap", "random", "duplicate"]
HEADER_KINDS = ["own", "own", "own", "own", "minor", "major", "contract", "missing", "garbage", "shape"]
BIG_HEADER = b"v" * (2 * 1024 * 1024)  # its DLQ record must still fit rl.dlq's 1 MiB
POOL = 256  # valid records per contract, built once: building one costs more than a whole case
_pools: dict[type[Contract], list[tuple[Contract, bytes, list]]] = {}


def _pool(contract: type[Contract]) -> list[tuple[Contract, bytes, list]]:
    """(model, its encoded value, its JSON tree's paths) for seeds 0..POOL-1."""
    if contract not in _pools:
        out = []
        for seed in range(POOL):
            model = VALID[contract](random.Random(seed))
            value = codec.encode(model)[0]
            out.append((model, value, list(_paths(json.loads(value)))))
        _pools[contract] = out
    return _pools[contract]


def case(contract: type[Contract], x: int) -> tuple[Contract, Any, Any, str, str]:
    """Case number `x` (hypothesis draws it): (model, value, headers, op, header kind)."""
    r = random.Random(x)
    model, value, spots = _pool(contract)[x % POOL]
    op = OPS[(x // POOL) % len(OPS)]
    hkind = HEADER_KINDS[(x // POOL // len(OPS)) % len(HEADER_KINDS)]
    poison = POISON[r.randrange(len(POISON))]
    if op in ("field", "delete", "extra"):
        obj = json.loads(value)
        if op == "field":
            where, key = r.choice(spots)
            _at(obj, where)[key] = poison
        elif op == "delete":
            where, key = r.choice([(w, k) for w, k in spots if isinstance(k, str)])
            del _at(obj, where)[key]
        else:
            dicts = [()] + [w + (k,) for w, k in spots if isinstance(_at(obj, w)[k], dict)]
            _at(obj, r.choice(dicts))[r.choice(["x", "", "\ud800", "prompt", "\x00", "NaN"])] = poison
        value = _dumps(obj, r.random() < 0.5)
    elif op == "raw":
        b, kind, at = value, r.choice(RAW_KINDS), r.randrange(2**16)
        if kind == "truncate":
            b = b[:at % len(b)]
        elif kind == "insert":
            i = at % (len(b) + 1)
            b = b[:i] + r.choice([b"NaN", b"\\ud800", b"[", b"{", b",", b'"', b"\xff", b"\x00", b"\xed\xa0\x80",
                                  r.randbytes(3)]) + b[i:]
        elif kind == "flip":
            i = at % len(b)
            b = b[:i] + bytes([b[i] ^ r.randint(1, 255)]) + b[i + 1:]
        elif kind == "number":  # one number token replaced by a raw literal
            nums = [m.span() for m in re.finditer(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", b)]
            if nums:
                i, j = nums[at % len(nums)]
                b = b[:i] + RAW[r.choice(RAW_NAMES)].encode() + b[j:]
        elif kind == "wrap":
            n = r.choice([1, 63, 200, 1000, 5000])
            b = b"[" * n + b + b"]" * n
        elif kind == "random":
            b = r.randbytes(at % 65)
        else:  # the same key twice: the last one counts
            fields = sorted(type(model).model_fields)
            b = b[:-1] + b', "' + fields[at % len(fields)].encode() + b'": ' + _dumps(poison, True) + b"}"
        value = b
    elif op == "type":
        value = r.choice([None, value.decode(), bytearray(value), memoryview(value), 7, [value], 1.5])
    elif op == "other":
        value = r.choice(OTHER_VALUES)
    header, hkind = headers(contract, hkind, r)
    return model, value, header, op, hkind


def headers(contract: type[Contract], kind: str, r: random.Random) -> tuple[Any, str]:
    """(headers, kind): kind "own" when the schema header is the contract's, any minor."""
    own = contract.schema_header().encode()
    if kind == "own":
        return [(codec.SCHEMA_HEADER, own)], "own"
    if kind == "minor":
        h = f"{contract.SCHEMA_NAME}/v{contract.major()}.{r.choice(['0', '1', '99', '000000001'])}"
        return [("other", b"x"), (codec.SCHEMA_HEADER, r.choice([h.encode(), h]))], "own"
    if kind == "major":
        major = r.choice(["0", "2", "10", "9" * 12, "9" * 5000, "\u0661", "01", "-1", ""])
        return [(codec.SCHEMA_HEADER, f"{contract.SCHEMA_NAME}/v{major}.0".encode())], kind
    if kind == "contract":
        other = r.choice([c for c in ALL_CONTRACTS if c is not contract])
        return [(codec.SCHEMA_HEADER, other.schema_header().encode())], kind
    if kind == "missing":
        return r.choice([None, [], [("other", own)], [(codec.SCHEMA_HEADER, None)], ()]), kind
    if kind == "garbage":
        v = r.choice([r.randbytes(r.randint(0, 40)), _text(r), own + b"\n", b" " + own, own + b"\x00", own.upper(),
                      "\ud800", own.replace(b"/v", b"/V"), own * 1000, BIG_HEADER, b"\xff" + own])
        return [(codec.SCHEMA_HEADER, v)], kind
    return r.choice([  # pairs of the wrong shape or type
        [(codec.SCHEMA_HEADER,)], [(codec.SCHEMA_HEADER, own, b"x")], [codec.SCHEMA_HEADER], "schema", 5,
        {codec.SCHEMA_HEADER: own}, [(codec.SCHEMA_HEADER, 5)], [(codec.SCHEMA_HEADER, [own])], [None],
        [(codec.SCHEMA_HEADER, b"\xff"), (codec.SCHEMA_HEADER, own)], [(codec.SCHEMA_HEADER, own), (b"schema", b"x")],
        [(None, own)], object(),
    ]), kind


# ---------------------------------------------------------------- the properties


def check(contract: type[Contract], model: Contract, value, headers, op: str, kind: str, seen: Counter) -> None:
    """One case: the properties in the module doc."""
    seen["examples"] += 1
    try:
        got = codec.decode(value, headers, contract, max_bytes=4 * 1024 * 1024)
    except codec.Rejected as rej:
        seen[rej.reason.value] += 1
        assert isinstance(rej.reason, DLQReason) and rej.detail, rej
        raw = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None
        rec = codec.dlq_record(rej, stage="fuzz", topic="t", partition=0, offset=1, key=b"k", value=raw)
        assert len(codec.encode(rec)[0]) < 1024 * 1024
        assert not (op == "none" and kind == "own" and raw is not None), f"a valid record was refused: {rej}"
        return
    seen["accepted"] += 1
    assert isinstance(got, contract)
    codec.encode(got)  # finite numbers only, and nothing a stage could not write out again
    if op == "none" and isinstance(value, (bytes, bytearray, memoryview)):
        assert got == model


@pytest.mark.parametrize("contract", ALL_CONTRACTS, ids=lambda c: c.SCHEMA_NAME)
def test_decode_raises_only_rejected(contract, record_property):
    seen: Counter = Counter()

    _pool(contract)

    @FUZZ
    @given(x=st.integers(0, 2**64 - 1))
    def run(x):
        check(contract, *case(contract, x), seen)

    t0 = time.perf_counter()
    run()
    took = time.perf_counter() - t0
    record_property("examples", seen["examples"])
    record_property("seconds", round(took, 1))
    log.info("fuzzed %s: %d cases in %.1f s: %s", contract.SCHEMA_NAME, seen["examples"], took, dict(seen))
    assert seen["examples"] >= EXAMPLES
    # both sides exercised: a fuzzer that only ever rejects (or accepts) proves little
    assert seen["accepted"] > EXAMPLES // 10 and seen["examples"] - seen["accepted"] > EXAMPLES // 10, dict(seen)
