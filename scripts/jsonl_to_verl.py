"""Convert make_arithmetic.py JSONL into verl parquet (train/test, and harder test splits)
plus PROVENANCE.json.

    python scripts/jsonl_to_verl.py train.jsonl test.jsonl data/arithmetic --provenance '{...}' \
        [--harder-test test_level04 level04.jsonl 4 --levels 20 --seed 1 --per-module 100]

Every test split (the easy one and each harder one) has the questions that are in train removed.
"""

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from steadyrl.model.data import INSTRUCTION


def rows(path: Path, split: str, skip: set[str]) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["question"] in skip:
            continue
        out.append({
            "data_source": f"mathematics_dataset/{rec['module']}",
            "prompt": [{"role": "user", "content": f"{rec['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": rec["answer"]},
            "extra_info": {"split": split, "index": len(out), "question": rec["question"]},
        })
    return out


def lines(path: Path) -> int:
    return sum(1 for _ in path.read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train")
    ap.add_argument("test")
    ap.add_argument("out")
    ap.add_argument("--provenance", required=True)
    ap.add_argument("--harder-test", nargs=3, action="append", default=[], metavar=("NAME", "JSONL", "LEVEL"),
                    help="a harder test split: written as NAME.parquet, from entropy slice LEVEL")
    ap.add_argument("--levels", type=int, help="entropy slices (provenance of the harder splits)")
    ap.add_argument("--seed", type=int, help="seed of the harder splits (provenance)")
    ap.add_argument("--per-module", type=int, help="questions per module of the harder splits (provenance)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train = rows(Path(a.train), "train", set())
    in_train = {r["extra_info"]["question"] for r in train}
    test = rows(Path(a.test), "test", in_train)  # no leakage
    for name, data in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(data), out / f"{name}.parquet")
    prov = json.loads(a.provenance)
    prov["counts"] = {"train": len(train), "test": len(test)}
    prov["test_questions_removed_as_in_train"] = lines(Path(a.test)) - len(test)
    harder = {}
    for name, path, level in a.harder_test:
        split = rows(Path(path), name, in_train)
        pq.write_table(pa.Table.from_pylist(split), out / f"{name}.parquet")
        harder[name] = {"file": f"{name}.parquet", "level": int(level), "levels": a.levels,
                        "difficulty": f"entropy slice {level} of {a.levels}", "seed": a.seed,
                        "per_module": a.per_module, "count": len(split),
                        "questions_removed_as_in_train": lines(Path(path)) - len(split)}
    if harder:
        prov["harder_test_splits"] = harder
    (out / "PROVENANCE.json").write_text(json.dumps(prov, indent=2) + "\n")
    print(json.dumps({**prov["counts"], **{k: v["count"] for k, v in harder.items()}}))


if __name__ == "__main__":
    main()
