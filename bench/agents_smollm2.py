"""SmolLM2-135M-Instruct with a calculator tool: GRPO through `steadyrl up --tools`, three seeds.

    .venv/bin/python bench/agents_smollm2.py data --out DIR        # train.jsonl (200), test.jsonl (40)
    .venv/bin/python bench/agents_smollm2.py train --dir DIR --seeds 0 1 2 --steps 12
    .venv/bin/python bench/agents_smollm2.py report --dir DIR      # evaluates, writes the JSON

`data` writes multiplications of a 3-digit by a 2-digit number (ground truth: the product), as
verl records whose prompt starts with one example call (SHOT). `train` runs `steadyrl up
--model smollm2-135m-instruct --tools examples/agents/calculator.py:calc --reward numeric_match`
once per seed (state folder
DIR/seed<k>) and exports the last policy to DIR/seed<k>/model. `report` runs the same
multi-turn episodes greedily, in process, on the held-out rows for the base model and each
seed's exported weights: the worker's code (steadyrl.model.agents: the tools' system message,
the first turn's ids, tool-call parsing, the tool results' ids appended, never re-tokenized;
the actor's TorchGenerator at temperature 0) and the run's reward (numeric_match on the final
answer). It reports accuracy, the share of episodes with at least one well-formed tool call,
calls per episode, and the mean and spread over seeds, into
bench/results/agents_smollm2_<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOOLS = "examples/agents/calculator.py:calc"
QUESTION = "What is {a} * {b}? Use the calc tool, then reply with only the final number."
#: One example call before each question: SmolLM2-135M writes no `<tool_call>` without one (0 of
#: 40 greedy answers). A dataset row may not hold a `tool` message, so the example stops at the call.
SHOT = [{"role": "user", "content": QUESTION.format(a=214, b=37)},
        {"role": "assistant", "content": '<tool_call>\n{"name": "calc", "arguments": {"expression": "214 * 37"}}\n'
                                         '</tool_call>'}]


def make_data(out: Path, n_train: int = 200, n_test: int = 40, seed: int = 48) -> None:
    """DIR/train.jsonl and DIR/test.jsonl: distinct a * b, a in [100, 999], b in [10, 99]."""
    r = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n_train + n_test:
        p = (r.randint(100, 999), r.randint(10, 99))
        if p not in pairs:
            pairs.append(p)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"data_source": "calc_mul", "prompt": [*SHOT, {"role": "user", "content": QUESTION.format(a=a, b=b)}],
             "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"a": a, "b": b}} for a, b in pairs]
    (out / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[:n_train]))
    (out / "test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[n_train:]))


def train(d: Path, seed: int, steps: int, port: int, offset: int) -> dict[str, Any]:
    """One `steadyrl up` run of `seed`; its last policy exported to d/seed<k>/model."""
    run_dir = d / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "config.yaml"
    cfg.write_text(f"""learner:
  steps: {steps}
  prompts_per_step: 4
  group_size: 4
  max_new_tokens: 64
  seed: {seed}
  max_staleness: 0
  checkpoint_every: {steps}
  train:
    lr: 2.0e-5
    temperature: 1.0
rollout:
  agent:
    max_turns: 3
