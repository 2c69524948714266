"""One update micro-batch of SmolLM2 with the LM head on every position vs on the response only.

The learner needs the logits of the T response positions (and the one before them); the prompt's
are thrown away. `logits_to_keep=T + 1` (transformers) runs the head only there. This times a
forward + backward of one micro-batch at the default run's shape (8 rows, prompt 70, response 32
tokens: the batch's padded widths at the default settings), both arms interleaved, fp32 on the CPU.

    .venv/bin/python bench/lm_head.py --rounds 5    # -> bench/results/lm_head.json
    .venv/bin/python bench/lm_head.py --trainer --rounds 3 --out bench/results/lm_head_trainer.json

`--trainer` times the learner's whole `Trainer.step` instead (the default run's train settings:
lr 1e-5, temperature 0.8; 8 prompts x 8 samples, prompts of 50-57 tokens, responses of 7-32),
the same fixed batch each time, arms interleaved: `response_only` is the trainer as it is,
`all_positions` the same trainer with adf8f9f's parent's `_forward` (the head on every position,
the response logits sliced out). The step's `timing_s/update_actor` is the number kept.

`--trainer --gap` keeps the head on the response only and times the same step alone
(`fixed`) against the step right after a generation of the step's 8 prompts x 8 samples x 32
tokens in the same process (`after_generate`, what the in-process loop does): whether the update
inside a run is slower than on its own because of the work around it. `--trainer --vary` times
the step on the fixed batch (`fixed`) against a new batch of the same shape each time
(`new_batch`: other token ids and lengths, as every step of a run has).

Floor: the head is hidden x vocab = 576 x 49 152 = 28.3 M of the model's 134.5 M parameters, so
on the 70 prompt positions of each row it was 6 x 28.3 M x 8 x 70 = 95 GFLOP of a micro-batch's
6 x 134.5 M x 8 x 102 = 658 GFLOP (14 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from steadyrl.model.models import load_policy
from steadyrl.rl import core

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "bench"))

from make_run import cpu_name  # noqa: E402  # bench/ is not a package


def step(model: torch.nn.Module, ids: torch.Tensor, P: int, keep: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one forward + backward of the response log-probs' sum. CPU seconds
    are the process's, all threads: steadier than wall time on a machine others share."""
    T = ids.shape[1] - P
    t0, c0 = time.perf_counter(), time.process_time()
    if keep:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=T + 1).logits[:, :-1]   # (n, T, V)
    else:
        logits = model(input_ids=ids, use_cache=False).logits[:, P - 1:-1]                   # (n, T, V)
    logp = core.token_logprobs(logits.float(), ids[:, P:])                                   # (n, T)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def _forward_all_positions(self, model, b, idx, need_values=False, need_entropy=False):
    """Trainer._forward as it was before adf8f9f: logits for every position, sliced to the T
    response ones."""
    P = int(b["P"])
    out = model(input_ids=b["input_ids"][idx], attention_mask=b["attention_mask"][idx],
                position_ids=b["position_ids"][idx], output_hidden_states=need_values, use_cache=False)
    logits = out.logits[:, P - 1:-1].float()                                     # (n, T, V)
    logp = core.token_logprobs(logits, b["responses"][idx], self.cfg.temperature)   # (n, T)
    ent = core.entropy_from_logits(logits / self.cfg.temperature) if need_entropy else None
    return logp, ent, None


