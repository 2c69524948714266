#!/usr/bin/env bash
# Rebuild data/arithmetic/{train,test}.parquet from DeepMind's mathematics-dataset.
# It needs sympy < 1.6, which torch refuses, so it runs in a throwaway venv.
set -euo pipefail
cd "$(dirname "$0")/.."
MODULES=numbers__place_value,numbers__gcd,arithmetic__add_sub_multiple
LEVEL=0; LEVELS=20; TRAIN_PER_MODULE=500; TEST_PER_MODULE=100
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q 'mathematics-dataset==1.0.1' 'sympy<1.6'
ver=$("$tmp/venv/bin/pip" show mathematics-dataset | awk '/^Version/{print $2}')
sympy=$("$tmp/venv/bin/pip" show sympy | awk '/^Version/{print $2}')
gen() { "$tmp/venv/bin/python" scripts/make_arithmetic.py --modules $MODULES --level $LEVEL --levels $LEVELS "$@"; }
gen --count $TRAIN_PER_MODULE --seed 0 > "$tmp/train.jsonl"
gen --count $TEST_PER_MODULE --seed 1 > "$tmp/test.jsonl"
.venv/bin/python scripts/jsonl_to_verl.py "$tmp/train.jsonl" "$tmp/test.jsonl" data/arithmetic --provenance "$(cat <<JSON
{"generator": "mathematics-dataset $ver (DeepMind), sympy $sympy", "modules": "$MODULES",
 "difficulty": "entropy slice $LEVEL of $LEVELS (easiest twentieth of each module's train range)",
 "seeds": {"train": 0, "test": 1}, "per_module": {"train": $TRAIN_PER_MODULE, "test": $TEST_PER_MODULE},
 "instruction": "Reply with only the final number.", "script": "scripts/make_arithmetic.sh",
 "why": "modules where SmolLM2-135M-Instruct greedy is near 10-25% on samples of 40-48: place_value 19-23%, gcd 22%, add_sub_multiple 2-15%; measured accuracy of the test split is in docs/rl.md"}
JSON
)"
