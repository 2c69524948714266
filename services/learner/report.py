"""What a run reports when it ends: greedy test accuracy before and after (eval_data, and
each harder split of eval_splits), `summary.json`, the SUMMARY lines and the reward curve (`curve.png`)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge
from scipy.stats import binomtest

from steadyrl.config import ConfigError
from steadyrl.files import write_atomic
from steadyrl.model.scorepool import ScoringLimits
from steadyrl.rl.loop import ScorerRaisedOnEveryItem
from steadyrl.rl.loop import evaluate as greedy_eval
from steadyrl.run.runfolder import Counts

from .config import LearnerSection, data_label
from .rows import EvalSplit, eval_split
from .state import RunState

if TYPE_CHECKING:
    import torch

log = logging.getLogger("steadyrl.learner")

EVAL_ACCURACY = Gauge("steadyrl_learner_eval_accuracy", "Greedy test-split accuracy", ["when"])
EVAL_SPLIT_ACCURACY = Gauge("steadyrl_learner_eval_split_accuracy", "Greedy accuracy on each harder test split "
                            "(learner.eval_splits)", ["split", "when"])


def paired_margin(before: list[bool], after: list[bool]) -> dict[str, Any]:
    """Accuracy change on the same n items, its 95% margin and McNemar's exact p-value.

    margin = 1.96 x s.e. of the paired difference, s.e. = sqrt(b + c - (b - c)^2 / n) / n with
    b, c the discordant counts (McNemar 1947; the paired-proportion normal interval).
    """
    n = len(before)
    b = sum(1 for x, y in zip(before, after, strict=True) if not x and y)   # wrong -> right
    c = sum(1 for x, y in zip(before, after, strict=True) if x and not y)   # right -> wrong
    delta = (b - c) / n
    se = max(b + c - (b - c) ** 2 / n, 0.0) ** 0.5 / n
    p = binomtest(b, b + c, 0.5).pvalue if b + c else 1.0
    return {"n": n, "improved": b, "regressed": c, "delta": delta, "margin_95": 1.96 * se,
            "mcnemar_p": p, "learned": delta > 1.96 * se}


#: Bump when the greedy evaluation's procedure changes (prompting, batching, scoring, the
#: record below): results cached by an earlier procedure are then not reused.
EVAL_PROCEDURE = 1


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of `model`'s weights: every tensor's name, dtype, shape and bytes, in name order
    (tied tensors once). What an evaluation's cache key names the model by."""
    import torch  # lazy: heavy (torch); report.py is imported where torch is not

    from steadyrl.run.tensors import unique_tensors  # lazy: heavy (torch, via checkpoint)

    h = hashlib.sha256()
    for name, t in sorted(unique_tensors(model.state_dict()).items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def cache_key(lc: LearnerSection, rows: list[Any], tok: Any, digest: str) -> str:
    """sha256 of what one greedy evaluation's result depends on: the weights (`digest`), the
    tokenizer (its vocabulary size, chat template and special tokens), the rows as evaluated,
    the scorer, max_new_tokens, EVAL_PROCEDURE, torch's and transformers' versions and torch's
    thread count (a reduction's order can flip a greedy argmax)."""
    import torch  # lazy: heavy (torch); report.py is imported where torch is not
    import transformers  # lazy: heavy (transformers), for its version

    what = {"procedure": EVAL_PROCEDURE, "weights": digest, "scorer": lc.eval_scorer,
            "max_new_tokens": lc.eval_max_new_tokens, "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "tokenizer": [len(tok), getattr(tok, "chat_template", None), getattr(tok, "eos_token", None),
                          getattr(tok, "pad_token", None)],
            "rows": [r.model_dump(mode="json") if hasattr(r, "model_dump") else r for r in rows]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


#: What the learner is told as an evaluation goes: (split, rows done, rows). The split is
#: "test" for eval_data (steadyrl.run.runview.MAIN_SPLIT), else the harder split's name.
EvalProgress = Callable[[str, int, int], None]


def _split(lc: LearnerSection, name: str, model: torch.nn.Module, tok: Any, beat: Callable[[], None],
           given: dict[str, EvalSplit] | None) -> EvalSplit:
    """The checked rows of evaluation `name` ("test": eval_data, else a harder split): from
    `given` (the learner checks them at start: services/learner/rows.py eval_splits), else
    checked now (without a model, as a unit test's fake: only rows that are not prompts are
    left out). Raises ConfigError when none is usable."""
    if given is not None and name in given:
        return given[name]
    from .tokens import TokenLimits  # lazy: only without the learner's

    context = TokenLimits.of(model, tok).context if model is not None else None
    if name == "test":
        assert lc.eval_data is not None, "evaluate() returns before asking for eval_data"
        return eval_split(lc, name, "learner.eval_data", lc.eval_data, lc.eval_limit, tok, context, beat=beat)
    return eval_split(lc, name, f"learner.eval_splits.{name}", lc.harder_splits[name], lc.eval_splits_limit, tok,
                      context, beat=beat)


def _greedy(lc: LearnerSection, split: EvalSplit, model: torch.nn.Module, tok: Any,
            beat: Callable[[], None], cache: tuple[Path, str] | None = None,
            progress: EvalProgress | None = None, limits: ScoringLimits | None = None) -> dict[str, Any]:
    """Greedy accuracy of `model` on the good rows of `split` (its bad rows are left out). With
    `cache` (a folder, and weights_digest of `model`), a result cached there under the same
    cache_key (the rows as evaluated: the good ones) is returned instead of evaluating again
    (logged, `cached: true`), and a new result is cached. `progress(split, done, rows)` as the
    evaluation goes (not for a cached result)."""
    spec, name = split.spec, split.split
    rows = split.prompt_rows()
    path = None
    if cache is not None:
        path = cache[0] / f"{cache_key(lc, rows, tok, cache[1])}.json"
        try:
            hit = json.loads(path.read_text())
            if isinstance(hit, dict) and {"accuracy", "n", "correct_items"} <= hit.keys():
                log.info("evaluation taken from the cache (same weights, rows and settings)",
                         extra={"data": spec, "cache": str(path), "saved_s": hit.get("seconds")})
                return {**hit, "cached": True}
        except (OSError, ValueError):   # absent or unreadable: evaluate
            pass
    t0 = time.perf_counter()
    try:
        if progress is None:
            acc, items = greedy_eval(model, tok, rows, lc.eval_scorer, lc.eval_max_new_tokens, on_batch=beat,
                                     limits=limits)
        else:
            acc, items = greedy_eval(model, tok, rows, lc.eval_scorer, lc.eval_max_new_tokens, on_batch=beat,
                                     on_progress=lambda done, n: progress(name, done, n), limits=limits)
    except ScorerRaisedOnEveryItem as e:   # a restart would fail the same way: exit 2, not a crash loop
        raise ConfigError(f"learner.eval_scorer {lc.eval_scorer} failed on the evaluation of {data_label(spec)} "
                          f"{e}") from None
    result = {"accuracy": acc, "n": len(items), "correct": sum(i["correct"] for i in items),
              "seconds": round(time.perf_counter() - t0, 1), "correct_items": [i["correct"] for i in items]}
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(result))
        except OSError as e:   # a cache: a full disk costs the next run the evaluation, nothing else
            log.warning("evaluation result not cached", extra={"cache": str(path), "error": str(e)})
    return result


