"""Whom `steadyrl up`'s stack lets in (closed to other local processes by default): its own
broker takes SCRAM logins, a principal per service with the ACLs of steadyrl/local/acl.py and
passwords made anew at every start (`_logins`, `_kafka_secrets`, `_login`); the actor's
/generate and the reward server's /score each take a token of their own (`_http_tokens`).
`--insecure` runs without either."""

from __future__ import annotations

import argparse
import os
import secrets as secrets_mod
from pathlib import Path

from steadyrl.bus import kafka
from steadyrl.cli.common import CliError, _up_broker
from steadyrl.local import acl
from steadyrl.local import broker as b

#: The Kafka principal (steadyrl/local/acl.py) each service logs in as under `--sasl`; the reward
#: server talks to no broker.
PRINCIPAL = {"actor": "actor", "rollout": "rollout", "reward": "reward", "learner": "learner"}


def _kafka_secrets(args: argparse.Namespace, lb: b.LocalBroker | None) -> Path | None:
    """Under `--sasl`: the folder of the principals' password files (the local broker's, with
    every principal's file made if missing; or `--kafka-secrets`), after making this process
    log in as `admin` from it. None without `--sasl`. Raises CliError when `--sasl` meets an
    existing cluster without `--kafka-secrets`."""
    if not args.sasl:
        return None

    if args.kafka_secrets:
        secrets = Path(args.kafka_secrets)
    elif lb is not None:
        secrets = lb.secrets_dir
        b.ensure_password(secrets, acl.ADMIN)   # the broker's own: made once, at its format
        for principal in acl.PRINCIPALS:   # the commands' too (quarantine, replay): new at every start
            _new_secret(acl.password_file(secrets, principal))
    else:
        raise CliError("--sasl with --bootstrap (or a broker already running) needs --kafka-secrets DIR", code=2)
    try:
        kafka.use_auth(acl.auth_for(acl.ADMIN, secrets))
    except ValueError as e:
        raise CliError(f"--kafka-secrets {secrets}: {e}", code=2) from None
    return secrets


def _logins(args: argparse.Namespace, bootstrap: str | None) -> None:
    """`up`'s default: its own broker (no --bootstrap) takes logins -- `args.sasl` set unless
    --insecure. Raises CliError (2): --insecure with --sasl or --kafka-secrets, or a state
    folder whose broker was made without logins (LocalBroker.made_without_logins: an `up`
    before this default, or --insecure), which --insecure resumes as it was."""
    if args.insecure and (args.sasl or args.kafka_secrets):
        raise CliError("--insecure and --sasl/--kafka-secrets: give one", 2)
    if bootstrap is not None or args.insecure:
        return
    args.sasl = True
    lb = _up_broker(args)
    if lb.made_without_logins():
        raise CliError(f"the broker of {lb.state_dir} was made without logins (PLAINTEXT: by a steadyrl up before "
                       f"logins were its default, or with --insecure); resume this state folder as it was made "
                       f"with `steadyrl up --insecure ...`, or give a new --state-dir", 2)


def _new_secret(path: Path) -> Path:
    """Write a new random secret (32 URL-safe characters) to `path`, mode 0600 (its folder
    0700), replacing the one there; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".new")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets_mod.token_urlsafe(24) + "\n")
    os.replace(tmp, path)
    return path


#: The HTTP work routes `up` closes by default: token file name -> (the server that checks it,
#: the service whose instances call it).
HTTP_TOKENS = {"http-generate": ("actor", "rollout"), "http-score": ("reward-server", "reward")}


def _http_tokens(args: argparse.Namespace, state: Path) -> dict[str, list[str]]:
    """Per-route HTTP tokens, made anew at every start (none with --insecure): the actor's
    /generate token to the actor and the rollout workers, the reward server's /score token to
    it and the reward workers (`HTTP_TOKENS`, files under `<state>/secrets/`, mode 0600); the
    workers prove theirs both ways (`--http-token-proof`: no token goes to whoever holds a
    server's port, and no answer is taken without the server's proof). Returns each service's
    flags."""
    if args.insecure:
        return {}
    flags: dict[str, list[str]] = {}
    for name, (server, client) in HTTP_TOKENS.items():
        path = _new_secret(state / "secrets" / name)
        flags[server] = ["--http-token-file", str(path)]
        # the client proves it without sending it, and takes only answers proving it (steadyrl/httpproof.py)
        flags[client] = ["--http-token-file", str(path), "--http-token-proof", "true"]
    return flags


def _closed_line(args: argparse.Namespace, secrets: Path | None, tokens: dict[str, list[str]],
                 seconds: float) -> str:
    """What `up` prints of whom its stack lets in."""
    if args.insecure:
        return ("--insecure: the broker takes no logins and /generate, /score no tokens: any process on this host "
                "can write the run's topics")
    http = f"/generate and /score each take a token of their own ({seconds:.2f} s)"
    if secrets is None:
        return (f"closed: {http}; Kafka: the cluster at --bootstrap as it is configured (--sasl --kafka-secrets DIR "
                f"logs in to it)")
    return (f"closed: Kafka logins per service (SCRAM, ACLs; commands log in with STEADYRL_KAFKA__SECURITY_PROTOCOL="
            f"SASL_PLAINTEXT STEADYRL_KAFKA__USERNAME=<principal> STEADYRL_KAFKA__PASSWORD_FILE={secrets}/"
            f"kafka-<principal>); {http}")


def _login(svc: str, secrets: Path | None) -> list[str]:
    """The `--kafka.*` flags that make `svc` log in as its principal (none without secrets)."""
    if secrets is None or svc not in PRINCIPAL:
        return []

    return ["--kafka.security-protocol", "SASL_PLAINTEXT", "--kafka.username", PRINCIPAL[svc],
            "--kafka.password-file", str(acl.password_file(secrets, PRINCIPAL[svc]))]
