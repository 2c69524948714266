#!/bin/bash
# Starts one KRaft node from the environment, as apache/kafka's image does: every KAFKA_*
# variable but the JVM ones and this script's own (below) becomes a property of server.properties
# (KAFKA_FOO_BAR -> foo.bar, `__` -> `_`, `___` -> `-`), the storage is formatted once with
# CLUSTER_ID, then kafka.Kafka runs in the foreground (PID 1 after exec: SIGTERM stops it cleanly).
#
# SASL/SCRAM (issue 21; docs/deploy.md, "Trust"): with KAFKA_SCRAM_ADMIN_PASSWORD_FILE set (a
# file, e.g. the compose secret /run/secrets/kafka-admin), the super user `admin` gets that
# password, so that no secret is in the environment or the compose file:
#   - at format time: `--add-scram 'SCRAM-SHA-512=[name=admin,password=...]'` (the credential is in
#     the metadata log from the start; a volume formatted earlier keeps what it had);
#   - listener.name.<listener>.scram-sha-512.sasl.jaas.config for every SASL listener of
#     listener.security.protocol.map (the broker's own inter-broker login, as admin);
#   - $KAFKA_CONF_DIR/admin-client.properties: the admin's client login, which the health check
#     passes to kafka-broker-api-versions.sh (--command-config).
# The generated files are mode 0600 (they hold the password). Used by the local image
# (compose/local/kafka/Dockerfile) and, mounted, by compose and Kubernetes on apache/kafka, whose
# own start script cannot take a SCRAM credential at format time (deploy/k8s/base/kafka/ is a copy
# of this file; tests/deploy checks that they are the same).
set -euo pipefail
: "${CLUSTER_ID:?CLUSTER_ID is required (a KRaft cluster id, kafka-storage random-uuid)}"
: "${KAFKA_LOG_DIRS:=/var/lib/kafka/data}"
export KAFKA_LOG_DIRS
conf_dir=${KAFKA_CONF_DIR:-/opt/kafka/config}
props=$conf_dir/server.properties
umask 077
: > "$props"
while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_OPTS|KAFKA_LOG4J_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_JMX_OPTS) continue ;;
    KAFKA_SCRAM_ADMIN_PASSWORD_FILE|KAFKA_CONF_DIR|KAFKA_VERSION|KAFKA_JMX_HOSTNAME) continue ;;  # this script's own
    KAFKA_*) ;;
    *) continue ;;
  esac
  key=${name#KAFKA_}
  key=${key,,}
  key=${key//___/-}
  key=${key//__/@}
  key=${key//_/.}
  key=${key//@/_}
  printf '%s=%s\n' "$key" "$value" >> "$props"
done < <(env)

format_args=()
if [ -n "${KAFKA_SCRAM_ADMIN_PASSWORD_FILE:-}" ]; then
  [ -r "$KAFKA_SCRAM_ADMIN_PASSWORD_FILE" ] ||
    { echo "run-kafka.sh: cannot read KAFKA_SCRAM_ADMIN_PASSWORD_FILE $KAFKA_SCRAM_ADMIN_PASSWORD_FILE" >&2; exit 1; }
  admin_password=$(tr -d '\r\n' < "$KAFKA_SCRAM_ADMIN_PASSWORD_FILE")
  # The password goes into a JAAS line ("...") and a --add-scram [k=v,...] list: no quoting there.
  [[ "$admin_password" =~ ^[A-Za-z0-9._~-]{16,}$ ]] ||
    { echo "run-kafka.sh: the admin password must be 16+ of A-Z a-z 0-9 . _ ~ - (deploy/secrets.sh writes one)" >&2; exit 1; }
  format_args+=(--add-scram "SCRAM-SHA-512=[name=admin,password=$admin_password]")
  jaas="org.apache.kafka.common.security.scram.ScramLoginModule required username=\"admin\" password=\"$admin_password\";"
  protocol_map=$(sed -n 's/^listener\.security\.protocol\.map=//p' "$props")
  IFS=',' read -ra pairs <<< "$protocol_map"
  for pair in "${pairs[@]}"; do
    listener=${pair%%:*} protocol=${pair#*:}
    case "$protocol" in
      SASL_PLAINTEXT|SASL_SSL) printf 'listener.name.%s.scram-sha-512.sasl.jaas.config=%s\n' "${listener,,}" "$jaas" >> "$props" ;;
    esac
  done
  printf 'security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-512\nsasl.jaas.config=%s\n' "$jaas" \
    > "$conf_dir/admin-client.properties"
fi

# log4j2: the local image's properties file, else apache/kafka's own YAML
log4j=$conf_dir/log4j2.properties
[ -f "$log4j" ] || log4j=$conf_dir/log4j2.yaml
cp="/opt/kafka/libs/*"
first_dir=${KAFKA_LOG_DIRS%%,*}
if [ ! -f "$first_dir/meta.properties" ]; then
  java -cp "$cp" -Dlog4j2.configurationFile="$log4j" kafka.tools.StorageTool format --ignore-formatted \
    -t "$CLUSTER_ID" -c "$props" "${format_args[@]}"
fi
# shellcheck disable=SC2086  # the options are lists of words
exec java ${KAFKA_HEAP_OPTS:--Xmx1g -Xms512m} ${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20} \
  -Djava.awt.headless=true -Dlog4j2.configurationFile="$log4j" ${KAFKA_OPTS:-} \
  -cp "$cp" kafka.Kafka "$props"
