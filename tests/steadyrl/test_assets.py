"""The files steadyrl ships (steadyrl/assets) and where what it fetches goes (the user cache)."""

import pytest

from steadyrl.assets import ASSETS, asset_dir, user_cache_dir
from steadyrl.local import jars
from steadyrl.model.data import DATA_DIR, dataset_path
from tests.helpers import ROOT


def test_each_asset_folder_is_the_checkouts_folder_of_that_name():
    for name in ASSETS:
        assert asset_dir(name).resolve() == (ROOT / name).resolve(), name
    with pytest.raises(ValueError, match="no asset folder"):
        asset_dir("libs")


def test_user_cache_dir_is_steadyrl_cache_else_xdg_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STEADYRL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "steadyrl"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")   # the XDG spec: a relative path is ignored
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "steadyrl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "steadyrl"
    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path / "mine"))
    assert user_cache_dir() == tmp_path / "mine"


def test_broker_jars_go_to_the_user_cache_per_manifest(monkeypatch, tmp_path):
    monkeypatch.delenv("STEADYRL_KAFKA_LIBS", raising=False)
    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path))
    libs = jars.libs_dir()
    assert libs.parent.parent == tmp_path / "broker" and libs.name == "libs"
    assert libs.parent.name.startswith("4.") and not libs.is_relative_to(jars.BROKER_DIR.resolve())
    monkeypatch.setenv("STEADYRL_KAFKA_LIBS", str(tmp_path / "jars"))
    assert jars.libs_dir() == tmp_path / "jars"


def test_a_relative_data_path_is_the_working_folders_else_the_shipped_copy(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert dataset_path("data/arithmetic/train.parquet") == DATA_DIR / "arithmetic" / "train.parquet"
    assert dataset_path("data/arithmetic/nope.parquet").as_posix() == "data/arithmetic/nope.parquet"
    assert dataset_path("other/train.parquet").as_posix() == "other/train.parquet"
    (tmp_path / "data" / "arithmetic").mkdir(parents=True)
    (tmp_path / "data" / "arithmetic" / "train.parquet").write_bytes(b"")
    assert dataset_path("data/arithmetic/train.parquet").as_posix() == "data/arithmetic/train.parquet"
