"""docs/metrics.md lists exactly the metrics the services register (both ways)."""

import importlib
import re

from steadyrl.broker import PROJECT_ROOT

CATALOGUE = PROJECT_ROOT / "docs" / "metrics.md"
SERVICE_MODULES = ["services.learner.learner", "services.learner.prompt_gate", "services.reward.client",
                   "services.reward.server", "services.reward.worker", "services.rollout.worker",
                   "services.rollout.gate", "services.actor.server", "services.alertbridge.bridge",
                   "steadyrl.bus.stage", "steadyrl.bus.kafka"]
UNLISTED = re.compile(r"^(python_gc_|python_info)")


def catalogue() -> dict[str, str]:
    """metric name -> type, from the first two columns of the tables."""
    rows = re.findall(r"^\| `([a-z_:]+)` \| (counter|gauge|histogram) \|", CATALOGUE.read_text(), re.M)
    return dict(rows)


def registered() -> dict[str, str]:
    from prometheus_client import REGISTRY

    for m in SERVICE_MODULES:
        importlib.import_module(m)
    from steadyrl import hardware

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
