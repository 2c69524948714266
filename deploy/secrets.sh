#!/usr/bin/env bash
# The stack's secrets (issue 21; docs/deploy.md, "Trust"): one random SCRAM password per Kafka
# principal (kafka-<principal>: the principals of steadyrl/local/acl.py and the super user admin), the
# HTTP work token (http-token: the actor's /generate, the reward server's /score) and the alert
# routes' token (alert-token: the alert bridge and Alertmanager only), one file each, in DIR. Never in the repository: the default
# DIRs (compose/secrets/, deploy/k8s/base/secrets/) are gitignored.
#
#   deploy/secrets.sh [DIR]       # default compose/secrets; make compose-secrets
#   deploy/secrets.sh deploy/k8s/base/secrets     # for kustomize's secretGenerator (make k8s-secrets)
#
# An existing file is kept (never overwritten), so running it again only adds what is missing;
# delete a file to rotate it (then re-run `steadyrl acl apply`, docs/deploy.md).
#
# Modes: DIR 0700 (only you, on the host); each file 0644. Compose's file-based secrets are bind
# mounts that keep the host file's owner and mode, and the containers read them as their own
# users (the steadyrl image's 10001, Kafka's 1000, Alertmanager's 65534), none of them the file's
# owner: the files must be readable by others, and the directory is what keeps other host users
# out. Kubernetes sets its own modes on the Secret's files (deploy/k8s: defaultMode 0440, group
# fsGroup).
#
# Passwords and the token: 32 random bytes as 64 hex characters (/dev/urandom), so that they
# need no quoting in a JAAS line, a --add-scram argument or an HTTP header.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT/compose/secrets}
# The principals of steadyrl/local/acl.py (PRINCIPALS) and the super user; tests/deploy checks the list.
PRINCIPALS=(admin learner actor rollout reward quarantine replay)

umask 077
mkdir -p "$DIR"
chmod 700 "$DIR"

random_hex() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }

write_secret() {  # write_secret NAME: DIR/NAME with a fresh random value, unless it exists
  local path=$DIR/$1 tmp
  if [ -e "$path" ] || [ -L "$path" ]; then
    [ -f "$path" ] || { echo "secrets.sh: $path exists but is not a regular file" >&2; exit 1; }
    [ -s "$path" ] || { echo "secrets.sh: $path exists but is empty (delete it to make a new one)" >&2; exit 1; }
    chmod 644 "$path"
    echo "kept    $path"
    return
  fi
  tmp=$(mktemp "$DIR/.$1.XXXXXX")
  random_hex > "$tmp"
  [ "$(wc -c < "$tmp")" -eq 64 ] || { rm -f "$tmp"; echo "secrets.sh: /dev/urandom gave too little" >&2; exit 1; }
  chmod 644 "$tmp"
  mv -n "$tmp" "$path"   # -n: a file another run wrote meanwhile wins
  rm -f "$tmp"
  echo "created $path"
}

for p in "${PRINCIPALS[@]}"; do
  write_secret "kafka-$p"
done
write_secret http-token
write_secret alert-token
