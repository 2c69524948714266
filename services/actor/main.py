"""The actor service: `POST /generate` (routes.py) over the model (model.py), serving the
policy versions the follower (follower.py) loads from `rl.policy`, behind the version gate
(gate.py). Stateless: a restarted actor rebuilds everything from the model name and
`rl.policy`.

    python -m steadyrl.services.actor --config steadyrl.yaml
"""

from __future__ import annotations

import threading

from steadyrl.config import load
from steadyrl.http import Health
from steadyrl.service import Loop, run_service

from .config import ActorConfig
from .follower import PolicyFollower, ServedVersion
from .model import ServedModel
from .routes import Generation, add_routes


def main(argv: list[str]) -> int:
    """Run the actor with the config from `argv` until SIGTERM/SIGINT. Returns the exit status
    (2: a configuration error; 1: the follower failed, e.g. a dead vLLM engine)."""
    cfg = load(ActorConfig, argv, prog="steadyrl-actor")
    built: dict[str, Generation] = {}

    def build(health: Health) -> Loop:
        model = ServedModel(cfg.actor)
        served = ServedVersion(model, cfg.actor.policy_root)
        built["generation"] = Generation(cfg.actor, model, served)
        health.add_check("model", lambda: (True, f"{cfg.actor.model} loaded"))
        health.add_check("policy", lambda: (served.caught_up, f"serving run {served.run_id!r} version {served.version}"
                                            if served.caught_up else "reading rl.policy"))
        follower = PolicyFollower(served, cfg)

        class FollowerLoop:
            def run(self, stop: threading.Event) -> None:
                try:
                    follower.run(stop, health)
                finally:
                    model.close()

        return FollowerLoop()

    return run_service("actor", cfg, build, extra_routes=lambda app: add_routes(
        app, cfg.actor, lambda: built.get("generation"), token=cfg.http_token()))
