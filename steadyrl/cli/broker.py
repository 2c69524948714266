"""`steadyrl broker`, `topics`, `acl` and `schemas`: the local broker, the topic catalogue, the
principals' credentials and ACLs (steadyrl/local/acl.py), the JSON Schemas."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from steadyrl.bus.topics import create_topics, list_topics
from steadyrl.cli.common import (
    LOCAL_BOOTSTRAP,
    CliError,
    _bootstrap,
    _local_broker,
    _require_broker,
    add_common_options,
)
from steadyrl.local import acl, jars


def cmd_broker(args: argparse.Namespace) -> int:
    try:
        return _broker(args)
    except jars.BrokerError as e:   # no Maven, no Java, a broker that does not start: one line, no traceback
        raise CliError(str(e)) from None


def _broker(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        print(jars.fetch(release=args.from_release))
        return 0
    if args.from_release is not None:
        raise CliError("--from-release goes with `steadyrl broker fetch`", code=2)
    lb = _local_broker(args)
    if args.action == "start":
        jars.fetch()
        lb.start()
        print(json.dumps(lb.status()))
    elif args.action == "stop":
        print("stopped" if lb.stop() else "not running")
    else:
        st = lb.status()
        print(json.dumps(st))
        return 0 if st["running"] else 3
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    _require_broker(bootstrap)
    try:
        if args.action == "create":
            try:
                made = create_topics(bootstrap, args.prefix, replication_factor=args.replication_factor,
                                     min_insync_replicas=args.min_insync_replicas)
            except ValueError as e:
                raise CliError(str(e), code=2) from None
            for name, what in made.items():
                print(f"{name}\t{what}")
        else:
            for row in list_topics(bootstrap, args.prefix):
                print(f"{row['topic']}\t{'present' if row['present'] else 'MISSING'}\t"
                      f"{row['partitions']}/{row['wanted']} partitions"
                      + (f"\treplication {row['replication']}" if row["replication"] > 1 else ""))
    except KafkaException as e:
        raise CliError(f"topics {args.action} on {bootstrap}: {e}") from None
    return 0


def cmd_acl(args: argparse.Namespace) -> int:
    """`steadyrl acl apply`: each principal's SCRAM credential and ACLs; `acl show`: the table."""
    if args.action == "show":
        for principal, grant in acl.PRINCIPALS.items():
            print(f"{principal}\twrites {' '.join(grant.writes) or '-'}\treads {' '.join(grant.reads) or '-'}\t"
                  f"groups {' '.join(g + '*' for g in grant.groups) or '-'}\t"
                  f"transactional ids {' '.join(t + '*' for t in grant.txn_ids) or '-'}")
        return 0
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

    if not args.secrets_dir:
        raise CliError("acl apply needs --secrets-dir DIR (the kafka-<principal> password files)", code=2)
    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    _require_broker(bootstrap)
    try:
        done = acl.apply(bootstrap, args.secrets_dir, args.prefix)
    except ValueError as e:
        raise CliError(str(e), code=2) from None
    except KafkaException as e:
        raise CliError(f"acl apply on {bootstrap} (run it as a super user, e.g. STEADYRL_KAFKA__USERNAME=admin): "
                       f"{e}") from None
    for principal, n in done.items():
        print(f"{principal}\t{n} ACLs\tcredential SCRAM-SHA-512")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from steadyrl.wire.schemas import check_schemas, export_schemas  # lazy: entry point (a command), keeps --help fast

    if args.action == "export":
        for p in export_schemas():
            print(p)
        return 0
    from steadyrl.wire.contracts import ALL_CONTRACTS  # lazy: entry point (a command), keeps `steadyrl --help` fast

    problems = check_schemas()
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{len(ALL_CONTRACTS)} schemas in schemas/ agree with the models")
    return 1 if problems else 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("broker", help="the local single-node Kafka broker")
    sp.add_argument("action", choices=["fetch", "start", "stop", "status"])
    sp.add_argument("--from-release", type=Path, metavar="TGZ_OR_DIR",
                    help="fetch: copy the jars from Apache's binary release of the broker's Kafka version "
                         "(kafka_2.13-<version>.tgz, or its unpacked folder) instead of running Maven")
    add_common_options(sp, broker_opts=True)
    sp.set_defaults(fn=cmd_broker)

    sp = sub.add_parser("topics", help="create or list the catalogue's topics")
    sp.add_argument("action", choices=["create", "list"])
    sp.add_argument("--replication-factor", type=int, default=1,
                    help="create: copies of each new topic's partitions (3 on a three-broker cluster)")
    sp.add_argument("--min-insync-replicas", type=int, default=1,
                    help="create: the new topics' min.insync.replicas (2 with replication 3)")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_topics)

    sp = sub.add_parser("acl", help="apply (as a super user) or show each service principal's credential and ACLs")
    sp.add_argument("action", choices=["apply", "show"])
    sp.add_argument("--secrets-dir", help="apply: folder of kafka-<principal> password files")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_acl)

    sp = sub.add_parser("schemas", help="export or check the JSON Schemas in schemas/")
    sp.add_argument("action", choices=["export", "check"])
    sp.set_defaults(fn=cmd_schemas)
