"""docs/metrics.md lists exactly the metrics the services register (both ways)."""

import importlib
import pkgutil
import re

from tests.helpers import ROOT

CATALOGUE = ROOT / "docs" / "metrics.md"
PACKAGES = {"steadyrl": "steadyrl", "steadyrl.services": "services"}  # import name -> folder
OPTIONAL = ("vllm",)  # a module that needs an optional extra is skipped where it is missing
UNLISTED = re.compile(r"^(python_gc_|python_info)")


def catalogue() -> dict[str, str]:
    """metric name -> type, from the first two columns of the tables."""
    rows = re.findall(r"^\| `([a-z_:]+)` \| (counter|gauge|histogram) \|", CATALOGUE.read_text(), re.M)
    return dict(rows)


def all_modules() -> list[str]:
    """Every module of the project's packages (so a metric in a new module is not missed)."""
    mods = []
    for pkg, folder in PACKAGES.items():
        for info in pkgutil.walk_packages([str(ROOT / folder)], prefix=f"{pkg}."):
            if not info.name.endswith("__main__"):
                mods.append(info.name)
    return mods


def registered() -> dict[str, str]:
    from prometheus_client import REGISTRY

    for m in all_modules():
        try:
            importlib.import_module(m)
        except ImportError as e:
            if e.name is None or not e.name.startswith(OPTIONAL):
                raise
    from steadyrl.local import hardware

    hardware.register()
    out = {}
    for fam in REGISTRY.collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        if not UNLISTED.match(name):
            out[name] = fam.type
    return out


def test_every_registered_metric_is_in_the_catalogue_with_its_type():
    listed, have = catalogue(), registered()
    assert sorted(set(have) - set(listed)) == [], "registered but not in docs/metrics.md"
    assert {k: v for k, v in have.items() if listed.get(k) != v} == {}, "type differs from docs/metrics.md"


def test_every_catalogued_metric_is_registered():
    assert sorted(set(catalogue()) - set(registered())) == [], "in docs/metrics.md but no service registers it"


def test_counter_names_end_in_total_and_units_are_base_units():
    for name, kind in catalogue().items():
        assert (kind == "counter") == name.endswith("_total"), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)(_|$)", name), f"{name}: use base units"
