"""The configuration `steadyrl up` runs, made from its flags before anything starts: a verl
config translated (`--from-verl`), the own-things flags (`--model`, `--data`, `--eval-data`,
`--reward`, `--steps`, or the same top-level keys of the config file) written over the config,
and the whole checked as each service will read it (`check_config`)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from steadyrl.cli.common import CliError
from steadyrl.local.stack import PolicyModel


def _from_verl(verl_file: Path, state: Path, config: str | None) -> Path:
    """Translate a verl config (steadyrl/verl.py) into `<state>/from-verl.yaml`, print what
    was mapped and left out, and return that file (`up` then runs it as --config). Raises
    CliError (2) for a missing or unreadable file, or --config given too."""
    import yaml  # lazy: only --from-verl reads YAML here

    from steadyrl import verl  # lazy: only --from-verl needs the mapping

    if config:
        raise CliError("--from-verl and --config: give one (the translated file can be edited and given as "
                       "--config)", 2)
    try:
        cfg, notes = verl.translate(yaml.safe_load(verl_file.read_text()) or {})
    except (OSError, yaml.YAMLError, ValueError, AttributeError) as e:
        raise CliError(f"--from-verl {verl_file}: {type(e).__name__}: {e}", 2) from None
    out = state / "from-verl.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# translated from {verl_file} by `steadyrl up --from-verl` (docs/verl.md)\n"
                   + yaml.safe_dump(cfg, sort_keys=False))
    print(f"verl config {verl_file} -> {out}:", flush=True)
    for note in notes:
        print(f"  {note}", flush=True)
    return out


#: up's own-things flags, which a config may also give as top-level keys (`model: ./my-model`).
OWN_THINGS = ("model", "data", "eval_data", "reward", "steps", "tools", "env")


def _own_things_in(config: str | None) -> bool:
    """Whether the YAML file `config` has a top-level key of OWN_THINGS (False when it has none,
    or cannot be read: the config check says why)."""
    if not config:
        return False
    import yaml  # lazy: only a config file given reads YAML here

    try:
        cfg = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and any(_own(cfg, k) for k in OWN_THINGS)


def _own(cfg: dict[str, Any], key: str) -> bool:
    """Whether top-level `key` of a config is an own thing: not a mapping (`reward:` as a mapping
    is the reward workers' section, not the reward)."""
    return key in cfg and cfg[key] is not None and not isinstance(cfg[key], dict)


def _own_things(args: argparse.Namespace) -> Path:
    """--model, --data, --eval-data, --reward, --steps (or the same top-level keys of the config
    file; a flag wins) over the config (or the defaults), each set everywhere it is read (the
    model: actor and learner; the reward: the reward server's scorers and default, the learner's
    evaluation), written to `<state-dir>/up-config.yaml`, which is returned. Data without eval
    data turns the evaluation off (the arithmetic test set says nothing of another dataset), and
    says so. Raises CliError (2): unreadable config."""
    import yaml  # lazy: only these flags read YAML here

    try:
        cfg = (yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else {}
    except (OSError, yaml.YAMLError) as e:
        raise CliError(f"--config {args.config}: {type(e).__name__}: {e}", 2) from None
    for key in OWN_THINGS:   # top-level keys of the file, as the flags
        value = cfg.pop(key) if key in cfg and not isinstance(cfg[key], dict) else None   # a mapping stays
        if value is not None and getattr(args, key, None) is None:
            setattr(args, key, [str(v) for v in value] if key in ("data", "eval_data") and isinstance(value, list)
                    else [str(value)] if key in ("data", "eval_data") else value)
    learner = cfg.setdefault("learner", {})
    if args.model is not None:
        cfg.setdefault("actor", {})["model"] = learner["model"] = args.model
    if args.data is not None:   # several files: one dataset, their rows in the order given
        learner["data"] = args.data[0] if len(args.data) == 1 else args.data
        if args.eval_data is None:
            learner["eval_data"] = None
            print("evaluation: none (--data without --eval-data; give --eval-data FILE to evaluate on your "
                  "own held-out rows)", flush=True)
    if args.eval_data is not None:
        learner["eval_data"] = args.eval_data[0] if len(args.eval_data) == 1 else args.eval_data
    if args.data is not None or args.eval_data is not None:
        learner.setdefault("eval_splits", {})   # the default harder splits are the arithmetic set's
    if args.reward is not None:
        server = cfg.setdefault("reward_server", {})
        server["scorers"] = [args.reward]
        server["default_scorer"] = learner["eval_scorer"] = args.reward
    if args.steps is not None:
        learner["steps"] = args.steps
    _agent(cfg, args)
    out = Path(args.state_dir) / "up-config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# written by `steadyrl up` from {args.config or 'the defaults'} and its flags\n"
                   + yaml.safe_dump(cfg, sort_keys=False))
    return out


def _agent(cfg: dict[str, Any], args: argparse.Namespace) -> None:
    """--tools / --env (docs/agents.md): the rollout workers' multi-turn episodes, with the
    actor's model for their tokenizer (unless the config names one)."""
    tools, env = getattr(args, "tools", None), getattr(args, "env", None)
    agent = cfg.get("rollout", {}).get("agent") if isinstance(cfg.get("rollout"), dict) else None
    if tools is None and env is None and not isinstance(agent, dict):
        return
    agent = cfg.setdefault("rollout", {}).setdefault("agent", {})
    if tools is not None or env is not None:   # a flag replaces the config's other shape
        agent.pop("env" if tools is not None else "tools", None)
        agent.update({"tools": tools} if tools is not None else {"env": env})
    if args.model is not None or not agent.get("model"):   # the actor's tokenizer, always
        agent["model"] = str(cfg.get("actor", {}).get("model") or PolicyModel().model)


def check_config(config: str | None, flags: dict[str, list[str]], source: str | None = None) -> None:
    """Check the configuration as every service will read it (steadyrl.local.configcheck, in a process
    of its own: the learner's config imports torch), before anything starts. Raises CliError
    (2) with one line per error, each once (an unknown section is not reported by every
    service). When the check itself cannot run, says so and returns: each service still
    checks its own at start. `source`: what `config` was written from (`up`'s own-things or
    --from-verl file), named in the error instead."""
    cmd = [sys.executable, "-m", "steadyrl.local.configcheck", config or "", json.dumps(flags)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"configuration not checked before the start ({type(e).__name__}: {e}); each service checks its "
              f"own", flush=True)
        return
    if r.returncode == 2 and r.stdout.strip():
        where = source or (f"config file {config}" if config else "the defaults")
        raise CliError(f"invalid configuration ({where}, STEADYRL_* over it):\n{r.stdout.rstrip()}", 2)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"configuration not checked before the start (the check exited with {r.returncode}: {last}); "
              f"each service checks its own", flush=True)
