"""`steadyrl eval`: greedy accuracy of a model on a prompt set (steadyrl.rl.loop.evaluate)."""

from __future__ import annotations

import argparse
import json
import logging
from collections import defaultdict
from pathlib import Path

from steadyrl.cli.common import DEFAULT_STATE
from steadyrl.model.data import load_rows


def cmd_eval(args: argparse.Namespace) -> int:
    import torch  # lazy: heavy (torch), entry point (a command)

    from steadyrl.model.models import load_policy  # lazy: heavy (torch), entry point (a command)
    from steadyrl.rl.loop import evaluate  # lazy: heavy (torch, transformers), entry point (a command)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    rows = load_rows(args.data)
    if args.limit and args.limit < len(rows):  # evenly spread, so every module is sampled
        stride = len(rows) / args.limit
        rows = [rows[int(i * stride)] for i in range(args.limit)]
    model, tok = load_policy(args.model)
    acc, items = evaluate(model, tok, rows, scorer=args.scorer, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size)
    by_source: defaultdict[str, list[bool]] = defaultdict(list)
    for row, item in zip(rows, items, strict=True):
        item["data_source"] = row.data_source
        by_source[row.data_source].append(item["correct"])
    out = Path(args.out or DEFAULT_STATE / "eval" / f"eval-{Path(args.data).stem}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(i) + "\n" for i in items))
    if len(by_source) > 1:
        for src, oks in sorted(by_source.items()):
            print(f"  {src}: {sum(oks)}/{len(oks)} = {sum(oks) / len(oks):.3f}")
    print(f"accuracy {acc:.4f} ({sum(i['correct'] for i in items)}/{len(items)}) "
          f"model={args.model} data={args.data} greedy, per-item results: {out}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("eval", help="greedy accuracy of a model on a prompt set")
    sp.add_argument("--model", default="smollm2-135m-instruct", help="smollm2-135m-instruct, tiny, or a local HF dir")
    sp.add_argument("--data", default="data/arithmetic/test.parquet", help="verl parquet, or JSONL (question/answer)")
    sp.add_argument("--limit", type=int, default=0, help="N rows spread evenly over the file (0: all)")
    sp.add_argument("--scorer", default="numeric_match")
    sp.add_argument("--max-new-tokens", type=int, default=32)
    sp.add_argument("--batch-size", type=int, default=32)
    sp.add_argument("--out", help="per-item JSONL (default .steadyrl/eval/eval-<data>.jsonl)")
    sp.set_defaults(fn=cmd_eval)
