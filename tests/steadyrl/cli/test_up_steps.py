"""`steadyrl up`'s pure steps (steadyrl/cli/up.py): the command line of each service instance it
starts, and what it says and exits with once supervision ends."""

import argparse
import sys

import pytest

from steadyrl.cli.up import SERVICE_PORTS, SERVICES, _children, _ending, _service_flags
from steadyrl.local import placement


@pytest.mark.parametrize("failed, finished, ready, line, code", [
    (None, None, {}, None, 0),                                                       # Ctrl-C
    (None, "learner-0", {"learner-0": True}, "learner-0 finished its run; stopping the stack", 0),
    ("reward-0", None, {"reward-0": True}, "reward-0 stopped the run (exit 2", 2),      # it ran first
    ("reward-0", None, {"reward-0": False}, "reward-0 cannot start (exit 2", 2),
    ("reward-0", "learner-0", {"reward-0": False}, "reward-0 cannot start", 2),       # a failure wins
])
def test_the_end_of_supervision_says_why_and_exits(failed, finished, ready, line, code):
    said, exit_code = _ending(failed, finished, ready)
    assert exit_code == code
    assert said == line if line is None else said.startswith(line)


def test_each_instance_gets_its_port_flags_and_config_once(tmp_path):
    args = argparse.Namespace(port_offset=7, prefix="p.", config="c.yaml")
    scale = {"rollout": 2}
    places = {svc.replace("-", "_"): placement.ServicePlacement() for svc in SERVICES}
    flags = {svc: [f"--{svc}.x", "1"] for svc in SERVICES}
    children = _children(args, "h:9", scale, {"actor": "/venv/python"}, places, flags)
    assert [c.name for c in children] == ["reward-server-0", "actor-0", "rollout-0", "rollout-1", "reward-0",
                                          "learner-0"]
    for c in children:
        svc, i = c.name.rsplit("-", 1)
        port = SERVICE_PORTS[svc] + 7 + int(i)
        assert c.argv[0] == ("/venv/python" if svc == "actor" else sys.executable)
        assert c.argv[1:3] == ["-m", SERVICES[svc]]
        assert c.argv[c.argv.index("--metrics-port") + 1] == str(port)
        assert c.argv[c.argv.index("--instance-id") + 1] == c.name
        assert c.argv[-4:] == [f"--{svc}.x", "1", "--config", "c.yaml"]
        assert c.argv.count("--config") == 1 and c.argv[c.argv.index("--bootstrap") + 1] == "h:9"
    assert [c.name for c in children if c.final] == ["learner-0"]
    wiring = _service_flags(7, tmp_path)
    assert wiring["rollout"] == ["--rollout.actor-url", f"http://127.0.0.1:{SERVICE_PORTS['actor'] + 7}"]
