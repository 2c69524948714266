"""Latency and throughput through one transactional stage (the reward worker), real broker.

    .venv/bin/python bench/kafka_roundtrip.py [--out bench/results/kafka_roundtrip.json]

For 1 KB and 64 KB rollout groups:
  - latency: records produced at a steady low rate; per record, time from produce
    (`generated_ms`) to receipt of its scored group by a read_committed consumer;
    reports p50/p99 in ms.
  - throughput: a backlog of records produced up front; records/s and MB/s from the
    first produce to the last scored group received.
Starts its own broker (temporary dir), a reward server and one reward worker process; stops them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._reward_stack import reward_stack  # noqa: E402
from steadyrl.wire import codec  # noqa: E402
from steadyrl.wire.contracts import Prompt, RolloutGroup, Sample, ScoredGroup  # noqa: E402


def make_group(i: int, size: int) -> RolloutGroup:
    p = Prompt(prompt_id=f"b{i}", epoch=0, index=i, n_samples=1, ground_truth="4",
               messages=[{"role": "user", "content": "2+2?"}])
    g = RolloutGroup(prompt=p, samples=[Sample(text="", token_ids=[], logprobs=[])], policy_version=0)
    pad = size - len(codec.encode(g)[0])
    g.samples[0].text = "x" * max(0, pad - 1) + "4"
    return g


def consumer(bootstrap: str, topic: str):
    """A read_committed reader of every partition of `topic`, starting at its current end."""
    from confluent_kafka import OFFSET_END, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 10, "fetch.max.bytes": 33554432,
                  "max.partition.fetch.bytes": 16777216, "receive.message.max.bytes": 34603008})
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, OFFSET_END) for p in parts])
    return c


def drain(c, n: int, timeout_s: float) -> list[tuple[float, ScoredGroup]]:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for m in c.consume(500, timeout=0.05):
            if m.error() is None:
                out.append((time.time(), codec.decode(m.value(), m.headers(), ScoredGroup)))
    return out


def run_size(bootstrap: str, prefix: str, size: int, n_lat: int, rate: float, n_tput: int) -> dict:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 0,
                  "message.max.bytes": 16 * 1024 * 1024})
    c = consumer(bootstrap, f"{prefix}rl.scored")
    # latency: steady low rate, received concurrently
    import threading

    got: list = []
    reader = threading.Thread(target=lambda: got.extend(drain(c, n_lat, 120)))
    reader.start()
    for i in range(n_lat):
        g = make_group(i, size)
        g.generated_ms = int(time.time() * 1000)
        p.produce(f"{prefix}rl.rollouts", *codec.encode(g)[:1], key=g.prompt_id, headers=codec.encode(g)[1])
        p.poll(0)
        time.sleep(1 / rate)
    p.flush(30)
    reader.join()
    lat = sorted(t * 1000 - s.group.generated_ms for t, s in got)
    # throughput: backlog
    groups = [make_group(100_000 + i, size) for i in range(n_tput)]
    encoded = [(g.prompt_id, *codec.encode(g)) for g in groups]
    t0 = time.time()
    for key, value, headers in encoded:
        while True:
            try:
                p.produce(f"{prefix}rl.rollouts", value, key=key, headers=headers)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    p.flush(120)
    got_t = drain(c, n_tput, 300)
    elapsed = max(t for t, _ in got_t) - t0
    c.close()
    q = statistics.quantiles(lat, n=100)
    return {
        "record_bytes": len(encoded[0][1]),
        "latency_records": len(lat), "latency_rate_per_s": rate,
        "latency_p50_ms": round(q[49], 1), "latency_p99_ms": round(q[98], 1),
        "throughput_records": len(got_t), "throughput_seconds": round(elapsed, 2),
        "records_per_s": round(len(got_t) / elapsed, 1),
        "mb_per_s": round(len(got_t) * len(encoded[0][1]) / elapsed / 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench/results/kafka_roundtrip.json"))
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    with reward_stack(["--reward.batch-size", str(args.batch_size)]) as (bootstrap, _, _):
        results = {
            "1KB": run_size(bootstrap, "bench.", 1024, n_lat=300, rate=20, n_tput=5000),
            "64KB": run_size(bootstrap, "bench.", 64 * 1024, n_lat=200, rate=10, n_tput=1000),
        }
    out = {
        "benchmark": "kafka_roundtrip",
        "what": "produce -> reward worker (transactional consume, one HTTP call to the reward server per batch, "
                "produce) -> read_committed consumer",
        "stage_batch_size": args.batch_size,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "broker": "Apache Kafka 4.1.1, single node KRaft, local, -Xmx512m",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
