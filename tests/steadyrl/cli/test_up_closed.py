"""Issue 46: `steadyrl up` closed to other local processes by default, without a broker: its own
broker takes logins unless --insecure, a state folder whose broker was made without them is
refused naming why, and the HTTP work routes each get a token of their own, new at every start."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from steadyrl.cli.common import CliError
from steadyrl.cli.up import HTTP_TOKENS, _http_tokens, _logins
from steadyrl.local.broker import LocalBroker
from tests.helpers import ROOT


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = {"state_dir": str(tmp_path / "state"), "port": 19092, "heap_mb": 512, "sasl": False, "insecure": False,
            "kafka_secrets": None, "broker_data": None, "bootstrap": None}
    return argparse.Namespace(**{**base, **kw})


def test_logins_are_the_default_for_ups_own_broker_only(tmp_path):
    args = _args(tmp_path)
    _logins(args, None)
    assert args.sasl is True
    args = _args(tmp_path, insecure=True)
    _logins(args, None)
    assert args.sasl is False
    args = _args(tmp_path, bootstrap="127.0.0.1:9")   # an existing cluster: used as it is
    _logins(args, "127.0.0.1:9")
    assert args.sasl is False
    with pytest.raises(CliError, match="--insecure and --sasl"):
        _logins(_args(tmp_path, insecure=True, sasl=True), None)


def _old_broker(state) -> None:
    """A broker folder as today's main's `up` leaves it: formatted PLAINTEXT."""
    lb = LocalBroker(state / "broker", port=19092, controller_port=19093)
    lb.data.mkdir(parents=True)
    (lb.data / "meta.properties").write_text("version=1\n")
    (lb.state_dir / "server.properties").write_text(lb._server_properties())


def test_a_state_folder_whose_broker_was_made_without_logins_is_refused_naming_why(tmp_path):
    _old_broker(tmp_path / "state")
    with pytest.raises(CliError, match="made without logins.*steadyrl up --insecure") as e:
        _logins(_args(tmp_path), None)
    assert e.value.code == 2
    _logins(_args(tmp_path, insecure=True), None)   # resumed as it was made


def test_up_refuses_such_a_folder_with_exit_2_before_anything_starts(tmp_path):
    _old_broker(tmp_path / "state")
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--state-dir", str(tmp_path / "state"),
                        "--port", "19092", "--port-offset", "3717"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "made without logins" in r.stderr and "--insecure" in r.stderr
    assert not (tmp_path / "state" / "broker" / "logs").exists()   # the broker was not started


def test_each_work_route_gets_a_token_of_its_own_new_at_every_start(tmp_path):
    args = _args(tmp_path)
    state = tmp_path / "state"
    flags = _http_tokens(args, state)
    files = {svc: f[1] for svc, f in flags.items()}
    assert set(flags) == {"actor", "rollout", "reward-server", "reward"}
    assert all(f[0] == "--http-token-file" for f in flags.values())
    assert flags["rollout"][2:] == flags["reward"][2:] == ["--http-token-proof", "true"]   # the clients prove it
    assert len(flags["actor"]) == len(flags["reward-server"]) == 2
    assert files["actor"] == files["rollout"] != files["reward-server"] == files["reward"]
    first = {name: (state / "secrets" / name).read_text() for name in HTTP_TOKENS}
    assert first["http-generate"] != first["http-score"] and all(len(t.strip()) >= 32 for t in first.values())
    for name in HTTP_TOKENS:
        assert (state / "secrets" / name).stat().st_mode & 0o077 == 0
    assert (state / "secrets").stat().st_mode & 0o077 == 0
    _http_tokens(args, state)
    assert all((state / "secrets" / name).read_text() != first[name] for name in HTTP_TOKENS)
    assert _http_tokens(_args(tmp_path, insecure=True), state) == {}


def test_up_says_whom_its_stack_lets_in(tmp_path):
    from steadyrl.cli.up import _closed_line

    secure = _closed_line(_args(tmp_path), tmp_path / "s", {"actor": []}, 0.4)
    assert secure.startswith("closed: Kafka logins per service") and "(0.40 s)" in secure
    assert "KAFKA__PASSWORD_FILE=" in secure
    given = _closed_line(_args(tmp_path, bootstrap="x:1"), None, {"actor": []}, 0.1)
    assert given.startswith("closed: /generate and /score") and "the cluster at --bootstrap as it is" in given
    assert "any process on this host" in _closed_line(_args(tmp_path, insecure=True), None, {}, 0.0)
