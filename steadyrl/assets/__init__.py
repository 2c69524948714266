"""Files steadyrl reads at run time, shipped inside the package, and the user cache beside it.

The checkout keeps them at its top (`schemas/`, `data/`, `configs/`, `broker/`); this folder
links to each (`steadyrl/assets/schemas -> ../../schemas`, ...), so an editable install reads the
checkout's files and a wheel carries a copy (pyproject's package-data names them).
`asset_dir(name)` finds one through importlib.resources, wherever steadyrl is installed.

What steadyrl downloads or generates (the broker's jars, converted models) goes to
`user_cache_dir()`, never into these folders: an installed package may be read-only, and
shared by every user of its environment.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

#: The shipped folders: name -> what it holds.
ASSETS = {"schemas": "JSON Schemas of the contracts and the topic catalogue (topics.yaml)",
          "data": "the default data set (arithmetic/: verl parquet files)",
          "configs": "stack configs (tiny.yaml)",
          "broker": "the embedded broker's Maven manifest (pom.xml) and log4j2.properties"}


def asset_dir(name: str) -> Path:
    """The folder of the shipped `name` (one of ASSETS) as a file system path.

    Raises ValueError for an unknown name, RuntimeError when steadyrl is installed somewhere
    that is not a folder (a zip file): the broker and Maven need real paths.
    """
    if name not in ASSETS:
        raise ValueError(f"no asset folder {name!r}; one of {', '.join(ASSETS)}")
    folder = importlib.resources.files(__name__) / name
    if not isinstance(folder, Path):
        raise RuntimeError(f"steadyrl's {name} files are not in a folder ({folder!r}): install steadyrl unzipped")
    return folder


def user_cache_dir() -> Path:
    """Where steadyrl keeps what it downloads or generates: `$STEADYRL_CACHE`, else
    `$XDG_CACHE_HOME/steadyrl`, else `~/.cache/steadyrl` (created by whoever writes there)."""
    if os.environ.get("STEADYRL_CACHE"):
        return Path(os.environ["STEADYRL_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "steadyrl"