def evaluate(lc: LearnerSection, model: torch.nn.Module, tok: Any, when: str, beat: Callable[[], None],
             splits: Collection[str] | None = None, cache: Path | None = None,
             progress: EvalProgress | None = None, rows: dict[str, EvalSplit] | None = None,
             limits: ScoringLimits | None = None) -> dict[str, Any] | None:
    """Greedy accuracy of `model` on lc.eval_data (None when there is none), and under "splits"
    on each harder test split of lc.eval_splits (those named in `splits`, when given: after the
    run, those evaluated before it); `beat` is called after every batch (liveness). With
    `cache` (the learner's `<state_dir>/eval-cache`), each result is cached by weights, rows
    and settings (_greedy, cache_key): a second run of the same base model and evaluation
    settings skips the evaluation before. `rows`: the evaluations' rows as the learner checked
    them at start (rows.eval_splits; else checked here): bad rows are left out, and a split with
    none usable raises ConfigError (exit 2). `limits`: the rule scorer's processes (the
    `reward_server:` section's ScoringLimits; None: their defaults)."""
    if lc.eval_data is None:
        return None
    keyed = None if cache is None else (cache, weights_digest(model))
    result = _greedy(lc, _split(lc, "test", model, tok, beat, rows), model, tok, beat, keyed, progress, limits)
    EVAL_ACCURACY.labels(when).set(result["accuracy"])
    log.info("evaluation", extra={"when": when, "accuracy": result["accuracy"], "n": result["n"]})
    result["splits"] = evaluate_splits(lc, model, tok, when, beat, splits, cache, keyed[1] if keyed else None,
                                       progress, rows, limits)
    return result


