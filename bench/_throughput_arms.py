"""The in-process arms of bench/throughput.py, each run in its own process:

    .venv/bin/python bench/_throughput_arms.py loop --config CFG.yaml --out OUT.json [--min-seconds S]
    bench/.venv-trl/bin/python bench/_throughput_arms.py trl --config CFG.yaml --out OUT.json [--min-seconds S]

`loop`: steadyrl's in-process reference loop (`steadyrl.rl.loop.run_loop`).
`trl`: TRL's GRPOTrainer with the settings that match the loop (see `trl_settings`).

Both take the learner section of a steadyrl YAML config (model, data, steps, B, G,
max_new_tokens, train.*), build the same tiny model with the same seed, and time every step
(wall clock at each step's end). With --min-seconds, the whole N-step run is repeated (fresh
model, same seed) until the runs together took that long, so that an arm much faster than
the others is still measured over a long enough stretch. Writes one JSON object.
"""

from __future__ import annotations

import time

T_PROCESS = time.time()  # before the heavy imports: the end-to-end figure counts them

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _learner_section(path: str) -> dict:
    """The learner section of the stack config at `path`, with `scorer`: the reward server's
    default scorer there (numeric_match, the server's default, when the file names none)."""
    import yaml

    cfg = yaml.safe_load(Path(path).read_text())
    return {**cfg["learner"], "scorer": (cfg.get("reward_server") or {}).get("default_scorer", "numeric_match")}


def _versions(*names: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def arm_loop(lc: dict, min_seconds: float) -> dict:
    import torch

    t_imported = time.time()
    from steadyrl.model.models import load_policy
    from steadyrl.rl.loop import LoopConfig, run_loop
    from steadyrl.rl.trainer import TrainConfig
    from steadyrl.services.learner.config import load_dataset

    rows = load_dataset(lc["data"])
    runs, spent = [], 0.0
    while not runs or spent < min_seconds:
        t0 = time.time()
        model, tok = load_policy(lc.get("model", "tiny"), seed=lc.get("seed", 0))
        cfg = LoopConfig(steps=lc["steps"], prompts_per_step=lc["prompts_per_step"], group_size=lc["group_size"],
                         max_new_tokens=lc["max_new_tokens"], scorer=lc["scorer"], seed=lc.get("seed", 0),
                         train=TrainConfig(**lc["train"]))
        ends: list[float] = []
        t_loop = time.time()
        hist = run_loop(model, tok, rows, cfg, on_step=lambda s, m, ends=ends: ends.append(time.time()))
        t_end = time.time()
        runs.append({
            "setup_s": t_loop - t0, "loop_s": t_end - t_loop, "step_end": ends, "t_start": t_loop,
            "tokens": [int(round(h["response_length/mean"] * lc["prompts_per_step"] * lc["group_size"]))
                       if "response_length/mean" in h else None for h in hist],
            "reward": [h["critic/score/mean"] for h in hist],
            "phase_s": {k: [h[k] for h in hist] for k in ("timing_s/gen", "timing_s/reward", "timing_s/train_step")
                        if k in hist[0]},
        })
        spent += t_end - t_loop
    return {"arm": "loop", "import_s": t_imported - T_PROCESS, "runs": runs,
            "torch_threads": torch.get_num_threads(), "versions": _versions("torch", "transformers")}


def trl_settings(lc: dict) -> dict:
    """GRPOConfig arguments that match steadyrl's TrainConfig / LoopConfig for `lc`. TrainConfig's
    autocast bf16 maps to TRL's own `bf16=True` (accelerate's bf16 mixed precision: the model's
    forward wrapped in torch.autocast, fp32 master weights). Not quite the same lever: TRL
    generates with that wrapped model, so its generation runs under autocast too, while
    steadyrl's autocast covers only the update."""
    tc = lc["train"]
    B, G = lc["prompts_per_step"], lc["group_size"]
    return {
        "output_dir": "unused", "max_steps": lc["steps"], "seed": lc.get("seed", 0),
        "per_device_train_batch_size": B * G, "gradient_accumulation_steps": 1, "steps_per_generation": 1,
        "num_generations": G, "num_iterations": 1, "max_completion_length": lc["max_new_tokens"],
        "temperature": tc.get("temperature", 1.0), "top_p": lc.get("top_p", 1.0), "top_k": 0,
        "learning_rate": tc["lr"], "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
        "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "optim": "adamw_torch",
        "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2, "loss_type": "dapo", "scale_rewards": "group",
        "use_vllm": False, "use_cpu": True, "bf16": tc.get("autocast", "off") == "bf16", "fp16": False,
        "report_to": "none", "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
        "log_completions": False, "dataloader_num_workers": 0, "shuffle_dataset": True, "remove_unused_columns": False,
    }


def arm_trl(lc: dict, min_seconds: float) -> dict:
    import torch

    t_imported0 = time.time()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from steadyrl.model.data import encode_prompt
    from steadyrl.model.models import load_policy
    from steadyrl.model.rewards import resolve_scorer, score_value
    from steadyrl.services.learner.config import load_dataset

    t_imported = time.time()
    scorer = resolve_scorer(lc["scorer"])
    rows = load_dataset(lc["data"])
    _, tok0 = load_policy(lc.get("model", "tiny"), seed=lc.get("seed", 0))
    prompts = [tok0.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False) for r in rows]
    # the same token ids as the loop's chat encoding (the tiny tokenizer adds no BOS)
    assert tok0(prompts[0])["input_ids"] == encode_prompt(tok0, rows[0]), (prompts[0], tok0(prompts[0]))
    data = Dataset.from_list([{"prompt": p, "ground_truth": r.ground_truth, "data_source": r.data_source}
                              for p, r in zip(prompts, rows, strict=True)])

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.time())

    runs, spent = [], 0.0
    while not runs or spent < min_seconds:
        t0 = time.time()
        model, tok = load_policy(lc.get("model", "tiny"), seed=lc.get("seed", 0))
        per_step_tokens: list[int] = []
        per_step_reward: list[float] = []

        def reward(prompts, completions, completion_ids, ground_truth, data_source,
                   _tokens=per_step_tokens, _rewards=per_step_reward, **kw):
            out = [score_value(scorer(ds, c, gt))[0]
                   for c, gt, ds in zip(completions, ground_truth, data_source, strict=True)]
            _tokens.append(sum(len(ids) for ids in completion_ids))
            _rewards.append(sum(out) / len(out))
            return out

        clock = Clock()
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], train_dataset=data,
                              args=GRPOConfig(**trl_settings(lc)), callbacks=[clock])
        t_loop = time.time()
        trainer.train()
        t_end = time.time()
        runs.append({"setup_s": t_loop - t0, "loop_s": t_end - t_loop, "step_end": clock.ends, "t_start": t_loop,
                     "tokens": per_step_tokens, "reward": per_step_reward})
        spent += t_end - t_loop
        del trainer
    return {"arm": "trl", "import_s": t_imported - T_PROCESS, "import_trl_s": t_imported - t_imported0,
            "runs": runs, "torch_threads": torch.get_num_threads(), "settings": trl_settings(lc),
            "versions": _versions("trl", "torch", "transformers", "accelerate", "datasets")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arm", choices=["loop", "trl"])
    ap.add_argument("--config", required=True, help="steadyrl YAML; its learner section is used")
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-seconds", type=float, default=0.0,
                    help="repeat the N-step run until the runs took this long together")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lc = _learner_section(args.config)
    res = (arm_loop if args.arm == "loop" else arm_trl)(lc, args.min_seconds)
    res["process_wall_s"] = time.time() - T_PROCESS
    Path(args.out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
