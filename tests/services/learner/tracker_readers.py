"""Each experiment tracker's record read back with that tracker's own reader: step -> {name:
value}, and the count of times each step was logged (a step redone after a crash must be
there once)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

STEP_KEY = "training/global_step"


def tensorboard(log_dir: Path) -> tuple[dict[int, dict[str, float]], Counter]:
    """TensorBoard's EventAccumulator over the run's log dir (purged steps dropped, as
    TensorBoard shows them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    steps: dict[int, dict[str, float]] = {}
    times: Counter = Counter()
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            steps.setdefault(ev.step, {})[tag] = ev.value
            if tag == STEP_KEY:
                times[ev.step] += 1
    return steps, times


def mlflow(uri: str, run_id: str) -> tuple[dict[int, dict[str, float]], Counter]:
    """MlflowClient's metric history of every key of the run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    steps: dict[int, dict[str, float]] = {}
    times: Counter = Counter()
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            steps.setdefault(m.step, {})[key] = m.value
            if key == STEP_KEY:
                times[m.step] += 1
    return steps, times


def _wandb_records(path: Path):
    """The records of a .wandb file: W&B's transaction log, LevelDB's log format (a 7-byte file
    header `:W&B` + magic + version, then 32 KiB blocks of records, each a 7-byte header:
    crc32c, length, type FULL/FIRST/MIDDLE/LAST). wandb 0.31 ships no Python reader of it."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:            # the block's tail: padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:
            pos += left         # zero-filled rest of a block
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:           # FULL
            yield chunk
        elif kind == 2:         # FIRST
            parts = chunk
        elif kind == 3:         # MIDDLE
            parts += chunk
        elif kind == 4:         # LAST
            yield parts + chunk
            parts = b""


def wandb_offline(wandb_dir: Path) -> tuple[dict[int, dict[str, float]], Counter]:
    """The run's history as W&B would hold it after `wandb sync`: the history records of every
    offline-run folder under `wandb_dir` (each start of a resumed run writes one), parsed with
    wandb's own protobuf messages, folders in start order (their names begin with the start
    time, as sync orders them), a step at or below the run's last dropped (W&B's rule for a
    resumed run's steps)."""
    from wandb.proto import wandb_internal_pb2

    steps: dict[int, dict[str, float]] = {}
    times: Counter = Counter()
    files = sorted(wandb_dir.rglob("*.wandb"), key=lambda f: f.parent.name)
    assert files, f"no .wandb file under {wandb_dir}"
    last = -1
    for f in files:
        top = last
        for data in _wandb_records(f):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") != "history":
                continue
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            step = int(items.get("_step", rec.history.step.num))
            if step <= last:    # below the run's last step when this folder resumed it: dropped
                continue
            steps.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
            if STEP_KEY in items:
                times[step] += 1
            top = max(top, step)
        last = top
    return steps, times


def jsonl(path: Path) -> tuple[dict[int, dict[str, float]], Counter]:
    steps: dict[int, dict[str, float]] = {}
    times: Counter = Counter()
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps[row["step"]] = row
        times[row["step"]] += 1
    return steps, times
