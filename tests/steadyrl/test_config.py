import subprocess
import sys

import pytest
from pydantic import BaseModel, Field, model_validator

from steadyrl.config import ConfigError, ServiceConfig, load
from tests.helpers import ROOT


class Section(BaseModel):
    batch_size: int = Field(4, ge=1)
    scorer: str = "numeric_match"


class Cfg(ServiceConfig):
    svc: Section = Section()


def test_precedence_defaults_yaml_env_cli(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("metrics_port: 7000\nmetrics_interval: 9\nsvc:\n  batch_size: 3\n  scorer: yaml\n")
    monkeypatch.setenv("STEADYRL_SVC__BATCH_SIZE", "5")
    monkeypatch.setenv("STEADYRL_BOOTSTRAP", "10.0.0.1:9092")
    cfg = load(Cfg, ["--config", str(f), "--metrics-port", "9100", "--svc.scorer", "cli"])
    assert cfg.metrics_port == 9100          # CLI beats YAML
    assert cfg.metrics_interval == 9         # YAML beats default
    assert cfg.svc.batch_size == 5           # env beats YAML
    assert cfg.svc.scorer == "cli"
    assert cfg.bootstrap == "10.0.0.1:9092"  # STEADYRL_BOOTSTRAP
    assert cfg.metrics_host == "127.0.0.1"   # loopback by default


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError) as exc:
        load(Cfg, ["--svc.batch-size", "0"])
    assert "svc.batch_size" in str(exc.value) and "greater than or equal to 1" in str(exc.value)


class Checked(BaseModel):
    low: int = 1
    high: int = 2

    @model_validator(mode="after")
    def _ordered(self):
        if self.high < self.low:
            raise ValueError(f"high {self.high} < low {self.low}")
        return self


class CheckedCfg(ServiceConfig):
    svc: Checked = Checked()


def test_a_check_across_fields_names_them_without_dumping_the_section():
    with pytest.raises(ConfigError) as exc:
        load(CheckedCfg, ["--svc.low", "5"])
    assert "svc: Value error, high 2 < low 5" in str(exc.value) and "got" not in str(exc.value)


def test_a_long_value_is_cut_to_200_characters():
    with pytest.raises(ConfigError) as exc:
        load(Cfg, ["--svc.batch-size", "x" * 1000])
    line = str(exc.value).splitlines()[-1]
    assert "(got 'xxx" in line and line.endswith("...)") and len(line) < 320


def test_unknown_yaml_key_names_it(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("metrics_prot: 1\n")
    with pytest.raises(ConfigError, match="metrics_prot"):
        load(Cfg, ["--config", str(f)])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load(Cfg, ["--config", "/nonexistent.yaml"])


def test_service_refuses_bad_config_at_start():
    r = subprocess.run([sys.executable, "-m", "steadyrl.services.reward", "--reward.batch-size", "-1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "reward.batch_size" in r.stderr


def test_malformed_yaml_is_a_config_error(tmp_path):
    import pytest

    from steadyrl.config import ConfigError, load
    from steadyrl.services.reward.worker import RewardConfig

    bad = tmp_path / "bad.yaml"
    bad.write_text("reward:\n  batch_size: [1\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load(RewardConfig, ["--config", str(bad)])


def test_a_config_error_never_echoes_what_may_be_a_secret(tmp_path, monkeypatch):
    """Regression: a misspelt secret's name (an unknown key) printed its value."""
    f = tmp_path / "c.yaml"
    f.write_text("dingtalk_secert: SECf00dcafe\nsvc:\n  batch_size: 0\n")
    with pytest.raises(ConfigError) as exc:
        load(Cfg, ["--config", str(f)])
    msg = str(exc.value)
    assert "dingtalk_secert" in msg and "SECf00dcafe" not in msg
    assert "svc.batch_size" in msg and "(got 0)" in msg     # an ordinary value is still shown


def test_http_token_file_is_read_and_checked_at_start(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc123\n")
    cfg = load(Cfg, ["--http-token-file", str(token)])
    assert cfg.http_token() == "abc123" and cfg.http_auth_headers() == {"Authorization": "Bearer abc123"}
    assert load(Cfg, []).http_auth_headers() == {}
    for bad, why in ((tmp_path / "missing", "cannot read the token file"), (tmp_path / "empty", "empty")):
        if bad.name == "empty":
            bad.write_text("  \n")
        with pytest.raises(ConfigError) as exc:
            load(Cfg, ["--http-token-file", str(bad)])
        assert "http_token_file" in str(exc.value) and why in str(exc.value)
        assert "abc123" not in str(exc.value)


def test_a_count_of_tokens_is_shown_but_a_token_is_not():
    """Regression: every field with "token" in its name hid its value, so
    `--learner.max-new-tokens 0` said only "greater than or equal to 1", not "(got '0')"."""
    from steadyrl.services.learner.config import LearnerConfig
    from steadyrl.services.rollout.worker import RolloutConfig

    with pytest.raises(ConfigError) as exc:
        load(LearnerConfig, ["--learner.max-new-tokens", "0"])
    assert "learner.max_new_tokens" in str(exc.value) and "(got '0')" in str(exc.value)   # a flag: a string
    with pytest.raises(ConfigError) as exc:
        load(RolloutConfig, ["--rollout.max-response-tokens", "0"])
    assert "(got '0')" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load(Cfg, ["--http-token-file", "/nonexistent/s3cr3t-token"])
    assert "s3cr3t" not in str(exc.value)      # a token file's path is still not echoed
