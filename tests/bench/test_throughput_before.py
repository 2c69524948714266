"""bench/throughput.py's `ARM@before` arms (the same pipeline arm from an earlier checkout, in
the same rounds): their config key, and their place in the Kafka summary (regression: the
summary named four arms and left the @before ones out of kafka_overhead_cut.json)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import _throughput_report as report  # noqa: E402
import throughput  # noqa: E402


@pytest.mark.parametrize("arm, key", [("pipeline-s2", (2, True)), ("pipeline-s0-unplaced", (0, False)),
                                      ("pipeline-s2@before", (2, True)), ("pipeline-s0@before", (0, True))])
def test_an_arm_from_the_earlier_checkout_has_the_config_of_its_arm(arm, key):
    assert throughput.arm_config_key(arm) == key


def test_the_kafka_summary_has_every_pipeline_arm_of_the_rounds():
    ko = json.loads((ROOT / "bench/results/kafka_overhead_cut.json").read_text())
    rounds: dict = {}
    for run in ko["per_run"]:
        run = dict(run)
        rounds.setdefault(run.pop("round"), {"arms": {}})["arms"][run.pop("arm")] = {"kafka": run}
    got = report.kafka_summary(list(rounds.values()))
    assert sorted(got) == ["pipeline-s0", "pipeline-s0@before", "pipeline-s2", "pipeline-s2@before"]
    assert got["pipeline-s2@before"]["cpu_per_record"]["groups"] > 0
