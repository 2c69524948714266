"""`learner.world_size` > 1: the learner process execs torchrun with its own arguments, once
(a rank, with RANK set, does not), so `steadyrl up`, compose and Kubernetes start the ranks
alike (services/learner/main.py, steadyrl/rl/distributed.py)."""

from __future__ import annotations

import sys

import pytest

from steadyrl.services.learner import main as learner_main


class Exec(Exception):
    pass


def _exec_args(monkeypatch, argv: list[str]) -> list[str]:
    seen: list[list[str]] = []

    def execv(path, args):
        seen.append([path, *args[1:]] if args[0] == path else args)
        raise Exec

    monkeypatch.setattr(learner_main.os, "execv", execv)
    with pytest.raises(Exec):
        learner_main.main(argv)
    return seen[0]


def test_world_size_two_execs_torchrun_with_the_same_arguments(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--learner.world-size", "2", "--metrics-port", "0", "--bootstrap", "127.0.0.1:1"]
    assert _exec_args(monkeypatch, argv) == [
        sys.executable, "-m", "steadyrl.rl.torchrun", "--ranks-host", "127.0.0.1", "--nnodes", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1",
        "--nproc-per-node", "2", "--max-restarts", "3", "-m", "steadyrl.services.learner", *argv]


def test_from_the_environment_too(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("STEADYRL_LEARNER__WORLD_SIZE", "3")
    monkeypatch.setenv("STEADYRL_RANKS_HOST", "10.0.0.7")   # the group's address, across hosts
    args = _exec_args(monkeypatch, ["--bootstrap", "127.0.0.1:1"])
    assert args[args.index("--nproc-per-node") + 1] == "3"
    assert args[args.index("--ranks-host") + 1] == "10.0.0.7" and "10.0.0.7:0" in args


def test_a_rank_does_not_exec_again(monkeypatch):
    """Under torchrun (RANK set) the process is a rank: it joins the group instead."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(learner_main.os, "execv", lambda *a: pytest.fail("exec'd again"))
    joined = []
    monkeypatch.setattr("steadyrl.rl.distributed.init_from_env", lambda **kw: joined.append(kw) or (1, 2))
    monkeypatch.setattr(learner_main, "follower", lambda cfg: 7)
    assert learner_main.main(["--learner.world-size", "2", "--bootstrap", "127.0.0.1:1"]) == 7
    assert joined == [{"device": "cpu"}]   # the trainer's device picks the group's backends


def test_more_cuda_ranks_than_gpus_is_refused_before_torchrun(monkeypatch):
    """One rank per GPU: 2 cuda ranks where fewer GPUs are visible stop the start with both
    settings named, instead of N ranks failing in CUDA and torchrun restarting them."""
    import torch

    from steadyrl.config import ConfigError

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(learner_main.os, "execv", lambda *a: pytest.fail("torchrun started"))
    with pytest.raises(ConfigError, match=r"learner\.world_size is 2 with learner\.train\.device cuda, but 1 GPUs"):
        learner_main.main(["--learner.world-size", "2", "--learner.train.device", "cuda",
                           "--bootstrap", "127.0.0.1:1"])
