"""`steadyrl score`: one response through a reward server scorer (steadyrl.model.scorers), in-process."""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import Any


def cmd_score(args: argparse.Namespace) -> int:
    """One item through a reward server scorer (steadyrl.model.scorers), as the reward server scores
    it: a rule in a worker process with the server's default limits (steadyrl.model.scorepool), a
    model in this process. Prints `reward  scorer-id  [extra]`.

    Exit status 2 for a scorer that cannot be built or loaded, 1 when it cannot score the item
    (the error names its kind: scorer_error, scorer_timeout, scorer_crash, non_finite)."""
    from steadyrl.model.scorepool import ScoringLimits  # lazy: entry point (a command), keeps `steadyrl --help` fast
    from steadyrl.model.scorers import spec_kind  # lazy: entry point (a command), keeps `steadyrl --help` fast

    if spec_kind(args.scorer) != "rule":
        return _score(args, None)
    with ScoringLimits(processes=1).pool() as pool:
        return _score(args, pool)


def _score(args: argparse.Namespace, pool: Any) -> int:
    from steadyrl.model.scorers import ScorerError, build_scorer  # lazy: entry point (a command), keeps --help fast
    from steadyrl.wire.contracts import RewardSource  # lazy: entry point (a command), keeps `steadyrl --help` fast

    try:
        scorer = build_scorer(args.scorer, pool=pool)
        if scorer.source is RewardSource.model:
            from transformers.utils import logging as hf_logging  # lazy: heavy (transformers), model scorers only

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: untyped
        scorer.load()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    item = SimpleNamespace(data_source=args.data_source, prompt=args.prompt, response=args.response,
                           ground_truth=args.ground_truth, extra_info={})
    try:
        result = scorer.score([item])[0]
    except ScorerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result["reward"] is None:
        print(f"error ({result.get('kind', 'scorer_error')}): {result['error']}", file=sys.stderr)
        return 1
    extra = f"  {json.dumps(result['extra'])}" if result["extra"] else ""
    print(f"{round(result['reward'], 6)}  {scorer.id}{extra}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("score", help="score one response with a reward server scorer, in-process (hand check)")
    sp.add_argument("--scorer", required=True,
                    help="rule name (numeric_match, tiny_copy, ...), module:function, rm:<dir> or "
                         "embedding:all-minilm-l6-v2")
    sp.add_argument("--prompt", default="", help="the prompt's text (model scorers read it)")
    sp.add_argument("--response", required=True)
    sp.add_argument("--ground-truth", default=None)
    sp.add_argument("--data-source", default="")
    sp.set_defaults(fn=cmd_score)
