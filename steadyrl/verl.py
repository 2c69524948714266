"""verl's config names, in steadyrl's: `steadyrl up --from-verl FILE.yaml`, and the hint a config
error gives when an unknown key is a verl name (docs/verl.md has the table).

    cfg, notes = translate(yaml.safe_load(open("ppo_trainer.yaml")))   # steadyrl's sections
    hint(("actor_rollout_ref",))   # "a verl section: ..."

Only what both mean the same is mapped (`VERL_KEYS`); a verl key without an equal here is listed
in the notes, never guessed. Values that differ in spelling are converted (`adv_estimator: gae`
is steadyrl's `ppo`; `rollout.name: hf` is the `torch` actor). One model setting in verl is two
here (actor and learner) and one reward function is three (the reward server's scorers and
default, the learner's evaluation): `translate` sets them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

#: verl dotted key -> steadyrl dotted keys (all set to the value)
VERL_KEYS: dict[str, tuple[str, ...]] = {
    "data.train_files": ("learner.data",),
    "data.val_files": ("learner.eval_data",),
    "data.train_batch_size": ("learner.prompts_per_step",),
    "data.max_response_length": ("learner.max_new_tokens",),
    "data.seed": ("learner.seed",),
    "actor_rollout_ref.model.path": ("actor.model", "learner.model"),
    "actor_rollout_ref.rollout.name": ("actor.backend",),
    "actor_rollout_ref.rollout.n": ("learner.group_size",),
    "actor_rollout_ref.rollout.temperature": ("learner.train.temperature",),
    "actor_rollout_ref.rollout.top_p": ("learner.top_p",),
    "actor_rollout_ref.actor.optim.lr": ("learner.train.lr",),
    "actor_rollout_ref.actor.optim.weight_decay": ("learner.train.weight_decay",),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("learner.train.warmup_steps",),
    "actor_rollout_ref.actor.optim.warmup_style": ("learner.train.lr_schedule",),
    "actor_rollout_ref.actor.ppo_epochs": ("learner.train.ppo_epochs",),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("learner.train.mini_batch_size",),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("learner.train.micro_batch_size",),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("learner.train.max_tokens_per_micro_batch",),
    "actor_rollout_ref.actor.grad_clip": ("learner.train.max_grad_norm",),
    "actor_rollout_ref.actor.clip_ratio_low": ("learner.train.clip_low",),
    "actor_rollout_ref.actor.clip_ratio_high": ("learner.train.clip_high",),
    "actor_rollout_ref.actor.clip_ratio_c": ("learner.train.clip_ratio_c",),
    "actor_rollout_ref.actor.loss_agg_mode": ("learner.train.loss_agg",),
    "actor_rollout_ref.actor.entropy_coeff": ("learner.train.entropy_coeff",),
    "actor_rollout_ref.actor.use_kl_loss": ("learner.train.use_kl_loss",),
    "actor_rollout_ref.actor.kl_loss_coef": ("learner.train.kl_coef",),
    "actor_rollout_ref.actor.kl_loss_type": ("learner.train.kl_estimator",),
    "algorithm.adv_estimator": ("learner.train.algorithm",),
    "algorithm.gamma": ("learner.train.gamma",),
    "algorithm.lam": ("learner.train.lam",),
    "algorithm.norm_adv_by_std_in_grpo": ("learner.train.norm_adv_by_std",),
    "algorithm.use_kl_in_reward": ("learner.train.kl_in_reward",),
    "algorithm.kl_ctrl.kl_coef": ("learner.train.kl_coef",),
    "trainer.total_training_steps": ("learner.steps",),
    "trainer.save_freq": ("learner.checkpoint_every",),
    "trainer.logger": ("learner.trackers",),
    "trainer.default_local_dir": ("learner.state_dir",),
    "custom_reward_function.path": ("reward_server.default_scorer",),   # with .name: see translate
    "custom_reward_function.name": ("reward_server.default_scorer",),
}

#: verl values spelt otherwise here, by verl key
VALUES: dict[str, Callable[[Any], Any]] = {
    "algorithm.adv_estimator": lambda v: {"gae": "ppo"}.get(v, v),
    "actor_rollout_ref.rollout.name": lambda v: {"hf": "torch"}.get(v, v),
    "trainer.logger": lambda v: [v] if isinstance(v, str) else list(v),
    "actor_rollout_ref.actor.kl_loss_type": lambda v: {"kl": "k1", "mse": "k2"}.get(v, v),
}

#: verl's top-level sections
SECTIONS = frozenset(k.split(".", 1)[0] for k in VERL_KEYS) | {"critic", "reward_model", "ray_init"}


def _flat(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flat(v, key + ".")
        else:
            yield key, v


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
    cfg[leaf] = value


def translate(verl: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """steadyrl's config (sections actor, learner, reward_server) from a verl config dict, and
    notes: what was mapped (`verl.key -> steadyrl.key = value`) and each verl key left out with
    why. `None` values (verl's "unset") are left out. data.train_files and data.val_files may list
    several files, as steadyrl's learner.data and learner.eval_data do (one file: that file)."""
    cfg: dict[str, Any] = {}
    notes: list[str] = []
    flat = dict(_flat(verl))
    reward_path = flat.pop("custom_reward_function.path", None)
    reward_name = flat.pop("custom_reward_function.name", None) or "compute_score"
    for key, value in flat.items():
        if key == "actor_rollout_ref.actor.ppo_mini_batch_size":
            continue   # below: times rollout.n
        if key not in VERL_KEYS:
            notes.append(f"left out: {key} (no steadyrl equal; docs/verl.md)")
            continue
        if value is None:
            continue
        value = VALUES.get(key, lambda v: v)(value)
        if key in ("data.train_files", "data.val_files") and isinstance(value, list) and len(value) == 1:
            value = value[0]
        for target in VERL_KEYS[key]:
            _set(cfg, target, value)
            notes.append(f"{key} -> {target} = {value!r}")
    if "learner" in cfg and {"data", "eval_data"} & set(cfg["learner"]):
        _set(cfg, "learner.eval_splits", {})   # the default harder splits are steadyrl's arithmetic set's
    mini = flat.get("actor_rollout_ref.actor.ppo_mini_batch_size")
    if mini is not None:   # verl counts prompts and multiplies by rollout.n; steadyrl counts sequences
        n = flat.get("actor_rollout_ref.rollout.n") or 1
        _set(cfg, "learner.train.mini_batch_size", mini * n)
        notes.append(f"actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n -> learner.train.mini_batch_size "
                     f"= {mini * n} (verl counts prompts, steadyrl sequences)")
    if reward_path:
        spec = f"{reward_path}:{reward_name}"
        for target in ("reward_server.default_scorer", "learner.eval_scorer"):
            _set(cfg, target, spec)
            notes.append(f"custom_reward_function -> {target} = {spec!r}")
        _set(cfg, "reward_server.scorers", [spec])
    return cfg, notes


def hint(loc: tuple[str | int, ...]) -> str:
    """The hint for an unknown config key at `loc` (a pydantic error location) when it is a
    verl name, else "": a verl section, or a leaf spelt as verl spells one of ours."""
    if not loc:
        return ""
    names = [str(p) for p in loc]
    if names[0] in SECTIONS:
        return (" (a verl section: `steadyrl up --from-verl FILE.yaml` translates a verl config; "
                "docs/verl.md maps each key)")
    leaf = names[-1]
    if leaf in ("path", "name"):   # custom_reward_function's, too generic to point anywhere
        return ""
    ours = sorted({t for k, ts in VERL_KEYS.items() if k.rsplit(".", 1)[-1] == leaf for t in ts})
    if ours:
        return f" (verl's `{leaf}`: steadyrl's is {' / '.join(f'`{t}`' for t in ours)}; docs/verl.md)"
    return ""
