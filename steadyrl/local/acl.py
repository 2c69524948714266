"""Who may write and read each topic: one Kafka principal per service, and its ACLs.

Kafka does not tell a consumer who produced a record, so authorship comes from topics: a
record's author is whoever may write its topic. With a SASL listener and the StandardAuthorizer
(`allow.everyone.if.no.acl.found=false`), `apply` gives each principal of `PRINCIPALS` exactly
the rights below and nothing else; the broker refuses everything else with an authorization
error (a forged group on rl.scored from the rollout principal fails its transaction with
TOPIC_AUTHORIZATION_FAILED, and is never read by the learner).

| principal  | writes                                         | reads                               |
|------------|------------------------------------------------|-------------------------------------|
| learner    | rl.prompts rl.policy rl.quarantine rl.dlq      | rl.scored rl.dlq rl.releases, ...   |
| actor      | -                                              | rl.policy                           |
| rollout    | rl.rollouts rl.episodes rl.dlq                 | rl.prompts rl.episodes              |
| reward     | rl.scored rl.dlq                               | rl.rollouts                         |
| quarantine | rl.quarantine (decisions) rl.releases          | rl.quarantine                       |
| replay     | topics named `replay.*` (it creates them too)  | every rl.* topic                    |
| admin      | super user: topic creation, `apply`, audits    |                                     |

Consumer groups and transactional ids are covered too (prefixed ACLs: `GROUP_PREFIXES`,
`TXN_PREFIXES`), so one principal can neither join another's group (and take its partitions)
nor fence another's transactions. Each topic name carries the stack's `topic_prefix`.

    STEADYRL_KAFKA__SECURITY_PROTOCOL=SASL_PLAINTEXT STEADYRL_KAFKA__USERNAME=admin \\
    STEADYRL_KAFKA__PASSWORD_FILE=secrets/kafka-admin steadyrl acl apply --secrets-dir secrets

creates (or updates) the SCRAM-SHA-512 credential of every principal with a password file
`secrets/kafka-<principal>` and its ACLs. Idempotent: the broker keeps one copy of each binding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.bus.kafka import KafkaAuth, client_config

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding  # type: ignore[attr-defined]  # re-exported without __all__

log = logging.getLogger(__name__)

#: SCRAM iterations of the credentials `apply` creates (Kafka's minimum is 4096).
SCRAM_ITERATIONS = 8192


@dataclass(frozen=True)
class Grant:
    """What one principal may do. Topic entries are base names (`rl.prompts`); a name ending
    in `*` is a prefix (`replay.*`). Group and transactional-id entries are prefixes."""

    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    txn_ids: tuple[str, ...] = ()
    creates: tuple[str, ...] = ()     # topic prefixes it may create (CREATE on the prefix)


PRINCIPALS: dict[str, Grant] = {
    "learner": Grant(writes=("rl.prompts", "rl.policy", "rl.quarantine", "rl.dlq"),
                     reads=("rl.scored", "rl.dlq", "rl.releases", "rl.quarantine", "rl.prompts", "rl.policy"),
                     groups=("learner-",), txn_ids=("learner-",)),
    "actor": Grant(reads=("rl.policy",), groups=("actor-",)),
    "rollout": Grant(writes=("rl.rollouts", "rl.episodes", "rl.dlq"), reads=("rl.prompts", "rl.episodes"),
                     groups=("steadyrl-rollout",), txn_ids=("steadyrl-rollout-",)),
    "reward": Grant(writes=("rl.scored", "rl.dlq"), reads=("rl.rollouts",),
                    groups=("steadyrl-reward",), txn_ids=("steadyrl-reward-",)),
    "quarantine": Grant(writes=("rl.quarantine", "rl.releases"), reads=("rl.quarantine",),
                        groups=("quarantine-",), txn_ids=("quarantine-",)),
    "replay": Grant(writes=("replay.*",), reads=("rl.*", "replay.*"), creates=("replay.*",),
                    groups=("replay-",), txn_ids=("replay-",)),
}

#: The principal every broker lists in `super.users`: topic creation, `apply`, audits.
ADMIN = "admin"


def password_file(secrets_dir: Path, principal: str) -> Path:
    """Where a principal's password lives: `<secrets_dir>/kafka-<principal>`."""
    return Path(secrets_dir) / f"kafka-{principal}"


