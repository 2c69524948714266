import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class StrictSection(Section):
    model_config = ConfigDict(extra="forbid")


class StrictCfg(ServiceConfig):
    svc: StrictSection | None = None


def test_an_unknown_key_gets_the_closest_field_and_the_file_is_named(tmp_path):
    """The walk-through's `learner.max_new_token: Extra inputs are not permitted` named neither
    the field meant nor the file."""
    f = tmp_path / "mine.yaml"
    f.write_text("svc:\n  batch_sise: 3\n  wholly_unlike: 1\nsvcc: {}\n")
    with pytest.raises(ConfigError) as exc:
        load(StrictCfg, ["--config", str(f)])
    text = str(exc.value)
    assert text.splitlines()[0] == f"invalid StrictCfg (config file {f}):"
    assert "  svc.batch_sise: Extra inputs are not permitted (did you mean `batch_size`?)" in exc.value.lines
    assert "  svc.wholly_unlike: Extra inputs are not permitted" in exc.value.lines   # nothing close: no guess
    assert "  svcc: Extra inputs are not permitted (did you mean `svc`?)" in exc.value.lines


def test_a_misspelt_stack_section_suggests_the_section():
    from steadyrl.config import suggestion
    from steadyrl.services.learner.config import LearnerConfig
    from steadyrl.services.reward.worker import RewardConfig

    assert suggestion(RewardConfig, ("lerner",)) == " (did you mean `learner`?)"   # another service's section
    assert suggestion(LearnerConfig, ("learner", "max_new_token")) == " (did you mean `max_new_tokens`?)"
    assert suggestion(LearnerConfig, ("learner", "train", "clip_hihg")) == " (did you mean `clip_high`?)"
    assert suggestion(LearnerConfig, ("learner", "steps", "x")) == ""   # not a section: no guess


def test_a_verl_name_keeps_its_verl_hint(tmp_path):
    from steadyrl.services.learner.config import LearnerConfig

    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  n: 8\n")
    with pytest.raises(ConfigError) as exc:
        load(LearnerConfig, ["--config", str(f)])
    assert "learner.n: Extra inputs are not permitted (verl's `n`: steadyrl's is `learner.group_size`" in str(exc.value)
    assert "did you mean" not in str(exc.value)


def test_the_stack_check_says_each_error_once(tmp_path):
    """An unknown top-level section was reported by the reward server, the rollout and the reward
    workers, after the broker and services had started; steadyrl.local.configcheck reads the file as
    every service does, before anything starts, and says each error once."""
    from steadyrl.local import configcheck

    f = tmp_path / "c.yaml"
    f.write_text("lerner:\n  steps: 3\nlearner:\n  max_new_token: 8\n")
    assert configcheck.errors(str(f)) == [
        "  lerner: Extra inputs are not permitted (did you mean `learner`?)",
        "  learner.max_new_token: Extra inputs are not permitted (did you mean `max_new_tokens`?)"]
    f.write_text("learner:\n  steps: 3\n")
    assert configcheck.errors(str(f), {"learner": ["--learner.state-dir", str(tmp_path / "state")]}) == []


def test_a_relative_configs_path_is_the_shipped_copy_when_no_such_file_is_here(tmp_path, monkeypatch):
    """The walk-through's `--config configs/tiny.yaml` from a folder outside the checkout said
    "no such file", though the file ships with the package."""
    from steadyrl.assets import asset_dir
    from steadyrl.config import config_path
    from steadyrl.services.reward.worker import RewardConfig

    monkeypatch.chdir(tmp_path)
    shipped = asset_dir("configs") / "tiny.yaml"
    assert config_path("configs/tiny.yaml") == shipped
    assert config_path("configs/nosuch.yaml") == Path("configs/nosuch.yaml")   # the caller says it is missing
    assert config_path("tiny.yaml") == Path("tiny.yaml")                       # only configs/... is looked up
    assert load(RewardConfig, ["--config", "configs/tiny.yaml"]).reward.batch_size >= 1
    from steadyrl.api import Run

    assert Run(config="configs/tiny.yaml").settings["learner"]["model"] == "tiny"   # the README's example
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text("reward:\n  batch_size: 3\n")
    assert config_path("configs/tiny.yaml") == Path("configs/tiny.yaml")      # a file here wins
    assert load(RewardConfig, ["--config", "configs/tiny.yaml"]).reward.batch_size == 3


def test_up_takes_the_shipped_config_from_any_folder_and_says_so(tmp_path):
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--config", "configs/tiny.yaml", "--bootstrap",
                        "127.0.0.1:1", "--state-dir", str(tmp_path / "state"), "--port-offset", "31500"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cannot reach the Kafka broker at 127.0.0.1:1" in r.stderr, r.stdout + r.stderr
    assert "tiny.yaml (the copy steadyrl ships; no such file here)" in r.stdout
    missing = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--config", "configs/nosuch.yaml",
                              "--state-dir", str(tmp_path / "state")], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "--config configs/nosuch.yaml: no such file" in missing.stderr
    helped = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert "copy steadyrl ships" in " ".join(helped.stdout.split())
