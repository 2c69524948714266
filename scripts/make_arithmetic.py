"""Generate the default arithmetic prompt set with DeepMind's mathematics-dataset.

mathematics-dataset needs sympy < 1.6, which torch refuses, so this runs in a throwaway
venv and prints JSONL; `make_arithmetic.sh` builds the venv, runs this, and converts the
output into verl parquet with provenance. Usage (inside that venv):

    python make_arithmetic.py --modules arithmetic__add_or_sub,arithmetic__mul \
        --level 0 --levels 10 --count 200 --seed 0
"""

import argparse
import json
import random

import numpy as np
from mathematics_dataset import generate_settings
from mathematics_dataset.modules import modules


def entropy_fn(level: int, levels: int):
    """Restrict a module's entropy range to slice `level` of `levels` (0 = easiest),
    as mathematics_dataset.generate._make_entropy_fn does."""
    lo, hi = level / levels, (level + 1) / levels

    def modify(range_):
        length = range_[1] - range_[0]
        return (range_[0] + lo * length, range_[0] + hi * length)

    return modify


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", required=True)
    ap.add_argument("--level", type=int, default=0)
    ap.add_argument("--levels", type=int, default=10)
    ap.add_argument("--count", type=int, default=100, help="per module")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    flat = {}
    for group, subs in modules.train(entropy_fn(args.level, args.levels)).items():
        for name, fn in subs.items():
            flat[f"{group}__{name}"] = fn
    for name in args.modules.split(","):
        made = 0
        while made < args.count:
            p = flat[name]()
            q, a = str(p.question), str(p.answer)
            if len(q) > generate_settings.MAX_QUESTION_LENGTH or len(a) > generate_settings.MAX_ANSWER_LENGTH:
                continue
            print(json.dumps({"module": name, "question": q, "answer": a}))
            made += 1


if __name__ == "__main__":
    main()
