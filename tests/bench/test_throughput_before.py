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


def _old_tree(root: Path, learner_keys: str) -> Path:
    """A checkout without steadyrl/local/placement.py whose learner knows `learner_keys`."""
    (root / "steadyrl").mkdir(parents=True)
    (root / "services" / "learner").mkdir(parents=True)
    (root / "services" / "learner" / "config.py").write_text(learner_keys)
    return root


def test_a_checkout_from_before_placement_gets_the_config_without_what_it_does_not_know(tmp_path):
    """Regression: 4bba081 (the issue's 'today') refused the arm's config: `placement` and
    `learner.eval_splits` are unknown to it, and an unknown key fails a service at start."""
    import yaml

    config = throughput.make_config(tmp_path / "c.yaml", 100, 2, placed=False)
    assert "placement" in yaml.safe_load(config.read_text())  # unplaced: every field null
    assert throughput.config_for_tree(config, ROOT) == config  # this checkout knows every key
    old = _old_tree(tmp_path / "old", "steps prompts_per_step max_staleness model data")
    got = yaml.safe_load(throughput.config_for_tree(config, old).read_text())
    assert "placement" not in got and "eval_splits" not in got["learner"]
    assert got["learner"]["steps"] == 100 and got["learner"]["max_staleness"] == 2