def trainer_arms(rounds: int, mode: str = "head") -> dict:
    """{arm: [update_actor seconds per round]} of `Trainer.step` (module doc). `mode` "head":
    all_positions vs response_only on one fixed batch; "gap": fixed vs after_generate; "vary":
    fixed vs new_batch."""
    import random

    from steadyrl.rl.batch import Group
    from steadyrl.rl.generation import SamplingParams, TorchGenerator
    from steadyrl.rl.trainer import TrainConfig, Trainer

    model, tok = load_policy("smollm2-135m-instruct")
    rng = random.Random(0)
    V = model.config.vocab_size

    def batch() -> list:   # 8 prompts x 8 samples, the padded width set by the first batch made
        return [Group([rng.randrange(V) for _ in range(rng.randint(50, 57))],
                      [[rng.randrange(V) for _ in range(rng.randint(7, 32))] for _ in range(8)],
                      [float(rng.random() < 0.2) for _ in range(8)]) for _ in range(8)]

    groups = batch()
    groups[0].responses[0] = [rng.randrange(V) for _ in range(32)]   # the batch's T = 32, as in the run
    P = max(len(g.prompt_ids) for g in groups)

    def new_batch(_: int) -> list:   # other ids and lengths, the fixed batch's padded shape
        b = batch()
        b[0].responses[0] = [rng.randrange(V) for _ in range(32)]
        b[0].prompt_ids = [rng.randrange(V) for _ in range(len(groups[0].prompt_ids))]
        b[1].prompt_ids = [rng.randrange(V) for _ in range(P)]
        return b

    def after_generate(r: int) -> list:
        gen.generate([g.prompt_ids for g in groups], SamplingParams(n=8, temperature=0.8, max_new_tokens=32),
                     seeds=[r * 8 + i for i in range(8)])
        return groups

    def fixed(_: int) -> list:
        return groups

    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-5, temperature=0.8, total_steps=20))  # the learner's
    trainer.step(groups)   # warm-up
    kept = Trainer._forward
    gen = TorchGenerator(model, tok)
    arms = {"head": {"all_positions": (_forward_all_positions, fixed), "response_only": (kept, fixed)},
            "gap": {"fixed": (kept, fixed), "after_generate": (kept, after_generate)},
            "vary": {"fixed": (kept, fixed), "new_batch": (kept, new_batch)}}[mode]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm, (forward, prepare) in arms.items():
            Trainer._forward = forward  # type: ignore[method-assign]
            times[arm].append(round(trainer.step(prepare(r))["timing_s/update_actor"], 3))
    Trainer._forward = kept  # type: ignore[method-assign]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=70)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench/results/lm_head.json"))
    ap.add_argument("--trainer", action="store_true", help="time the learner's Trainer.step (module doc)")
    ap.add_argument("--gap", action="store_true", help="with --trainer: the step alone vs after a generation")
    ap.add_argument("--vary", action="store_true", help="with --trainer: the fixed batch vs a new one each step")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.trainer:
        mode = "gap" if a.gap else "vary" if a.vary else "head"
        times = trainer_arms(a.rounds, mode)
        med = {k: statistics.median(v) for k, v in times.items()}
        slow, fast = list(times) if mode == "head" else list(times)[::-1]
        flag = "" if mode == "head" else f" --{mode}"
        out = {"benchmark": "lm_head_trainer" + flag.replace(" --", "_"),
               "command": f"bench/lm_head.py --trainer{flag} --rounds {a.rounds}",
               "machine": f"{os.cpu_count()} vCPU {cpu_name()}, {torch.get_num_threads()} threads, "
                          f"torch {torch.__version__}",
               "update_actor_s": times, "median_s": med,
               ("speedup" if mode == "head" else "ratio"): round(med[slow] / med[fast], 3),
               "load_average": os.getloadavg()}
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out, indent=1))  # noqa: T201
        return
    model, _ = load_policy("smollm2-135m-instruct")
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (a.rows, a.prompt + a.response))
    with torch.no_grad():   # the two arms compute the same log-probs
        full = model(input_ids=ids, use_cache=False).logits[:, a.prompt - 1:-1]
        kept = model(input_ids=ids, use_cache=False, logits_to_keep=a.response + 1).logits[:, :-1]
        max_diff = float((full - kept).abs().max())
    step(model, ids, a.prompt, True)   # warm-up
    times: dict[str, list[float]] = {"all_positions": [], "response_only": []}
    cpu: dict[str, list[float]] = {"all_positions": [], "response_only": []}
    for _ in range(a.rounds):
        for arm, keep in (("all_positions", False), ("response_only", True)):
            wall, used = step(model, ids, a.prompt, keep)
            times[arm].append(round(wall, 3))
            cpu[arm].append(round(used, 3))
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    out = {"benchmark": "lm_head", "command": f"bench/lm_head.py --rounds {a.rounds}",
           "shape": {"rows": a.rows, "prompt": a.prompt, "response": a.response},
           "machine": f"{os.cpu_count()} vCPU {cpu_name()}, {torch.get_num_threads()} threads, "
                      f"torch {torch.__version__}",
           "seconds": times, "median_s": med, "speedup": round(med["all_positions"] / med["response_only"], 3),
           "cpu_seconds": cpu, "median_cpu_s": med_cpu,
           "cpu_speedup": round(med_cpu["all_positions"] / med_cpu["response_only"], 3),
           "load_average": os.getloadavg(),
           "max_abs_logit_diff": max_diff}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
