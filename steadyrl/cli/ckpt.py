"""`steadyrl ckpt list|verify|sign`: learner checkpoints (steadyrl.run.checkpoint)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def cmd_ckpt(args: argparse.Namespace) -> int:
    """list: every checkpoint of a checkpoints folder with its state. verify: a step folder,
    or every checkpoint of a checkpoints folder, and which one a resume would use. Both exit
    1 when any checkpoint is broken (or there is none). With `--key-file` (the learner's
    `checkpoint_key_file`) a checkpoint must also be signed with that key, as a resume
    requires; without it signatures are not checked. sign: sign one step folder you trust
    with `--key-file` (after verifying it), so a learner with that key resumes from it."""
    from steadyrl.run import checkpoint as ck  # lazy: heavy (torch), entry point (a command)
    from steadyrl.run import signing  # lazy: heavy (torch), entry point (a command)

    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {root}: no such folder", file=sys.stderr)
        return 1
    try:
        key = signing.read_key(args.key_file) if args.key_file is not None else None
    except ck.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    one = (root / "manifest.json").exists() or re.fullmatch(r"step_\d+", root.name)
    if args.action == "sign":
        if key is None or not one:
            print("error: ckpt sign takes one step_* folder and --key-file", file=sys.stderr)
            return 2
        try:
            ck.verify(root)
        except ck.CheckpointError as e:
            print(f"invalid, not signed: {e}", file=sys.stderr)
            return 1
        signing.sign(root, key)
        print(f"signed: {root / signing.SIGNATURE}")
        return 0
    if one:  # one checkpoint
        try:
            m = ck.verify(root, key=key)
        except ck.CheckpointError as e:
            print(f"invalid: {e}", file=sys.stderr)
            return 1
        print(f"ok: {root} step {m['step']}, format v{m['format_version']}, {len(m['files'])} files verified, "
              f"{_signed(root, key)}, config {json.dumps(m.get('config', {}))}")
        return 0
    names = ck.list_checkpoints(root)
    if not names:
        hint = f" (did you mean {root / 'checkpoints'}?)" if (root / "checkpoints").is_dir() else ""
        print(f"no checkpoints in {root}{hint}", file=sys.stderr)
        return 1
    latest = (root / "LATEST").read_text().strip() if (root / "LATEST").exists() else None
    broken = 0
    for name in names:
        try:
            m = ck.verify(root / name, key=key)
            size = sum(f["size"] for f in m["files"].values())
            major = str(m["format_version"]).split(".")[0]
            kind = "sharded" if major == ck.SHARDED_FORMAT_VERSION.split(".")[0] else "whole"
            status = (f"ok  step {m['step']}  format v{m['format_version']} ({kind})  {size / 1e6:.1f} MB  "
                      f"{_signed(root / name, key)}  {m.get('created', '')}")
        except ck.CheckpointError as e:
            status, broken = f"BROKEN: {e}", broken + 1
        print(f"{'*' if name == latest else ' '} {name}  {status}")
    if args.action == "verify":
        try:
            use = ck.latest_valid(root, key=key)
            if use is None:  # every checkpoint went since they were listed
                print("a resume would start from step 0: no checkpoint left", file=sys.stderr)
                return 1
            print(f"a resume would use {use.name}" + ("" if use.name == latest else f" (LATEST names {latest})"))
        except ck.CheckpointError:
            print("a resume would fail: no checkpoint verifies", file=sys.stderr)
    return 1 if broken else 0


def _signed(path: Path, key: bytes | None) -> str:
    from steadyrl.run import signing  # lazy: heavy (torch); only `steadyrl ckpt` calls this

    if key is not None:
        return "signature ok"
    return "signed (not checked: no --key-file)" if (path / signing.SIGNATURE).exists() else "unsigned"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("ckpt", help="list, verify or sign learner checkpoints")
    sp.add_argument("action", choices=["list", "verify", "sign"])
    sp.add_argument("dir", help="checkpoint folder (verify: it, or a step_* folder in it; sign: a step_* folder)")
    sp.add_argument("--key-file", type=Path, default=None,
                    help="the learner's checkpoint_key_file: require (verify, list) or write (sign) the "
                         "manifest's signature")
    sp.set_defaults(fn=cmd_ckpt)
