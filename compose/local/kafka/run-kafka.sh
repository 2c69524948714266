#!/bin/bash
# Starts one KRaft node from the environment, as apache/kafka's image does: every KAFKA_*
# variable but the JVM ones becomes a property of server.properties (KAFKA_FOO_BAR -> foo.bar,
# `__` -> `_`, `___` -> `-`), the storage is formatted once with CLUSTER_ID, then kafka.Kafka runs
# in the foreground (PID 1 after exec: SIGTERM stops it cleanly).
set -euo pipefail
: "${CLUSTER_ID:?CLUSTER_ID is required (a KRaft cluster id, kafka-storage random-uuid)}"
: "${KAFKA_LOG_DIRS:=/var/lib/kafka/data}"
export KAFKA_LOG_DIRS
props=/opt/kafka/config/server.properties
: > "$props"
while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_OPTS|KAFKA_LOG4J_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_JMX_OPTS) continue ;;
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
cp="/opt/kafka/libs/*"
first_dir=${KAFKA_LOG_DIRS%%,*}
if [ ! -f "$first_dir/meta.properties" ]; then
  java -cp "$cp" kafka.tools.StorageTool format --ignore-formatted -t "$CLUSTER_ID" -c "$props"
fi
# shellcheck disable=SC2086  # the options are lists of words
exec java ${KAFKA_HEAP_OPTS:--Xmx1g -Xms512m} ${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20} \
  -Djava.awt.headless=true -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties ${KAFKA_OPTS:-} \
  -cp "$cp" kafka.Kafka "$props"
