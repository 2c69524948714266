"""A stack's configuration checked as every service `steadyrl up` starts reads it, before
anything starts: each service's config class (steadyrl.config.load) on the same `--config`
file, environment and the flags `up` gives it. An error several services find (an unknown
top-level section, a bad shared field) is said once.

`up` runs this as `python -m steadyrl.local.configcheck CONFIG FLAGS_JSON` (exit 2 and one line per
error on stdout), so the services' imports (torch, for the learner's config) stay out of its own
long-lived process.
"""

from __future__ import annotations

import importlib
import json
import sys

from steadyrl.config import ConfigError, ServiceConfig, load

#: The config class of each service `steadyrl up` starts: service -> (module, class).
CONFIGS = {"reward-server": ("steadyrl.services.reward.server", "RewardServerConfig"),
           "actor": ("steadyrl.services.actor.config", "ActorConfig"),
           "rollout": ("steadyrl.services.rollout.worker", "RolloutConfig"),
           "reward": ("steadyrl.services.reward.worker", "RewardConfig"),
           "learner": ("steadyrl.services.learner.config", "LearnerConfig")}


def config_class(service: str) -> type[ServiceConfig]:
    """The config class of `service` (a key of CONFIGS), imported."""
    module, name = CONFIGS[service]
    cls: type[ServiceConfig] = getattr(importlib.import_module(module), name)
    return cls


def errors(config: str | None, flags: dict[str, list[str]] | None = None) -> list[str]:
    """Each error of the stack's configuration (`config`, a YAML file, or None: the defaults;
    and STEADYRL_*), one line each (`  section.field: message`), in the order the services
    find them, each once; [] when every service loads it. `flags`: service -> the flags `up`
    gives it (its state folder, its peers' addresses)."""
    said: dict[str, None] = {}
    for service in CONFIGS:
        argv = (["--config", config] if config else []) + list((flags or {}).get(service, []))
        try:
            load(config_class(service), argv)
        except ConfigError as e:
            said.update(dict.fromkeys(e.lines))
    return list(said)


def main(argv: list[str]) -> int:
    """`CONFIG FLAGS_JSON` (CONFIG "" for none): print each error; exit 2 when there is one."""
    config, flags = argv[0] or None, json.loads(argv[1]) if len(argv) > 1 else {}
    lines = errors(config, flags)
    for line in lines:
        print(line)  # noqa: T201  - read by `steadyrl up`
    return 2 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