def evaluate_splits(lc: LearnerSection, model: torch.nn.Module, tok: Any, when: str, beat: Callable[[], None],
                    names: Collection[str] | None = None, cache: Path | None = None,
                    digest: str | None = None, progress: EvalProgress | None = None,
                    rows: dict[str, EvalSplit] | None = None,
                    limits: ScoringLimits | None = None) -> dict[str, dict[str, Any]]:
    """Greedy accuracy on each harder test split of lc.eval_splits (only those in `names`, when
    given), lc.eval_splits_limit rows each, with the dataset under "data"; {} when lc.eval_data
    is None (no evaluation at all). `cache`, `rows`: see evaluate; `digest`: the model's
    weights_digest when the caller has it (else taken here when `cache` is given)."""
    if lc.eval_data is None:
        return {}
    keyed = None if cache is None else (cache, digest or weights_digest(model))
    out = {}
    for name, spec in lc.harder_splits.items():
        if names is not None and name not in names:
            continue
        out[name] = {"data": spec, **_greedy(lc, _split(lc, name, model, tok, beat, rows), model, tok, beat, keyed,
                                             progress, limits)}
        EVAL_SPLIT_ACCURACY.labels(name, when).set(out[name]["accuracy"])
        log.info("evaluation", extra={"when": when, "split": name, "accuracy": out[name]["accuracy"],
                                      "n": out[name]["n"]})
    return out


def pending_splits(lc: LearnerSection, before: dict[str, Any] | None) -> set[str]:
    """The harder splits of lc.eval_splits that `before` (RunState.eval_before) has no result for:
    a run resumed at step 0 whose eval before was saved without them (by a version before
    eval_splits, or with other eval_splits)."""
    if lc.eval_data is None or before is None:
        return set()
    return set(lc.harder_splits) - set(before.get("splits", {}))


def summary(lc: LearnerSection, st: RunState) -> dict[str, Any]:
    """The run's summary.json: configuration, counts, reward, seconds and train/inference
    mismatch KL (mismatch/kl; None for a step without it, or of a run from before it) per step,
    evaluation: `eval` (eval_data) and `eval_splits` (each harder split evaluated before and after
    on the same items; absent for a run from before them)."""
    out = {"run_id": st.run_id, "steps": st.step, "model": lc.model, "algorithm": lc.train.algorithm, "data": lc.data,
           "prompts_per_step": lc.prompts_per_step, "group_size": lc.group_size,
           "max_staleness": lc.max_staleness, "lr": lc.train.lr, "counts": st.counts,
           "reward_per_step": [round(h["reward_mean"], 4) for h in st.history],
           "seconds_per_step": [h["seconds"] for h in st.history],
           "mismatch_kl_per_step": [h.get("mismatch/kl") for h in st.history]}
    b, a = st.eval_before, st.eval_after
    # the same items before and after (a resume that left out other evaluation rows has not)
    if b and a and len(b["correct_items"]) == len(a["correct_items"]):
        out["eval"] = {"data": lc.eval_data, "before": b["accuracy"], "after": a["accuracy"],
                       **paired_margin(b["correct_items"], a["correct_items"])}
    splits = {}  # eval_before/after["splits"]: absent in a run from before eval_splits
    for name, sb in ((b or {}).get("splits") or {}).items():
        sa = ((a or {}).get("splits") or {}).get(name)
        if sa and sb["n"] and len(sa["correct_items"]) == len(sb["correct_items"]):  # the same items
            splits[name] = {"data": sb["data"], "before": sb["accuracy"], "after": sa["accuracy"],
                            **paired_margin(sb["correct_items"], sa["correct_items"])}
    if splits:
        out["eval_splits"] = splits
    return out


