#!/bin/bash
# As Kafka's own bin/kafka-broker-api-versions.sh: the image's health check.
exec java -Xmx128m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp "/opt/kafka/libs/*" org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
