#!/usr/bin/env bash
# Rebuild data/arithmetic/{train,test}.parquet, and the harder test splits
# test_level{04,09}.parquet, from DeepMind's mathematics-dataset.
# It needs sympy < 1.6, which torch refuses, so it runs in a throwaway venv.
set -euo pipefail
cd "$(dirname "$0")/.."
MODULES=numbers__place_value,numbers__gcd,arithmetic__add_sub_multiple
LEVEL=0; LEVELS=20; TRAIN_PER_MODULE=500; TEST_PER_MODULE=100
HARD_LEVELS="4 9"  # harder test splits of the same modules: does what was learnt transfer?
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q 'mathematics-dataset==1.0.1' 'sympy<1.6'
ver=$("$tmp/venv/bin/pip" show mathematics-dataset | awk '/^Version/{print $2}')
sympy=$("$tmp/venv/bin/pip" show sympy | awk '/^Version/{print $2}')
gen() { local level=$1; shift; "$tmp/venv/bin/python" scripts/make_arithmetic.py --modules $MODULES --level "$level" --levels $LEVELS "$@"; }
gen $LEVEL --count $TRAIN_PER_MODULE --seed 0 > "$tmp/train.jsonl"
gen $LEVEL --count $TEST_PER_MODULE --seed 1 > "$tmp/test.jsonl"
hard=()
for level in $HARD_LEVELS; do
  name=$(printf 'test_level%02d' "$level")
  gen "$level" --count $TEST_PER_MODULE --seed 1 > "$tmp/$name.jsonl"
  hard+=(--harder-test "$name" "$tmp/$name.jsonl" "$level")
done
.venv/bin/python scripts/jsonl_to_verl.py "$tmp/train.jsonl" "$tmp/test.jsonl" data/arithmetic "${hard[@]}" \
  --levels $LEVELS --seed 1 --per-module $TEST_PER_MODULE --provenance "$(cat <<JSON
{"generator": "mathematics-dataset $ver (DeepMind), sympy $sympy", "modules": "$MODULES",
 "difficulty": "entropy slice $LEVEL of $LEVELS (easiest twentieth of each module's train range)",
 "seeds": {"train": 0, "test": 1}, "per_module": {"train": $TRAIN_PER_MODULE, "test": $TEST_PER_MODULE},
 "instruction": "Reply with only the final number.", "script": "scripts/make_arithmetic.sh",
 "why": "modules where SmolLM2-135M-Instruct greedy is near 10-25% on samples of 40-48: place_value 19-23%, gcd 22%, add_sub_multiple 2-15%; measured accuracy of the test split is in docs/rl.md"}
JSON
)"