def auth_for(principal: str, secrets_dir: Path, protocol: str = "SASL_PLAINTEXT") -> KafkaAuth:
    """The KafkaAuth of `principal` with its password file under `secrets_dir` (tests, `up`).
    Raises pydantic.ValidationError if the file is missing or empty."""
    return KafkaAuth(security_protocol=protocol, username=principal,
                     password_file=password_file(secrets_dir, principal))


def bindings(principal: str, grant: Grant, prefix: str = "") -> list[AclBinding]:
    """The ALLOW AclBindings of `grant` for `User:<principal>` (any host). Topics take `prefix`."""
    # confluent_kafka.admin re-exports these without __all__, so mypy --strict does not see them
    from confluent_kafka.admin import (  # type: ignore[attr-defined]  # lazy: heavy (confluent_kafka), only ACL calls
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    user = f"User:{principal}"

    def topic(name: str) -> tuple[str, ResourcePatternType]:
        if name.endswith("*"):
            return prefix + name[:-1], ResourcePatternType.PREFIXED
        return prefix + name, ResourcePatternType.LITERAL

    def allow(rtype: ResourceType, name: str, pattern: ResourcePatternType, op: AclOperation) -> AclBinding:
        return AclBinding(rtype, name, pattern, user, "*", op, AclPermissionType.ALLOW)

    out = []
    for name in grant.writes:
        out.append(allow(ResourceType.TOPIC, *topic(name), AclOperation.WRITE))
    for name in grant.reads:
        out.append(allow(ResourceType.TOPIC, *topic(name), AclOperation.READ))
    for name in grant.creates:
        out.append(allow(ResourceType.TOPIC, *topic(name), AclOperation.CREATE))
    for g in grant.groups:
        out.append(allow(ResourceType.GROUP, g, ResourcePatternType.PREFIXED, AclOperation.READ))
    for t in grant.txn_ids:
        out.append(allow(ResourceType.TRANSACTIONAL_ID, t, ResourcePatternType.PREFIXED, AclOperation.WRITE))
    return out


def upsert_users(bootstrap: str, passwords: dict[str, str], auth: KafkaAuth | None = None,
                 timeout_s: float = 30.0) -> None:
    """Create or update the SCRAM-SHA-512 credential of each `user -> password`.

    Raises KafkaException on a broker error (e.g. the caller is not a super user)."""
    # confluent_kafka.admin re-exports these without __all__, so mypy --strict does not see them
    from confluent_kafka.admin import (  # type: ignore[attr-defined]  # lazy: heavy (confluent_kafka), only SCRAM calls
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    if not passwords:
        return
    admin = AdminClient(client_config(bootstrap, auth) | {"log_level": 4})
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    futs = admin.alter_user_scram_credentials(
        [UserScramCredentialUpsertion(user, info, pw.encode()) for user, pw in passwords.items()],
        request_timeout=timeout_s)
    for f in futs.values():
        f.result()


def apply(bootstrap: str, secrets_dir: Path, prefix: str = "", auth: KafkaAuth | None = None,
          timeout_s: float = 30.0) -> dict[str, int]:
    """For each principal of `PRINCIPALS` with a password file in `secrets_dir`: upsert its
    SCRAM credential and create its ACLs (`bindings`). The caller (`auth`, default the
    process's) must be a super user.

    Returns `{principal: number of ACL bindings}`. Raises ValueError when no password file is
    there (nothing would be applied), KafkaException on a broker error.
    """
    from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka), only broker calls need it

    found = {p: password_file(secrets_dir, p).read_text().strip() for p in PRINCIPALS
             if password_file(secrets_dir, p).is_file()}
    if not found:
        raise ValueError(f"no kafka-<principal> password file in {secrets_dir} (principals: {', '.join(PRINCIPALS)})")
    empty = [p for p, pw in found.items() if not pw]
    if empty:
        raise ValueError(f"empty password file for {', '.join(empty)} in {secrets_dir}")
    upsert_users(bootstrap, found, auth, timeout_s)
    admin = AdminClient(client_config(bootstrap, auth) | {"log_level": 4})
    done: dict[str, int] = {}
    for principal in found:
        acls = bindings(principal, PRINCIPALS[principal], prefix)
        for f in admin.create_acls(acls, request_timeout=timeout_s).values():
            f.result()
        done[principal] = len(acls)
        log.info("principal applied", extra={"principal": principal, "acls": len(acls), "prefix": prefix})
    return done
