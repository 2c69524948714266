"""The rollout gate at its exact thresholds."""

import pytest

from steadyrl.services.rollout.gate import RolloutGate
from steadyrl.wire.contracts import Prompt, RolloutGroup, Sample


def _group(samples, max_new_tokens=64):
    p = Prompt(prompt_id="e0-i0", epoch=0, index=0, n_samples=len(samples), messages=[{"role": "user", "content": "x"}],
               max_new_tokens=max_new_tokens)
    return RolloutGroup(prompt=p, policy_version=0,
                        samples=[Sample(text=t, token_ids=[1] * n, logprobs=[-0.1] * n) for t, n in samples])


def test_length_limit_512_passes_513_fails():
    gate = RolloutGate(max_response_tokens=512)
    assert gate.reason("a", 512) is None
    assert gate.reason("a", 513) == "too_long"
    assert gate.reason("a", 513, asked=4096) == "too_long"   # a set limit wins over the request's


def test_by_default_the_limit_is_what_the_prompt_asked_for():
    """One length setting: learner.max_new_tokens reaches the gate in each prompt; answers of
    4 096 tokens pass a run that asks for 4 096 (the old fixed 512 sent them all to the DLQ)."""
    gate = RolloutGate()
    assert gate.reason("a", 4096, asked=4096) is None and gate.reason("a", 4097, asked=4096) == "too_long"
    assert gate.reason("a", 10**6) is None                   # nothing asked, nothing set: no length limit
    g, why = gate.apply(_group([("ok", 4096), ("long", 4097)], max_new_tokens=4096))
    assert [s.text for s in g.samples] == ["ok"] and why == {"too_long": 1}


@pytest.mark.parametrize("text,ok", [("tab\there", True), ("line\nbreak\r\n", True), ("plain ascii ~", True),
                                     ("é and 中文", True), ("nul\x00", False), ("bell\x07", False),
                                     ("unit sep\x1f", False), ("del\x7f", False), ("c1 \x85", False),
                                     ("vertical tab\x0b", False)])
def test_control_characters(text, ok):
    assert (RolloutGate().reason(text, 3) is None) == ok


def test_json_schema_for_structured_outputs():
    gate = RolloutGate(response_schema={"type": "object", "required": ["answer"],
                                        "properties": {"answer": {"type": "integer"}}})
    assert gate.reason('{"answer": 4}', 5) is None
    assert gate.reason('{"answer": "4"}', 5) == "schema_mismatch"
    assert gate.reason("answer: 4", 5) == "not_json"
    with pytest.raises(Exception, match="is not valid under any of the given schemas|is not of type"):
        RolloutGate(response_schema={"type": 12})


def test_apply_keeps_passing_samples_and_counts_the_rest():
    g, why = RolloutGate(max_response_tokens=4).apply(_group([("ok", 4), ("long", 5), ("bad\x00", 2), ("fine", 1)]))
    assert [s.text for s in g.samples] == ["ok", "fine"] and g.rejected == {"too_long": 1, "illegal_characters": 1}
    assert why == {"too_long": 1, "illegal_characters": 1}
    clean = _group([("ok", 1)])
    assert RolloutGate().apply(clean) == (clean, {})
    emptied, why = RolloutGate(max_response_tokens=1).apply(_group([("x", 2), ("y", 3)]))
    assert emptied.samples == [] and why == {"too_long": 2}


def test_a_bad_response_schema_is_a_config_error_naming_the_field():
    """Regression: it passed config loading and crashed the service (exit 1, restarted by up)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    proc = subprocess.run([sys.executable, "-m", "steadyrl.services.rollout",
                           "--rollout.response-schema", '{"type": "bogus"}'],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "rollout.response_schema" in proc.stderr and "not a valid JSON Schema" in proc.stderr