def write_summary(lc: LearnerSection, st: RunState, run_dir: Path) -> Path:
    """Write summary.json and curve.png into `run_dir` and print the SUMMARY lines."""
    s = summary(lc, st)
    path = run_dir / "summary.json"
    write_atomic(path, json.dumps(s, indent=2))
    try:
        plot(s, run_dir / "curve.png")
    except Exception as e:  # noqa: BLE001 - a missing font (any plotting error) must not fail the run
        log.warning("curve not drawn", extra={"error": str(e)})
    lines = [f"run {s['run_id']}: {s['steps']} steps of {lc.model} on {data_label(lc.data)} "
             f"(B={s['prompts_per_step']} x G={s['group_size']}, max_staleness {s['max_staleness']})",
             "reward per step: " + " ".join(f"{r:.2f}" for r in s["reward_per_step"])]
    if "eval" in s:
        ev = s["eval"]
        lines.append(f"test accuracy (greedy, n={ev['n']}): before {ev['before']:.4f}, after {ev['after']:.4f}, "
                     f"change {ev['delta']:+.4f} (95% margin +-{ev['margin_95']:.4f}, "
                     f"McNemar p={ev['mcnemar_p']:.3g}) -> {'LEARNED' if ev['learned'] else 'not above noise'}")
    for name, ev in s.get("eval_splits", {}).items():
        lines.append(f"harder split {name} ({ev['data']}, greedy, n={ev['n']}): before {ev['before']:.4f}, "
                     f"after {ev['after']:.4f}, change {ev['delta']:+.4f} (95% margin +-{ev['margin_95']:.4f}, "
                     f"McNemar p={ev['mcnemar_p']:.3g}) -> {'LEARNED' if ev['learned'] else 'not above noise'}")
    counts = Counts(s["counts"]).line()
    lines.append(f"counts: {counts or 'none (no bad rows, refusals, drops or held batches)'}")
    lines.append(f"summary {path}, curve {run_dir / 'curve.png'}; the trained weights as a model folder: "
                 f"steadyrl export {run_dir} latest <folder>")
    for line in lines:
        print(f"SUMMARY {line}", flush=True)  # noqa: T201  the run's result, for the person at `steadyrl up`
    return path


def rolling_mean(xs: list[float], window: int) -> list[float]:
    """Mean of each value and the up to `window - 1` before it, (n,) -> (n,)."""
    return [sum(xs[max(0, i - window + 1):i + 1]) / len(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]


def accuracy_margin(p: float, n: int) -> float:
    """Half-width of the normal-approximation 95 % interval of an accuracy p over n items."""
    return 1.96 * (p * (1 - p) / n) ** 0.5 if n else 0.0


def plot(s: dict[str, Any], path: Path) -> None:
    """curve.png: left, the batch reward per step and its rolling mean (5 steps); right, the greedy
    accuracy before and after of the test split and each harder split, with 95 % whiskers and the
    paired change (its 95 % margin, McNemar's p) above each pair; titled by model and algorithm."""
    import matplotlib  # lazy: heavy (matplotlib), only for the curve at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: heavy (matplotlib), only for the curve at the end

    evals = ([("test", s["eval"])] if "eval" in s else []) + list(s.get("eval_splits", {}).items())
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(10 if evals else 6, 3.6), squeeze=False)
    ax = axes[0][0]
    rewards = s["reward_per_step"]
    steps = range(1, len(rewards) + 1)
    ax.plot(steps, rewards, marker="o", ms=3, lw=1, alpha=0.6, label="batch reward mean")
    ax.plot(steps, rolling_mean(rewards, 5), lw=2, label="rolling mean (5 steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    if evals:
        ax = axes[0][1]
        xs = range(len(evals))
        for dx, when, color in ((-0.2, "before", "grey"), (0.2, "after", "C2")):
            vals = [ev[when] for _, ev in evals]
            errs = [accuracy_margin(ev[when], ev["n"]) for _, ev in evals]
            ax.bar([x + dx for x in xs], vals, width=0.4, yerr=errs, capsize=3, color=color, label=when)
        for x, (_, ev) in zip(xs, evals, strict=True):
            top = max(ev[w] + accuracy_margin(ev[w], ev["n"]) for w in ("before", "after"))
            label = f"{100 * ev['delta']:+.1f} ±{100 * ev['margin_95']:.1f} pts\np={ev['mcnemar_p']:.2g}"
            ax.text(x, top + 0.01, label, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [f"{name}\n(n={ev['n']})" for name, ev in evals], fontsize=8)
        ax.set_ylabel("greedy accuracy")
        ax.set_ylim(0, min(1.0, max(max(ev["before"], ev["after"]) for _, ev in evals) * 1.5 + 0.1))
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{s['model']} {str(s.get('algorithm', 'grpo')).upper()} through Kafka ({s['run_id']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