""")
    cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--config", str(cfg), "--model", "smollm2-135m-instruct",
           "--tools", TOOLS, "--data", str(d / "train.jsonl"), "--reward", "numeric_match",
           "--state-dir", str(run_dir / "state"), "--port", str(port), "--port-offset", str(offset), "--plain",
           # a training step on a loaded 2-core machine outlasts the 60 s of /livez misses that
           # restart the learner (its heartbeat stops during the update): not watched here
           "--liveness-failures", "0"]
    t0 = time.perf_counter()
    with open(run_dir / "up.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    steps_log = [json.loads(line.split("| ", 1)[1]) for line in (run_dir / "up.log").read_text().splitlines()
                 if line.startswith("learner-0") and '"msg": "step"' in line]
    return {"seed": seed, "rc": rc, "wall_s": round(wall, 1), "command": " ".join(cmd[2:]),
            "reward_per_step": [round(s["reward_mean"], 4) for s in steps_log],
            "seconds_per_step": [round(s["seconds"], 1) for s in steps_log]}


def export(run_dir: Path) -> Path:
    """`steadyrl export <run> latest <folder>` of the run in run_dir/state."""
    runs = sorted(p for p in (run_dir / "state" / "learner").iterdir() if p.is_dir() and p.name.startswith("r"))
    model = run_dir / "model"
    subprocess.check_call([sys.executable, "-m", "steadyrl.cli", "export", str(runs[-1]), "latest", str(model)],
                          cwd=ROOT)
    return model


def episodes(model: Any, tok: Any, rows: list[Any], max_turns: int = 3, max_new: int = 64,
             temperature: float = 0.0) -> list[dict[str, Any]]:
    """Greedy multi-turn episodes of `rows`, as the rollout worker runs them (tools in a system
    message, ids continued turn by turn), scored by numeric_match on the final answer."""
    from steadyrl.model import agents
    from steadyrl.model.rewards import numeric_match
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

    tools = agents.load_tools(str(ROOT / TOOLS))
    in_template = "tools" in str(getattr(tok, "chat_template", "") or "")
    env = agents.ToolEnv(tools, 10.0, in_template)
    schemas = env.schemas if in_template else None
    gen = TorchGenerator(model, tok, batch_size=64)
    eps = []
    for r in rows:
        msgs = env.reset({"messages": [dict(m) for m in r.messages]})
        eps.append({"messages": msgs, "ids": agents.prompt_ids(tok, msgs, schemas), "truth": r.ground_truth,
                    "calls": 0, "good_calls": 0, "turns": 0, "done": False, "text": ""})
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new)
    for turn in range(max_turns):
        live = [e for e in eps if not e["done"]]
        if not live:
            break
        # one random stream per episode and turn (one seed for all would correlate the samples)
        outs = gen.generate([e["ids"] for e in live], params, seeds=[7919 * turn + eps.index(e) for e in live])
        for e, (c,) in zip(live, outs, strict=True):
            e["ids"] = e["ids"] + c.token_ids
            e["messages"].append({"role": "assistant", "content": c.text})
            e["text"], e["turns"] = c.text, e["turns"] + 1
            calls = agents.parse_tool_calls(c.text, tools)
            e["calls"] += len(calls)
            e["good_calls"] += sum(k.error is None for k in calls)
            if turn + 1 >= max_turns:
                e["done"] = True
                continue
            new, _, done = env.step(e["messages"])
            if done or not new:
                e["done"] = True
                continue
            e["messages"] += new
            e["ids"] = e["ids"] + agents.delta_ids(tok, new)
    for e in eps:
        e["correct"] = float(numeric_match("calc_mul", e["text"], e["truth"])["score"])
        # right, and a final answer rather than a call whose expression happens to end in the number
        e["answered"] = e["correct"] * (not agents.TOOL_CALL.search(e["text"]))
    return eps


def summary(eps: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(eps)
    return {"n": n, "accuracy": round(sum(e["correct"] for e in eps) / n, 4),
            "accuracy_answer_without_call": round(sum(e["answered"] for e in eps) / n, 4),
            "tool_call_rate": round(sum(e["good_calls"] > 0 for e in eps) / n, 4),
            "calls_per_episode": round(sum(e["calls"] for e in eps) / n, 3),
            "well_formed_calls_per_episode": round(sum(e["good_calls"] for e in eps) / n, 3),
            "turns_per_episode": round(sum(e["turns"] for e in eps) / n, 3)}


def evaluate(folder: str | None, d: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from steadyrl.model.data import read_jsonl
    from steadyrl.model.models import SMOLLM2, load_policy

    model, tok = load_policy(folder or SMOLLM2)
    rows = read_jsonl(d / "test.jsonl")
    t0 = time.perf_counter()
    eps = episodes(model, tok, rows)
    s = summary(eps)
    s["seconds"] = round(time.perf_counter() - t0, 1)
    return s, [{"text": e["text"], "truth": e["truth"], "correct": e["correct"], "calls": e["calls"]} for e in eps]


def same_weights(folder: Path) -> bool:
    """Whether the exported model's tensors equal the base model's bit for bit (a run whose
    every group scored alike has zero policy gradient: its weights do not move)."""
    from safetensors.torch import load_file

    from steadyrl.model.models import smollm2_cached

    base = load_file(str(smollm2_cached() / "model.safetensors"))
    new = load_file(str(folder / "model.safetensors"))
    return base.keys() == new.keys() and all(bool((base[k] == new[k]).all()) for k in base)


def mean_sd(xs: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.mean(xs), 4), "sd": round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def main() -> None:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["data", "train", "eval", "report"])
    ap.add_argument("--dir", type=Path, default=Path(".steadyrl/agents_smollm2"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--port", type=int, default=19092)
    ap.add_argument("--port-offset", type=int, default=12000)
    ap.add_argument("--model", default=None, help="eval: a model folder (default: the base model)")
    ap.add_argument("--save", type=Path, default=None, help="eval: write the result here")
    ap.add_argument("--out", type=Path, default=ROOT / f"bench/results/agents_smollm2_{time.strftime('%Y%m%d')}.json")
    args = ap.parse_args()
    d = args.dir
    if args.what == "data":
        make_data(d)
    elif args.what == "train":
        for seed in args.seeds:
            res = train(d, seed, args.steps, args.port, args.port_offset)
            if res["rc"] == 0:
                export(d / f"seed{seed}")
            (d / f"seed{seed}" / "train.json").write_text(json.dumps(res, indent=2) + "\n")
            print(json.dumps(res), flush=True)
    elif args.what == "eval":   # one model; --save keeps the result for `report`
        s, items = evaluate(args.model, d)
        print(json.dumps(s), flush=True)
        for it in items[:8]:
            print(json.dumps(it), flush=True)
        if args.save:
            args.save.write_text(json.dumps({"summary": s, "items": items}, indent=1) + "\n")
    else:
        import torch

        def evaluated(folder: str | None, saved: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            if saved.exists():
                got = json.loads(saved.read_text())
                return got["summary"], got["items"]
            return evaluate(folder, d)

        base, base_items = evaluated(None, d / "eval_base.json")
        print("base", json.dumps(base), flush=True)
        seeds = []
        for seed in args.seeds:
            run_dir = d / f"seed{seed}"
            tr = json.loads((run_dir / "train.json").read_text())
            tr["weights_equal_base"] = same_weights(run_dir / "model")
            if tr["weights_equal_base"] and not (run_dir / "eval.json").exists():
                after, items = base, base_items   # the same weights: greedy gives the same answers
            else:
                after, items = evaluated(str(run_dir / "model"), run_dir / "eval.json")
            print(f"seed {seed}", json.dumps(after), flush=True)
            tr["command"] = "steadyrl " + tr["command"].removeprefix("steadyrl.cli ").replace(str(d), "D")
            seeds.append({**tr, "after": after, "examples_after": items[:5]})
        keys = ("accuracy", "accuracy_answer_without_call", "tool_call_rate", "calls_per_episode",
                "well_formed_calls_per_episode", "turns_per_episode")
        out = {
            "benchmark": "agents_smollm2", "model": "smollm2-135m-instruct", "tools": TOOLS,
            "data": "a * b, a in [100, 999], b in [10, 99]: 200 train, 40 held-out (make_data, seed 48)",
            "prompt": [*SHOT, {"role": "user", "content": QUESTION}],
            "eval": "greedy, max_turns 3, 64 new tokens a turn, numeric_match on the final answer",
            "machine": {"nproc": os.cpu_count(), "cpu": _cpu(), "platform": platform.platform(),
                        "torch": torch.__version__, "note": "2 cores shared with 3 other jobs: times are noisy"},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "before": base, "examples_before": base_items[:5], "seeds": seeds,
            "after_over_seeds": {k: mean_sd([s["after"][k] for s in seeds]) for k in keys},
            "change_over_seeds": {k: mean_sd([round(s["after"][k] - base[k], 4) for s in seeds]) for k in keys},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: out[k] for k in ("before", "after_over_seeds", "change_over_seeds")}, indent=2))


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
