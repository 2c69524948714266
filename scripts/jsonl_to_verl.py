"""Convert make_arithmetic.py JSONL into verl parquet (train/test) plus PROVENANCE.json.

    python scripts/jsonl_to_verl.py train.jsonl test.jsonl data/arithmetic --provenance '{...}'
"""

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from steadyrl.data import INSTRUCTION


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train")
    ap.add_argument("test")
    ap.add_argument("out")
    ap.add_argument("--provenance", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train = rows(Path(a.train), "train", set())
    test = rows(Path(a.test), "test", {r["extra_info"]["question"] for r in train})  # no leakage
    for name, data in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(data), out / f"{name}.parquet")
    prov = json.loads(a.provenance)
    prov["counts"] = {"train": len(train), "test": len(test)}
    prov["test_questions_removed_as_in_train"] = sum(1 for _ in Path(a.test).read_text().splitlines()) - len(test)
    (out / "PROVENANCE.json").write_text(json.dumps(prov, indent=2) + "\n")
    print(json.dumps(prov["counts"]))


if __name__ == "__main__":
    main()
