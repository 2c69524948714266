"""The Python API runs the tiny stack to its end, reports its progress and metrics on the way,
and exports the last version (issue 38: nothing could start, watch or stop a run from Python)."""

import os

import pytest

import steadyrl
from steadyrl.local.ports import free_port_pair
from tests.helpers import ROOT


@pytest.mark.timeout(600)
def test_a_run_from_python_trains_follows_waits_and_exports(tmp_path):
    offset = 1500 + os.getpid() % 500
    run = steadyrl.Run(ROOT / "configs/tiny.yaml", tmp_path / "run", port=free_port_pair(), port_offset=offset,
                       learner={"steps": 6, "eval_data": "tiny_copy:16", "checkpoint_every": 3})
    with run:
        seen, metrics = [], {}
        for p in run.follow(interval_s=0.5):
            seen.append(p)
            if p.get("step", 0) >= 1 and not metrics:
                metrics = run.metrics()
        summary = run.wait(300)
        out = run.export(tmp_path / "model")
    assert not run.running
    assert len(summary["reward_per_step"]) == 6 and summary["eval"]["n"] == 16
    assert seen and seen[-1]["run_id"] == run.run_dir.name and max(p.get("step", 0) for p in seen) >= 1
    assert metrics[("steadyrl_learner_reward_mean", frozenset())] >= 0.0
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    assert (tmp_path / "run" / "api-config.yaml").read_text().count("steps: 6") == 1
    with pytest.raises(RuntimeError, match="started already"):
        run.start()


def test_a_failed_run_raises_with_its_output(tmp_path):
    run = steadyrl.up(ROOT / "configs/tiny.yaml", tmp_path / "run", port_offset=1400 + os.getpid() % 100,
                      bootstrap="127.0.0.1:1")
    with pytest.raises(steadyrl.RunFailed, match="cannot reach the Kafka broker at 127.0.0.1:1"):
        run.wait(120)
    run.stop()
